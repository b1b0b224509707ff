//! The database seam: the SQL of the delivery state machines (docs/design.md) lives in this
//! folder, so they can be read in one place. (The reconciler's advisory lock and drift query,
//! the idempotency key insert and the listener's `LISTEN` stay beside their code.) Internal; users
//! see only [`PgPool`], the pool builders and [`ConnectionConfig`].

pub(crate) mod access;
pub(crate) mod admin;
pub(crate) mod audit;
mod connection;
pub(crate) mod contract;
pub(crate) mod effects;
pub(crate) mod inbox;
pub(crate) mod lease;
pub(crate) mod migrate;
pub(crate) mod outbox;
pub(crate) mod replay;
pub(crate) mod retention;
pub(crate) mod scan;
pub(crate) mod schema;
pub(crate) mod snapshots;
pub(crate) mod stats;
pub(crate) mod status;
pub(crate) mod timeline;

use diesel::connection::TransactionDepthChange;
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::QueryResult;
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::{
    AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection,
    TransactionManager,
};

pub(crate) use connection::open_connections_here_for;
pub use connection::ConnectionConfig;
pub(crate) use schema::sql;

/// The connection pool the runtime and the application share.
pub type PgPool = bb8::Pool<AsyncDieselConnectionManager<AsyncPgConnection>>;

/// A pooled connection that can move into an actor message (`Pool::get_owned`).
pub(crate) type OwnedConn =
    bb8::PooledConnection<'static, AsyncDieselConnectionManager<AsyncPgConnection>>;

/// Builds a pool for `database_url` with `max_size` connections and the default
/// [`ConnectionConfig`]; a convenience for applications that do not configure bb8 themselves.
///
/// # Errors
/// [`Error::Pool`](crate::Error::Pool) if the pool cannot be built.
pub async fn connect(database_url: &str, max_size: u32) -> crate::Result<PgPool> {
    connect_with(database_url, max_size, &ConnectionConfig::default()).await
}

/// [`connect`] with network settings of your own.
///
/// Connections are not tested on check-out (bb8's default costs a round trip each time): a
/// connection that died while idle fails its first statement instead, and the caller retries.
/// Keepalive closes such a connection within `keepalive_idle + keepalive_retries ×
/// keepalive_interval` of the fault, so few are handed out; one that still looks alive but
/// answers nothing costs the runtime one bounded round trip, after which it checks the pool's
/// other idle connections.
///
/// # Errors
/// [`Error::Config`](crate::Error::Config) for invalid settings,
/// [`Error::Pool`](crate::Error::Pool) if the pool cannot be built.
pub async fn connect_with(
    database_url: &str,
    max_size: u32,
    config: &ConnectionConfig,
) -> crate::Result<PgPool> {
    config.validate()?;
    bb8::Pool::builder()
        .max_size(max_size)
        // A `SELECT 1` per check-out is a round trip per batch and per claim.
        .test_on_check_out(false)
        .connection_timeout(config.acquire_timeout)
        .build(config.manager(database_url))
        .await
        .map_err(|e| crate::Error::Pool(crate::error::PoolError::connect(e)))
}

/// A raw SQL statement whose text never changes, marked so that diesel-async prepares it once
/// per connection and reuses it.
///
/// `diesel::sql_query` is never cached (its SQL could be built at run time), so each call costs
/// a prepare round trip before the execution — one extra round trip per event in a handler.
/// Wrap a constant statement with bind parameters to avoid it:
///
/// ```no_run
/// # async fn f(conn: &mut diesel_async::AsyncPgConnection) -> diesel::QueryResult<()> {
/// use diesel_async::RunQueryDsl;
/// actix_outbox::db::Prepared(
///     diesel::sql_query("INSERT INTO notifications (order_id) VALUES ($1)")
///         .bind::<diesel::sql_types::Text, _>("o1"),
/// )
/// .execute(conn)
/// .await?;
/// # Ok(()) }
/// ```
///
/// Only for SQL whose text is the same on every call: each distinct text is kept as a prepared
/// statement for the life of the connection.
pub struct Prepared<Q>(pub Q);

impl<Q: QueryFragment<Pg>> QueryFragment<Pg> for Prepared<Q> {
    fn walk_ast<'b>(&'b self, pass: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        self.0.walk_ast(pass)
    }

    fn is_safe_to_cache_prepared(&self, _backend: &Pg) -> QueryResult<bool> {
        Ok(true)
    }
}

impl<Q> QueryId for Prepared<Q> {
    type QueryId = ();
    // Prepared by SQL text, not by type: one wrapper type serves many statements.
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Q: Query> Query for Prepared<Q> {
    type SqlType = Q::SqlType;
}

/// `text` with a cursor consumer's status for an event (`cursor_status.sql`, one definition
/// for the operator's views) where `/* cursor_status */` stands.
pub(crate) fn with_cursor_status(text: &str) -> String {
    text.replace("/* cursor_status */", include_str!("cursor_status.sql"))
}

/// Runs one constant statement through a shared reference, so that it can be pipelined with
/// others on the same connection (diesel-async sends futures polled together without waiting
/// for each answer; the server still runs them in the order they were first polled).
pub(crate) async fn run(mut conn: &AsyncPgConnection, sql: &'static str) -> crate::Result<()> {
    Prepared(crate::store::sql(sql)).execute(&mut conn).await?;
    Ok(())
}

/// `d` in milliseconds, for `$n * interval '1 millisecond'`, capped at a century: `now() - …`
/// must stay a timestamp PostgreSQL can hold (a `Duration::MAX` would fail every run that uses
/// it), and an age of a century means "for ever" in practice.
pub(crate) fn millis(d: std::time::Duration) -> i64 {
    const CENTURY_MS: u128 = 100 * 366 * 24 * 3600 * 1000;
    d.as_millis().min(CENTURY_MS) as i64
}

/// Keeps the planner on the indexes for the runtime's statements on the outbox and inbox, to
/// the end of the current transaction (`set_config(…, true)` is `SET LOCAL`).
///
/// Why: a prepared statement keeps the generic plan it got after five runs. Planned while the
/// tables were empty (a fresh deployment, a truncated test database), that plan scans the
/// whole table, and it stays in use as the table grows until an `ANALYZE` invalidates it:
/// each mark and claim then reads every row. Measured: three consumers on freshly emptied
/// tables ran at ~440 events/s without it and ~710 with it. With these off, only index paths
/// compete.
/// Sent pipelined just before the statements it guards, so it costs no round trip.
pub(crate) const PLAN_GUARD: &str = include_str!("plan_guard.sql");

/// How long the runtime waits for one database round trip (a claim, a mark, a commit) before
/// it takes the connection for dead. TCP alone does not notice a peer that stopped answering
/// while the path still accepts packets (a failover without RST, an expired NAT entry, a hung
/// proxy), so every runtime statement is bounded in the client too.
pub(crate) const DB_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// Runs `fut` (database work on `conn`'s behalf) for at most `limit`. On time-out the
/// connection is marked broken, so that the pool closes it rather than lending it out again:
/// its session may still be waiting for an answer that never comes.
pub(crate) async fn timed<T>(
    limit: std::time::Duration,
    fut: impl std::future::Future<Output = crate::Result<T>>,
) -> std::result::Result<crate::Result<T>, TimedOut> {
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| TimedOut(limit))
}

/// A [`timed`] call that ran out of time; [`TimedOut::close`] marks its connection broken.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TimedOut(pub std::time::Duration);

impl TimedOut {
    /// Marks `conn` broken (the pool then closes it) and returns the error to report.
    pub(crate) fn close(self, conn: &mut AsyncPgConnection) -> crate::Error {
        poison(conn);
        crate::Error::DatabaseTimeout(self.0)
    }
}

/// This process, as leases name it (`locked_by`): its pid and a random part, so that a
/// restarted process with the same pid is another. Fixed for the life of the process: a death
/// ends every lease of the process at once, whichever runtime took it.
pub(crate) fn process_id() -> &'static str {
    static ID: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!("{}-{}", std::process::id(), uuid::Uuid::now_v7().simple())
    });
    &ID
}

/// Marks `conn` broken: the pool closes it when it is returned instead of lending it again.
pub(crate) fn poison(conn: &mut AsyncPgConnection) {
    AnsiTransactionManager::transaction_manager_status_mut(conn).set_in_error();
}

/// Runs `work` on `conn` for at most `limit`. On time-out `conn` is marked broken and the
/// result is [`Error::DatabaseTimeout`](crate::Error::DatabaseTimeout); so it is when the
/// connection turns out closed. Either way the pool closes it instead of lending it out again.
pub(crate) async fn bounded<T>(
    conn: &mut AsyncPgConnection,
    limit: std::time::Duration,
    work: impl AsyncFnOnce(&mut AsyncPgConnection) -> crate::Result<T>,
) -> crate::Result<T> {
    match timed(limit, work(conn)).await {
        Ok(Err(e)) if e.lost_connection() => {
            poison(conn);
            Err(e)
        }
        Ok(done) => done,
        Err(t) => Err(t.close(conn)),
    }
}

/// How long [`sweep_idle`] waits for an idle connection to answer. Short: a connection closed
/// by mistake costs one reconnect, while every dead one left in the pool costs the next
/// borrower a whole [`DB_TIMEOUT`].
pub(crate) const SWEEP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// Checks every connection idle in `pool` with a bounded `SELECT 1`, all at once, and closes
/// those that do not answer within [`SWEEP_TIMEOUT`]. Returns how many it closed.
///
/// Why: when one round trip ran out of time, the fault that caused it (a hung proxy, a path
/// that swallows packets) has most likely cut the pool's idle connections too, and TCP cannot
/// tell while the path still acknowledges packets. Without this, each of them would be found
/// out one borrower and one [`DB_TIMEOUT`] at a time. A live connection answers in
/// milliseconds and goes straight back to the pool.
pub(crate) async fn sweep_idle(pool: &PgPool) -> usize {
    let mut idle = Vec::new();
    // Only connections that are idle now: once none is, `get` would wait or open a new one.
    // Polled once, so it can never wait here.
    while pool.state().idle_connections > 0 {
        use futures_util::FutureExt;
        match pool.get_owned().now_or_never() {
            Some(Ok(conn)) => idle.push(conn),
            _ => break,
        }
    }
    let checks = idle.into_iter().map(|mut conn| async move {
        let ping = timed(SWEEP_TIMEOUT, async {
            conn.batch_execute("SELECT 1").await?;
            Ok(())
        })
        .await;
        match ping {
            Ok(Ok(())) => false,
            Ok(Err(_)) => {
                poison(&mut conn);
                true
            }
            Err(t) => {
                let _ = t.close(&mut conn);
                true
            }
        }
    });
    let closed = futures_util::future::join_all(checks)
        .await
        .into_iter()
        .filter(|closed| *closed)
        .count();
    if closed > 0 {
        tracing::warn!(
            closed,
            "idle connections did not answer after a database time-out; closed"
        );
    }
    closed
}

/// Tells the connection's transaction manager that a pipelined `BEGIN` is about to open a
/// transaction, so that nested `transaction()` calls in handlers use savepoints. Called before
/// the `BEGIN` is sent: if the pipeline fails or is dropped half-way, the connection still
/// counts as mid-transaction, and the pool closes it instead of lending it out again.
pub(crate) fn entered_transaction(conn: &mut AsyncPgConnection) -> crate::Result<()> {
    change_depth(conn, TransactionDepthChange::IncreaseDepth)
}

/// The counterpart of [`entered_transaction`] after a pipelined `COMMIT` succeeded.
pub(crate) fn left_transaction(conn: &mut AsyncPgConnection) -> crate::Result<()> {
    change_depth(conn, TransactionDepthChange::DecreaseDepth)
}

/// [`left_transaction`] after a pipelined `COMMIT` that PostgreSQL answered, with success or
/// with an error: either way the transaction is over (a `COMMIT` refused, by a deferred
/// constraint say, rolls it back), and the connection can begin another, as a careful pass
/// does. A `COMMIT` that got no answer leaves the connection mid-transaction, so that the
/// pool closes it. Returns the `COMMIT`'s own result.
pub(crate) fn after_commit(
    conn: &mut AsyncPgConnection,
    committed: crate::Result<()>,
) -> crate::Result<()> {
    let answered = match &committed {
        Ok(()) => true,
        Err(crate::Error::Database(e)) => answered_by_server(e),
        Err(_) => false,
    };
    if answered {
        left_transaction(conn)?;
    }
    committed
}

/// Whether PostgreSQL answered `e` (a statement it refused), as opposed to a connection that
/// broke or a client-side failure.
pub(crate) fn answered_by_server(e: &diesel::result::Error) -> bool {
    use diesel::result::DatabaseErrorKind as K;
    matches!(
        e,
        diesel::result::Error::DatabaseError(kind, _)
            if !matches!(kind, K::ClosedConnection | K::UnableToSendCommand)
    )
}

fn change_depth(conn: &mut AsyncPgConnection, change: TransactionDepthChange) -> crate::Result<()> {
    AnsiTransactionManager::transaction_manager_status_mut(conn)
        .transaction_state()?
        .change_transaction_depth(change)?;
    Ok(())
}
