//! Applies the library's migrations (the `migrations/` folder, embedded at build time) inside
//! the library's schema, so that they can run on a live database.
//!
//! - Everything lands in the schema ([`schema`](super::schema::schema)): the migrations' SQL
//!   names no schema and runs with `search_path` set to it, and the versions applied are
//!   recorded in its `schema_migrations`, never in the application's
//!   `__diesel_schema_migrations`.
//! - Every statement runs under `lock_timeout`, and a statement that times out waiting for a
//!   lock is tried again after a pause: a migration never queues the application's writes
//!   behind a long reader for longer than that timeout.
//! - A migration whose `metadata.toml` says `run_in_transaction = false` runs each statement
//!   in a transaction of its own (`CREATE INDEX CONCURRENTLY`, `VALIDATE CONSTRAINT`). Such
//!   statements are written to be run again (`IF NOT EXISTS`), and an index that a failed
//!   concurrent build left invalid is dropped before the next try.
//! - An install made by an earlier version (its tables in `public`, its versions in
//!   `public.__diesel_schema_migrations`) is moved into the schema first, every row kept.
//!
//! The rules a migration of large tables keeps are checked by `migrations_keep_to_the_rules`
//! below.

use std::time::{Duration, Instant};

use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, NoTls};

use super::schema::schema;
use crate::error::{Error, Result};

/// One embedded migration.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// The version recorded once it is applied, e.g. `20261129000001`.
    pub version: &'static str,
    /// Its name, e.g. `outbox_inbox`.
    pub name: &'static str,
    /// Whether its statements run in one transaction (the default), or one by one.
    pub transactional: bool,
    /// Its SQL: statements separated by `;`, naming no schema.
    pub sql: &'static str,
}

impl Migration {
    /// Its statements, as the runner sends them: split at each `;` outside quotes, dollar
    /// quotes and comments.
    pub fn statements(&self) -> Vec<&'static str> {
        split(self.sql)
    }
}

/// The library's migrations, oldest first.
pub const MIGRATIONS: &[Migration] = include!(concat!(env!("OUT_DIR"), "/migrations.rs"));

/// What an install of an earlier version kept in `public`: each object's kind, its name, the
/// version that created it and the one that dropped it. Only an object whose creating version
/// is recorded (and dropping version is not) is the library's: a table of the application's
/// that happens to share the name of one a later version creates stays where it is.
const LEGACY: &[(&str, &str, &str, Option<&str>)] = &[
    ("TABLE", "outbox_events", "20261129000001", None),
    ("TABLE", "inbox_events", "20261129000001", None),
    ("TABLE", "consumer_states", "20261129000001", None),
    ("TABLE", "consumer_subscriptions", "20261129000001", None),
    ("TABLE", "idempotency_keys", "20261129000002", None),
    ("TABLE", "reconcile_runs", "20261129000002", None),
    ("TABLE", "admin_audit", "20261129000003", None),
    ("TABLE", "outbox_stats_samples", "20261129000003", None),
    ("SEQUENCE", "outbox_lease_token_seq", "20261129000004", None),
    ("TABLE", "aggregate_versions", "20261129000005", None),
    (
        "TABLE",
        "inbox_in_flight",
        "20261129000008",
        Some("20261201000010"),
    ),
    (
        "FUNCTION",
        "inbox_lease_held(bigint, bigint)",
        "20261201000010",
        None,
    ),
    ("TABLE", "inbox_leases", "20261201000011", None),
    ("TABLE", "unrouted_events", "20261202000014", None),
    ("TABLE", "contract_findings", "20261202000015", None),
    ("TABLE", "replays", "20261202000016", None),
    ("TABLE", "nats_bindings", "20261203000021", None),
    ("TABLE", "side_effects", "20261203000024", None),
    ("TABLE", "log_head", "20261205000025", None),
    ("TABLE", "log_stamps", "20261205000025", None),
    ("TABLE", "consumer_cursors", "20261205000025", None),
];

/// How [`migrate_with`] treats a live database.
#[derive(Debug, Clone)]
pub struct MigrateConfig {
    /// How long one statement may wait for a lock before it gives up and is tried again.
    /// While a migration waits for a table's lock, the application's writes to that table
    /// queue behind it, so this bounds the stall a migration can cause. Default 500 ms.
    pub lock_timeout: Duration,
    /// The same for a statement that runs `CONCURRENTLY`. Its waits (for the transactions
    /// older than it to end) queue no write behind them, and a timeout throws away a build
    /// that then starts over, so it waits longer. Default 60 s.
    pub concurrent_lock_timeout: Duration,
    /// How long a statement that keeps timing out is tried again before the migration fails
    /// (a transaction that never ends, an autovacuum of a large table: PostgreSQL cancels an
    /// autovacuum that blocks a lock request only after `deadlock_timeout`, 1 s by default,
    /// longer than `lock_timeout`). Default 15 min.
    pub retry_for: Duration,
    /// Apply the migrations up to this version only (for an upgrade in steps, and tests);
    /// `None`, the default, applies them all.
    pub until: Option<String>,
}

impl Default for MigrateConfig {
    fn default() -> Self {
        MigrateConfig {
            lock_timeout: Duration::from_millis(500),
            concurrent_lock_timeout: Duration::from_secs(60),
            retry_for: Duration::from_secs(15 * 60),
            until: None,
        }
    }
}

/// What [`migrate_with`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigrateReport {
    /// Whether an install of an earlier version was moved out of `public` into the schema.
    pub moved_from_public: bool,
    /// The versions applied now, oldest first.
    pub applied: Vec<String>,
    /// How many statements timed out waiting for a lock and were tried again.
    pub lock_retries: u32,
}

/// Applies every pending migration of the library to the database at `database_url`, in the
/// library's schema (`actix_outbox` unless [`use_schema`](crate::db::use_schema) says
/// otherwise), with [`MigrateConfig`]'s defaults.
///
/// Run it as the role that owns the schema (see `docs/security.md`): the runtime's role needs
/// no DDL right. Safe to call from several processes at once (they take turns on an advisory
/// lock of the schema) and on a live database (each statement runs under `lock_timeout`).
///
/// # Errors
/// [`Error::Migration`] (`MIGRATION_FAILED`) when the database cannot be reached or a statement
/// fails, naming the migration and the statement; a migration that runs in a transaction is
/// rolled back whole. [`Error::Config`] for an invalid `ACTIX_OUTBOX_SCHEMA`.
pub async fn migrate(database_url: &str) -> Result<()> {
    migrate_with(database_url, &MigrateConfig::default())
        .await
        .map(|_| ())
}

/// [`migrate`] with settings of your own; says what it did.
///
/// # Errors
/// As [`migrate`].
pub async fn migrate_with(database_url: &str, config: &MigrateConfig) -> Result<MigrateReport> {
    super::schema::check()?;
    let (client, connection) = tokio_postgres::connect(database_url, NoTls)
        .await
        .map_err(fail("connecting"))?;
    let driver = tokio::spawn(connection);
    let mut runner = Runner {
        client,
        config: config.clone(),
        schema: schema(),
        report: MigrateReport::default(),
    };
    let result = runner.run().await;
    drop(runner);
    // The connection ends with its client; its session locks go with it.
    let _ = driver.await;
    result
}

struct Runner {
    client: Client,
    config: MigrateConfig,
    schema: &'static str,
    report: MigrateReport,
}

impl Runner {
    async fn run(&mut self) -> Result<MigrateReport> {
        let s = self.schema;
        if let Some(until) = &self.config.until {
            if !MIGRATIONS.iter().any(|m| m.version == until.as_str()) {
                return Err(Error::Config(format!(
                    "MigrateConfig::until: {until:?} is no migration's version (such as {})",
                    MIGRATIONS[0].version
                )));
            }
        }
        let settings = format!(
            "SET lock_timeout = '{}ms'; SET statement_timeout = 0; SET search_path = {s}",
            self.config.lock_timeout.as_millis().max(1)
        );
        // search_path may name the schema before it exists.
        self.client
            .batch_execute(&settings)
            .await
            .map_err(fail("setting lock_timeout and search_path"))?;
        // Instances that start together take turns. A waiter asks again and again rather than
        // wait inside one statement: a statement's snapshot would make the holder's
        // `CREATE INDEX CONCURRENTLY` wait for the waiter, which waits for the holder.
        loop {
            let row = self
                .client
                .query_one(
                    "SELECT pg_try_advisory_lock(hashtextextended('actix_outbox.migrate:' || $1, 0))",
                    &[&s],
                )
                .await
                .map_err(fail("taking the migration lock"))?;
            if row.get::<_, bool>(0) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let exists = self
            .client
            .query_one(
                "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)",
                &[&s],
            )
            .await
            .map_err(fail("looking for the schema"))?;
        if !exists.get::<_, bool>(0) {
            // CREATE SCHEMA checks the right to create one even when it exists: a schema made
            // beforehand by a DBA (`docs/security.md`) needs no such right.
            self.retried(
                "creating the schema",
                &format!("CREATE SCHEMA IF NOT EXISTS {s}"),
            )
            .await?;
        }
        // Only when missing: CREATE … IF NOT EXISTS needs the right to create even when the
        // table exists, and a role without DDL rights may call `migrate` at every start.
        let recorded = self
            .client
            .query_one(
                "SELECT to_regclass($1 || '.schema_migrations') IS NOT NULL",
                &[&s],
            )
            .await
            .map_err(fail("looking for schema_migrations"))?;
        if !recorded.get::<_, bool>(0) {
            self.retried(
                "creating schema_migrations",
                &format!(
                    "CREATE TABLE IF NOT EXISTS {s}.schema_migrations (\
                     version text PRIMARY KEY, name text NOT NULL, \
                     applied_at timestamptz NOT NULL DEFAULT now())"
                ),
            )
            .await?;
        }
        let mut applied: Vec<String> = self
            .client
            .query(&format!("SELECT version FROM {s}.schema_migrations"), &[])
            .await
            .map_err(fail("reading schema_migrations"))?
            .iter()
            .map(|r| r.get(0))
            .collect();
        if applied.is_empty() {
            applied = self.move_from_public().await?;
        }
        for m in MIGRATIONS {
            if applied.iter().any(|v| v == m.version) {
                continue;
            }
            if let Some(until) = &self.config.until {
                if m.version > until.as_str() {
                    break;
                }
            }
            self.apply(m).await?;
            self.report.applied.push(m.version.to_owned());
        }
        Ok(std::mem::take(&mut self.report))
    }

    /// Moves an earlier version's install out of `public`, in one transaction: its objects
    /// (`ALTER … SET SCHEMA` changes the catalog only: no row is read or rewritten), and its
    /// versions copied into the schema's record. Returns the versions it carried over.
    async fn move_from_public(&mut self) -> Result<Vec<String>> {
        let s = self.schema;
        let legacy = self
            .client
            .query_one(
                "SELECT to_regclass('public.outbox_events') IS NOT NULL \
                    AND to_regclass('public.__diesel_schema_migrations') IS NOT NULL",
                &[],
            )
            .await
            .map_err(fail("looking for an install in public"))?;
        if !legacy.get::<_, bool>(0) {
            return Ok(Vec::new());
        }
        let ours: Vec<&str> = MIGRATIONS.iter().map(|m| m.version).collect();
        let recorded: Vec<String> = self
            .client
            .query(
                "SELECT version::text FROM public.__diesel_schema_migrations \
                 WHERE version = ANY($1) ORDER BY version",
                &[&ours],
            )
            .await
            .map_err(fail("reading public.__diesel_schema_migrations"))?
            .iter()
            .map(|r| r.get(0))
            .collect();
        // The application's own `outbox_events` and a diesel history without ours: not ours.
        if !recorded.iter().any(|v| v == MIGRATIONS[0].version) {
            return Ok(Vec::new());
        }
        let has = |v: &str| recorded.iter().any(|r| r == v);
        let mut statements = Vec::new();
        for (kind, name, created, dropped) in LEGACY {
            if has(created) && !dropped.is_some_and(has) {
                statements.push(format!("ALTER {kind} public.{name} SET SCHEMA {s}"));
            }
        }
        for v in &recorded {
            let name = MIGRATIONS
                .iter()
                .find(|m| m.version == v)
                .map_or("", |m| m.name);
            statements.push(format!(
                "INSERT INTO {s}.schema_migrations (version, name) VALUES ('{v}', '{name}')"
            ));
        }
        // The versions stay in `public.__diesel_schema_migrations` too: an instance of an
        // earlier build that starts again (a rollback, a crash loop) then finds nothing to
        // migrate and fails on the missing tables, loudly, instead of making a second, empty
        // install in `public` beside this one. Once no earlier build can start, delete them
        // (docs/operations.md#upgrading-a-running-fleet).
        let refs: Vec<&str> = statements.iter().map(String::as_str).collect();
        self.transaction("moving the install out of public", &refs)
            .await?;
        self.report.moved_from_public = true;
        tracing::info!(
            name: "outbox.migrate.moved",
            schema = s,
            versions = recorded.len(),
            "outbox.migrate.moved: the install in public moved into its schema"
        );
        Ok(recorded)
    }

    async fn apply(&mut self, m: &Migration) -> Result<()> {
        let what = format!("migration {}_{}", m.version, m.name);
        let record = format!(
            "INSERT INTO {}.schema_migrations (version, name) VALUES ('{}', '{}')",
            self.schema, m.version, m.name
        );
        let statements = m.statements();
        if m.transactional {
            let mut all: Vec<&str> = statements.clone();
            all.push(&record);
            self.transaction(&what, &all).await?;
        } else {
            // Left by an earlier try that failed half-way: `IF NOT EXISTS` would skip it.
            for index in statements.iter().filter_map(|st| built_index(st)) {
                self.drop_if_invalid(&index).await?;
            }
            for (i, st) in statements.iter().enumerate() {
                self.retried(&format!("{what}, statement {}", i + 1), st)
                    .await?;
            }
            self.retried(&what, &record).await?;
        }
        tracing::info!(name: "outbox.migrate.applied", version = m.version, migration = m.name,
            "outbox.migrate.applied");
        Ok(())
    }

    /// `statements` in one transaction, tried again whole after a lock timeout.
    async fn transaction(&mut self, what: &str, statements: &[&str]) -> Result<()> {
        let started = Instant::now();
        loop {
            let result = async {
                self.client.batch_execute("BEGIN").await?;
                for st in statements {
                    self.client.batch_execute(st).await?;
                }
                self.client.batch_execute("COMMIT").await
            }
            .await;
            let Err(e) = result else { return Ok(()) };
            let _ = self.client.batch_execute("ROLLBACK").await;
            self.after_error(what, &e, started).await?;
        }
    }

    /// One statement in a transaction of its own, tried again after a lock timeout. A
    /// `CONCURRENTLY` statement waits up to `concurrent_lock_timeout`, and the index a
    /// concurrent build of it left invalid is dropped before it is tried again.
    async fn retried(&mut self, what: &str, statement: &str) -> Result<()> {
        let concurrently = code_of(statement)
            .to_uppercase()
            .split_whitespace()
            .any(|w| w == "CONCURRENTLY");
        let builds = built_index(statement);
        let started = Instant::now();
        loop {
            let result = if concurrently {
                self.with_lock_timeout(self.config.concurrent_lock_timeout, statement)
                    .await
            } else {
                self.client.batch_execute(statement).await
            };
            let Err(e) = result else { return Ok(()) };
            self.after_error(what, &e, started).await?;
            if let Some(index) = &builds {
                self.drop_if_invalid(index).await?;
            }
        }
    }

    async fn with_lock_timeout(
        &mut self,
        timeout: Duration,
        statement: &str,
    ) -> std::result::Result<(), tokio_postgres::Error> {
        let set = |d: Duration| format!("SET lock_timeout = '{}ms'", d.as_millis().max(1));
        self.client.batch_execute(&set(timeout)).await?;
        let result = self.client.batch_execute(statement).await;
        self.client
            .batch_execute(&set(self.config.lock_timeout))
            .await?;
        result
    }

    /// After a failed try: `Ok` to try again (a lock timeout, within `retry_for`), after a
    /// pause; the error otherwise.
    async fn after_error(
        &mut self,
        what: &str,
        e: &tokio_postgres::Error,
        started: Instant,
    ) -> Result<()> {
        let lock_timeout = e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE);
        if !lock_timeout || started.elapsed() >= self.config.retry_for {
            let why = described(e);
            let tried = if lock_timeout {
                format!(", tried for {:?}", started.elapsed())
            } else {
                String::new()
            };
            return Err(Error::Migration(format!("{what}: {why}{tried}").into()));
        }
        self.report.lock_retries += 1;
        tracing::info!(name: "outbox.migrate.lock_timeout", step = what,
            "outbox.migrate.lock_timeout: waited too long for a lock; trying again");
        // 200 ms, growing to 5 s while the lock stays taken.
        let pause =
            (started.elapsed() / 10).clamp(Duration::from_millis(200), Duration::from_secs(5));
        tokio::time::sleep(pause).await;
        Ok(())
    }

    /// Drops `index` of the schema if a concurrent build left it invalid, so that its
    /// `CREATE INDEX CONCURRENTLY IF NOT EXISTS` builds it again rather than skipping it. Only
    /// the migration's own indexes: another invalid one may be a build in progress (an
    /// operator's `REINDEX CONCURRENTLY`). The drop builds nothing, so it never comes back here.
    async fn drop_if_invalid(&mut self, index: &str) -> Result<()> {
        let qualified = format!("{}.{index}", self.schema);
        let invalid = self
            .client
            .query_one(
                "SELECT EXISTS (SELECT FROM pg_index \
                 WHERE indexrelid = to_regclass($1) AND NOT indisvalid)",
                &[&qualified],
            )
            .await
            .map_err(fail("looking for an invalid index"))?;
        if invalid.get::<_, bool>(0) {
            let drop = format!("DROP INDEX CONCURRENTLY IF EXISTS {qualified}");
            Box::pin(self.retried(&format!("dropping the invalid index {index}"), &drop)).await?;
        }
        Ok(())
    }
}

fn fail(what: &'static str) -> impl Fn(tokio_postgres::Error) -> Error {
    move |e| Error::Migration(format!("{what}: {}", described(&e)).into())
}

/// The server's message and SQLSTATE, where tokio-postgres' own text says only "db error".
fn described(e: &tokio_postgres::Error) -> String {
    e.as_db_error().map_or_else(
        || e.to_string(),
        |d| format!("{} ({})", d.message(), d.code().code()),
    )
}

/// The name of the index `statement` builds `CONCURRENTLY`, lower-cased: the word after
/// `INDEX CONCURRENTLY [IF NOT EXISTS]`.
fn built_index(statement: &str) -> Option<String> {
    let code = code_of(statement).to_lowercase();
    let words: Vec<&str> = code.split_whitespace().collect();
    let at = words
        .windows(2)
        .position(|w| w == ["index", "concurrently"])?;
    let rest = &words[at + 2..];
    let rest = if rest.starts_with(&["if", "not", "exists"]) {
        &rest[3..]
    } else {
        rest
    };
    rest.first()
        .filter(|w| **w != "on" && words[0] == "create")
        .map(|w| (*w).to_owned())
}

/// `statement` without its comments (outside quotes), for reading what it does.
fn code_of(statement: &str) -> String {
    let mut out = String::with_capacity(statement.len());
    let mut rest = statement;
    while !rest.is_empty() {
        if rest.starts_with("--") {
            rest = &rest[rest.find('\n').unwrap_or(rest.len())..];
        } else if rest.starts_with("/*") {
            rest = &rest[rest.find("*/").map_or(rest.len(), |e| e + 2)..];
        } else if rest.starts_with('\'') {
            let end = rest[1..].find('\'').map_or(rest.len(), |e| e + 2);
            out.push_str(&rest[..end]);
            rest = &rest[end..];
        } else {
            let c = rest.chars().next().unwrap_or(' ');
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// The statements of `sql`: split at each `;` outside quotes, dollar quotes and comments;
/// statements that are only comments are left out.
fn split(sql: &'static str) -> Vec<&'static str> {
    let bytes = sql.as_bytes();
    let (mut out, mut start, mut i) = (Vec::new(), 0, 0);
    let mut code = false; // whether the current statement has anything but comments
    while i < bytes.len() {
        let rest = &sql[i..];
        if rest.starts_with("--") {
            i += rest.find('\n').unwrap_or(rest.len());
            continue;
        }
        if rest.starts_with("/*") {
            i += rest.find("*/").map_or(rest.len(), |e| e + 2);
            continue;
        }
        match bytes[i] {
            q @ (b'\'' | b'"') => {
                let end = rest[1..].find(q as char).map_or(rest.len(), |e| e + 2);
                i += end;
                code = true;
                continue;
            }
            b'$' => {
                let tag_len = rest[1..].find('$').filter(|&n| {
                    rest[1..=n]
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_')
                });
                if let Some(n) = tag_len {
                    let tag = &rest[..n + 2];
                    let body_end = rest[tag.len()..]
                        .find(tag)
                        .map_or(rest.len(), |e| tag.len() + e + tag.len());
                    i += body_end;
                    code = true;
                    continue;
                }
            }
            b';' => {
                if code {
                    out.push(sql[start..i].trim());
                }
                start = i + 1;
                code = false;
            }
            c if !c.is_ascii_whitespace() => code = true,
            _ => {}
        }
        i += 1;
    }
    if code {
        out.push(sql[start..].trim());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_split_outside_quotes_and_comments() {
        let sql = "-- a; comment\nCREATE TABLE a (x text DEFAULT ';');\n\
                   CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$ BEGIN RETURN 1; END $$;\n\
                   /* b; */ SELECT \"a;b\" FROM a;\n-- only a comment;\n";
        let got = split(sql);
        assert_eq!(got.len(), 3, "{got:#?}");
        assert!(got[0].ends_with("DEFAULT ';')"));
        assert!(got[1].ends_with("END $$"));
        assert!(got[2].ends_with("FROM a"));
    }

    #[test]
    fn versions_are_unique_and_ordered() {
        for pair in MIGRATIONS.windows(2) {
            assert!(pair[0].version < pair[1].version, "{pair:?}");
        }
        assert_eq!(MIGRATIONS[0].version, "20261129000001");
    }

    /// What `m` does that a migration of live, large tables must not.
    fn rule_breaks(m: &Migration) -> Vec<String> {
        let mut broken = Vec::new();
        for st in split(m.sql) {
            let flat = code_of(st)
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
                .to_uppercase();
            let mut why = Vec::new();
            if flat.starts_with("CREATE INDEX") || flat.starts_with("CREATE UNIQUE INDEX") {
                if !flat.contains(" CONCURRENTLY ") {
                    why.push("an index built without CONCURRENTLY");
                }
                if !flat.contains(" IF NOT EXISTS ") {
                    why.push("a concurrent build that cannot be run again (IF NOT EXISTS)");
                }
            }
            if flat.contains("CONCURRENTLY") && m.transactional {
                why.push("CONCURRENTLY in a migration that runs in a transaction");
            }
            if flat.contains("ADD CONSTRAINT") && !flat.contains("NOT VALID") {
                why.push("a constraint added without NOT VALID");
            }
            if flat.contains("VALIDATE CONSTRAINT") && m.transactional {
                why.push("VALIDATE in the transaction that holds the ADD's lock");
            }
            let rewrites = [
                " TYPE ",
                "SET NOT NULL",
                "VACUUM FULL",
                "CLUSTER ",
                "SET LOGGED",
            ];
            if flat.starts_with("ALTER TABLE") && rewrites.iter().any(|r| flat.contains(r)) {
                why.push("a statement that rewrites or scans the table under ACCESS EXCLUSIVE");
            }
            for w in why {
                broken.push(format!("{}_{}: {w}: {st}", m.version, m.name));
            }
        }
        broken
    }

    /// Migrations from `20261202000017` on run against live, large tables, so each keeps to
    /// the rules in the module docs: an index is built `CONCURRENTLY` (in a migration that does
    /// not run in a transaction), a constraint is added `NOT VALID` and validated in a
    /// statement of its own, and nothing rewrites or scans a whole table under an ACCESS
    /// EXCLUSIVE lock. The ones before predate the rules; every install has applied them, and
    /// a new install runs them on empty tables.
    #[test]
    fn migrations_keep_to_the_rules() {
        let broken: Vec<String> = MIGRATIONS
            .iter()
            .filter(|m| m.version >= "20261202000017")
            .flat_map(rule_breaks)
            .collect();
        assert!(broken.is_empty(), "{}", broken.join("\n"));
    }

    /// The rules read past a statement's comments: a migration opens with one.
    #[test]
    fn the_rules_see_a_statement_behind_its_comment() {
        let bad = Migration {
            version: "20990101000001",
            name: "bad",
            transactional: true,
            sql: "-- why this index\nCREATE INDEX x ON outbox_events (id);\n\
                  -- and this check\nALTER TABLE inbox_events ADD CONSTRAINT c CHECK (id > 0);",
        };
        let broken = rule_breaks(&bad);
        assert_eq!(broken.len(), 3, "{broken:#?}");
        let good = Migration {
            version: "20990101000002",
            name: "good",
            transactional: false,
            sql: "-- why\nCREATE INDEX CONCURRENTLY IF NOT EXISTS x ON outbox_events (id);",
        };
        assert!(rule_breaks(&good).is_empty());
    }

    #[test]
    fn the_index_a_statement_builds_is_read_past_comments() {
        let st = "-- the 'why'; of it\nCREATE INDEX CONCURRENTLY IF NOT EXISTS Outbox_X ON t (a)";
        assert_eq!(built_index(st).as_deref(), Some("outbox_x"));
        assert_eq!(
            built_index("CREATE INDEX CONCURRENTLY y ON t (a)").as_deref(),
            Some("y")
        );
        assert_eq!(built_index("CREATE INDEX CONCURRENTLY ON t (a)"), None);
        assert_eq!(built_index("DROP INDEX CONCURRENTLY IF EXISTS y"), None);
        assert_eq!(
            built_index("-- CREATE INDEX CONCURRENTLY z\nSELECT 1"),
            None
        );
        assert_eq!(code_of("a -- b\nc /* d */ 'e -- f'"), "a \nc  'e -- f'");
    }
}
