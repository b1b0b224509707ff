//! Replays (`ops::replay`) against real PostgreSQL: an operator re-applies a window of events a
//! replay-safe consumer already processed. Each event of the window is re-applied exactly
//! once, seen as `DeliveryMode::Replay`, even through a failing step, while live events keep
//! flowing and keep their one inbox row each; a consumer not marked safe is refused. Every
//! assertion on delivery counts rows.

use crate::common;

use std::time::Duration;

use actix::prelude::*;
use actix_outbox::event::ConsumerName;
use actix_outbox::ops::{self, ReplayRange};
use actix_outbox::{ConsumerConfig, Delivery, DeliveryMode, HandlerError, OutboxRuntime};
use chrono::{DateTime, Utc};
use common::*;
use diesel::sql_types::{Integer, Text, Timestamptz, Uuid as SqlUuid};
use diesel::QueryableByName;
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};

/// Writes one row per delivery it handles (`mode`: live or replay), in the delivery's
/// transaction. Fails the first replay attempt of the event whose `n` is `fail_replay_of`.
#[derive(Clone, Default)]
struct Projector {
    fail_replay_of: Option<u64>,
    /// Fails the first live attempt of every event whose `n` this divides, so that it is
    /// retried from an inbox row.
    fail_live_every: Option<u64>,
    /// Time each delivery takes after its write, so that steps are in flight when a fault
    /// strikes.
    work: Duration,
}

impl Actor for Projector {
    type Context = Context<Self>;
}

impl Handler<Delivery> for Projector {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
        let (fail_replay_of, work) = (self.fail_replay_of, self.work);
        let fail_live_every = self.fail_live_every;
        Box::pin(async move {
            let mode = match d.mode() {
                DeliveryMode::Replay => "replay",
                _ => "live",
            };
            let mut conn = d.conn().await?;
            diesel::sql_query(
                "INSERT INTO projections (event_id, mode, attempt) VALUES ($1, $2, $3)",
            )
            .bind::<SqlUuid, _>(d.event_id().as_uuid())
            .bind::<Text, _>(mode)
            .bind::<Integer, _>(d.attempt() as i32)
            .execute(&mut *conn)
            .await?;
            drop(conn);
            actix_rt::time::sleep(work).await;
            let n = d.payload()["n"].as_u64();
            if mode == "replay" && d.attempt() == 1 && n.is_some() && n == fail_replay_of {
                // Its write above rolls back with the step.
                return Err(HandlerError::retry("injected replay failure"));
            }
            let every = fail_live_every.unwrap_or(0);
            if mode == "live" && d.attempt() == 1 && every > 0 && n.is_some_and(|n| n % every == 0)
            {
                return Err(HandlerError::retry("injected live failure"));
            }
            Ok(())
        })
    }
}

async fn setup(db: &TestDb) {
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(
        "CREATE TABLE projections (id bigserial PRIMARY KEY, event_id uuid NOT NULL, \
         mode text NOT NULL, attempt int NOT NULL)",
    )
    .await
    .unwrap();
}

/// `n` events `from..from + n` (the payload's `n`), one transaction each.
async fn produce(db: &TestDb, from: u64, n: u64) {
    produce_type(db, "ORDER_PLACED", from, n).await;
}

/// The database's clock, which stamps `created_at`.
async fn db_now(db: &TestDb) -> DateTime<Utc> {
    #[derive(QueryableByName)]
    struct Now {
        #[diesel(sql_type = Timestamptz)]
        t: DateTime<Utc>,
    }
    let mut conn = db.pool.get().await.unwrap();
    let now: Now = diesel::sql_query("SELECT clock_timestamp() AS t")
        .get_result(&mut conn)
        .await
        .unwrap();
    now.t
}

async fn start(db: &TestDb, fail_replay_of: Option<u64>) -> OutboxRuntime {
    let projector = Projector {
        fail_replay_of,
        ..Projector::default()
    };
    start_on(db, projector, false).await
}

/// `projector`, replay-safe, reading through cursors if `cursor`, beside `mailer` (inbox rows).
async fn start_on(db: &TestDb, projector: Projector, cursor: bool) -> OutboxRuntime {
    let cfg = consumer("projector", 3)
        .subscribe("ORDER_PLACED")
        .replay_safe(true)
        .cursor(cursor);
    OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer(cfg, move || projector.clone())
        .consumer(
            ConsumerConfig::new("mailer").subscribe("ORDER_PLACED"),
            Projector::default,
        )
        .start()
        .await
        .expect("start runtime")
}

fn name(s: &str) -> ConsumerName {
    ConsumerName::new(s).unwrap()
}

const LIVE: &str = "SELECT count(*) AS n FROM projections WHERE mode = 'live'";

#[actix_rt::test]
async fn a_replay_reapplies_exactly_its_window_once_while_live_events_flow() {
    reapplies_exactly_its_window_once(false).await;
}

/// The same, with the projector reading through cursors: the window's events have no inbox
/// row of it, and are replayed from the outbox.
#[actix_rt::test]
async fn a_cursor_consumers_replay_reapplies_exactly_its_window_once_while_live_events_flow() {
    reapplies_exactly_its_window_once(true).await;
}

async fn reapplies_exactly_its_window_once(cursor: bool) {
    let db = TestDb::new().await;
    setup(&db).await;
    let projector = Projector {
        fail_replay_of: Some(14),
        ..Projector::default()
    };
    let rt = start_on(&db, projector, cursor).await;

    // Three groups of ten; the window holds the middle one.
    produce(&db, 0, 10).await;
    let from = db_now(&db).await;
    produce(&db, 10, 10).await;
    let until = db_now(&db).await;
    produce(&db, 20, 10).await;
    // Both consumers write a projection row per event.
    assert_eq!(db.wait_for(LIVE, 60, WAIT).await, 60);

    let mut conn = db.pool.get().await.unwrap();
    let range = ReplayRange::all()
        .event_type("ORDER_PLACED")
        .created_from(from)
        .created_until(until)
        .rate(100.0);
    let refused = ops::replay(&mut conn, &name("mailer"), &range, "alice", "rebuild")
        .await
        .unwrap_err();
    assert_eq!(refused.code().as_str(), "CONSUMER_NOT_REPLAY_SAFE");
    let unknown = ops::replay(&mut conn, &name("nobody"), &range, "alice", "rebuild")
        .await
        .unwrap_err();
    assert_eq!(unknown.code().as_str(), "CONSUMER_UNKNOWN");
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.replays")
            .await,
        0
    );

    let replay = ops::replay(&mut conn, &name("projector"), &range, "alice", "rebuild")
        .await
        .unwrap();
    assert_eq!((replay.total, replay.done), (10, 0));
    // Live traffic meanwhile: forty more events, delivered as usual to both consumers.
    produce(&db, 30, 40).await;

    let done = format!(
        "SELECT count(*) AS n FROM actix_outbox.replays WHERE id = {} AND status = 'DONE' AND done = 10",
        replay.id
    );
    assert_eq!(db.wait_for(&done, 1, WAIT).await, 1, "the replay ends");
    assert_eq!(db.wait_for(LIVE, 140, WAIT).await, 140);

    // Exactly the window, each event once (the failed step's write rolled back) ...
    let replayed = "SELECT count(*) AS n FROM projections p JOIN actix_outbox.outbox_events o \
                    ON o.id = p.event_id WHERE p.mode = 'replay'";
    assert_eq!(db.count(replayed).await, 10);
    let in_window =
        "SELECT count(DISTINCT p.event_id) AS n FROM projections p JOIN actix_outbox.outbox_events o \
                     ON o.id = p.event_id WHERE p.mode = 'replay' \
                     AND (o.payload->>'n')::int BETWEEN 10 AND 19";
    assert_eq!(db.count(in_window).await, 10);
    // ... and the failing event's step was tried again on its own, as its second attempt.
    let retried = "SELECT count(*) AS n FROM projections p JOIN actix_outbox.outbox_events o \
                   ON o.id = p.event_id WHERE p.mode = 'replay' AND (o.payload->>'n')::int = 14 \
                   AND p.attempt = 2";
    assert_eq!(db.count(retried).await, 1);
    // Live effects once per (event, consumer); inbox rows untouched by the replay.
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM (SELECT event_id FROM projections WHERE mode = 'live' \
             GROUP BY event_id HAVING count(*) <> 2) x"
        )
        .await,
        0
    );
    // (None of the projector's when it reads through cursors.)
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'")
            .await,
        if cursor { 70 } else { 140 }
    );
    assert_eq!(read_through_cursors(&db, "projector").await, cursor);
    // Audited, with who and why.
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM actix_outbox.admin_audit WHERE action = 'consumer.replay' \
             AND who = 'alice' AND reason = 'rebuild' AND target = 'consumer:projector'"
        )
        .await,
        1
    );
    let listed = ops::replays(&mut conn, Some(&name("projector")))
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].status.as_str(), listed[0].done), ("DONE", 10));
    drop(conn);
    db.finish(&[&rt]).await;
}

/// A cursor consumer's replay covers what it handled through its cursors and what it handled
/// from inbox rows (failures retried), each once; and nothing it had not read when the replay
/// was asked for: events waiting past its cursors then are applied live, not replayed.
#[actix_rt::test]
async fn a_cursor_consumers_replay_covers_its_inbox_rows_and_stops_at_its_oldest_unread_event() {
    use actix_outbox::ops::{pause_consumer, resume_consumer};
    let db = TestDb::new().await;
    setup(&db).await;
    let projector = Projector {
        fail_live_every: Some(5),
        ..Projector::default()
    };
    let rt = start_on(&db, projector, true).await;
    produce(&db, 0, 20).await;
    assert_eq!(db.wait_for(LIVE, 40, WAIT).await, 40);
    // Events 0, 5, 10 and 15 failed once and were applied from inbox rows; the others
    // through the cursors.
    let retried = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                   WHERE consumer = 'projector' AND status = 'PROCESSED'";
    assert_eq!(db.count(retried).await, 4);
    assert!(read_through_cursors(&db, "projector").await);

    // Ten more wait past its cursors while it is paused (the mailer applies them).
    let mut conn = db.pool.get().await.unwrap();
    pause_consumer(&mut conn, &name("projector"), "ops", "replay later", None)
        .await
        .unwrap();
    produce(&db, 20, 10).await;
    assert_eq!(db.wait_for(LIVE, 50, WAIT).await, 50);
    let range = ReplayRange::all().rate(1000.0);
    let replay = ops::replay(&mut conn, &name("projector"), &range, "alice", "rebuild")
        .await
        .unwrap();
    assert_eq!(replay.total, 20, "the 20 it had applied, not the 10 unread");
    resume_consumer(&mut conn, &name("projector"), "ops")
        .await
        .unwrap();
    rt.handle().wake();
    let done = format!(
        "SELECT count(*) AS n FROM actix_outbox.replays WHERE id = {} AND status = 'DONE' \
         AND done = 20",
        replay.id
    );
    assert_eq!(db.wait_for(&done, 1, WAIT).await, 1, "the replay ends");
    assert_eq!(db.wait_for(LIVE, 60, WAIT).await, 60);
    let replayed = |n: &str| {
        format!(
            "SELECT count(*) AS n FROM projections p JOIN actix_outbox.outbox_events o \
             ON o.id = p.event_id WHERE p.mode = 'replay' AND (o.payload->>'n')::int {n}"
        )
    };
    assert_eq!(db.count(&replayed("< 20")).await, 20);
    assert_eq!(
        db.count("SELECT count(DISTINCT event_id) AS n FROM projections WHERE mode = 'replay'")
            .await,
        20,
        "each once"
    );
    assert_eq!(
        db.count(&replayed(">= 20")).await,
        0,
        "an unread event replayed"
    );
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM (SELECT event_id FROM projections WHERE mode = 'live' \
             GROUP BY event_id HAVING count(*) <> 2) x"
        )
        .await,
        0,
        "live effects once per (event, consumer)"
    );
    drop(conn);
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn a_cancelled_replay_stops_and_keeps_what_it_applied() {
    let db = TestDb::new().await;
    setup(&db).await;
    let rt = start(&db, None).await;
    produce(&db, 0, 20).await;
    assert_eq!(db.wait_for(LIVE, 40, WAIT).await, 40);

    let mut conn = db.pool.get().await.unwrap();
    // Two events a second: one per step, a step every half second.
    let range = ReplayRange::all().rate(2.0);
    let replay = ops::replay(&mut conn, &name("projector"), &range, "bob", "check")
        .await
        .unwrap();
    assert_eq!(replay.total, 20);
    let replayed = "SELECT count(*) AS n FROM projections WHERE mode = 'replay'";
    assert_eq!(db.wait_for(replayed, 2, WAIT).await, 2);
    let cancelled = ops::cancel_replay(&mut conn, replay.id, "bob")
        .await
        .unwrap();
    assert_eq!(cancelled.status, "CANCELLED");
    // A step in flight finished before the cancel: what was applied is what was counted.
    assert_eq!(db.count(replayed).await, cancelled.done);
    assert!(cancelled.done < 20, "the rate limit held it to a few steps");
    // Nothing runs after it: three of its steps' worth of time later, still the same.
    actix_rt::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(db.count(replayed).await, cancelled.done);
    let again = ops::cancel_replay(&mut conn, replay.id, "bob")
        .await
        .unwrap();
    assert_eq!(
        (again.status.as_str(), again.done),
        ("CANCELLED", cancelled.done)
    );
    let unknown = ops::cancel_replay(&mut conn, 999_999, "bob")
        .await
        .unwrap_err();
    assert_eq!(unknown.code().as_str(), "REPLAY_UNKNOWN");
    drop(conn);
    db.finish(&[&rt]).await;
}

/// Two instances step one replay, and one of them loses its consumer actor again and again
/// with steps in flight: each event is still re-applied exactly once, because a step's effects
/// and the cursor commit together and a step cut short commits neither.
#[actix_rt::test]
async fn a_replay_stepped_by_two_instances_through_crashes_applies_each_event_once() {
    stepped_by_two_instances_through_crashes(false).await;
}

/// The same, with the projector reading through cursors (its replay walks the outbox).
#[actix_rt::test]
async fn a_cursor_consumers_replay_stepped_by_two_instances_through_crashes_applies_each_event_once(
) {
    stepped_by_two_instances_through_crashes(true).await;
}

async fn stepped_by_two_instances_through_crashes(cursor: bool) {
    let db = TestDb::new().await;
    setup(&db).await;
    let slow = Projector {
        work: Duration::from_millis(15),
        ..Projector::default()
    };
    let instance = || {
        let slow = slow.clone();
        OutboxRuntime::builder(db.pool.clone())
            .config(fast_runtime())
            .consumer(
                consumer("projector", 3)
                    .subscribe("ORDER_PLACED")
                    .replay_safe(true)
                    .cursor(cursor),
                move || slow.clone(),
            )
            .start()
    };
    let a = instance().await.expect("start a");
    let b = instance().await.expect("start b");
    produce(&db, 0, 120).await;
    assert_eq!(db.wait_for(LIVE, 120, WAIT).await, 120);

    // Steps of 4 events, one every 100 ms at the most: the replay takes 3 s whatever the
    // machine, long enough for several faults, and both instances wake for each step.
    let mut conn = db.pool.get().await.unwrap();
    let range = ReplayRange::all().rate(40.0);
    let replay = ops::replay(&mut conn, &name("projector"), &range, "carol", "rebuild")
        .await
        .unwrap();
    assert_eq!(replay.total, 120);
    drop(conn);
    let done = format!(
        "SELECT count(*) AS n FROM actix_outbox.replays WHERE id = {} AND status = 'DONE'",
        replay.id
    );
    let mut crashes = 0;
    within(WAIT, async {
        while db.count(&done).await == 0 {
            if a.inject_fault(actix_outbox::testing::Fault::PanicConsumer(
                "projector".into(),
            ))
            .await
            {
                crashes += 1;
            }
            actix_rt::time::sleep(Duration::from_millis(250)).await;
        }
    })
    .await;
    assert!(
        crashes >= 3,
        "the fault struck during the replay ({crashes} times)"
    );
    let replayed = "SELECT count(*) AS n FROM projections WHERE mode = 'replay'";
    assert_eq!(db.count(replayed).await, 120);
    assert_eq!(
        db.count("SELECT count(DISTINCT event_id) AS n FROM projections WHERE mode = 'replay'")
            .await,
        120,
        "each event once"
    );
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) AS n FROM actix_outbox.replays WHERE id = {} AND done = 120",
            replay.id
        ))
        .await,
        1
    );
    db.finish(&[&a, &b]).await;
}

/// The replay of `consumer` with id `id`, as `(status, done, error_code)`.
async fn replay_state(db: &TestDb, id: i64) -> (String, i64, Option<String>) {
    let mut conn = db.pool.get().await.unwrap();
    let r = ops::replays(&mut conn, None)
        .await
        .unwrap()
        .into_iter()
        .find(|r| r.id == id)
        .expect("the replay");
    (r.status, r.done, r.error_code)
}

/// A replay waits while its consumer is paused, as live deliveries do; retention never deletes
/// a row a running replay has yet to reach; and rows that go anyway (deleted by a retention
/// that began before the replay was asked for) end the replay FAILED with `REPLAY_GAP`, never
/// DONE: before, it skipped them and ended DONE.
#[actix_rt::test]
async fn a_replay_waits_for_resume_keeps_its_rows_from_retention_and_fails_past_a_gap() {
    waits_keeps_and_fails_past_a_gap(false).await;
}

/// The same, with the projector reading through cursors: retention keeps the outbox rows its
/// replay has yet to walk.
#[actix_rt::test]
async fn a_cursor_consumers_replay_waits_for_resume_keeps_its_events_from_retention_and_fails_past_a_gap(
) {
    waits_keeps_and_fails_past_a_gap(true).await;
}

async fn waits_keeps_and_fails_past_a_gap(cursor: bool) {
    use actix_outbox::ops::{pause_consumer, resume_consumer};
    let db = TestDb::new().await;
    setup(&db).await;
    let rt = start_on(&db, Projector::default(), cursor).await;
    produce(&db, 0, 20).await;
    assert_eq!(db.wait_for(LIVE, 40, WAIT).await, 40);
    let mut conn = db.pool.get().await.unwrap();
    pause_consumer(&mut conn, &name("projector"), "ops", "replay later", None)
        .await
        .unwrap();
    let range = ReplayRange::all().rate(1000.0);
    let replay = ops::replay(&mut conn, &name("projector"), &range, "alice", "rebuild")
        .await
        .unwrap();
    assert_eq!(replay.total, 20);
    // Paused: many polls later, nothing replayed.
    actix_rt::time::sleep(Duration::from_millis(1500)).await;
    let replayed = "SELECT count(*) AS n FROM projections WHERE mode = 'replay'";
    assert_eq!(db.count(replayed).await, 0, "a paused consumer replayed");
    assert_eq!(replay_state(&db, replay.id).await.1, 0);

    // Retention of everything processed: the mailer's rows go, the replay's stay.
    retention_of_everything(&db).await;
    let kept = |c: &str| {
        format!(
            "SELECT count(*) AS n FROM actix_outbox.inbox_events \
             WHERE consumer = '{c}' AND status = 'PROCESSED'"
        )
    };
    assert_eq!(db.count(&kept("mailer")).await, 0, "retention ran");
    // What the replay walks: the projector's inbox rows, or, through cursors, the outbox.
    let (walked, five) = if cursor {
        (
            "SELECT count(*) AS n FROM actix_outbox.outbox_events".to_owned(),
            "DELETE FROM actix_outbox.outbox_events WHERE id IN (SELECT id FROM \
             actix_outbox.outbox_events ORDER BY seq DESC LIMIT 5)",
        )
    } else {
        (
            kept("projector"),
            "DELETE FROM actix_outbox.inbox_events WHERE id IN (SELECT id FROM \
             actix_outbox.inbox_events WHERE consumer = 'projector' ORDER BY id DESC LIMIT 5)",
        )
    };
    assert_eq!(db.count(&walked).await, 20, "a replay's row went");
    assert_eq!(read_through_cursors(&db, "projector").await, cursor);
    // Five go anyway, as if deleted by a retention batch that began before the replay.
    conn.batch_execute(five).await.unwrap();

    resume_consumer(&mut conn, &name("projector"), "ops")
        .await
        .unwrap();
    rt.handle().wake();
    let ended = format!(
        "SELECT count(*) AS n FROM actix_outbox.replays WHERE id = {} AND status <> 'RUNNING'",
        replay.id
    );
    assert_eq!(db.wait_for(&ended, 1, WAIT).await, 1);
    assert_eq!(
        replay_state(&db, replay.id).await,
        ("FAILED".to_owned(), 15, Some("REPLAY_GAP".to_owned()))
    );
    assert_eq!(db.count(replayed).await, 15, "what was there, once");
    drop(conn);
    db.finish(&[&rt]).await;
}

/// A consumer that skips stale events does not re-apply, in a replay, an event older than the
/// version it has recorded for its aggregate: live, it would have skipped it too.
#[actix_rt::test]
async fn a_replay_of_a_consumer_that_skips_stale_events_reapplies_only_current_versions() {
    reapplies_only_current_versions(false).await;
}

/// The same, with the consumer reading through cursors (its replay walks the outbox).
#[actix_rt::test]
async fn a_cursor_consumers_replay_skips_stale_events_too() {
    reapplies_only_current_versions(true).await;
}

async fn reapplies_only_current_versions(cursor: bool) {
    let db = TestDb::new().await;
    setup(&db).await;
    let cfg = consumer("projector", 1)
        .subscribe("ORDER_PLACED")
        .skip_stale(true)
        .replay_safe(true)
        .cursor(cursor);
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer(cfg, Projector::default)
        .start()
        .await
        .unwrap();
    // o-1 at versions 1, 2 and 3; o-2 at version 1.
    for (id, version) in [("o-1", 1), ("o-1", 2), ("o-1", 3), ("o-2", 1)] {
        let event = actix_outbox::NewEvent::new(
            "ORDER_PLACED",
            "order",
            id,
            serde_json::json!({ "v": version }),
        )
        .aggregate_version(version);
        let conn = db.pool.get().await.unwrap();
        actix_outbox::enqueue(&conn, &event).await.unwrap();
    }
    assert_eq!(db.wait_for(LIVE, 4, WAIT).await, 4);
    let mut conn = db.pool.get().await.unwrap();
    let replay = replay_projector(&mut conn, &ReplayRange::all().rate(1000.0)).await;
    let ended = format!(
        "SELECT count(*) AS n FROM actix_outbox.replays WHERE id = {} AND status = 'DONE'",
        replay.id
    );
    assert_eq!(db.wait_for(&ended, 1, WAIT).await, 1);
    let replayed = "SELECT count(*) AS n FROM projections p JOIN actix_outbox.outbox_events o \
                    ON o.id = p.event_id WHERE p.mode = 'replay' \
                    AND ((o.aggregate_id = 'o-1' AND o.aggregate_version = 3) \
                         OR (o.aggregate_id = 'o-2' AND o.aggregate_version = 1))";
    assert_eq!(db.count(replayed).await, 2);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM projections WHERE mode = 'replay'")
            .await,
        2,
        "an older version was re-applied"
    );
    assert_eq!(replay_state(&db, replay.id).await.1, 4, "all four walked");
    drop(conn);
    db.finish(&[&rt]).await;
}

/// A replay step whose handler hangs, holding the step's transaction and the replay's lock,
/// has its session ended past its timeout and the grace: the step is recorded as failed, and
/// a cancel, which waits for that lock, returns. Before, the cancel waited as long as the
/// handler hung.
#[actix_rt::test]
async fn a_hung_replay_step_is_ended_past_the_grace_and_its_cancel_returns() {
    let db = TestDb::new().await;
    setup(&db).await;
    let cfg = consumer("projector", 1)
        .subscribe("ORDER_PLACED")
        .replay_safe(true)
        .handler_timeout(Duration::from_secs(1))
        // The failed step waits for its retry: the replay is still running when cancelled.
        .retry(actix_outbox::RetryPolicy::fixed(
            5,
            Duration::from_secs(600),
        ));
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer_fn(cfg, |d: Delivery| async move {
            let mut conn = d.conn().await?;
            conn.batch_execute("SELECT 1")
                .await
                .map_err(|e| HandlerError::retry(e.to_string()))?;
            if d.mode() == DeliveryMode::Replay {
                // Stuck outside the database, in the step's transaction.
                std::future::pending::<()>().await;
            }
            Ok(())
        })
        .start()
        .await
        .unwrap();
    produce(&db, 0, 1).await;
    let processed =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(processed, 1, WAIT).await, 1);
    let mut conn = db.pool.get().await.unwrap();
    let replay = replay_projector(&mut conn, &ReplayRange::all()).await;
    let failed = format!(
        "SELECT count(*) AS n FROM actix_outbox.replays WHERE id = {} AND attempts = 1 \
         AND last_error LIKE '%did not finish within%'",
        replay.id
    );
    assert_eq!(db.wait_for(&failed, 1, WAIT).await, 1, "the step failed");
    let cancel = ops::cancel_replay(&mut conn, replay.id, "alice");
    let cancelled = actix_rt::time::timeout(WAIT, cancel)
        .await
        .expect("the cancel waited for the hung step")
        .unwrap();
    assert_eq!(cancelled.status, "CANCELLED");
    let open = "SELECT count(*) AS n FROM pg_stat_activity \
                WHERE state LIKE 'idle in transaction%' AND datname = current_database()";
    // An ended backend lets go of its locks before it leaves `pg_stat_activity`: the
    // cancel can return a moment before the session is gone.
    assert_eq!(
        db.wait_for(open, 0, WAIT).await,
        0,
        "the hung step's session is left"
    );
    drop(conn);
    db.finish(&[&rt]).await;
}

/// Asks for a replay of `range` to `projector`, as alice, to rebuild.
async fn replay_projector(
    conn: &mut diesel_async::AsyncPgConnection,
    range: &ReplayRange,
) -> actix_outbox::ops::Replay {
    ops::replay(conn, &name("projector"), range, "alice", "rebuild")
        .await
        .unwrap()
}

/// Review findings on the cursor replay (2026-12-05), each with the runtime built here: a
/// replay-safe `projector` on cursors or not, beside a cursor consumer `auditor` of
/// `ORDER_SHIPPED`.
async fn start_beside_auditor(db: &TestDb, cfg: ConsumerConfig) -> OutboxRuntime {
    OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer(cfg.replay_safe(true), Projector::default)
        .consumer(
            ConsumerConfig::new("auditor")
                .subscribe("ORDER_PLACED")
                .subscribe("ORDER_SHIPPED")
                .cursor(true),
            Projector::default,
        )
        .start()
        .await
        .expect("start runtime")
}

/// `n` events of `event_type`, `from..from + n`, one transaction each.
async fn produce_type(db: &TestDb, event_type: &str, from: u64, n: u64) {
    for i in from..from + n {
        let event = actix_outbox::NewEvent::new(
            event_type,
            "order",
            format!("o-{i}"),
            serde_json::json!({ "n": i }),
        );
        let conn = db.pool.get().await.unwrap();
        actix_outbox::enqueue(&conn, &event).await.unwrap();
    }
}

async fn retention_of_everything(db: &TestDb) {
    use actix_outbox::retention::{Retention, RetentionConfig};
    let all = RetentionConfig::default()
        .published_outbox_after(Duration::from_millis(1))
        .processed_inbox_after(Duration::from_millis(1))
        .idempotency_keys_after(Duration::from_millis(1));
    Retention::new(db.pool.clone(), all)
        .unwrap()
        .run_once()
        .await
        .unwrap();
}

/// While a replay walks the outbox, retention keeps only the rows of its range and of its
/// consumer's types: another consumer's events go as usual. (Before, every stamped row below
/// the replay's bound stayed, for as long as the replay ran.)
#[actix_rt::test]
async fn retention_beside_a_cursor_replay_keeps_only_the_replays_events() {
    use actix_outbox::ops::pause_consumer;
    let db = TestDb::new().await;
    setup(&db).await;
    let cfg = consumer("projector", 3)
        .subscribe("ORDER_PLACED")
        .cursor(true);
    let rt = start_beside_auditor(&db, cfg).await;
    produce_type(&db, "ORDER_PLACED", 0, 5).await;
    produce_type(&db, "ORDER_SHIPPED", 5, 5).await;
    // The projector's 5 and the auditor's 10.
    assert_eq!(db.wait_for(LIVE, 15, WAIT).await, 15);
    let mut conn = db.pool.get().await.unwrap();
    pause_consumer(&mut conn, &name("projector"), "ops", "replay later", None)
        .await
        .unwrap();
    let replay = replay_projector(&mut conn, &ReplayRange::all()).await;
    assert_eq!(replay.total, 5);
    retention_of_everything(&db).await;
    let left = |t: &str| {
        format!("SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE event_type = '{t}'")
    };
    assert_eq!(
        db.count(&left("ORDER_PLACED")).await,
        5,
        "the replay's events"
    );
    assert_eq!(
        db.count(&left("ORDER_SHIPPED")).await,
        0,
        "held for the replay"
    );
    drop(conn);
    db.finish(&[&rt]).await;
}

/// A consumer that never read through cursors replays its inbox rows only, even when its
/// events were stamped for another consumer's cursors: before, once retention had deleted its
/// PROCESSED rows, it replayed those events from the outbox, which depended on another
/// consumer's storage (and, with a registration racing a claim, included events it never
/// handled).
#[actix_rt::test]
async fn an_inbox_consumers_replay_never_walks_the_outbox() {
    use actix_outbox::retention::{Retention, RetentionConfig};
    let db = TestDb::new().await;
    setup(&db).await;
    let rt = start_beside_auditor(&db, consumer("projector", 3).subscribe("ORDER_PLACED")).await;
    produce_type(&db, "ORDER_PLACED", 0, 10).await;
    assert_eq!(db.wait_for(LIVE, 20, WAIT).await, 20);
    assert!(read_through_cursors(&db, "auditor").await);
    assert!(!read_through_cursors(&db, "projector").await);
    // Its processed rows go; the outbox keeps the events.
    let inbox_only = RetentionConfig::default()
        .processed_inbox_after(Duration::from_millis(1))
        .idempotency_keys_after(Duration::from_millis(1));
    Retention::new(db.pool.clone(), inbox_only)
        .unwrap()
        .run_once()
        .await
        .unwrap();
    let rows = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'projector'";
    assert_eq!(db.count(rows).await, 0);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.outbox_events")
            .await,
        10
    );
    let mut conn = db.pool.get().await.unwrap();
    let replay = replay_projector(&mut conn, &ReplayRange::all()).await;
    assert_eq!((replay.total, replay.status.as_str()), (0, "DONE"));
    drop(conn);
    db.finish(&[&rt]).await;
}

/// A cursor consumer `projector` (skip_stale) beside the auditor, which has applied o-1 at
/// version 2 through its cursor and marked version 1, published after it, stale in an inbox
/// row.
async fn with_a_stale_mark(db: &TestDb) -> OutboxRuntime {
    setup(db).await;
    let cfg = consumer("projector", 3)
        .subscribe("ORDER_PLACED")
        .skip_stale(true)
        .cursor(true);
    let rt = start_beside_auditor(db, cfg).await;
    // o-1 at version 2, then at version 1: stale, marked in an inbox row.
    for version in [2, 1] {
        let event = actix_outbox::NewEvent::new(
            "ORDER_PLACED",
            "order",
            "o-1",
            serde_json::json!({ "v": version }),
        )
        .aggregate_version(version);
        let conn = db.pool.get().await.unwrap();
        actix_outbox::enqueue(&conn, &event).await.unwrap();
        let stamped = format!(
            "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE aggregate_version = {version} \
             AND status = 'PUBLISHED'"
        );
        assert_eq!(db.wait_for(&stamped, 1, WAIT).await, 1);
        rt.handle().wake();
        // The auditor applies each; the projector the first only.
        let auditor = "SELECT count(*) AS n FROM projections WHERE mode = 'live'";
        db.wait_for(auditor, if version == 2 { 2 } else { 3 }, WAIT)
            .await;
    }
    let stale = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'projector' \
                 AND error_code = 'EVENT_STALE'";
    assert_eq!(db.wait_for(stale, 1, WAIT).await, 1);
    assert!(read_through_cursors(db, "projector").await);
    rt
}

/// An inbox row of the consumer that was there when the replay was asked for (here a stale
/// mark, which a replay does not count) stays while the replay walks the outbox, so its event
/// never joins the walk: `done` ends equal to `total`. Before, inbox retention deleted it
/// meanwhile, the walk took the event in, and the replay ended with 2 done of 1.
#[actix_rt::test]
async fn a_cursor_replay_keeps_the_inbox_rows_that_were_there_when_asked() {
    use actix_outbox::ops::{pause_consumer, resume_consumer};
    let db = TestDb::new().await;
    let rt = with_a_stale_mark(&db).await;
    let stale = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'projector' \
                 AND error_code = 'EVENT_STALE'";
    let mut conn = db.pool.get().await.unwrap();
    pause_consumer(&mut conn, &name("projector"), "ops", "replay later", None)
        .await
        .unwrap();
    let replay = replay_projector(&mut conn, &ReplayRange::all().rate(1000.0)).await;
    assert_eq!(replay.total, 1, "version 2, read through the cursor");
    retention_of_everything(&db).await;
    assert_eq!(db.count(stale).await, 1, "the stale mark went");
    resume_consumer(&mut conn, &name("projector"), "ops")
        .await
        .unwrap();
    rt.handle().wake();
    let ended = format!(
        "SELECT count(*) AS n FROM actix_outbox.replays WHERE id = {} AND status <> 'RUNNING'",
        replay.id
    );
    assert_eq!(db.wait_for(&ended, 1, WAIT).await, 1);
    assert_eq!(
        replay_state(&db, replay.id).await,
        ("DONE".to_owned(), 1, None)
    );
    drop(conn);
    db.finish(&[&rt]).await;
}

/// Each step of a cursor replay's outbox walk starts its index scan at the walk's position:
/// the whole replay reads each published row about once, counted in `pg_stat_user_tables`.
/// Before, the position sat in a join, and every step read the published outbox from its
/// start (a review measured 276 ms a step at 1 M rows; past the step's time bound a replay
/// would never end).
#[actix_rt::test]
async fn a_cursor_replays_steps_read_the_outbox_from_where_the_walk_stands() {
    const EVENTS: i64 = 2000;
    let db = TestDb::new().await;
    setup(&db).await;
    // One event per claim, so that no two share a `published_at`: the walk's order is
    // (`published_at`, `id`) over an index of `published_at`, and a claim's events, published
    // at one instant, are read again by each step that starts among them.
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime().publish_batch_size(1))
        .consumer(
            consumer("projector", 3)
                .subscribe("ORDER_PLACED")
                .replay_safe(true)
                .cursor(true),
            Projector::default,
        )
        .consumer(
            ConsumerConfig::new("mailer").subscribe("ORDER_PLACED"),
            Projector::default,
        )
        .start()
        .await
        .expect("start runtime");
    produce(&db, 0, EVENTS as u64).await;
    let projected = "SELECT count(*) AS n FROM projections WHERE mode = 'live'";
    assert_eq!(db.wait_for(projected, 2 * EVENTS, WAIT).await, 2 * EVENTS);
    let read = "SELECT (coalesce(idx_tup_fetch, 0) + coalesce(seq_tup_read, 0))::int8 AS n \
                FROM pg_stat_user_tables WHERE relid = 'actix_outbox.outbox_events'::regclass";
    // Backends report their counts once idle for a second.
    actix_rt::time::sleep(Duration::from_millis(2500)).await;
    let before = db.count(read).await;
    let mut conn = db.pool.get().await.unwrap();
    // Steps of 32 (the batch size): 63 of them.
    let replay = replay_projector(&mut conn, &ReplayRange::all().rate(10_000.0)).await;
    assert_eq!(replay.total, EVENTS);
    let done = format!(
        "SELECT count(*) AS n FROM actix_outbox.replays WHERE id = {} AND status = 'DONE' \
         AND done = {EVENTS}",
        replay.id
    );
    assert_eq!(db.wait_for(&done, 1, WAIT).await, 1);
    actix_rt::time::sleep(Duration::from_millis(2500)).await;
    let spent = db.count(read).await - before;
    // The request counts the set (one pass), the walk reads it once more.
    assert!(
        spent < 5 * EVENTS,
        "{spent} outbox rows read for a replay of {EVENTS}: each step read from the start"
    );
    drop(conn);
    db.finish(&[&rt]).await;
}

/// A cursor consumer's replay takes in no event stamped before its cursors began, even one
/// published after its subscription's time: a claim racing its registration stamps such
/// events for the other cursor consumers only, and its cursors start past them. The race is
/// set up by moving the subscription's time back. Before, the replay counted them.
#[actix_rt::test]
async fn a_cursor_replay_takes_in_nothing_stamped_before_its_cursors_began() {
    let db = TestDb::new().await;
    setup(&db).await;
    // The auditor alone reads five events through its cursors.
    let auditor = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer(
            ConsumerConfig::new("auditor")
                .subscribe("ORDER_PLACED")
                .cursor(true),
            Projector::default,
        )
        .start()
        .await
        .expect("start runtime");
    produce(&db, 0, 5).await;
    assert_eq!(db.wait_for(LIVE, 5, WAIT).await, 5);
    auditor.shutdown().await;
    // The projector starts after, on cursors; its subscription dated back past the five.
    let rt = start_on(&db, Projector::default(), true).await;
    assert!(read_through_cursors(&db, "projector").await);
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(
        "UPDATE actix_outbox.consumer_subscriptions SET created_at = '-infinity' \
         WHERE consumer = 'projector'",
    )
    .await
    .unwrap();
    produce(&db, 5, 3).await;
    assert_eq!(
        db.wait_for(LIVE, 11, WAIT).await,
        11,
        "three each, projector and mailer"
    );
    let replay = replay_projector(&mut conn, &ReplayRange::all()).await;
    assert_eq!(replay.total, 3, "only what its cursors read");
    drop(conn);
    db.finish(&[&rt]).await;
}

/// A stale mark stays while its event's outbox row does, so a replay asked for after inbox
/// retention ran does not take the stale event for one its consumer applied. Before, the mark
/// went with the consumer's processed rows and the replay counted the event (2 of 1).
#[actix_rt::test]
async fn a_stale_mark_outlives_inbox_retention_while_its_event_is_in_the_outbox() {
    use actix_outbox::retention::{Retention, RetentionConfig};
    let db = TestDb::new().await;
    let rt = with_a_stale_mark(&db).await;
    let inbox_only = RetentionConfig::default()
        .processed_inbox_after(Duration::from_millis(1))
        .idempotency_keys_after(Duration::from_millis(1));
    Retention::new(db.pool.clone(), inbox_only)
        .unwrap()
        .run_once()
        .await
        .unwrap();
    let stale = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'projector' \
                 AND error_code = 'EVENT_STALE'";
    assert_eq!(db.count(stale).await, 1, "the stale mark went");
    let mut conn = db.pool.get().await.unwrap();
    let replay = replay_projector(&mut conn, &ReplayRange::all()).await;
    assert_eq!(replay.total, 1, "version 2 only");
    drop(conn);
    db.finish(&[&rt]).await;
}

/// A type added to a cursor consumer: its replay counts the events of that type stamped
/// after the subscription, not those its cursors passed before as another consumer's (here
/// the subscription's time is moved back, as a registration that waited on a lock leaves
/// it). Before, the replay read the subscription's time, and counted 5 instead of 2.
#[actix_rt::test]
async fn a_cursor_replay_counts_a_new_type_from_its_subscription_on() {
    let db = TestDb::new().await;
    setup(&db).await;
    let shipped = || {
        consumer("projector", 3)
            .subscribe("ORDER_SHIPPED")
            .cursor(true)
    };
    let rt = start_beside_auditor(&db, shipped()).await;
    produce(&db, 0, 3).await;
    // The auditor applies the three; the projector's cursors pass them.
    assert_eq!(db.wait_for(LIVE, 3, WAIT).await, 3);
    let passed = "SELECT count(*) AS n FROM actix_outbox.log_stamps s \
                  JOIN actix_outbox.consumer_cursors k ON k.part = s.part \
                  WHERE k.consumer = 'projector' AND (k.stamp, k.idx) < (s.stamp, cardinality(s.events))";
    assert_eq!(db.wait_for(passed, 0, WAIT).await, 0);
    rt.shutdown().await;
    let rt = start_beside_auditor(&db, shipped().subscribe("ORDER_PLACED")).await;
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(
        "UPDATE actix_outbox.consumer_subscriptions SET created_at = '-infinity' \
         WHERE consumer = 'projector'",
    )
    .await
    .unwrap();
    produce(&db, 3, 2).await;
    assert_eq!(db.wait_for(LIVE, 7, WAIT).await, 7);
    let replay = replay_projector(&mut conn, &ReplayRange::all()).await;
    assert_eq!(replay.total, 2, "only what its cursors read");
    drop(conn);
    db.finish(&[&rt]).await;
}
