//! What the CLI prints: the API's JSON as it is (`--json`), or tables for a person.

use serde_json::Value;

/// Which answer it is, for the columns a person wants to see first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Health,
    Stats,
    Inbox,
    Outbox,
    Effects,
    Event,
    Timeline,
    List,
    Action,
}

/// The columns of a list of inbox rows.
const INBOX: &[&str] = &[
    "id",
    "consumer",
    "status",
    "event_type",
    "aggregate_id",
    "attempt_count",
    "error_code",
    "updated_at",
    "event_id",
];
const OUTBOX: &[&str] = &[
    "id",
    "status",
    "event_type",
    "aggregate_id",
    "attempt_count",
    "error_code",
    "updated_at",
];
const EFFECTS: &[&str] = &[
    "id",
    "kind",
    "key",
    "status",
    "attempt_count",
    "error_code",
    "last_error",
    "created_at",
];
const FANOUT: &[&str] = &[
    "consumer",
    "subscribed",
    "got",
    "inbox_id",
    "status",
    "cursor",
    "attempt_count",
    "error_code",
    "last_error",
    "processed_at",
];
const REASONS: &[&str] = &["state", "code", "consumer", "message"];
const TIMELINE: &[&str] = &[
    "at",
    "kind",
    "consumer",
    "status",
    "event_type",
    "aggregate_id",
    "attempts",
    "error_code",
    "event_id",
];

/// A successful answer.
pub fn answer(json_out: bool, v: &Value, shape: Shape) {
    if json_out {
        println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
        return;
    }
    let columns = |key: &str| -> Option<&'static [&'static str]> {
        match (shape, key) {
            (Shape::Inbox, "items") => Some(INBOX),
            (Shape::Outbox, "items") => Some(OUTBOX),
            (Shape::Effects, "items") => Some(EFFECTS),
            (Shape::Event, "consumers") => Some(FANOUT),
            (Shape::Health, "reasons") => Some(REASONS),
            (Shape::Timeline, "entries") => Some(TIMELINE),
            _ => None,
        }
    };
    print!("{}", object(v, "", &columns));
}

/// A refusal or failure: the API's `{"error": {"code", "message"}}`. On stdout as JSON with
/// `--json` (a script parses it), else on stderr as `CODE: message`.
pub fn error(json_out: bool, v: &Value) {
    if json_out {
        println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
    } else {
        let code = v["error"]["code"].as_str().unwrap_or("ERROR");
        let message = v["error"]["message"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| v.to_string());
        eprintln!("{code}: {message}");
    }
}

/// An object as `key: value` lines, nested objects by dotted keys, lists of objects as tables.
fn object(
    v: &Value,
    prefix: &str,
    columns: &dyn Fn(&str) -> Option<&'static [&'static str]>,
) -> String {
    let Value::Object(map) = v else {
        return format!("{}\n", cell(v));
    };
    let mut lines = String::new();
    let mut tables = String::new();
    for (k, val) in map {
        let key = format!("{prefix}{k}");
        match val {
            Value::Object(_) => lines.push_str(&object(val, &format!("{key}."), columns)),
            Value::Array(items) if items.iter().all(Value::is_object) => {
                let cols: Vec<String> = match columns(k) {
                    Some(c) => c.iter().map(|s| (*s).to_owned()).collect(),
                    None => scalar_keys(items.first()),
                };
                tables.push_str(&format!("\n{key} ({}):\n", items.len()));
                tables.push_str(&table(items, &cols));
            }
            _ => lines.push_str(&format!("{key}: {}\n", cell(val))),
        }
    }
    lines + &tables
}

/// The keys of an item whose values are not nested.
fn scalar_keys(item: Option<&Value>) -> Vec<String> {
    match item {
        Some(Value::Object(m)) => m
            .iter()
            .filter(|(_, v)| !v.is_object() && !v.is_array())
            .map(|(k, _)| k.clone())
            .collect(),
        _ => Vec::new(),
    }
}

/// Rows under a header, each column as wide as its widest cell.
fn table(items: &[Value], cols: &[String]) -> String {
    if items.is_empty() {
        return "  (none)\n".into();
    }
    let rows: Vec<Vec<String>> = items
        .iter()
        .map(|i| cols.iter().map(|c| cell(&i[c.as_str()])).collect())
        .collect();
    let widths: Vec<usize> = cols
        .iter()
        .enumerate()
        .map(|(n, c)| {
            rows.iter()
                .map(|r| r[n].chars().count())
                .chain([c.len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: Vec<&str>| -> String {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        format!("{}\n", padded.join("  ").trim_end())
    };
    let mut out = line(
        cols.iter()
            .map(|c| c.to_ascii_uppercase())
            .collect::<Vec<_>>()
            .iter()
            .map(String::as_str)
            .collect(),
    );
    for r in &rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

/// One value as a cell: strings bare, nothing as `-`, long text cut at 60 characters.
fn cell(v: &Value) -> String {
    let s = match v {
        Value::Null => "-".to_owned(),
        Value::String(s) => s.replace('\n', " "),
        other => other.to_string(),
    };
    if s.chars().count() > 60 {
        format!("{}…", s.chars().take(59).collect::<String>())
    } else {
        s
    }
}
