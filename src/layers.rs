//! The check that keeps the crate's layers one-directional (see "Architecture" in the crate
//! docs): a module may use its own layer's code and the layers below, never a layer above,
//! and never another module of its own layer. It reads the sources, so that a new `use` that
//! breaks the order fails `scripts/test` (and with it CI) rather than a review.

use std::collections::BTreeMap;
use std::path::Path;

/// The top-level modules by layer, lowest first. Every top-level module is listed.
pub(crate) const LAYERS: &[&[&str]] = &[
    &["error"],
    &["event", "messages", "retry", "telemetry"],
    &["store"],
    &["outbox", "inbox"],
    &["consumer", "publisher", "reconciler", "maintenance"],
    // The NATS bridge: a transport (publisher's trait) and a receiver the runtime supervises;
    // the side-effect workers, whose calls fail like a consumer's handler.
    &["nats", "effects"],
    &["runtime"],
    &["admin", "testing"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// Each name the crate root re-exports (`pub use module::{…}` in `lib.rs`), with its module.
fn root_names(lib: &str) -> BTreeMap<String, String> {
    let mut names = BTreeMap::new();
    for stmt in lib.split(';') {
        let Some(at) = stmt.find("pub use ") else {
            continue;
        };
        let path = &stmt[at + "pub use ".len()..];
        let module: String = path
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        for name in leaf_names(path) {
            names.insert(name, module.clone());
        }
    }
    names
}

/// The last segments of a `use` path, through any `{…}` groups.
fn leaf_names(path: &str) -> Vec<String> {
    let path = path.trim();
    match path.find('{') {
        None => path
            .rsplit("::")
            .next()
            .map(|s| s.trim().to_owned())
            .into_iter()
            .collect(),
        Some(open) => split_top(&path[open + 1..path.rfind('}').unwrap_or(path.len())])
            .into_iter()
            .flat_map(|p| leaf_names(&p))
            .collect(),
    }
}

/// `a, b::{c, d}, e` split at the commas outside braces.
fn split_top(group: &str) -> Vec<String> {
    let (mut parts, mut depth, mut cur) = (Vec::new(), 0, String::new());
    for c in group.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    parts.push(cur);
    parts
        .into_iter()
        .map(|p| p.trim().to_owned())
        .filter(|p| !p.is_empty())
        .collect()
}

/// The first segment of every `crate::` path in `code` (comments excluded): a top-level
/// module, or a name the root re-exports.
fn crate_uses(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in code.lines() {
        let line = line.trim_start();
        if line.starts_with("//") {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                // `crate::{a, b::c}` on one line; a group over several lines is rustfmt's
                // and is caught by the lines that follow starting with the module name.
                let end = group.find('}').unwrap_or(group.len());
                found.extend(split_top(&group[..end]).iter().map(|p| first_segment(p)));
            } else {
                found.push(first_segment(rest));
            }
        }
    }
    found
}

fn first_segment(path: &str) -> String {
    path.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// Every `(from, to, file)` edge that breaks the layers.
fn violations(src: &Path) -> Vec<(String, String, String)> {
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let roots = root_names(&lib);
    let mut bad = Vec::new();
    let mut files = Vec::new();
    collect(src, &mut files);
    for file in files {
        let rel = file.strip_prefix(src).expect("under src");
        let Some(top) = rel.components().next() else {
            continue;
        };
        let from = top
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_owned();
        // The crate root, the checks that run as unit tests (no layer: nothing uses them), and the
        // operator CLI, a crate of its own that sees only the public API.
        if ["lib", "layers", "layout", "msrv", "bin"].contains(&from.as_str()) {
            continue;
        }
        let from_layer = layer_of(&from)
            .unwrap_or_else(|| panic!("module `{from}` is in no layer of src/layers.rs"));
        let code = std::fs::read_to_string(&file).expect("readable source");
        // A multi-line `use crate::{` group: its lines start with the module names.
        let mut grouped = Vec::new();
        let mut in_group = false;
        for line in code.lines() {
            let t = line.trim();
            if t.starts_with("use crate::{") && !t.contains('}') {
                in_group = true;
                continue;
            }
            if in_group {
                if t.starts_with("};") {
                    in_group = false;
                } else if !t.starts_with("//")
                    && line.starts_with("    ")
                    && !line.starts_with("        ")
                {
                    grouped.push(first_segment(t));
                }
            }
        }
        for name in crate_uses(&code).into_iter().chain(grouped) {
            let to = if layer_of(&name).is_some() {
                name.clone()
            } else if let Some(m) = roots.get(&name) {
                m.clone()
            } else {
                continue; // `crate::self`, a macro, …
            };
            if to == from {
                continue;
            }
            let to_layer = layer_of(&to).expect("a listed module");
            if to_layer >= from_layer {
                bad.push((
                    from.clone(),
                    format!("{to} ({name})"),
                    rel.display().to_string(),
                ));
            }
        }
    }
    bad.sort();
    bad.dedup();
    bad
}

fn collect(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            collect(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

#[test]
fn modules_use_only_their_own_layer_and_the_layers_below() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let bad = violations(&src);
    assert!(
        bad.is_empty(),
        "uses that break the layers (module -> what it uses, in file):\n{}",
        bad.iter()
            .map(|(f, t, file)| format!("  {f} -> {t}  in {file}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn the_check_sees_each_form_of_use() {
    let code = "use crate::store::x;\nuse crate::{event::E, error::Result};\n// crate::admin\nlet a = crate::enqueue(c);";
    assert_eq!(crate_uses(code), ["store", "event", "error", "enqueue"]);
    let roots = root_names(
        "pub use outbox::{enqueue, timeline};\npub use store::migrate::{migrate, MIGRATIONS};",
    );
    assert_eq!(roots["enqueue"], "outbox");
    assert_eq!(roots["MIGRATIONS"], "store");
}
