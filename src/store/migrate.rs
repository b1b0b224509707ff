//! Applies the library's migrations (the `migrations/` folder, embedded at build time).

use diesel_async::async_connection_wrapper::AsyncConnectionWrapper;
use diesel_async::AsyncPgConnection;
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};

use crate::error::{Error, Result};

/// The library's migrations, for applications that run them with their own harness next to
/// their own migrations instead of calling [`migrate`].
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations");

/// Serialises concurrent start-ups of several instances against one database.
const MIGRATION_LOCK_KEY: i64 = 0x6163_7469_786f_7574; // "actixout"

/// Applies every pending migration of the library to the database at `database_url`.
///
/// Safe to call from several processes at once: they queue on an advisory lock, and the
/// versions are recorded in diesel's `__diesel_schema_migrations`, so `diesel migration run`
/// and this function agree on what has been applied.
///
/// # Errors
/// [`Error::Migration`] when the database cannot be reached or a migration fails; a failed
/// migration is rolled back whole.
pub async fn migrate(database_url: &str) -> Result<()> {
    let url = database_url.to_owned();
    let (tx, rx) = tokio::sync::oneshot::channel();
    // diesel's harness is synchronous and blocks on its own runtime, which cannot run on the
    // actix (current-thread) runtime's thread, so it gets a thread of its own.
    std::thread::Builder::new()
        .name("actix-outbox-migrate".into())
        .spawn(move || {
            let _ = tx.send(run_blocking(&url));
        })
        .map_err(|e| Error::Migration(e.into()))?;
    rx.await
        .map_err(|_| Error::Migration("the migration thread panicked".into()))?
}

fn run_blocking(url: &str) -> Result<()> {
    use diesel::{Connection, RunQueryDsl};
    let mut conn = AsyncConnectionWrapper::<AsyncPgConnection>::establish(url)
        .map_err(|e| Error::Migration(e.into()))?;
    diesel::sql_query(format!("SELECT pg_advisory_lock({MIGRATION_LOCK_KEY})"))
        .execute(&mut conn)
        .map_err(|e| Error::Migration(e.into()))?;
    let applied = conn
        .run_pending_migrations(MIGRATIONS)
        .map(|_| ())
        .map_err(Error::Migration);
    // Closing the connection would release the lock too; unlocking says so explicitly.
    let _ = diesel::sql_query(format!("SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})"))
        .execute(&mut conn);
    applied
}
