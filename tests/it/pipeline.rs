//! Pipelined consumers (`ConsumerConfig::pipeline`) against real PostgreSQL: a one-event
//! handler given many deliveries of a batch at once, in the batch's transaction, writing
//! through `Delivery::shared_conn`. Each effect commits once, one aggregate's deliveries are
//! never in flight together and arrive in order, and a failure is charged to its own event.
//! Every assertion on delivery counts rows.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::prelude::*;
use actix_outbox::{Delivery, HandlerError, NewEvent, OutboxRuntime};
use common::*;
use diesel::sql_types::{Integer, Text, Uuid as SqlUuid};
use diesel_async::{AsyncConnection, RunQueryDsl};

const MAX_EFFECTS_PER_EVENT: &str =
    "SELECT coalesce(max(c), 0) AS n FROM (SELECT count(*) AS c FROM effects GROUP BY consumer, event_id) x";

/// What the handler saw, shared with the test.
#[derive(Default)]
struct Seen {
    in_flight: AtomicUsize,
    most_in_flight: AtomicUsize,
    /// Aggregates with a delivery in flight now.
    aggregates: Mutex<HashSet<String>>,
    /// Times a delivery started while another of its aggregate was in flight.
    overlaps: AtomicUsize,
    /// Per aggregate, the payload's `n` of each delivery, in the order they started.
    order: Mutex<HashMap<String, Vec<u64>>>,
}

/// A one-event handler that writes its effect through the shared connection (every fifth
/// event through the connection alone, which must wait for the others), stays in flight a
/// little, and fails, to be retried, for the event whose `n` is `poison`.
#[derive(Clone)]
struct Piped {
    seen: Arc<Seen>,
    poison: Option<u64>,
}

impl Actor for Piped {
    type Context = Context<Self>;
}

impl Handler<Delivery> for Piped {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
        let (seen, poison) = (self.seen.clone(), self.poison);
        Box::pin(async move {
            let n = d.payload()["n"].as_u64().expect("n");
            let aggregate = d.aggregate_id().to_owned();
            let now = seen.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
            seen.most_in_flight.fetch_max(now, Ordering::Relaxed);
            if !seen.aggregates.lock().unwrap().insert(aggregate.clone()) {
                seen.overlaps.fetch_add(1, Ordering::Relaxed);
            }
            seen.order
                .lock()
                .unwrap()
                .entry(aggregate.clone())
                .or_default()
                .push(n);
            let effect = diesel::sql_query(
                "INSERT INTO effects (consumer, event_id, attempt) VALUES ($1, $2, $3)",
            )
            .bind::<Text, _>("piped")
            .bind::<SqlUuid, _>(d.event_id().as_uuid())
            .bind::<Integer, _>(d.attempt() as i32);
            let written = if n.is_multiple_of(5) {
                let mut conn = d.conn().await?;
                effect.execute(&mut *conn).await
            } else {
                let conn = d.shared_conn().await?;
                let written = effect.execute(&mut &*conn).await;
                // Still holding the shared connection: the others go on meanwhile.
                actix_rt::time::sleep(Duration::from_millis(2)).await;
                written
            };
            seen.in_flight.fetch_sub(1, Ordering::Relaxed);
            seen.aggregates.lock().unwrap().remove(&aggregate);
            written?;
            if Some(n) == poison {
                return Err(HandlerError::retry("injected failure"));
            }
            Ok(())
        })
    }
}

/// `n` events over `aggregates` aggregates (event `i` to aggregate `i % aggregates`), with
/// `n` in the payload, enqueued 100 per transaction before the runtime starts.
async fn backlog(db: &TestDb, n: u64, aggregates: u64) {
    let mut conn = db.pool.get().await.unwrap();
    let events: Vec<NewEvent> = (0..n)
        .map(|i| {
            let aggregate = format!("agg-{}", i % aggregates);
            NewEvent::new(
                "ORDER_STATUS_CHANGED",
                "order",
                &aggregate,
                serde_json::json!({ "n": i }),
            )
        })
        .collect();
    for chunk in events.chunks(100) {
        conn.transaction::<_, actix_outbox::Error, _>(async |c| {
            actix_outbox::enqueue_many(c, chunk).await?;
            Ok(())
        })
        .await
        .unwrap();
    }
}

/// Starts `piped` (pipeline `pipeline`, failing on event `poison`), reading through cursors
/// (storage v2) if `cursor`.
async fn start_piped_on(
    db: &TestDb,
    pipeline: u32,
    poison: Option<u64>,
    cursor: bool,
) -> (OutboxRuntime, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let handler = Piped {
        seen: seen.clone(),
        poison,
    };
    let cfg = consumer("piped", 2)
        .batch_size(100)
        .pipeline(pipeline)
        .cursor(cursor);
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer(cfg, move || handler.clone())
        .start()
        .await
        .expect("start runtime");
    (rt, seen)
}

#[actix_rt::test]
async fn a_pipelined_consumer_takes_many_deliveries_at_once_and_writes_each_effect_once() {
    pipelined_consumer(false).await;
}

/// The same on cursors (storage v2): each aggregate's events sit in one slot in stamp order.
/// Processed means an effect, and no event may need an inbox row.
#[actix_rt::test]
async fn a_pipelined_cursor_consumer_takes_many_deliveries_at_once_and_writes_each_effect_once() {
    pipelined_consumer(true).await;
}

async fn pipelined_consumer(cursor: bool) {
    let db = TestDb::new().await;
    backlog(&db, 600, 12).await;
    let (rt, seen) = start_piped_on(&db, 32, None, cursor).await;

    let done = match cursor {
        false => {
            "SELECT count(*) AS n FROM actix_outbox.inbox_events \
             WHERE status = 'PROCESSED' AND attempt_count = 1"
        }
        true => "SELECT count(DISTINCT event_id) AS n FROM effects",
    };
    assert_eq!(db.wait_for(done, 600, WAIT).await, 600);
    if cursor {
        assert!(read_through_cursors(&db, "piped").await);
        let rows = "SELECT count(*) AS n FROM actix_outbox.inbox_events";
        assert_eq!(db.count(rows).await, 0, "an event needed an inbox row");
    }
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 600);
    assert_eq!(db.count(MAX_EFFECTS_PER_EVENT).await, 1);
    // Handed over together: more than one in flight, never more than the pipeline.
    let most = AtomicUsize::load(&seen.most_in_flight, Ordering::Relaxed);
    assert!((2..=32).contains(&most), "at most {most} in flight");
    // One aggregate's deliveries one at a time, in the order they were enqueued.
    assert_eq!(AtomicUsize::load(&seen.overlaps, Ordering::Relaxed), 0);
    let order = seen.order.lock().unwrap().clone();
    assert_eq!(order.len(), 12);
    for (aggregate, ns) in order {
        assert!(ns.windows(2).all(|w| w[0] < w[1]), "{aggregate}: {ns:?}");
    }
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn a_failure_among_pipelined_deliveries_is_charged_to_its_own_event() {
    pipelined_failure(false).await;
}

/// The same on cursors (storage v2): only the failing event gets an inbox row, where it
/// spends its attempts; the others are processed past the cursor.
#[actix_rt::test]
async fn a_failure_among_pipelined_cursor_deliveries_is_charged_to_its_own_event() {
    pipelined_failure(true).await;
}

async fn pipelined_failure(cursor: bool) {
    let db = TestDb::new().await;
    backlog(&db, 300, 300).await;
    let (rt, _) = start_piped_on(&db, 64, Some(137), cursor).await;

    // Its batch is handed over again one delivery at a time: the others commit their effect
    // on their first counted attempt, and only the failing event spends attempts.
    let healthy = match cursor {
        false => {
            "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED' \
             AND attempt_count = 1"
        }
        true => "SELECT count(DISTINCT event_id) AS n FROM effects",
    };
    assert_eq!(db.wait_for(healthy, 299, WAIT).await, 299);
    if cursor {
        assert!(read_through_cursors(&db, "piped").await);
        let others = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                      WHERE aggregate_id <> 'agg-137'";
        assert_eq!(db.count(others).await, 0, "another event got an inbox row");
    }
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'DEAD_LETTER' \
                AND aggregate_id = 'agg-137' AND attempt_count = 2 \
                AND last_error LIKE '%injected failure%'";
    assert_eq!(db.wait_for(dead, 1, WAIT).await, 1);
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 299);
    assert_eq!(db.count(MAX_EFFECTS_PER_EVENT).await, 1);
    db.finish(&[&rt]).await;
}
