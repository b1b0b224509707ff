//! The PostgreSQL schema that holds every table, sequence and function of the library.
//!
//! The library's SQL names each of its objects as `actix_outbox.<name>`, so a statement means
//! the same whatever the connection's `search_path` is, and the application's own tables of
//! the same names (`public.idempotency_keys`, say) are never touched. When the process uses
//! another schema ([`use_schema`], or `ACTIX_OUTBOX_SCHEMA`), [`sql`] rewrites that prefix
//! before the statement is sent: the text of a statement is fixed for the life of the process,
//! so prepared statements stay prepared.
//!
//! One schema per process: it is read once, before the first statement, and never changes
//! after. Two services that share one database each set their own.

use std::borrow::Cow;
use std::sync::OnceLock;

use diesel::query_builder::SqlQuery;

use crate::error::{Error, Result};

/// The schema the library uses unless told otherwise.
pub const DEFAULT_SCHEMA: &str = "actix_outbox";

/// The environment variable that names the schema when [`use_schema`] was not called.
pub const SCHEMA_ENV: &str = "ACTIX_OUTBOX_SCHEMA";

/// The prefix every statement of the library is written with.
const PREFIX: &str = "actix_outbox.";

/// The schema, or why `ACTIX_OUTBOX_SCHEMA` names none: fixed by the first use.
static SCHEMA: OnceLock<std::result::Result<String, String>> = OnceLock::new();

/// The longest name: `NOTIFY` channels are the name and `_outbox`, and a channel name must fit
/// PostgreSQL's 63 bytes.
const MAX_NAME: usize = 63 - "_outbox".len();

/// Sets the schema this process's library objects live in: call it once, before
/// [`migrate`](crate::migrate), the runtime or the first [`enqueue`](crate::enqueue).
///
/// A name is lower-case letters, digits and `_`, starting with a letter or `_`, at most 56
/// bytes, and not `public` (the library's schema is its own). It is written into statements
/// unquoted, the way PostgreSQL folds it. Calling it again with the same name is harmless.
///
/// # Errors
/// [`Error::Config`] (`CONFIG_INVALID`) for an invalid name, or when the process already uses
/// another schema (an earlier call, or a statement already sent).
pub fn use_schema(name: &str) -> Result<()> {
    valid(name)?;
    match SCHEMA.get_or_init(|| Ok(name.to_owned())) {
        Ok(set) if set == name => Ok(()),
        Ok(set) => Err(Error::Config(format!(
            "the schema is already {set}: use_schema({name:?}) must come before the library's \
             first statement, and a process uses one schema"
        ))),
        Err(why) => Err(Error::Config(why.clone())),
    }
}

fn resolved() -> &'static std::result::Result<String, String> {
    SCHEMA.get_or_init(|| match std::env::var(SCHEMA_ENV) {
        Ok(name) => valid(&name)
            .map(|()| name)
            .map_err(|e| format!("{SCHEMA_ENV}: {e}")),
        Err(_) => Ok(DEFAULT_SCHEMA.to_owned()),
    })
}

/// The schema this process uses: [`use_schema`]'s, else `ACTIX_OUTBOX_SCHEMA`'s, else
/// `actix_outbox`. Fixed by the first call. (With an invalid `ACTIX_OUTBOX_SCHEMA`, the
/// default; `migrate`, the runtime's start and every enqueue then refuse to run.)
pub fn schema() -> &'static str {
    match resolved() {
        Ok(name) => name,
        Err(_) => DEFAULT_SCHEMA,
    }
}

/// Refuses to go on with an `ACTIX_OUTBOX_SCHEMA` that names no valid schema: `migrate`, the
/// runtime's start and every enqueue call it, so a mistyped variable never sends a producer's
/// events to another schema's outbox. A read of a value fixed once.
pub(crate) fn check() -> Result<()> {
    resolved()
        .as_ref()
        .map(|_| ())
        .map_err(|why| Error::Config(why.clone()))
}

fn valid(name: &str) -> Result<()> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    let reserved = name == "public" || name == "information_schema" || name.starts_with("pg_");
    if first_ok && rest_ok && name.len() <= MAX_NAME && !reserved {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "invalid schema name {name:?}: use lower-case letters, digits and '_', starting with \
             a letter or '_', at most {MAX_NAME} bytes, and a schema of the library's own (not \
             public, information_schema or pg_…)"
        )))
    }
}

/// `text` with the library's objects in this process's schema.
pub(crate) fn qualify(text: &str) -> Cow<'_, str> {
    let schema = schema();
    if schema == DEFAULT_SCHEMA {
        Cow::Borrowed(text)
    } else {
        Cow::Owned(text.replace(PREFIX, &format!("{schema}.")))
    }
}

/// `diesel::sql_query` for the library's own statements: [`qualify`]'d.
pub(crate) fn sql(text: impl AsRef<str>) -> SqlQuery {
    diesel::sql_query(qualify(text.as_ref()).into_owned())
}

/// A `NOTIFY` channel of this schema: instances of services that share a database in
/// different schemas do not wake each other. The default schema's are the channels of
/// earlier versions (`actix_outbox_outbox`, `actix_outbox_inbox`).
pub(crate) fn channel(suffix: &str) -> String {
    format!("{}_{suffix}", schema())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        for ok in ["actix_outbox", "billing_outbox", "_x", "a1"] {
            assert!(valid(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "Billing",
            "1a",
            "a-b",
            "a.b",
            "a\"b",
            "pg_x",
            &"a".repeat(64),
        ] {
            let e = valid(bad).unwrap_err();
            assert_eq!(e.code().as_str(), "CONFIG_INVALID", "{bad}");
        }
    }

    /// No statement of the library names one of its tables without the schema: a name left
    /// bare would resolve through the connection's `search_path`, to the application's table
    /// of that name or to none. Reads every SQL text in `src/`.
    #[test]
    fn every_statement_names_the_schema() {
        let tables = [
            "outbox_events",
            "inbox_events",
            "consumer_states",
            "consumer_subscriptions",
            "idempotency_keys",
            "reconcile_runs",
            "admin_audit",
            "outbox_stats_samples",
            "aggregate_versions",
            "inbox_leases",
            "unrouted_events",
            "nats_bindings",
            "contract_findings",
            "replays",
            "side_effects",
            "log_head",
            "log_stamps",
            "consumer_cursors",
            "outbox_lease_token_seq",
            "inbox_lease_held",
        ];
        let keywords = ["FROM", "JOIN", "INTO", "UPDATE", "TABLE", "USING"];
        let mut bare = Vec::new();
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut stack = vec![root];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                let ext = path.extension().and_then(|e| e.to_str());
                if !matches!(ext, Some("rs" | "sql"))
                    || path.ends_with("schema.rs")
                    || path.ends_with("migrate.rs")
                {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                // Words, with the `\` of a continued Rust string taken as a space.
                let words: Vec<&str> = text
                    .split(|c: char| c.is_whitespace() || c == '\\' || c == '(' || c == '"')
                    .filter(|w| !w.is_empty())
                    .collect();
                for pair in words.windows(2) {
                    let named = pair[1].trim_end_matches([',', ')', ';']);
                    if keywords.contains(&pair[0]) && tables.contains(&named) {
                        bare.push(format!("{}: {} {}", path.display(), pair[0], pair[1]));
                    }
                }
                for f in ["nextval('", "inbox_lease_held("] {
                    for (i, _) in text.match_indices(f) {
                        let after = &text[i..];
                        if f == "nextval('" && !after[f.len()..].starts_with(PREFIX) {
                            bare.push(format!("{}: {}", path.display(), &after[..30]));
                        }
                        if f == "inbox_lease_held(" && !text[..i].ends_with(PREFIX) {
                            bare.push(format!("{}: {}", path.display(), &after[..20]));
                        }
                    }
                }
            }
        }
        assert!(
            bare.is_empty(),
            "statements without the schema:\n{}",
            bare.join("\n")
        );
    }
}
