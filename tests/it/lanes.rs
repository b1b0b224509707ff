//! Priority lanes (`ConsumerConfig::subscribe_high`, the migration `lanes`): under a LOW
//! backlog a cursor consumer reads its HIGH events first, and LOW keeps one claim in five.
use crate::common;

use std::time::{Duration, Instant};

use actix_outbox::{NewEvent, OutboxRuntime};
use common::*;

const HIGH_TYPE: &str = "PAYMENT_CAPTURED";

fn payment(id: &str) -> NewEvent {
    NewEvent::new(
        HIGH_TYPE,
        "payment",
        id,
        serde_json::json!({"payment_id": id}),
    )
}

/// Effects of `event_type` applied by `lanes` before the last effect of a HIGH event, in the
/// order they were written (`effects.id`; one batch at a time).
fn before_last_high(event_type: &str) -> String {
    format!(
        "SELECT count(*) AS n FROM effects e JOIN actix_outbox.outbox_events o ON o.id = e.event_id \
         WHERE e.consumer = 'lanes' AND o.event_type = '{event_type}' \
           AND e.id < (SELECT max(h.id) FROM effects h \
                       JOIN actix_outbox.outbox_events p ON p.id = h.event_id \
                       WHERE h.consumer = 'lanes' AND p.event_type = '{HIGH_TYPE}')"
    )
}

/// A backlog of 100,000 LOW events waits past the cursor, stamped before 2,000 HIGH events.
/// Once the consumer is resumed, the HIGH events are all applied while all but a few hundred
/// LOW events still wait (without lanes, stamp order would put all 100,000 first), and yet
/// LOW is not starved: about one claim in five (here of 100 events) went to it meanwhile.
/// Then, across a restart, every event of both lanes is applied exactly once.
#[actix_rt::test]
async fn a_high_event_overtakes_a_low_backlog_and_low_keeps_its_share() {
    const LOW: i64 = 100_000;
    const HIGH: i64 = 2_000;
    let db = TestDb::new().await;
    let cfg = consumer("lanes", 3)
        .subscribe_high(HIGH_TYPE)
        .cursor(true)
        .batch_size(100);
    let rt = start(&db, vec![(cfg, Behaviour::default())]).await;
    pause(&db, "lanes").await;
    let stamped = |part: &str| {
        format!(
            "SELECT coalesce(sum(cardinality(events)), 0)::int8 AS n \
             FROM actix_outbox.log_stamps WHERE {part}"
        )
    };
    for chunk in 0..LOW / 5_000 {
        let events: Vec<NewEvent> = (0..5_000)
            .map(|i| order(&format!("o-{chunk}-{i}")))
            .collect();
        enqueue_events(&db, &events).await;
        rt.handle().wake();
    }
    assert_eq!(db.wait_for(&stamped("part < 8"), LOW, WAIT).await, LOW);
    let events: Vec<NewEvent> = (0..HIGH).map(|i| payment(&format!("p-{i}"))).collect();
    enqueue_events(&db, &events).await;
    rt.handle().wake();
    assert_eq!(
        db.wait_for(&stamped("part >= 8"), HIGH, WAIT).await,
        HIGH,
        "HIGH events were not stamped in the HIGH lane's slots"
    );
    assert_eq!(db.count(&stamped("part < 8")).await, LOW);

    let resumed = Instant::now();
    resume(&db, "lanes").await;
    rt.handle().wake();
    let high_done = format!(
        "SELECT count(*) AS n FROM effects e JOIN actix_outbox.outbox_events o ON o.id = e.event_id \
         WHERE e.consumer = 'lanes' AND o.event_type = '{HIGH_TYPE}'"
    );
    assert_eq!(db.wait_for(&high_done, HIGH, WAIT).await, HIGH);
    let high_after = resumed.elapsed();
    // 2,000 HIGH events take at least 20 claims of up to 100; LOW's turns among them (one in
    // five) give it about 5 claims of 100.
    let low_before = db.count(&before_last_high("ORDER_STATUS_CHANGED")).await;
    assert!(
        low_before >= 300,
        "LOW was starved: {low_before} LOW events applied before the last HIGH one"
    );
    assert!(
        low_before <= 1_500,
        "HIGH did not go first: {low_before} LOW events applied before the last HIGH one"
    );

    // The rest of the backlog, in larger batches: a restart goes on from the cursors.
    rt.shutdown().await;
    let cfg = consumer("lanes", 3)
        .subscribe_high(HIGH_TYPE)
        .cursor(true)
        .batch_size(1_000)
        .concurrency(2);
    let rt = start(&db, vec![(cfg, Behaviour::default())]).await;
    rt.handle().wake();
    let all = "SELECT count(DISTINCT event_id) AS n FROM effects WHERE consumer = 'lanes'";
    let total = LOW + HIGH;
    assert_eq!(
        db.wait_for(all, total, Duration::from_secs(300)).await,
        total
    );
    let all_after = resumed.elapsed();
    let effects = "SELECT count(*) AS n FROM effects WHERE consumer = 'lanes'";
    assert_eq!(
        db.count(effects).await,
        total,
        "an effect was applied twice"
    );
    // The shutdown gave the events of its unfinished batch back as inbox rows; none failed.
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                WHERE consumer = 'lanes' AND status = 'DEAD_LETTER'";
    assert_eq!(db.count(dead).await, 0, "events were dead-lettered");
    // A figure, not an assertion: how long the HIGH events waited behind the backlog.
    eprintln!(
        "lanes: {HIGH} HIGH events applied {high_after:?} after the resume, with {low_before} \
         LOW events; all {total} after {all_after:?}"
    );
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// Lanes are read through a cursor: `subscribe_high` on an inbox consumer is refused before
/// anything is written.
#[actix_rt::test]
async fn subscribe_high_without_a_cursor_is_refused() {
    let db = TestDb::new().await;
    let started = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer(consumer("high_box", 3).subscribe_high(HIGH_TYPE), || {
            Recorder {
                name: "high_box".into(),
                behaviour: Behaviour::default(),
            }
        })
        .start()
        .await;
    let err = started
        .err()
        .expect("subscribe_high without a cursor must be refused");
    assert_eq!(err.code().to_string(), "CONFIG_INVALID");
    let subs = "SELECT count(*) AS n FROM actix_outbox.consumer_subscriptions \
                WHERE consumer = 'high_box'";
    assert_eq!(
        db.count(subs).await,
        0,
        "the refused start wrote subscriptions"
    );
    db.finish(&[]).await;
}
