//! Rebuilds the crate when a migration is added or changed: `embed_migrations!` reads the
//! `migrations` folder at compile time, and cargo does not see what a macro reads.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
