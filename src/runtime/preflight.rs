//! What a start checks before it writes anything: the role's privileges and the schema's
//! version (`store::access`), and that the pool does not go through a transaction pooler.
//!
//! The runtime needs sessions: a lease names the backend that claimed it, the reconciler holds
//! a session advisory lock, the listener holds `LISTEN`, and statements stay prepared on their
//! connection. Behind a pooler in transaction (or statement) mode, each transaction may run on
//! another server connection, and all of that breaks without an error. Such a pooler shows
//! itself when two statements of one client session answer from two backends, which is what
//! [`pooler`] looks for.

use std::time::Duration;

use diesel::sql_types::Integer;
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use crate::error::{Error, Result};
use crate::store::{self, PgPool};

/// The checks of a start, in one place: privileges and schema first (they name what to fix),
/// then the pooler, unless `pooler_check` is off.
pub(crate) async fn check(pool: &PgPool, pooler_check: bool) -> Result<()> {
    let mut conn = pool.get().await?;
    store::access::check_runtime(&mut conn).await?;
    if pooler_check {
        // A pooler with no server connection to spare makes the probe wait for one.
        tokio::time::timeout(PROBE_BOUND, pooler(pool, &mut conn))
            .await
            .map_err(|_| Error::DatabaseTimeout(PROBE_BOUND))??;
    }
    Ok(())
}

/// How long the pooler probe may take: a few round trips and one new connection.
const PROBE_BOUND: Duration = Duration::from_secs(15);

#[derive(QueryableByName)]
struct Pid {
    #[diesel(sql_type = Integer)]
    pid: i32,
}

async fn pid(conn: &mut AsyncPgConnection) -> Result<i32> {
    let p: Pid = diesel::sql_query("SELECT pg_backend_pid() AS pid")
        .get_result(conn)
        .await?;
    Ok(p.pid)
}

/// Refuses a pool whose session moves between backends. Between two statements of `conn`,
/// a second client holds a transaction open: a transaction pooler that reuses its most recent
/// server connection (PgBouncer's default) gives it the one `conn` just used, so `conn`'s
/// next statement answers from another backend. The second client commits as soon as that
/// statement answers, or after 200 ms if it waits (for the server connection the second
/// client holds: a pooler with a single one), so the check cannot deadlock; such a pooler
/// then passes unseen.
async fn pooler(pool: &PgPool, conn: &mut AsyncPgConnection) -> Result<()> {
    let first = pid(conn).await?;
    // The statement's Close goes out after its answer, unawaited: wait for it to be done, or
    // the second client may arrive while the pooler still holds `conn`'s server connection,
    // get a new one, and leave `conn` on the same server as before.
    conn.batch_execute("SELECT 1").await?;
    // Outside the pool: a pool of one connection must not wait for itself.
    let mut other = pool.dedicated_connection().await.map_err(|e| match e {
        diesel_async::pooled_connection::PoolError::ConnectionError(e) => Error::from(e),
        diesel_async::pooled_connection::PoolError::QueryError(e) => Error::Database(e),
    })?;
    other.batch_execute("BEGIN").await?;
    let _ = pid(&mut other).await?;
    let second = {
        let mut probe = std::pin::pin!(pid(conn));
        let answered = tokio::time::timeout(Duration::from_millis(200), &mut probe).await;
        other.batch_execute("COMMIT").await?;
        match answered {
            Ok(pid) => pid?,
            Err(_) => probe.await?,
        }
    };
    if first == second {
        return Ok(());
    }
    Err(Error::PoolerUnsupported(format!(
        "the pool's session moved from backend {first} to backend {second} between two \
         statements: a pooler in transaction or statement mode is in front of PostgreSQL. The \
         runtime needs sessions (leases, advisory locks, LISTEN, prepared statements): connect \
         it directly or through a session-mode pooler (docs/deployment.md#poolers), or turn \
         the check off with RuntimeConfig::pooler_check(false) if it misreads your set-up"
    )))
}
