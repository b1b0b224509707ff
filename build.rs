//! Embeds the `migrations/` folder: writes `$OUT_DIR/migrations.rs`, the list of migrations in
//! version order that `src/store/migrate.rs` includes, and rebuilds the crate when a migration
//! is added or changed (cargo does not see what `include_str!` of a generated list reads).
//!
//! A migration is a folder `YYYY-MM-DD-NNNNNN_name` holding `up.sql`; its version is the
//! digits of the date and number (diesel's form, which earlier versions recorded). A
//! `metadata.toml` saying `run_in_transaction = false` runs its statements one by one, each in
//! a transaction of its own (needed for `CREATE INDEX CONCURRENTLY`).
use std::fmt::Write as _;
use std::path::Path;

fn main() {
    println!("cargo:rerun-if-changed=migrations");
    let root = Path::new(&std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("migrations");
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    let mut out = String::from("&[\n");
    for dir in dirs {
        println!("cargo:rerun-if-changed={}", dir.display());
        let folder = dir.file_name().unwrap().to_string_lossy().into_owned();
        let (stamp, name) = folder
            .split_once('_')
            .unwrap_or_else(|| panic!("migration folder {folder}: expected DATE-NUMBER_name"));
        let version: String = stamp.chars().filter(char::is_ascii_digit).collect();
        let metadata = std::fs::read_to_string(dir.join("metadata.toml")).unwrap_or_default();
        let transactional = !metadata
            .lines()
            .any(|l| l.replace(' ', "") == "run_in_transaction=false");
        let up = dir.join("up.sql");
        writeln!(
            out,
            "    Migration {{ version: {version:?}, name: {name:?}, transactional: {transactional}, \
             sql: include_str!({:?}) }},",
            up.display().to_string()
        )
        .unwrap();
    }
    out.push(']');
    let dest = Path::new(&std::env::var("OUT_DIR").unwrap()).join("migrations.rs");
    std::fs::write(dest, out).unwrap();
}
