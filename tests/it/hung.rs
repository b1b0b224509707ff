//! Handlers hung past their timeout must be bounded in the database too, not only in the
//! process: within `handler_timeout` and a grace (5 s) their sessions should give back the row
//! locks they hold or wait for, and their hold on the vacuum horizon. Each test counts what it
//! checks in `pg_locks` and `pg_stat_activity`.
//!
//! The engine ends such a call's session after the grace, its rows staying in flight until its
//! handler lets go (`lend.rs`); the server cuts its statements at a bound of its own
//! (`statement_timeout`).

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use actix_outbox::health::{StatsConfig, StatsSampler};
use actix_outbox::{Delivery, HandlerError, OutboxRuntime, RetryPolicy};
use common::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

/// Lets the handlers that hang return.
static RELEASED: AtomicBool = AtomicBool::new(false);

/// The handler's timeout in these tests: the grace is 5 s more.
const TIMEOUT: Duration = Duration::from_secs(1);

/// Sessions of this database, other than `except`, that wait for a lock.
fn waiting(db: &TestDb, except: i32) -> String {
    format!(
        "SELECT count(*) AS n FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE NOT l.granted AND a.datname = '{}' AND a.pid <> {except}",
        db.name
    )
}

/// Sessions of this database, other than `except`, in a transaction that began over `secs`
/// seconds ago, or holding the vacuum horizon (a snapshot) that long.
fn holding(db: &TestDb, except: i32, secs: u32) -> String {
    format!(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = '{}' AND pid <> {except} \
         AND xact_start < now() - interval '{secs} seconds'",
        db.name
    )
}

async fn start(db: &TestDb, name: &str, work: &'static str, hang: bool) -> OutboxRuntime {
    let cfg = consumer(name, 5)
        .batch_size(1)
        .handler_timeout(TIMEOUT)
        // Not again within the test: one stuck attempt is what it watches.
        .retry(RetryPolicy::fixed(5, Duration::from_secs(600)));
    // No `idle_in_transaction_session_timeout` (its default ends a session idle in a
    // transaction after 60 s): what ends it here must be the engine.
    let mut settings = actix_outbox::db::ConnectionConfig::default();
    settings.idle_in_transaction_timeout = None;
    let pool = actix_outbox::db::connect_with(&db.url, 16, &settings)
        .await
        .unwrap();
    // The runtime's own sampler takes no sample during the test: the test's does.
    let quiet = StatsConfig::default()
        .interval(Duration::from_secs(3600))
        .history(Duration::from_secs(86_400));
    OutboxRuntime::builder(pool)
        .config(fast_runtime().stats(quiet))
        .consumer_fn(cfg, move |d: Delivery| async move {
            let mut conn = d.conn().await?;
            conn.batch_execute(work)
                .await
                .map_err(|e| HandlerError::retry(e.to_string()))?;
            while hang && !AtomicBool::load(&RELEASED, Ordering::SeqCst) {
                // Stuck outside the database, keeping its connection and its transaction.
                actix_rt::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(())
        })
        .start()
        .await
        .unwrap()
}

/// VACUUMs `churn` and returns how many dead row versions it had to leave.
async fn dead_after_vacuum(conn: &mut AsyncPgConnection) -> i64 {
    #[derive(diesel::QueryableByName)]
    struct Dead {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    for step in ["CREATE EXTENSION IF NOT EXISTS pgstattuple", "VACUUM churn"] {
        conn.batch_execute(step).await.unwrap();
    }
    let d: Dead = diesel::sql_query("SELECT dead_tuple_count AS n FROM pgstattuple('churn')")
        .get_result(conn)
        .await
        .unwrap();
    d.n
}

async fn backend(conn: &mut AsyncPgConnection) -> i32 {
    #[derive(diesel::QueryableByName)]
    struct Pid {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        pid: i32,
    }
    let p: Pid = diesel::sql_query("SELECT pg_backend_pid() AS pid")
        .get_result(conn)
        .await
        .unwrap();
    p.pid
}

/// A handler's statement waits for a row lock another session holds for as long as the test
/// runs: PostgreSQL cancels it at `handler_timeout` + the grace (or the engine ends its session
/// then), so its lock request and its transaction are gone while the other session still holds
/// the row, and its attempt is counted.
#[actix_rt::test]
async fn a_handler_stuck_on_a_row_lock_lets_go_of_the_database_within_its_timeout_and_grace() {
    let db = TestDb::new().await;
    let mut blocker = AsyncPgConnection::establish(&db.url).await.unwrap();
    let me = backend(&mut blocker).await;
    blocker
        .batch_execute("INSERT INTO orders (id, status) VALUES ('locked', 'PLACED')")
        .await
        .unwrap();
    blocker
        .batch_execute("BEGIN; SELECT 1 FROM orders WHERE id = 'locked' FOR UPDATE")
        .await
        .unwrap();
    let rt = start(
        &db,
        "stuck",
        "UPDATE orders SET status = 'SEEN' WHERE id = 'locked'",
        false,
    )
    .await;
    db.enqueue_one("o-1").await;
    rt.handle().wake();
    assert_eq!(
        db.wait_for(&waiting(&db, me), 1, WAIT).await,
        1,
        "the handler waits"
    );
    assert_eq!(
        db.wait_for(&waiting(&db, me), 0, WAIT).await,
        0,
        "the handler's lock request outlived its timeout and grace"
    );
    assert_eq!(
        db.count(&holding(&db, me, 8)).await,
        0,
        "a transaction held on"
    );
    let charged = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                   WHERE consumer = 'stuck' AND status = 'RETRY_PENDING' AND attempt_count = 1";
    assert_eq!(
        db.wait_for(charged, 1, WAIT).await,
        1,
        "its attempt counted once"
    );
    blocker.batch_execute("ROLLBACK").await.unwrap();
    db.finish(&[&rt]).await;
}

/// A handler takes a row lock and then hangs outside the database, keeping its connection and
/// its transaction open: the engine ends its session after the grace, so the row can be
/// written by others and no transaction of it holds the vacuum horizon (VACUUM then removes
/// the dead rows it held back), while the handler itself still runs and its event stays in
/// flight. Health names the consumer and says why. Once it lets go, its attempt is charged.
#[actix_rt::test]
async fn a_handler_hung_holding_a_row_lock_has_its_session_ended_after_the_grace() {
    let db = TestDb::new().await;
    let mut other = AsyncPgConnection::establish(&db.url).await.unwrap();
    let me = backend(&mut other).await;
    other
        .batch_execute("INSERT INTO orders (id, status) VALUES ('held', 'PLACED')")
        .await
        .unwrap();
    let rt = start(
        &db,
        "hung",
        "UPDATE orders SET status = 'TAKEN' WHERE id = 'held'",
        true,
    )
    .await;
    db.enqueue_one("o-1").await;
    rt.handle().wake();
    let took =
        "SELECT count(*) AS n FROM pg_stat_activity WHERE state LIKE 'idle in transaction%' \
                AND query LIKE 'UPDATE orders SET status = ''TAKEN''%'";
    assert_eq!(
        db.wait_for(took, 1, WAIT).await,
        1,
        "the handler holds the row"
    );
    // Dead rows made while the hung transaction runs: VACUUM may not remove them yet.
    other
        .batch_execute(
            "CREATE TABLE churn (id int PRIMARY KEY, n int) WITH (autovacuum_enabled = off); \
             INSERT INTO churn VALUES (1, 0); \
             DO $$ BEGIN FOR i IN 1..100 LOOP UPDATE churn SET n = n + 1; END LOOP; END $$;",
        )
        .await
        .unwrap();
    assert!(dead_after_vacuum(&mut other).await >= 100, "held back");
    assert_eq!(
        db.wait_for(took, 0, WAIT).await,
        0,
        "the hung handler's session outlived its timeout and grace"
    );
    // The ended session leaves the server's list of sessions a moment before it lets go of
    // its snapshot, longer on a loaded machine: VACUUM is tried again for a few seconds (a
    // session that still held on would hold on for ever).
    let mut dead = dead_after_vacuum(&mut other).await;
    for _ in 0..50 {
        if dead == 0 {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(100)).await;
        dead = dead_after_vacuum(&mut other).await;
    }
    assert_eq!(dead, 0, "VACUUM still could not remove the dead rows");
    let sampler = StatsSampler::new(db.pool.clone(), StatsConfig::default()).unwrap();
    let report = sampler.run_once().await.unwrap();
    let why: Vec<_> = report
        .reasons
        .iter()
        .filter(|r| r.code == "HANDLER_SESSION_ENDED")
        .collect();
    assert_eq!(why.len(), 1, "{report:?}");
    assert_eq!(why[0].consumer.as_deref(), Some("hung"), "{why:?}");
    assert_eq!(
        db.count(&holding(&db, me, 8)).await,
        0,
        "a transaction held on"
    );
    // The row is free: another session writes it at once.
    other
        .batch_execute(
            "SET lock_timeout = '2s'; UPDATE orders SET status = 'FREE' WHERE id = 'held'",
        )
        .await
        .unwrap();
    assert_eq!(
        db.count("SELECT count(*) AS n FROM orders WHERE id = 'held' AND status = 'FREE'")
            .await,
        1,
        "the hung attempt's write rolled back"
    );
    // The event stays in flight while its handler hangs: never handed over again meanwhile.
    let in_flight = "SELECT count(*) AS n FROM actix_outbox.inbox_leases \
                     WHERE consumer = 'hung' AND backend IS NULL";
    assert_eq!(db.count(in_flight).await, 1, "no longer leased");
    // Once the handler lets go, its attempt is charged.
    RELEASED.store(true, Ordering::SeqCst);
    let charged = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                   WHERE consumer = 'hung' AND status = 'RETRY_PENDING' AND attempt_count = 1";
    assert_eq!(
        db.wait_for(charged, 1, WAIT).await,
        1,
        "its attempt counted once"
    );
    db.finish(&[&rt]).await;
}

/// A handler hung past its timeout and the grace (within its lease, 10 s, and 20 s), with no delay
/// before a retry: its session is ended, but its event stays in flight until the handler lets
/// go, so the event is never handled twice at once (the first design settled it at the grace, and a second call ran
/// beside the first); then it is retried and applied once.
#[actix_rt::test]
async fn an_event_whose_handler_hangs_past_the_grace_is_never_handled_twice_at_once() {
    static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
    static MOST: AtomicUsize = AtomicUsize::new(0);
    let db = TestDb::new().await;
    let cfg = consumer("twice", 5)
        .batch_size(1)
        .handler_timeout(TIMEOUT)
        .retry(RetryPolicy::fixed(5, Duration::ZERO));
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer_fn(cfg, |d: Delivery| async move {
            let now = IN_FLIGHT.fetch_add(1, Ordering::SeqCst) + 1;
            MOST.fetch_max(now, Ordering::SeqCst);
            if d.attempt() == 1 {
                // Past the timeout (1 s) and the grace (5 s), outside the database.
                actix_rt::time::sleep(Duration::from_secs(8)).await;
            } else {
                let mut conn = d.conn().await?;
                conn.batch_execute("INSERT INTO orders (id, status) VALUES ('twice', 'DONE')")
                    .await
                    .map_err(|e| HandlerError::retry(e.to_string()))?;
            }
            IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        })
        .start()
        .await
        .unwrap();
    db.enqueue_one("o-1").await;
    rt.handle().wake();
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                WHERE consumer = 'twice' AND status = 'PROCESSED' AND attempt_count = 2";
    assert_eq!(db.wait_for(done, 1, WAIT).await, 1);
    assert_eq!(
        AtomicUsize::load(&MOST, Ordering::SeqCst),
        1,
        "handled twice at once"
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM orders WHERE id = 'twice'")
            .await,
        1
    );
    db.finish(&[&rt]).await;
}

/// A handler's statements run under a `statement_timeout` of its timeout and the grace, so the
/// server cuts a hung statement even when the process can no longer act; never under the
/// engine's own bound for a statement (20 s), so the engine's statements in the same
/// transaction are not cut sooner than it would give up on them itself.
#[actix_rt::test]
async fn a_handlers_statements_run_under_a_statement_timeout_that_follows_its_timeout() {
    let db = TestDb::new().await;
    let mut rts = Vec::new();
    for (name, timeout) in [("slow", 30), ("quick", 1)] {
        let cfg = consumer(name, 1).handler_timeout(Duration::from_secs(timeout));
        let rt = OutboxRuntime::builder(db.pool.clone())
            .config(fast_runtime())
            .consumer_fn(cfg, move |d: Delivery| async move {
                let mut conn = d.conn().await?;
                let sql = format!(
                    "INSERT INTO orders (id, status) \
                     VALUES ('{name}', current_setting('statement_timeout'))"
                );
                conn.batch_execute(&sql)
                    .await
                    .map_err(|e| HandlerError::retry(e.to_string()))
            })
            .start()
            .await
            .unwrap();
        rts.push(rt);
    }
    db.enqueue_one("o-1").await;
    for rt in &rts {
        rt.handle().wake();
    }
    let seen = "SELECT count(*) AS n FROM orders WHERE (id, status) IN (('slow', '35s'), ('quick', '20s'))";
    assert_eq!(db.wait_for(seen, 2, WAIT).await, 2);
    let refs: Vec<&OutboxRuntime> = rts.iter().collect();
    db.finish(&refs).await;
}
