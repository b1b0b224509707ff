//! Failure semantics against real PostgreSQL: pause, poison events, graceful shutdown and
//! SIGKILL of a process running the runtime. Every assertion counts rows.

use crate::common;

use std::process::Child;
use std::time::{Duration, Instant};

use actix_outbox::{
    event::ConsumerName, ops::pause_consumer, ops::resume_consumer, testing::Fault, ConsumerConfig,
    OutboxRuntime,
};
use common::*;

const MAX_EFFECTS_PER_EVENT: &str =
    "SELECT coalesce(max(c), 0) AS n FROM (SELECT count(*) AS c FROM effects GROUP BY consumer, event_id) x";

/// One poison event ahead of 50 healthy ones, for a one-per-call consumer.
async fn poison_first(poison: Poison, cfg: ConsumerConfig) -> (TestDb, OutboxRuntime) {
    let behaviour = Behaviour {
        poison_aggregate: Some("poison".into()),
        poison,
        ..Default::default()
    };
    poison_first_with(behaviour, cfg).await
}

async fn poison_first_with(behaviour: Behaviour, cfg: ConsumerConfig) -> (TestDb, OutboxRuntime) {
    let db = TestDb::new().await;
    db.enqueue_one("poison").await;
    db.produce(50, "healthy").await;
    let rt = start(&db, vec![(cfg, behaviour)]).await;
    (db, rt)
}

const HEALTHY_DONE: &str =
    "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED' \
     AND attempt_count = 1 AND aggregate_id <> 'poison'";

/// A failure PostgreSQL cannot store as given — a NUL in its message, a wait longer than a
/// timestamp can hold — is still recorded against its row. Were the mark refused, the batch
/// would fail whole, its rows would be claimed again for ever, and the events behind them
/// would wait.
async fn recorded_against_the_poison_only(poison: Poison, recorded: &str) {
    let (db, rt) = poison_first(poison, consumer("c1", 3).batch_size(8)).await;
    assert_eq!(db.wait_for(HEALTHY_DONE, 50, WAIT).await, 50);
    let poisoned = format!(
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE aggregate_id = 'poison' AND {recorded}"
    );
    assert_eq!(db.wait_for(&poisoned, 1, WAIT).await, 1);
    // The poison event's effect rolled back with each of its attempts.
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 50);
    assert_eq!(db.count(MAX_EFFECTS_PER_EVENT).await, 1);
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn a_failure_message_holding_a_nul_is_recorded_and_dead_lettered() {
    recorded_against_the_poison_only(
        Poison::NulMessage,
        "status = 'DEAD_LETTER' AND attempt_count = 3 \
         AND last_error = 'upstream said: \u{FFFD}binary\u{FFFD}'",
    )
    .await;
}

/// A handler that swallows a failed statement and returns Ok leaves a transaction that cannot
/// commit. That is counted against its event, which is dead-lettered after its attempts, and
/// the other events of its batches commit.
#[actix_rt::test]
async fn a_handler_that_swallows_a_failed_statement_is_counted_and_does_not_stall_the_rest() {
    recorded_against_the_poison_only(
        Poison::SwallowError,
        "status = 'DEAD_LETTER' AND attempt_count = 3 AND last_error LIKE '%could not commit%'",
    )
    .await;
}

/// As above, with handlers that make an error of their own of a failed statement: the events
/// handed over after the swallowing one, whose statements fail in the transaction it left
/// failed, are still not charged, whatever error their handler returns.
#[actix_rt::test]
async fn events_after_a_swallowed_failure_are_not_charged_whatever_error_their_handler_makes() {
    let behaviour = Behaviour {
        poison_aggregate: Some("poison".into()),
        poison: Poison::SwallowError,
        own_errors: true,
        ..Default::default()
    };
    let (db, rt) = poison_first_with(behaviour, consumer("c1", 3).batch_size(8)).await;
    assert_eq!(db.wait_for(HEALTHY_DONE, 50, WAIT).await, 50);
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE aggregate_id = 'poison' \
                AND status = 'DEAD_LETTER' AND attempt_count = 3";
    assert_eq!(db.wait_for(dead, 1, WAIT).await, 1);
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 50);
    assert_eq!(db.count(MAX_EFFECTS_PER_EVENT).await, 1);
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn a_retry_after_forever_waits_ten_years_not_for_ever_in_a_loop() {
    recorded_against_the_poison_only(
        Poison::RetryNever,
        "status = 'RETRY_PENDING' AND attempt_count = 1 \
         AND next_attempt_at > now() + interval '9 years'",
    )
    .await;
}

/// A handler that overruns its timeout and keeps its connection keeps its row locked, so its
/// attempt cannot be recorded until it lets go. The consumer does not wait for that: the other
/// events are handled while the handler still hangs, and the attempt is counted once it ends.
#[actix_rt::test]
async fn a_handler_hanging_on_its_connection_does_not_stall_its_consumer() {
    let cfg = consumer("c1", 3)
        .batch_size(1)
        .handler_timeout(Duration::from_millis(300));
    let (db, rt) = poison_first(Poison::LongHang, cfg).await;
    // Well before the hang ends (`LONG_HANG`, 20 s).
    assert_eq!(
        db.wait_for(HEALTHY_DONE, 50, Duration::from_secs(12)).await,
        50
    );
    // Once the handler lets go, its transaction rolls back and its attempt is counted; the
    // event is delivered again until its three attempts are used up.
    let poison_done =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE aggregate_id = 'poison' \
                       AND status = 'DEAD_LETTER' AND attempt_count = 3";
    assert_eq!(db.wait_for(poison_done, 1, WAIT).await, 1);
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM effects WHERE event_id IN \
                  (SELECT event_id FROM actix_outbox.inbox_events WHERE aggregate_id = 'poison')"
        )
        .await,
        0,
        "the hung attempt's effect rolled back"
    );
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 50);
    db.finish(&[&rt]).await;
}

/// Every event hangs past its timeout holding its connection. The consumer goes on past one
/// such handler per batch loop, not more: hanging handlers must not take the pool's every
/// connection (each holds its own and its attempt's mark waits on another).
#[actix_rt::test]
async fn handlers_hanging_on_their_connections_take_a_bounded_share_of_the_pool() {
    let db = TestDb::new().await;
    db.produce(6, "h").await;
    let behaviour = Behaviour {
        poison_aggregate: Some("*".into()),
        poison: Poison::Hang,
        ..Default::default()
    };
    let cfg = consumer("c1", 1)
        .batch_size(1)
        .handler_timeout(Duration::from_millis(200));
    let rt = start(&db, vec![(cfg, behaviour)]).await;
    // Hung handlers' sessions: idle inside their transaction for longer than a batch between
    // its claim and its first handler ever is (a sample could catch one of those).
    let hung = format!(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = '{}' \
         AND state LIKE 'idle in transaction%' \
         AND state_change < now() - interval '300 milliseconds'",
        db.name
    );
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'DEAD_LETTER'";
    let mut most = 0;
    let deadline = std::time::Instant::now() + WAIT;
    while db.count(dead).await < 6 && std::time::Instant::now() < deadline {
        most = most.max(db.count(&hung).await);
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(db.count(dead).await, 6, "every attempt was counted");
    // One loop: the handler it went on past, and the one it then waited for.
    assert!(
        most <= 2,
        "{most} handlers hung holding their connections at once"
    );
    assert!(most >= 1, "the handlers did hang");
    db.finish(&[&rt]).await;
}

/// A consumer paused before any runtime registered it starts paused; a pause given an end
/// lifts itself then, on its own, and the consumer drains what waited.
#[actix_rt::test]
async fn a_pause_holds_from_a_consumers_first_start_and_lifts_itself_at_its_end() {
    let db = TestDb::new().await;
    let late = ConsumerName::new("late").unwrap();
    let mut conn = db.pool.get().await.unwrap();
    let in_an_hour = chrono::Utc::now() + chrono::TimeDelta::hours(1);
    pause_consumer(
        &mut conn,
        &late,
        "ops",
        "ships switched off",
        Some(in_an_hour),
    )
    .await
    .unwrap();
    drop(conn);
    let rt = start(
        &db,
        vec![
            (consumer("late", 3), Behaviour::default()),
            (consumer("other", 3), Behaviour::default()),
        ],
    )
    .await;
    db.produce_batched(200, 100, "o").await;
    rt.handle().wake();
    let other =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'other' AND status = 'PROCESSED'";
    assert_eq!(db.wait_for(other, 200, WAIT).await, 200);
    let late_done =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'late' AND status = 'PROCESSED'";
    assert_eq!(db.count(late_done).await, 0, "paused from its first start");
    let waiting = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'late' \
                   AND status = 'RECEIVED' AND attempt_count = 0";
    assert_eq!(db.count(waiting).await, 200);

    // The pause is given an end a moment away; nobody resumes it.
    let mut conn = db.pool.get().await.unwrap();
    let soon = chrono::Utc::now() + chrono::TimeDelta::milliseconds(500);
    pause_consumer(&mut conn, &late, "ops", "back soon", Some(soon))
        .await
        .unwrap();
    drop(conn);
    assert_eq!(db.wait_for(late_done, 200, WAIT).await, 200);
    let still =
        "SELECT count(*) AS n FROM actix_outbox.consumer_states WHERE consumer = 'late' AND paused";
    assert_eq!(
        db.count(still).await,
        1,
        "lifted by its end, not by a resume"
    );
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 400);
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn a_paused_consumer_keeps_its_events_and_drains_them_once_resumed() {
    let db = TestDb::new().await;
    let rt = start(
        &db,
        vec![
            (consumer("paused", 3), Behaviour::default()),
            (consumer("other", 3), Behaviour::default()),
        ],
    )
    .await;
    let paused = ConsumerName::new("paused").unwrap();
    let mut conn = db.pool.get().await.unwrap();
    pause_consumer(&mut conn, &paused, "ops", "maintenance", None)
        .await
        .unwrap();
    let unknown = resume_consumer(&mut conn, &ConsumerName::new("nobody").unwrap(), "ops").await;
    assert_eq!(unknown.unwrap_err().code().as_str(), "CONSUMER_UNKNOWN");
    drop(conn);

    db.produce_batched(1000, 100, "o").await;
    rt.handle().wake();
    let other =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'other' AND status = 'PROCESSED'";
    assert_eq!(
        db.wait_for(other, 1000, WAIT).await,
        1000,
        "other consumers are unaffected"
    );
    // Several of the paused consumer's polls have passed meanwhile (100 ms each).
    assert_eq!(
        db.count("SELECT count(*) AS n FROM effects WHERE consumer = 'paused'")
            .await,
        0
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'paused' AND status = 'RECEIVED' AND attempt_count = 0")
            .await,
        1000,
        "nothing acknowledged, nothing dropped"
    );

    let mut conn = db.pool.get().await.unwrap();
    resume_consumer(&mut conn, &paused, "ops").await.unwrap();
    drop(conn);
    let done =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'paused' AND status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 1000, WAIT).await, 1000);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM effects WHERE consumer = 'paused'")
            .await,
        1000
    );
    assert_eq!(db.count(MAX_EFFECTS_PER_EVENT).await, 1);
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn a_poison_event_is_dead_lettered_while_healthy_events_flow() {
    let db = TestDb::new().await;
    let behaviour = Behaviour {
        poison_aggregate: Some("poison".into()),
        ..Default::default()
    };
    let rt = start(&db, vec![(consumer("c1", 4).batch_size(8), behaviour)]).await;
    // The poison event is first in line, ahead of the healthy ones.
    let conn = db.pool.get().await.unwrap();
    actix_outbox::enqueue(&conn, &order_event("poison"))
        .await
        .unwrap();
    drop(conn);
    db.produce_batched(1000, 100, "healthy").await;
    rt.handle().wake();

    let healthy = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(healthy, 1000, WAIT).await, 1000);
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'DEAD_LETTER' AND aggregate_id = 'poison' \
                AND attempt_count = 4 AND error_code = 'INBOX_CONSUMER_FAILED'";
    assert_eq!(db.wait_for(dead, 1, WAIT).await, 1);
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 1000);
    db.finish(&[&rt]).await;
}

/// A handler that fails is called once per attempt. The failing row is in the middle of a
/// fast batch (no savepoints), whose rollback undoes its neighbours too; the batch is then
/// replayed one row per call, but the failure, known to be this row's, was recorded at once and
/// is not called again. (It was: every attempt cost two calls.)
#[actix_rt::test]
async fn a_failing_handler_is_called_once_per_attempt() {
    let db = TestDb::new().await;
    db.produce(5, "before").await;
    db.enqueue_one("poison").await;
    db.produce(20, "after").await;
    let behaviour = Behaviour {
        poison_aggregate: Some("poison".into()),
        ..Default::default()
    };
    let calls = behaviour.poison_calls.clone();
    let rt = start(&db, vec![(consumer("c1", 3).batch_size(8), behaviour)]).await;
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'DEAD_LETTER' \
                AND aggregate_id = 'poison' AND attempt_count = 3";
    assert_eq!(db.wait_for(dead, 1, WAIT).await, 1);
    let healthy = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(healthy, 25, WAIT).await, 25);
    assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), 3);
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 25);
    assert_eq!(db.count(MAX_EFFECTS_PER_EVENT).await, 1);
    // No lease is left holding a row: one would be settled by the reaper as a death, and the
    // charged row counted again.
    let left =
        "SELECT coalesce(sum(cardinality(ids)), 0)::int8 AS n FROM actix_outbox.inbox_leases";
    assert_eq!(db.wait_for(left, 0, WAIT).await, 0);
    db.finish(&[&rt]).await;
}

/// The consumer actor dies while its batch is open (a handler has written its effect and is
/// still working). The batch's BEGIN and COMMIT are pipelined outside diesel's transaction
/// manager, which is told about the BEGIN beforehand: so the connection, handed back when the
/// handler lets go of it, is closed by the pool (PostgreSQL rolls the batch back) instead of
/// being lent out again still inside that transaction, where the next batch would commit the
/// dead batch's effects along with its own.
#[actix_rt::test]
async fn a_consumer_killed_mid_batch_leaves_no_open_transaction_and_repeats_no_effect() {
    let db = TestDb::new().await;
    let slow = Behaviour {
        work: Duration::from_millis(300),
        ..Default::default()
    };
    let rt = start(&db, vec![(consumer("c1", 5).batch_size(5), slow)]).await;
    db.produce(10, "o").await;
    rt.handle().wake();
    let open = format!(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = '{}' \
         AND state LIKE 'idle in transaction%'",
        db.name
    );
    assert_eq!(db.wait_for(&open, 1, WAIT).await, 1, "a batch is in flight");
    assert!(rt.inject_fault(Fault::PanicConsumer("c1".into())).await);

    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 10, WAIT).await, 10);
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 10);
    assert_eq!(db.count(MAX_EFFECTS_PER_EVENT).await, 1);
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn graceful_shutdown_with_deliveries_in_flight_loses_and_repeats_nothing() {
    let db = TestDb::new().await;
    let slow = Behaviour {
        work: Duration::from_millis(5),
        ..Default::default()
    };
    let cfg = || consumer("c1", 3).batch_size(10).concurrency(2);
    let rt = start(&db, vec![(cfg(), slow.clone())]).await;
    db.produce_batched(400, 100, "o").await;
    rt.handle().wake();
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    let deadline = Instant::now() + WAIT;
    while db.count(done).await < 20 && Instant::now() < deadline {
        actix_rt::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        rt.shutdown().await,
        "in-flight batches finished within the deadline"
    );
    let at_stop = db.count(done).await;
    assert!(
        at_stop < 400,
        "the shutdown happened mid-run ({at_stop} processed)"
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM effects").await,
        at_stop,
        "every finished delivery was marked"
    );
    assert_eq!(db.idle_in_transaction().await, 0);

    let rt2 = start(&db, vec![(cfg(), slow)]).await;
    assert_eq!(db.wait_for(done, 400, WAIT).await, 400);
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 400);
    assert_eq!(db.count(MAX_EFFECTS_PER_EVENT).await, 1);
    db.finish(&[&rt2]).await;
}

/// The children's handler timeout.
const CHILD_TIMEOUT: Duration = Duration::from_secs(1);

/// The children's lease: twice their handlers' timeout.
const CHILD_LEASE: Duration = Duration::from_secs(2);

/// The process a SIGKILL test kills: runs a runtime on `AO_CHILD_DB` until killed. Not a test
/// of its own, hence ignored; the SIGKILL test starts it with `--ignored`.
#[actix_rt::test]
#[ignore = "entry point of the SIGKILL test's child process"]
async fn child_process_entry() {
    serve_as_child(
        vec![(
            consumer("c1", 10)
                .batch_size(50)
                .handler_timeout(CHILD_TIMEOUT),
            Behaviour::default(),
        )],
        false,
    )
    .await;
}

/// The body of every child process: runs `consumers` (as batch consumers if `batch`) on
/// `AO_CHILD_DB` until the process is killed or kills itself.
async fn serve_as_child(consumers: Vec<(ConsumerConfig, Behaviour)>, batch: bool) {
    let url = std::env::var("AO_CHILD_DB").expect("started by a child-process test");
    // A death is noticed when the dead process's leases expire: short leases keep the
    // restarts of these tests within their time.
    let consumers = consumers
        .into_iter()
        .map(|(cfg, b)| (cfg.lease(CHILD_LEASE), b))
        .collect();
    let pool = actix_outbox::connect(&url, 10).await.unwrap();
    let _rt = if batch {
        start_batch_on(pool, consumers).await
    } else {
        start_on(pool, consumers).await
    };
    std::future::pending::<()>().await;
}

/// The process the abort test restarts: a consumer whose handler aborts the whole process on
/// the poison event (`AO_CHILD_BATCH` set: a batch consumer). Not a test of its own.
#[actix_rt::test]
#[ignore = "entry point of the abort test's child process"]
async fn aborting_child_entry() {
    let behaviour = Behaviour {
        poison_aggregate: Some("poison".into()),
        poison: Poison::Abort,
        ..Default::default()
    };
    let cfg = consumer("c1", 2)
        .batch_size(20)
        .handler_timeout(CHILD_TIMEOUT);
    serve_as_child(
        vec![(cfg, behaviour)],
        std::env::var("AO_CHILD_BATCH").is_ok(),
    )
    .await;
}

fn spawn_child(url: &str) -> Child {
    spawn_entry(url, "failure::child_process_entry", &[])
}

/// The process the two-consumer abort test restarts: `c1` aborts the process on the poison
/// event, `c2` handles every event without fault. Both take a while per event, so that their
/// batches overlap. Not a test of its own.
#[actix_rt::test]
#[ignore = "entry point of the two-consumer abort test's child process"]
async fn two_consumers_aborting_child_entry() {
    let work = Duration::from_millis(10);
    let killer = Behaviour {
        poison_aggregate: Some("poison".into()),
        poison: Poison::Abort,
        work,
        ..Default::default()
    };
    let healthy = Behaviour {
        work,
        ..Default::default()
    };
    let cursor = std::env::var("AO_CHILD_CURSOR").is_ok();
    let consumers = vec![
        (
            consumer("c1", 2)
                .batch_size(20)
                .handler_timeout(CHILD_TIMEOUT)
                .cursor(cursor),
            killer,
        ),
        (
            consumer("c2", 2)
                .batch_size(20)
                .handler_timeout(CHILD_TIMEOUT)
                .cursor(cursor),
            healthy,
        ),
    ];
    serve_as_child(consumers, false).await;
}

/// The process the late-abort test restarts: `c1`'s handler outlives its timeout on the
/// poison event and then aborts the process. Not a test of its own.
#[actix_rt::test]
#[ignore = "entry point of the late-abort test's child process"]
async fn late_aborting_child_entry() {
    let behaviour = Behaviour {
        poison_aggregate: Some("poison".into()),
        poison: Poison::LateAbort,
        work: Duration::from_millis(50),
        ..Default::default()
    };
    let cfg = consumer("c1", 5)
        .batch_size(20)
        .handler_timeout(Duration::from_millis(200));
    serve_as_child(vec![(cfg, behaviour)], false).await;
}

/// Writes `poisons` events of the aggregate `poison` between healthy ones, all before any
/// runtime runs, so that they share batches.
async fn produce_with_poison(db: &TestDb, poisons: usize, healthy: usize) {
    let conn = db.pool.get().await.unwrap();
    actix_outbox::enqueue(&conn, &order_event("healthy-first"))
        .await
        .unwrap();
    for _ in 0..poisons {
        actix_outbox::enqueue(&conn, &order_event("poison"))
            .await
            .unwrap();
    }
    drop(conn);
    db.produce_batched(healthy, 10.min(healthy), "healthy")
        .await;
}

/// Runs `entry` as a child process, restarting it each time it dies, until every query of
/// `until` counts its expected rows or two minutes pass. Returns the number of deaths.
async fn restart_until(
    db: &TestDb,
    entry: &str,
    env: &[(&str, &str)],
    until: &[(&str, i64)],
) -> usize {
    let mut child = spawn_entry(&db.url, entry, env);
    let mut deaths = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        let mut done = true;
        for (query, n) in until {
            done &= db.count(query).await == *n;
        }
        if done {
            break;
        }
        if child.try_wait().unwrap().is_some() {
            deaths += 1;
            child = spawn_entry(&db.url, entry, env);
        }
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().ok();
    child.wait().ok();
    deaths
}

const POISON_DEAD: &str =
    "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE aggregate_id = 'poison' \
    AND status = 'DEAD_LETTER' AND attempt_count = 2 AND error_code = 'INBOX_ATTEMPT_INTERRUPTED'";
const HEALTHY_ONCE: &str =
    "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE aggregate_id <> 'poison' \
    AND status = 'PROCESSED' AND attempt_count = 1";

/// An event whose handler kills the process (an abort; an OOM kill or a crash in native code
/// alike) must not kill every restart for ever: the attempt it was handed over on its own is
/// counted when its row is claimed again, and after its attempts it is dead-lettered while
/// every other event is processed once. The runtime's processes are restarted as they die.
async fn an_event_that_kills_its_process(batch: bool) {
    let db = TestDb::new().await;
    // Register the consumer before any event exists, as a deployed service would have.
    let setup = start(&db, vec![(consumer("c1", 2), Behaviour::default())]).await;
    setup.shutdown().await;
    produce_with_poison(&db, 1, 200).await;

    let env: &[(&str, &str)] = if batch {
        &[("AO_CHILD_BATCH", "1")]
    } else {
        &[]
    };
    let until = [(POISON_DEAD, 1), (HEALTHY_ONCE, 201)];
    let deaths = restart_until(&db, "failure::aborting_child_entry", env, &until).await;
    // One death per counted attempt at least; more when it died inside a batch first.
    assert_survived(db, deaths, 2, (POISON_DEAD, 1), 201).await;
}

/// What every abort test ends with: the poison events dead-lettered (`dead` counts them), the
/// `healthy` others processed on their first attempt with one effect each, and at least
/// `min_deaths` deaths.
async fn assert_survived(
    db: TestDb,
    deaths: usize,
    min_deaths: usize,
    dead: (&str, i64),
    healthy: i64,
) {
    assert_eq!(
        db.count(dead.0).await,
        dead.1,
        "poison events dead-lettered"
    );
    assert_eq!(
        db.count(HEALTHY_ONCE).await,
        healthy,
        "every other event processed, first time"
    );
    assert!(deaths >= min_deaths, "the process died {deaths} times");
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, healthy);
    assert_eq!(db.count(MAX_EFFECTS_PER_EVENT).await, 1);
    db.finish(&[]).await;
}

/// Two events that kill the process, claimed in one batch: each death must be counted against
/// the event that caused it, and each count must survive the next death, or the process dies
/// for ever with neither event ever dead-lettered.
#[actix_rt::test]
async fn two_events_that_kill_their_process_in_one_batch_are_both_dead_lettered() {
    let db = TestDb::new().await;
    let setup = start(&db, vec![(consumer("c1", 2), Behaviour::default())]).await;
    setup.shutdown().await;
    produce_with_poison(&db, 2, 100).await;

    let until = [(POISON_DEAD, 2), (HEALTHY_ONCE, 101)];
    let deaths = restart_until(&db, "failure::aborting_child_entry", &[], &until).await;
    // One death in the batch, which charges neither (it held other rows), then one death of
    // each alone, which is charged with the death it was suspected of.
    assert_survived(db, deaths, 3, (POISON_DEAD, 2), 101).await;
}

/// A handler that overran its timeout still runs, and kills the process later. Its attempt was
/// counted when it timed out; the death must not be counted against whichever row was handed
/// over on its own meanwhile.
#[actix_rt::test]
async fn a_handler_that_kills_its_process_after_its_timeout_charges_no_other_event() {
    let db = TestDb::new().await;
    let setup = start(&db, vec![(consumer("c1", 5), Behaviour::default())]).await;
    setup.shutdown().await;
    produce_with_poison(&db, 1, 40).await;

    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE aggregate_id = 'poison' \
        AND status = 'DEAD_LETTER' AND attempt_count = 5";
    let until = [(dead, 1), (HEALTHY_ONCE, 41)];
    let deaths = restart_until(&db, "failure::late_aborting_child_entry", &[], &until).await;
    assert_survived(db, deaths, 1, (dead, 1), 41).await;
}

/// A death is counted only against the event whose handler caused it: another consumer in the
/// same process, handed the same event at the same time, is not charged for it, and a healthy
/// consumer's rows are never dead-lettered for a process death they did not cause.
#[actix_rt::test]
async fn a_process_death_is_not_counted_against_another_consumers_events() {
    let db = TestDb::new().await;
    let setup = start(
        &db,
        vec![
            (consumer("c1", 2), Behaviour::default()),
            (consumer("c2", 2), Behaviour::default()),
        ],
    )
    .await;
    setup.shutdown().await;
    produce_with_poison(&db, 1, 40).await;

    let c1_dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'c1' \
        AND aggregate_id = 'poison' AND status = 'DEAD_LETTER' AND attempt_count = 2 \
        AND error_code = 'INBOX_ATTEMPT_INTERRUPTED'";
    let c1_healthy = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'c1' \
        AND aggregate_id <> 'poison' AND status = 'PROCESSED' AND attempt_count = 1";
    let c2_once = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'c2' \
        AND status = 'PROCESSED' AND attempt_count = 1";
    let until = [(c1_dead, 1), (c1_healthy, 41), (c2_once, 42)];
    let deaths = restart_until(
        &db,
        "failure::two_consumers_aborting_child_entry",
        &[],
        &until,
    )
    .await;

    assert_eq!(
        db.count(c1_dead).await,
        1,
        "c1's poison event is dead-lettered"
    );
    assert_eq!(
        db.count(c1_healthy).await,
        41,
        "c1's other events processed, first time"
    );
    assert_eq!(
        db.count(c2_once).await,
        42,
        "c2 processed every event on its first attempt, the poison one too"
    );
    assert!(deaths >= 2, "the process died {deaths} times");
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 41 + 42);
    assert_eq!(db.count(MAX_EFFECTS_PER_EVENT).await, 1);
    db.finish(&[]).await;
}

/// The same with both consumers reading through cursors (storage v2): a dead process's cursor
/// leases are promoted and judged, and still only `c1`'s poison event is charged. Processed
/// means an effect; an inbox row of any other event must show no charged attempt.
#[actix_rt::test]
async fn a_process_death_is_not_counted_against_another_cursor_consumers_events() {
    let db = TestDb::new().await;
    let cfg = |name: &str| consumer(name, 2).cursor(true);
    let setup = start(
        &db,
        vec![
            (cfg("c1"), Behaviour::default()),
            (cfg("c2"), Behaviour::default()),
        ],
    )
    .await;
    setup.shutdown().await;
    produce_with_poison(&db, 1, 40).await;

    let c1_dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'c1' \
        AND aggregate_id = 'poison' AND status = 'DEAD_LETTER' AND attempt_count = 2 \
        AND error_code = 'INBOX_ATTEMPT_INTERRUPTED'";
    let applied = |c: &str| {
        format!(
            "SELECT count(DISTINCT e.event_id) AS n FROM effects e \
             JOIN actix_outbox.outbox_events o ON o.id = e.event_id \
             WHERE e.consumer = '{c}' AND o.aggregate_id <> 'poison'"
        )
    };
    let c2_poison = "SELECT count(*) AS n FROM effects e \
        JOIN actix_outbox.outbox_events o ON o.id = e.event_id \
        WHERE e.consumer = 'c2' AND o.aggregate_id = 'poison'";
    let (c1_healthy, c2_healthy) = (applied("c1"), applied("c2"));
    let until = [
        (c1_dead, 1),
        (&c1_healthy, 41),
        (&c2_healthy, 41),
        (c2_poison, 1),
    ];
    let deaths = restart_until(
        &db,
        "failure::two_consumers_aborting_child_entry",
        &[("AO_CHILD_CURSOR", "1")],
        &until,
    )
    .await;

    assert!(read_through_cursors(&db, "c1").await && read_through_cursors(&db, "c2").await);
    assert_eq!(
        db.count(c1_dead).await,
        1,
        "c1's poison event is dead-lettered"
    );
    assert_eq!(
        db.count(&c1_healthy).await,
        41,
        "c1's other events processed"
    );
    assert_eq!(db.count(&c2_healthy).await, 41, "c2's events processed");
    assert_eq!(
        db.count(c2_poison).await,
        1,
        "c2 processed the poison event too"
    );
    let charged = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
        WHERE NOT (consumer = 'c1' AND aggregate_id = 'poison') \
          AND (attempt_count > 1 OR status = 'DEAD_LETTER')";
    assert_eq!(
        db.count(charged).await,
        0,
        "another event was charged a death"
    );
    assert!(deaths >= 2, "the process died {deaths} times");
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 41 + 42);
    assert_eq!(db.count(MAX_EFFECTS_PER_EVENT).await, 1);
    db.finish(&[]).await;
}

#[actix_rt::test]
async fn an_event_that_kills_its_process_is_dead_lettered_after_its_attempts() {
    an_event_that_kills_its_process(false).await;
}

#[actix_rt::test]
async fn an_event_that_kills_a_batch_consumers_process_is_dead_lettered_after_its_attempts() {
    an_event_that_kills_its_process(true).await;
}

#[actix_rt::test]
async fn sigkill_of_the_runtime_process_loses_nothing_and_duplicates_nothing() {
    let db = TestDb::new().await;
    // Register the consumer before any event exists, as a deployed service would have.
    let setup = start(&db, vec![(consumer("c1", 10), Behaviour::default())]).await;
    setup.shutdown().await;

    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    let spawn = || spawn_child(&db.url);
    let (kills, mut child) = kill_while_producing(&db, spawn, done, 10_000, 400).await;
    let processed = db.wait_for(done, 10_000, Duration::from_secs(120)).await;
    child.kill().ok();
    child.wait().ok();

    assert!(
        kills >= 3,
        "the run was killed {kills} times; the test needs at least 3"
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.outbox_events")
            .await,
        10_000
    );
    assert_eq!(processed, 10_000, "zero lost");
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 10_000);
    assert_eq!(
        db.count(MAX_EFFECTS_PER_EVENT).await,
        1,
        "zero duplicate effects"
    );
    db.finish(&[]).await;
}

#[actix_rt::test]
async fn a_rate_limited_consumer_drains_a_backlog_at_its_rate() {
    let db = TestDb::new().await;
    db.produce_batched(300, 100, "o").await;
    // 150 events/s over two concurrent loops: 300 events take at least ~2 s.
    let cfg = consumer("paced", 3)
        .batch_size(10)
        .concurrency(2)
        .rate_limit(150.0);
    let rt = start(
        &db,
        vec![
            (cfg, Behaviour::default()),
            (consumer("free", 3), Behaviour::default()),
        ],
    )
    .await;
    let done =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED' AND consumer = 'paced'";
    assert_eq!(db.wait_for(done, 300, WAIT).await, 300);
    // Measured on the database clock: the span between the first and last processed rows.
    let span_ms =
        "SELECT (extract(epoch FROM max(processed_at) - min(processed_at)) * 1000)::bigint AS n \
                   FROM actix_outbox.inbox_events WHERE consumer = 'paced'";
    let paced = db.count(span_ms).await;
    assert!(paced >= 1_700, "300 events at 150/s took only {paced} ms");
    assert_eq!(db.count(MAX_EFFECTS_PER_EVENT).await, 1);
    // The other consumer of the same events has no limit and drains them all too. (How much
    // sooner is not asserted: on a loaded machine that is a race, not a property.)
    let free =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED' AND consumer = 'free'";
    assert_eq!(db.wait_for(free, 300, WAIT).await, 300);
    db.finish(&[&rt]).await;
}

/// Every session of the runtime — the claims, the batches, the in-flight records, the LISTEN
/// connection — is terminated three times while events flow.
/// Each broken batch rolls back and is claimed again, the listener reconnects, the pool
/// replaces what it lost: every event is handled, and no effect happens twice.
/// A rate-limited consumer pauses between batches (32 events at 1/s: half a minute). A
/// graceful shutdown during the pause ends it: the shutdown finishes within its timeout with
/// everything committed, instead of waiting out the pause and reporting that it did not.
#[actix_rt::test]
async fn a_shutdown_does_not_wait_out_a_rate_limit_pause() {
    let db = TestDb::new().await;
    db.produce(100, "o").await;
    let config = fast_runtime().shutdown_timeout(Duration::from_secs(10));
    let cfg = consumer("c1", 3).batch_size(32).rate_limit(1.0);
    let rt = start_with(db.pool.clone(), config, vec![(cfg, Behaviour::default())]).await;
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 32, WAIT).await, 32);
    assert!(
        rt.shutdown().await,
        "the shutdown finished within its timeout"
    );
    assert_eq!(db.count(done).await, 32);
    assert_eq!(db.count(MAX_EFFECTS_PER_EVENT).await, 1);
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn connections_dropped_mid_run_lose_nothing_and_repeat_no_effect() {
    connections_dropped_mid_run(false).await;
}

/// The same with both consumers reading through cursors (storage v2): claims, batches and
/// cursor moves lose their sessions. Processed means an effect, as a cursor consumer has no
/// inbox row per event.
#[actix_rt::test]
async fn connections_dropped_mid_run_lose_nothing_and_repeat_no_effect_on_cursors() {
    connections_dropped_mid_run(true).await;
}

async fn connections_dropped_mid_run(cursor: bool) {
    let db = TestDb::new().await;
    let busy = Behaviour {
        work: Duration::from_millis(3),
        ..Default::default()
    };
    // The runtime's sessions carry a name of their own, so that only they are terminated.
    let pool = actix_outbox::connect(&format!("{}?application_name=doomed", db.url), 10)
        .await
        .unwrap();
    let rt = start_with(
        pool,
        fast_runtime(),
        vec![
            (
                consumer("c1", 5).batch_size(20).cursor(cursor),
                busy.clone(),
            ),
            (
                consumer("c2", 5)
                    .batch_size(20)
                    .concurrency(2)
                    .cursor(cursor),
                busy,
            ),
        ],
    )
    .await;
    let kill = format!(
        "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity \
         WHERE datname = '{}' AND application_name = 'doomed'",
        db.name
    );
    let mut killed = 0;
    for round in 0..3 {
        db.produce(100, &format!("r{round}")).await;
        // Let batches get under way, then break every connection they use.
        actix_rt::time::sleep(Duration::from_millis(40)).await;
        killed += db.count(&kill).await;
    }
    assert!(killed >= 3, "sessions were terminated: {killed}");
    for c in ["c1", "c2"] {
        let done = match cursor {
            false => format!(
                "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                 WHERE consumer = '{c}' AND status = 'PROCESSED'"
            ),
            true => {
                format!("SELECT count(DISTINCT event_id) AS n FROM effects WHERE consumer = '{c}'")
            }
        };
        assert_eq!(db.wait_for(&done, 300, WAIT).await, 300, "{c}");
        assert_eq!(read_through_cursors(&db, c).await, cursor, "{c}");
    }
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 600);
    assert_eq!(db.count(MAX_EFFECTS_PER_EVENT).await, 1);
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status <> 'PUBLISHED'"
        )
        .await,
        0
    );
    // The listener lost its connection and listens again on a new one.
    let listening = format!(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = '{}' \
         AND application_name = 'doomed' AND query LIKE 'LISTEN%'",
        db.name
    );
    assert_eq!(db.wait_for(&listening, 1, WAIT).await, 1);
    let restarts = rt.status().await.unwrap().restarts;
    assert!(
        restarts.get("listener").is_some_and(|n| *n >= 1),
        "{restarts:?}"
    );
    db.finish(&[&rt]).await;
}

/// A handler factory that panics is contained in its consumer: the supervisor and the other
/// consumer go on, and the factory is tried again (with a growing wait) until it builds a
/// handler, which then processes every event once.
#[actix_rt::test]
async fn a_panicking_handler_factory_is_retried_and_stops_nothing_else() {
    let db = TestDb::new().await;
    db.produce(20, "o").await;
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let made = calls.clone();
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer(consumer("flaky", 3), move || {
            if made.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < 3 {
                panic!("fault injection: the factory cannot build its handler yet");
            }
            Recorder {
                name: "flaky".into(),
                behaviour: Behaviour::default(),
            }
        })
        .consumer(consumer("steady", 3), || Recorder {
            name: "steady".into(),
            behaviour: Behaviour::default(),
        })
        .start()
        .await
        .expect("a factory's panic is not a start-up failure");
    for c in ["steady", "flaky"] {
        let done = format!(
            "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = '{c}' \
             AND status = 'PROCESSED' AND attempt_count = 1"
        );
        assert_eq!(db.wait_for(&done, 20, WAIT).await, 20, "{c}");
    }
    assert!(
        calls.load(std::sync::atomic::Ordering::Relaxed) >= 4,
        "the factory was tried again after its panics"
    );
    assert!(rt.status().await.is_ok(), "the supervisor still answers");
    assert_eq!(db.count(MAX_EFFECTS_PER_EVENT).await, 1);
    db.finish(&[&rt]).await;
}
