//! The checks that keep the layout and the docs true, read from the sources as
//! [`layers`](crate::layers) reads them, so that `scripts/test` (and with it CI) fails instead
//! of a review:
//!
//! - no library file has more than [`MAX_FILE_LINES`] lines before its unit tests;
//! - the README has at most [`MAX_README_LINES`] lines;
//! - no benchmark file has more than [`MAX_BENCH_LINES`] (a benchmark's scenarios live in
//!   files of their own);
//! - every file or folder the README and `docs/` cite (`src/…`, `tests/…`, a relative link)
//!   exists.

use std::path::{Path, PathBuf};

/// Lines of library code per file, unit tests aside.
const MAX_FILE_LINES: usize = 600;
/// Lines of the README.
const MAX_README_LINES: usize = 300;
/// Lines of one benchmark file.
const MAX_BENCH_LINES: usize = 1_000;
/// The folders a citation starts with.
const CITED: &[&str] = &[
    "src/",
    "tests/",
    "docs/",
    "benches/",
    "scripts/",
    "examples/",
    "migrations/",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn files(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a readable folder") {
        let path = entry.expect("a folder entry").path();
        if path.is_dir() {
            files(&path, ext, out);
        } else if path.extension().is_some_and(|e| e == ext) {
            out.push(path);
        }
    }
}

/// Lines of `code` before its first `#[cfg(test)]` at the start of a line.
fn code_lines(code: &str) -> usize {
    code.lines()
        .take_while(|l| !l.starts_with("#[cfg(test)]"))
        .count()
}

/// The paths `text` cites: words starting with one of [`CITED`], and the targets of relative
/// Markdown links (resolved against `base`). Anchors and trailing punctuation are dropped.
fn citations(text: &str, base: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let is_path_char = |c: char| c.is_ascii_alphanumeric() || "_./*-".contains(c);
    for (i, _) in text.char_indices() {
        let before = text[..i].chars().next_back();
        if before.is_some_and(|c| is_path_char(c) || c == ':') {
            continue;
        }
        if let Some(start) = CITED.iter().find(|p| text[i..].starts_with(*p)) {
            let cited: String = text[i..].chars().take_while(|c| is_path_char(*c)).collect();
            let cited = cited.trim_end_matches(['.', '-']);
            if cited.len() > start.len() {
                out.push(root().join(cited));
            }
        }
    }
    out.extend(links(text, base));
    out
}

/// The targets of the relative Markdown links of `text`, resolved against `base`.
fn links(text: &str, base: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for link in text.split("](").skip(1) {
        let target = link.split([')', ' ']).next().unwrap_or("");
        let target = target.split('#').next().unwrap_or("");
        if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        out.push(base.join(target));
    }
    out
}

/// Whether a cited path exists; one with a `*` names the files of its folder that match.
fn exists(path: &Path) -> bool {
    let text = path.to_string_lossy();
    let Some(star) = text.find('*') else {
        return path.exists();
    };
    let (dir, pattern) = text[..star]
        .rsplit_once('/')
        .map_or((".", &text[..star]), |(d, p)| (d, p));
    let suffix = text[star + 1..].to_owned();
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with(pattern) && name.ends_with(&suffix)
        })
    })
}

/// The citations of the README and `docs/` that name nothing: (document, path).
fn dangling() -> Vec<(String, String)> {
    let mut docs = vec![root().join("README.md"), root().join("CHANGELOG.md")];
    files(&root().join("docs"), "md", &mut docs);
    let mut bad = Vec::new();
    for doc in docs {
        let text = std::fs::read_to_string(&doc).expect("a readable document");
        let base = doc.parent().expect("a folder").to_owned();
        // The changelog tells what was: only its links are checked, not the paths it names.
        let cited = if doc.ends_with("CHANGELOG.md") {
            links(&text, &base)
        } else {
            citations(&text, &base)
        };
        for path in cited {
            if !exists(&path) {
                let rel = |p: &Path| {
                    p.strip_prefix(root())
                        .unwrap_or(p)
                        .to_string_lossy()
                        .into_owned()
                };
                bad.push((rel(&doc), rel(&path)));
            }
        }
    }
    bad.sort();
    bad.dedup();
    bad
}

#[test]
fn no_library_file_is_over_its_size_and_the_readme_is_short() {
    let mut sources = Vec::new();
    files(&root().join("src"), "rs", &mut sources);
    let mut over: Vec<String> = sources
        .iter()
        .filter_map(|f| {
            let n = code_lines(&std::fs::read_to_string(f).expect("a readable source"));
            let shown = f.strip_prefix(root()).unwrap_or(f).display().to_string();
            (n > MAX_FILE_LINES).then(|| format!("  {shown} ({n} lines)"))
        })
        .collect();
    over.sort();
    assert!(
        over.is_empty(),
        "library files over {MAX_FILE_LINES} lines before their unit tests:\n{}",
        over.join("\n")
    );
    let mut benches = Vec::new();
    files(&root().join("benches"), "rs", &mut benches);
    let mut long: Vec<String> = benches
        .iter()
        .filter_map(|f| {
            let n = std::fs::read_to_string(f)
                .expect("a readable bench")
                .lines()
                .count();
            let shown = f.strip_prefix(root()).unwrap_or(f).display().to_string();
            (n > MAX_BENCH_LINES).then(|| format!("  {shown} ({n} lines)"))
        })
        .collect();
    long.sort();
    assert!(
        long.is_empty(),
        "benchmark files over {MAX_BENCH_LINES} lines (split them by scenario):\n{}",
        long.join("\n")
    );
    let readme = std::fs::read_to_string(root().join("README.md")).expect("the README");
    let n = readme.lines().count();
    assert!(
        n <= MAX_README_LINES,
        "the README has {n} lines, over {MAX_README_LINES}"
    );
}

#[test]
fn every_file_the_docs_cite_exists() {
    let bad = dangling();
    assert!(
        bad.is_empty(),
        "citations of nothing (document: path):\n{}",
        bad.iter()
            .map(|(d, p)| format!("  {d}: {p}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn the_checks_catch_what_they_should() {
    let long = "x\n".repeat(MAX_FILE_LINES + 1);
    assert_eq!(code_lines(&long), MAX_FILE_LINES + 1);
    assert_eq!(code_lines(&format!("a\nb\n#[cfg(test)]\n{long}")), 2);
    let base = root().join("docs");
    let cited = citations(
        "see `tests/it/hung.rs`, tests/nowhere.rs and [ops](operations.md#dead-letters), \
         not https://example.com/src/x.rs",
        &base,
    );
    assert_eq!(
        cited,
        [
            root().join("tests/it/hung.rs"),
            root().join("tests/nowhere.rs"),
            base.join("operations.md"),
        ]
    );
    assert!(exists(&root().join("tests/it/hung.rs")));
    assert!(!exists(&root().join("tests/nowhere.rs")));
    assert!(exists(&root().join("src/store/admin/*.sql")));
}
