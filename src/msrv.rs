//! The check that `rust-version` in `Cargo.toml` is true: at least the `rust-version` that
//! every locked dependency declares. A dependency update that needs a newer compiler fails
//! `scripts/test` until the crate says so, instead of failing its users' builds.

/// `"1.89.0"` → `(1, 89, 0)`; a missing part is 0.
fn parse(v: &str) -> (u64, u64, u64) {
    let mut parts = v.trim().split('.').map(|p| p.parse::<u64>().unwrap_or(0));
    let mut next = || parts.next().unwrap_or(0);
    (next(), next(), next())
}

#[test]
fn rust_version_is_at_least_every_locked_dependencys() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // This machine's packages only: the others may not be downloaded.
    let rustc = std::process::Command::new("rustc")
        .arg("-vV")
        .output()
        .expect("rustc -vV runs");
    let rustc = String::from_utf8_lossy(&rustc.stdout).into_owned();
    let host = rustc
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .expect("rustc names its host");
    let metadata = |offline: bool| {
        std::process::Command::new(&cargo)
            .args(["metadata", "--format-version", "1", "--locked"])
            .args(["--filter-platform", host])
            .args(offline.then_some("--offline"))
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .expect("cargo metadata runs")
    };
    // Offline first (the build has fetched what it needs); online for a package it has not.
    let mut out = metadata(true);
    if !out.status.success() {
        out = metadata(false);
    }
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let ours = parse(env!("CARGO_PKG_RUST_VERSION"));
    let needed: Vec<(String, (u64, u64, u64))> = meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .filter_map(|p| {
            let v = p["rust_version"].as_str()?;
            Some((
                format!("{} {}", p["name"].as_str()?, p["version"].as_str()?),
                parse(v),
            ))
        })
        .filter(|(_, v)| *v > ours)
        .collect();
    assert!(
        needed.is_empty(),
        "rust-version {} is older than these locked dependencies need: {needed:?}",
        env!("CARGO_PKG_RUST_VERSION")
    );
}

#[test]
fn versions_compare_by_number() {
    assert!(parse("1.89") > parse("1.88.5"));
    assert!(parse("1.100") > parse("1.89.0"));
    assert_eq!(parse("1.89"), parse("1.89.0"));
}
