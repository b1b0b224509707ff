//! Business idempotency keys and reconcile rules against real PostgreSQL.

use crate::common;

use std::time::Duration;

use actix_outbox::{
    keys::claim_key, keys::KeyClaim, reconcile::ReconcileRule, transport::BoxFuture, OutboxRuntime,
    RuntimeConfig,
};
use common::*;
use diesel::sql_types::Text;
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

#[actix_rt::test]
async fn two_claims_of_one_key_give_one_effect_and_a_rolled_back_claim_frees_it() {
    let db = TestDb::new().await;
    let mut conn = db.pool.get().await.unwrap();
    let first = claim_key(&mut conn, "notification:o1:COMPLETED", "test", None)
        .await
        .unwrap();
    let second = claim_key(&mut conn, "notification:o1:COMPLETED", "test", None)
        .await
        .unwrap();
    assert_eq!((first, second), (KeyClaim::Claimed, KeyClaim::AlreadyDone));

    let rolled_back = conn
        .transaction::<(), actix_outbox::Error, _>(async |conn| {
            assert_eq!(
                claim_key(conn, "k2", "test", None).await?,
                KeyClaim::Claimed
            );
            Err(actix_outbox::Error::Config("roll back".into()))
        })
        .await;
    assert!(rolled_back.is_err());
    assert_eq!(
        claim_key(&mut conn, "k2", "test", None).await.unwrap(),
        KeyClaim::Claimed
    );
    // Keys PostgreSQL cannot store or index fail with their own code, before any write; the
    // longest accepted one is stored.
    let longest = "k".repeat(actix_outbox::keys::MAX_KEY_BYTES);
    for (key, by) in [
        ("", "test"),
        ("k\0", "test"),
        ("k3", "te\0st"),
        (&*format!("{longest}k"), "test"),
    ] {
        let err = claim_key(&mut conn, key, by, None).await.unwrap_err();
        assert_eq!(err.code(), actix_outbox::ErrorCode::IDEMPOTENCY_KEY_INVALID);
    }
    assert_eq!(
        claim_key(&mut conn, &longest, "test", None).await.unwrap(),
        KeyClaim::Claimed
    );
    drop(conn);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.idempotency_keys")
            .await,
        3
    );
    db.finish(&[]).await;
}

/// COMPLETED orders without a `notify` effect get one, through the key `notify:{order}`.
struct MissingNotification;

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = Text)]
    id: String,
}

impl ReconcileRule for MissingNotification {
    fn name(&self) -> &str {
        "missing_notification"
    }
    fn interval(&self) -> Duration {
        Duration::from_secs(3600)
    }
    fn find_drift<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
    ) -> BoxFuture<'a, actix_outbox::Result<Vec<String>>> {
        Box::pin(async move {
            let ids: Vec<Id> = diesel::sql_query(
                "SELECT o.id FROM orders o WHERE o.status = 'COMPLETED' \
                 AND NOT EXISTS (SELECT 1 FROM notifications n WHERE n.order_id = o.id) ORDER BY o.id",
            )
            .load(conn)
            .await?;
            Ok(ids.into_iter().map(|i| i.id).collect())
        })
    }
    fn repair<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
        key: &'a str,
    ) -> BoxFuture<'a, actix_outbox::Result<bool>> {
        Box::pin(async move {
            if claim_key(conn, &format!("notify:{key}"), "missing_notification", None).await?
                == KeyClaim::AlreadyDone
            {
                return Ok(false);
            }
            diesel::sql_query("INSERT INTO notifications (order_id) VALUES ($1)")
                .bind::<Text, _>(key)
                .execute(conn)
                .await?;
            Ok(true)
        })
    }
}

async fn runtime_with_rule(db: &TestDb, dry_run: bool) -> OutboxRuntime {
    let cfg = RuntimeConfig::default().reconcile_dry_run(dry_run);
    OutboxRuntime::builder(db.pool.clone())
        .config(cfg)
        .reconcile(MissingNotification)
        .start()
        .await
        .unwrap()
}

#[actix_rt::test]
async fn a_rule_repairs_drift_once_and_never_duplicates_an_effect_made_by_the_normal_path() {
    let db = TestDb::new().await;
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(
        "CREATE TABLE notifications (id bigserial PRIMARY KEY, order_id text NOT NULL);
         INSERT INTO orders (id, status) SELECT 'o' || g, 'COMPLETED' FROM generate_series(1, 30) g;
         INSERT INTO orders (id, status) SELECT 'w' || g, 'WAITING' FROM generate_series(1, 5) g;
         -- o1..o10 were handled by the normal path, which claimed the same key
         INSERT INTO notifications (order_id) SELECT 'o' || g FROM generate_series(1, 10) g;
         INSERT INTO actix_outbox.idempotency_keys (key) SELECT 'notify:o' || g FROM generate_series(1, 10) g;
         -- o11 claimed its key but the effect row is missing: the key wins, no duplicate
         INSERT INTO actix_outbox.idempotency_keys (key) VALUES ('notify:o11');",
    )
    .await
    .unwrap();
    drop(conn);

    let dry = runtime_with_rule(&db, true).await;
    let report = dry.reconcile_now().await.unwrap().remove(0).unwrap();
    assert_eq!(
        (report.found, report.repaired, report.dry_run),
        (20, 0, true)
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM notifications").await,
        10,
        "dry run repairs nothing"
    );
    dry.shutdown().await;

    let rt = runtime_with_rule(&db, false).await;
    let report = rt.reconcile_now().await.unwrap().remove(0).unwrap();
    assert_eq!((report.found, report.repaired, report.failed), (20, 19, 0));
    let again = rt.reconcile_now().await.unwrap().remove(0).unwrap();
    assert_eq!(
        (again.found, again.repaired),
        (1, 0),
        "o11 stays found but is never duplicated"
    );

    assert_eq!(
        db.count("SELECT count(*) AS n FROM notifications").await,
        29
    );
    assert_eq!(
        db.count("SELECT coalesce(max(c), 0) AS n FROM (SELECT count(*) AS c FROM notifications GROUP BY order_id) x")
            .await,
        1
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.reconcile_runs")
            .await,
        3
    );
    assert_eq!(
        db.count("SELECT coalesce(sum(repaired), 0)::bigint AS n FROM actix_outbox.reconcile_runs")
            .await,
        19
    );
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn a_rule_held_by_another_instance_is_skipped() {
    let db = TestDb::new().await;
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(
        "CREATE TABLE notifications (id bigserial PRIMARY KEY, order_id text NOT NULL);
         INSERT INTO orders (id, status) VALUES ('o1', 'COMPLETED');",
    )
    .await
    .unwrap();
    let rt = runtime_with_rule(&db, false).await;
    // Another instance is running the rule: it holds the rule's advisory lock.
    let held = conn
        .transaction::<_, diesel::result::Error, _>(async |conn| {
            conn.batch_execute(
                "SELECT pg_advisory_xact_lock(hashtextextended('actix_outbox.reconcile:missing_notification', 0))",
            )
            .await?;
            Ok(within(Duration::from_secs(10), rt.reconcile_now()).await)
        })
        .await
        .unwrap()
        .unwrap()
        .remove(0)
        .unwrap();
    assert!(held.skipped);
    assert_eq!(db.count("SELECT count(*) AS n FROM notifications").await, 0);
    let free = rt.reconcile_now().await.unwrap().remove(0).unwrap();
    assert_eq!((free.skipped, free.repaired), (false, 1));
    drop(conn);
    db.finish(&[&rt]).await;
}

/// A rule with a zero interval (it would run in a loop that starves every other actor) and two
/// rules of one name (they would share one lock) are refused at start, before anything runs.
#[actix_rt::test]
async fn a_rule_with_a_zero_interval_or_a_name_used_twice_is_refused() {
    let db = TestDb::new().await;
    let slow = |interval| Slow {
        interval,
        sleep_ms: 0,
        fail: false,
    };
    let zero = OutboxRuntime::builder(db.pool.clone())
        .reconcile(slow(Duration::ZERO))
        .start()
        .await;
    let twice = OutboxRuntime::builder(db.pool.clone())
        .reconcile(slow(Duration::from_secs(60)))
        .reconcile(slow(Duration::from_secs(60)))
        .start()
        .await;
    for refused in [zero, twice] {
        assert_eq!(
            refused.err().map(|e| e.code()),
            Some(actix_outbox::ErrorCode::CONFIG_INVALID)
        );
    }
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.reconcile_runs")
            .await,
        0
    );
    db.finish(&[]).await;
}

/// A rule whose search waits `sleep_ms` outside the database (as for a call to another
/// service) and then, if `fail`, fails.
struct Slow {
    interval: Duration,
    sleep_ms: u32,
    fail: bool,
}

impl ReconcileRule for Slow {
    fn name(&self) -> &str {
        "slow"
    }
    fn interval(&self) -> Duration {
        self.interval
    }
    fn find_drift<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
    ) -> BoxFuture<'a, actix_outbox::Result<Vec<String>>> {
        Box::pin(async move {
            actix_rt::time::sleep(Duration::from_millis(self.sleep_ms.into())).await;
            if self.fail {
                conn.batch_execute("SELECT 1 FROM no_such_table").await?;
            }
            Ok(Vec::new())
        })
    }
    fn repair<'a>(
        &'a self,
        _: &'a mut AsyncPgConnection,
        _: &'a str,
    ) -> BoxFuture<'a, actix_outbox::Result<bool>> {
        Box::pin(async { Ok(false) })
    }
}

const ADVISORY_LOCKS: &str = "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' \
     AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";

/// The runtime stops while a rule runs, holding the rule's session lock on a pooled connection
/// of a pool the application keeps using. The lock must go with the run: left on a connection
/// back in the pool, every later run of the rule, on every instance, would be skipped. (A run
/// cut off by a panic is safe already: the pool closes a connection dropped while panicking.)
#[actix_rt::test]
async fn a_run_cut_off_by_a_stop_leaves_no_lock_behind_and_the_rule_runs_again() {
    let db = TestDb::new().await;
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .reconcile(Slow {
            interval: Duration::from_millis(100),
            sleep_ms: 2_000,
            fail: false,
        })
        .start()
        .await
        .unwrap();
    // The run holds its lock, and waits outside the database (no query in flight).
    assert_eq!(db.wait_for(ADVISORY_LOCKS, 1, WAIT).await, 1);
    rt.shutdown().await;
    assert_eq!(
        db.wait_for(ADVISORY_LOCKS, 0, Duration::from_secs(10))
            .await,
        0,
        "the lock outlived its run"
    );
    // A new runtime on the same pool runs the rule, whichever connection it gets.
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .reconcile(Slow {
            interval: Duration::from_secs(3600),
            sleep_ms: 0,
            fail: false,
        })
        .start()
        .await
        .unwrap();
    for _ in 0..5 {
        let report = within(Duration::from_secs(20), rt.reconcile_now()).await;
        let report = report.unwrap().remove(0).unwrap();
        assert!(!report.skipped, "{report:?}");
    }
    db.finish(&[&rt]).await;
}

/// Every run is recorded, a failed one with its error, each with when it started.
#[actix_rt::test]
async fn a_failed_run_is_recorded_with_its_error() {
    let db = TestDb::new().await;
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .reconcile(Slow {
            interval: Duration::from_secs(3600),
            sleep_ms: 50,
            fail: true,
        })
        .start()
        .await
        .unwrap();
    let report = within(Duration::from_secs(20), rt.reconcile_now()).await;
    assert!(report.unwrap().remove(0).is_err());
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM actix_outbox.reconcile_runs WHERE rule = 'slow' \
             AND error LIKE '%no_such_table%' AND error_code = 'DATABASE_ERROR' \
             AND started_at < finished_at"
        )
        .await,
        1
    );
    assert_eq!(db.count(ADVISORY_LOCKS).await, 0);
    db.finish(&[&rt]).await;
}

/// A rule whose search runs `statements` one after another, under a 300 ms time bound.
struct Searching {
    name: &'static str,
    interval: Duration,
    statements: &'static [&'static str],
}

impl ReconcileRule for Searching {
    fn name(&self) -> &str {
        self.name
    }
    fn interval(&self) -> Duration {
        self.interval
    }
    fn time_bound(&self) -> Duration {
        Duration::from_millis(300)
    }
    fn find_drift<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
    ) -> BoxFuture<'a, actix_outbox::Result<Vec<String>>> {
        Box::pin(async move {
            for st in self.statements {
                conn.batch_execute(st).await?;
            }
            Ok(Vec::new())
        })
    }
    fn repair<'a>(
        &'a self,
        _: &'a mut AsyncPgConnection,
        _: &'a str,
    ) -> BoxFuture<'a, actix_outbox::Result<bool>> {
        Box::pin(async { Ok(false) })
    }
}

/// A search that runs too long is stopped by the server at the rule's bound, so it holds no
/// snapshot (nor the vacuum horizon) past it; the run is recorded with `RECONCILE_TIMEOUT`,
/// the rule runs again at its next interval, and the session's own `statement_timeout` is put
/// back for the pool's next user.
#[actix_rt::test]
async fn a_search_past_its_time_bound_is_stopped_recorded_and_run_again() {
    let db = TestDb::new().await;
    // One connection, so the runtime's reconciler and this test's checks share it.
    let pool = actix_outbox::connect(&db.url, 1).await.unwrap();
    let rt = OutboxRuntime::builder(pool.clone())
        .config(fast_runtime())
        .reconcile(Searching {
            name: "stuck",
            interval: Duration::from_millis(200),
            // It would run for a minute inside the database.
            statements: &["SELECT pg_sleep(60) /* stuck rule */"],
        })
        .start()
        .await
        .unwrap();
    let timed_out = "SELECT least(count(*), 2) AS n FROM actix_outbox.reconcile_runs \
                     WHERE rule = 'stuck' AND error_code = 'RECONCILE_TIMEOUT' \
                     AND finished_at - started_at < interval '5 seconds'";
    assert_eq!(
        db.wait_for(timed_out, 2, WAIT).await,
        2,
        "stopped and run again"
    );
    let held = format!(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = '{}' \
         AND query LIKE '%stuck rule%' AND state = 'active' \
         AND query_start < now() - interval '3 seconds'",
        db.name
    );
    for _ in 0..5 {
        assert_eq!(db.count(&held).await, 0, "a search ran past its bound");
        actix_rt::time::sleep(Duration::from_millis(200)).await;
    }
    rt.shutdown().await;
    let mut conn = pool.get().await.unwrap();
    #[derive(QueryableByName)]
    struct Setting {
        #[diesel(sql_type = Text)]
        statement_timeout: String,
    }
    let setting: Setting = diesel::sql_query("SHOW statement_timeout")
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        setting.statement_timeout, "0",
        "the session's setting is put back"
    );
    drop(conn);
    db.finish(&[]).await;
}

/// A search whose statements each end within the bound, but which fails on its own error after
/// the bound has passed in all: that is the rule's error, not a timeout.
#[actix_rt::test]
async fn a_search_that_fails_on_its_own_after_the_bound_is_not_called_a_timeout() {
    let db = TestDb::new().await;
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .reconcile(Searching {
            name: "slow_then_wrong",
            interval: Duration::from_secs(3600),
            statements: &[
                "SELECT pg_sleep(0.2)",
                "SELECT pg_sleep(0.2)",
                "SELECT 1 FROM no_such_table",
            ],
        })
        .start()
        .await
        .unwrap();
    let report = within(Duration::from_secs(20), rt.reconcile_now()).await;
    let err = report.unwrap().remove(0).unwrap_err();
    assert_eq!(err.code().as_str(), "DATABASE_ERROR", "{err}");
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM actix_outbox.reconcile_runs WHERE rule = 'slow_then_wrong' \
             AND error_code = 'DATABASE_ERROR' AND error LIKE '%no_such_table%'"
        )
        .await,
        1
    );
    db.finish(&[&rt]).await;
}

/// The built-in drift report counts what is overdue past the consistency window (outbox rows
/// unpublished, inbox rows unprocessed) and the dead letters, and follows the tables: a paused
/// consumer's rows count until it is resumed and processes them.
#[actix_rt::test]
async fn the_built_in_drift_report_counts_overdue_rows_and_dead_letters() {
    use actix_outbox::reconcile::DriftReport;
    let db = TestDb::new().await;
    let name = actix_outbox::event::ConsumerName::new("drifty").unwrap();
    {
        let mut conn = db.pool.get().await.unwrap();
        actix_outbox::ops::pause_consumer(&mut conn, &name, "test", "set-up", None)
            .await
            .unwrap();
    }
    let cfg = fast_runtime()
        .consistency_window(Duration::from_millis(300))
        .reconcile_interval(Duration::from_millis(200));
    let rt = actix_outbox::OutboxRuntime::builder(db.pool.clone())
        .config(cfg)
        .consumer(consumer("drifty", 3), || Recorder {
            name: "drifty".into(),
            behaviour: Behaviour::default(),
        })
        .start()
        .await
        .unwrap();
    db.produce(3, "drift").await;
    rt.handle().wake();
    let fanned = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'drifty'";
    assert_eq!(db.wait_for(fanned, 3, WAIT).await, 3);
    {
        let mut conn = db.pool.get().await.unwrap();
        conn.batch_execute(
            "UPDATE actix_outbox.inbox_events SET status = 'DEAD_LETTER' \
             WHERE id = (SELECT min(id) FROM actix_outbox.inbox_events)",
        )
        .await
        .unwrap();
    }
    let wait_for = |want: DriftReport| {
        let rt = &rt;
        async move {
            let deadline = std::time::Instant::now() + WAIT;
            loop {
                let drift = rt.status().await.unwrap().drift;
                if drift.as_ref() == Some(&want) || std::time::Instant::now() > deadline {
                    return drift;
                }
                actix_rt::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let overdue = DriftReport {
        outbox_overdue: 0,
        inbox_overdue: 2,
        dead_letters: 1,
    };
    assert_eq!(wait_for(overdue.clone()).await, Some(overdue));
    {
        let mut conn = db.pool.get().await.unwrap();
        actix_outbox::ops::resume_consumer(&mut conn, &name, "test")
            .await
            .unwrap();
    }
    rt.handle().wake();
    let caught_up = DriftReport {
        outbox_overdue: 0,
        inbox_overdue: 0,
        dead_letters: 1,
    };
    assert_eq!(wait_for(caught_up.clone()).await, Some(caught_up));
    db.finish(&[&rt]).await;
}
