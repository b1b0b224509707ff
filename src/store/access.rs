//! Who may do what in the library's schema: the grants of each role (`docs/security.md`), and
//! the check at start that the runtime's role has them and that the schema is migrated.

use diesel::sql_types::Text;
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use super::migrate::MIGRATIONS;
use super::schema::schema;
use crate::error::{Error, Result};

/// The roles that use the library's schema, besides its owner (the role that runs
/// [`migrate`](crate::migrate) and owns what it creates). See `docs/security.md`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Role {
    /// The runtime (publisher, consumers, reaper, retention, stats) and the operator API's
    /// actions: rows of every table of the schema (only reads of the migration record), no
    /// DDL.
    Runtime,
    /// A service that only enqueues: inserts into `outbox_events`, nothing else.
    Producer,
    /// The operator API's reads, dashboards and ad-hoc queries: reads every table.
    Operator,
}

/// The statements that give `grantee` what `role` needs in this process's schema, today and
/// for the tables later migrations add (`ALTER DEFAULT PRIVILEGES`, so run them as the role
/// that runs the migrations). They are what [`grant`] runs; print them to review them or to
/// put them in your own provisioning.
///
/// # Errors
/// [`Error::Config`] when `grantee` is not a plain role name (lower-case letters, digits, `_`).
pub fn grants(role: Role, grantee: &str) -> Result<Vec<String>> {
    let ok = !grantee.is_empty()
        && grantee.len() <= 63
        && grantee
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && !grantee.starts_with(|c: char| c.is_ascii_digit());
    if !ok {
        return Err(Error::Config(format!(
            "role name {grantee:?}: use lower-case letters, digits and '_', not starting with a digit"
        )));
    }
    let (s, g) = (schema(), grantee);
    let usage = format!("GRANT USAGE ON SCHEMA {s} TO {g}");
    Ok(match role {
        Role::Runtime => vec![
            usage,
            format!("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {s} TO {g}"),
            format!("GRANT USAGE ON ALL SEQUENCES IN SCHEMA {s} TO {g}"),
            format!("GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {s} TO {g}"),
            // The migration record is the owner's to write.
            format!("REVOKE INSERT, UPDATE, DELETE ON {s}.schema_migrations FROM {g}"),
            format!(
                "ALTER DEFAULT PRIVILEGES IN SCHEMA {s} \
                 GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {g}"
            ),
            format!("ALTER DEFAULT PRIVILEGES IN SCHEMA {s} GRANT USAGE ON SEQUENCES TO {g}"),
            format!("ALTER DEFAULT PRIVILEGES IN SCHEMA {s} GRANT EXECUTE ON FUNCTIONS TO {g}"),
        ],
        Role::Producer => vec![
            usage,
            format!("GRANT INSERT ON {s}.outbox_events TO {g}"),
            // `seq`, a bigserial: its default takes the sequence's next value.
            format!("GRANT USAGE ON SEQUENCE {s}.outbox_events_seq_seq TO {g}"),
        ],
        Role::Operator => vec![
            usage,
            format!("GRANT SELECT ON ALL TABLES IN SCHEMA {s} TO {g}"),
            format!("ALTER DEFAULT PRIVILEGES IN SCHEMA {s} GRANT SELECT ON TABLES TO {g}"),
        ],
    })
}

/// Runs [`grants`] for `role` on `conn`, in one transaction: connect as the schema's owner.
///
/// # Errors
/// [`Error::Config`] for an invalid role name; [`Error::Database`] when a statement fails (the
/// role does not exist, or `conn`'s role may not grant).
pub async fn grant(conn: &mut AsyncPgConnection, role: Role, grantee: &str) -> Result<()> {
    use diesel_async::{AsyncConnection, SimpleAsyncConnection};
    let statements = grants(role, grantee)?.join(";\n");
    conn.transaction::<_, Error, _>(async |c| {
        c.batch_execute(&statements).await?;
        Ok(())
    })
    .await
}

#[derive(QueryableByName)]
struct Missing {
    #[diesel(sql_type = Text)]
    privilege: String,
    #[diesel(sql_type = Text)]
    object: String,
}

#[derive(QueryableByName)]
struct Version {
    #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
    version: Option<String>,
}

/// Refuses a start the runtime could not finish: the schema missing or behind this build
/// (`SCHEMA_NOT_MIGRATED`), or a privilege of [`Role::Runtime`] missing
/// (`PRIVILEGE_MISSING`, naming each object and privilege). One round trip, before anything
/// is written.
pub(crate) async fn check_runtime(conn: &mut AsyncPgConnection) -> Result<()> {
    let s = schema();
    let missing: Vec<Missing> = diesel::sql_query(
        "WITH o AS ( \
             SELECT c.oid, c.relname, c.relkind FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relkind IN ('r', 'p', 'S') AND NOT c.relispartition), \
         wanted AS ( \
             SELECT o.oid, o.relname, o.relkind, p FROM o, LATERAL unnest(CASE \
                 WHEN o.relkind = 'S' THEN ARRAY['USAGE'] \
                 WHEN o.relname = 'schema_migrations' THEN ARRAY['SELECT'] \
                 ELSE ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE'] END) p) \
         SELECT 'USAGE' AS privilege, 'schema ' || $1 AS object \
             WHERE EXISTS (SELECT FROM pg_namespace WHERE nspname = $1) \
               AND NOT has_schema_privilege($1, 'USAGE') \
         UNION ALL \
         SELECT p, $1 || '.' || relname FROM wanted \
             WHERE NOT CASE WHEN relkind = 'S' THEN has_sequence_privilege(oid, p) \
                            ELSE has_table_privilege(oid, p) END \
         UNION ALL \
         SELECT 'EXECUTE', $1 || '.' || p.oid::regprocedure::text FROM pg_proc p \
             JOIN pg_namespace n ON n.oid = p.pronamespace \
             WHERE n.nspname = $1 AND NOT has_function_privilege(p.oid, 'EXECUTE') \
         ORDER BY 2, 1",
    )
    .bind::<Text, _>(s)
    .load(conn)
    .await?;
    if !missing.is_empty() {
        let role: Version = diesel::sql_query("SELECT current_user::text AS version")
            .get_result(conn)
            .await?;
        return Err(Error::PrivilegeMissing {
            role: role.version.unwrap_or_default(),
            missing: missing
                .into_iter()
                .map(|m| (m.privilege, m.object))
                .collect(),
        });
    }
    let latest = MIGRATIONS.last().map_or("", |m| m.version);
    #[derive(QueryableByName)]
    struct Exists {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        exists: bool,
    }
    let table: Exists =
        diesel::sql_query("SELECT to_regclass($1 || '.schema_migrations') IS NOT NULL AS exists")
            .bind::<Text, _>(s)
            .get_result(conn)
            .await?;
    let found = if table.exists {
        super::sql("SELECT max(version) AS version FROM actix_outbox.schema_migrations")
            .get_result(conn)
            .await?
    } else {
        Version { version: None }
    };
    match found.version {
        Some(v) if v.as_str() >= latest => Ok(()),
        v => Err(Error::NotMigrated(format!(
            "schema {s} is {}, and this build needs version {latest}: run \
             actix_outbox::migrate as the schema's owner first",
            v.map_or_else(|| "not migrated".to_owned(), |v| format!("at version {v}"))
        ))),
    }
}
