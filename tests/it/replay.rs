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
#[derive(Clone)]
struct Projector {
    fail_replay_of: Option<u64>,
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
    for i in from..from + n {
        let event = actix_outbox::NewEvent::new(
            "ORDER_PLACED",
            "order",
            format!("o-{i}"),
            serde_json::json!({ "n": i }),
        );
        let conn = db.pool.get().await.unwrap();
        actix_outbox::enqueue(&conn, &event).await.unwrap();
    }
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
        work: Duration::ZERO,
    };
    let cfg = consumer("projector", 3)
        .subscribe("ORDER_PLACED")
        .replay_safe(true);
    OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer(cfg, move || projector.clone())
        .consumer(
            ConsumerConfig::new("mailer").subscribe("ORDER_PLACED"),
            || Projector {
                fail_replay_of: None,
                work: Duration::ZERO,
            },
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
    let db = TestDb::new().await;
    setup(&db).await;
    let rt = start(&db, Some(14)).await;

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
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'")
            .await,
        140
    );
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
    let db = TestDb::new().await;
    setup(&db).await;
    let slow = Projector {
        fail_replay_of: None,
        work: Duration::from_millis(15),
    };
    let instance = || {
        let slow = slow.clone();
        OutboxRuntime::builder(db.pool.clone())
            .config(fast_runtime())
            .consumer(
                consumer("projector", 3)
                    .subscribe("ORDER_PLACED")
                    .replay_safe(true),
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
