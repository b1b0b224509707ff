//! Priority lanes (`ConsumerConfig::subscribe_high`, the migration `lanes`): under a LOW
//! backlog a cursor consumer reads its HIGH events first, and LOW keeps one claim in five.
use crate::common;

use std::time::{Duration, Instant};

use actix_outbox::{ConsumerConfig, NewEvent, OutboxRuntime};
use common::*;
use diesel_async::SimpleAsyncConnection;

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

/// Entries of `event_type` in the stamps of the slots `part` selects.
fn stamped_of(event_type: &str, part: &str) -> String {
    format!(
        "SELECT count(*) AS n FROM actix_outbox.log_stamps s \
         CROSS JOIN LATERAL unnest(s.events) AS e(id) \
         JOIN actix_outbox.outbox_events o ON o.id = e.id \
         WHERE o.event_type = '{event_type}' AND {part}"
    )
}

/// An event is HIGH only when every cursor consumer of its type asks: once a consumer that
/// reads the type LOW is registered, the type's new events are stamped in the LOW lane, so
/// that consumer never finds an aggregate's events in two slots. The start that overrules a
/// HIGH subscription records a contract finding naming the LOW reader. Each event is applied
/// once by each consumer.
#[actix_rt::test]
async fn a_type_is_high_only_when_every_cursor_consumer_of_it_asks() {
    let db = TestDb::new().await;
    let fast = || consumer("fast", 3).subscribe_high(HIGH_TYPE).cursor(true);
    let rt = start(&db, vec![(fast(), Behaviour::default())]).await;
    let first: Vec<NewEvent> = (0..10).map(|i| payment(&format!("a-{i}"))).collect();
    enqueue_events(&db, &first).await;
    rt.handle().wake();
    assert_eq!(
        db.wait_for(&stamped_of(HIGH_TYPE, "s.part >= 8"), 10, WAIT)
            .await,
        10,
        "with one consumer asking, the type is HIGH"
    );
    rt.shutdown().await;

    let audit = consumer("audit", 3).subscribe(HIGH_TYPE).cursor(true);
    let rt = start(
        &db,
        vec![
            (fast(), Behaviour::default()),
            (audit, Behaviour::default()),
        ],
    )
    .await;
    let second: Vec<NewEvent> = (0..10).map(|i| payment(&format!("b-{i}"))).collect();
    enqueue_events(&db, &second).await;
    rt.handle().wake();
    assert_eq!(
        db.wait_for(&stamped_of(HIGH_TYPE, "s.part < 8"), 10, WAIT)
            .await,
        10,
        "a consumer reading the type LOW did not keep it LOW"
    );
    assert_eq!(db.count(&stamped_of(HIGH_TYPE, "s.part >= 8")).await, 10);
    let finding = "SELECT count(*) AS n FROM actix_outbox.contract_findings \
                   WHERE code = 'HIGH_LANE_OVERRULED' AND consumer = 'fast' \
                     AND event_type = 'PAYMENT_CAPTURED' AND detail = 'audit'";
    assert_eq!(
        db.count(finding).await,
        1,
        "no finding names the LOW reader"
    );

    // `fast` applies all 20, `audit` the 10 published since it subscribed; each once.
    let applied = |c: &str| {
        format!("SELECT count(DISTINCT event_id) AS n FROM effects WHERE consumer = '{c}'")
    };
    assert_eq!(db.wait_for(&applied("fast"), 20, WAIT).await, 20);
    assert_eq!(db.wait_for(&applied("audit"), 10, WAIT).await, 10);
    let effects = "SELECT count(*) AS n FROM effects";
    assert_eq!(db.count(effects).await, 30, "an effect was applied twice");
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// A consumer with no HIGH type reads both lanes in stamp order: another consumer's HIGH
/// burst, stamped after this consumer's backlog, is walked only once the backlog is read.
/// A probe on the effects table records, as each of `plain`'s effects is written, how many
/// HIGH entries `plain`'s cursors had passed by then; reading the HIGH lane first, they had
/// passed hundreds of entries none of which were its own.
#[actix_rt::test]
async fn a_consumer_with_no_high_type_reads_both_lanes_in_stamp_order() {
    const LOW: i64 = 200;
    const HIGH: i64 = 2_000;
    let db = TestDb::new().await;
    let vip = ConsumerConfig::new("vip")
        .subscribe_high(HIGH_TYPE)
        .cursor(true)
        .poll_interval(Duration::from_millis(100));
    let plain = consumer("plain", 3).cursor(true).batch_size(10);
    let rt = start(
        &db,
        vec![(vip, Behaviour::default()), (plain, Behaviour::default())],
    )
    .await;
    pause(&db, "plain").await;
    let events: Vec<NewEvent> = (0..LOW).map(|i| order(&format!("o-{i}"))).collect();
    enqueue_events(&db, &events).await;
    rt.handle().wake();
    let low = stamped_of("ORDER_STATUS_CHANGED", "s.part < 8");
    assert_eq!(db.wait_for(&low, LOW, WAIT).await, LOW);
    let events: Vec<NewEvent> = (0..HIGH).map(|i| payment(&format!("p-{i}"))).collect();
    enqueue_events(&db, &events).await;
    rt.handle().wake();
    let high = stamped_of(HIGH_TYPE, "s.part >= 8");
    assert_eq!(db.wait_for(&high, HIGH, WAIT).await, HIGH);

    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(
        "CREATE TABLE probe (passed int8 NOT NULL); \
         CREATE FUNCTION probe_passed() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN \
             INSERT INTO probe SELECT coalesce(sum(CASE WHEN s.stamp < k.stamp \
                     THEN cardinality(s.events) ELSE least(k.idx, cardinality(s.events)) END), 0) \
             FROM actix_outbox.consumer_cursors k \
             JOIN actix_outbox.log_stamps s ON s.part = k.part AND s.stamp <= k.stamp \
             WHERE k.consumer = 'plain' AND k.part >= 8; \
             RETURN NULL; \
         END $$; \
         CREATE TRIGGER probe AFTER INSERT ON effects FOR EACH ROW \
             WHEN (NEW.consumer = 'plain') EXECUTE FUNCTION probe_passed();",
    )
    .await
    .unwrap();
    drop(conn);
    resume(&db, "plain").await;
    rt.handle().wake();
    let applied = "SELECT count(DISTINCT event_id) AS n FROM effects WHERE consumer = 'plain'";
    assert_eq!(db.wait_for(applied, LOW, WAIT).await, LOW);
    let passed = db
        .count("SELECT coalesce(max(passed), 0) AS n FROM probe")
        .await;
    // One claim's fill-up may reach past the backlog's last entries (a batch of 10).
    assert!(
        passed < 10,
        "{passed} HIGH entries of another consumer were walked before this consumer's backlog"
    );
    let effects = "SELECT count(*) AS n FROM effects WHERE consumer = 'plain'";
    assert_eq!(db.count(effects).await, LOW, "an effect was applied twice");
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// The migration `lanes` cannot be reverted while a HIGH event waits past a cursor: its
/// down.sql would drop the only cursors that read it. Once the HIGH lane is read, it can.
#[actix_rt::test]
async fn lanes_are_not_reverted_over_unread_high_events() {
    const DOWN: &str = include_str!("../../migrations/2026-12-05-000026_lanes/down.sql");
    let db = TestDb::new().await;
    let vip = consumer("vip", 3).subscribe_high(HIGH_TYPE).cursor(true);
    let rt = start(&db, vec![(vip, Behaviour::default())]).await;
    pause(&db, "vip").await;
    let events: Vec<NewEvent> = (0..5).map(|i| payment(&format!("p-{i}"))).collect();
    enqueue_events(&db, &events).await;
    rt.handle().wake();
    assert_eq!(
        db.wait_for(&stamped_of(HIGH_TYPE, "s.part >= 8"), 5, WAIT)
            .await,
        5
    );
    let revert = async || {
        let mut conn = db.pool.get().await.unwrap();
        let tried = conn
            .batch_execute(&format!(
                "BEGIN; SET LOCAL search_path TO actix_outbox; {DOWN}"
            ))
            .await;
        conn.batch_execute("ROLLBACK").await.unwrap();
        tried
    };
    let refused = revert()
        .await
        .expect_err("reverted over unread HIGH events");
    assert!(
        refused
            .to_string()
            .contains("HIGH events wait past a cursor"),
        "{refused}"
    );
    resume(&db, "vip").await;
    rt.handle().wake();
    let applied = "SELECT count(*) AS n FROM effects WHERE consumer = 'vip'";
    assert_eq!(db.wait_for(applied, 5, WAIT).await, 5);
    revert().await.expect("the read lane could not be reverted");
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// Lanes apply an aggregate's events out of order across types, so `skip_stale` with both
/// lanes is refused before anything is written; with every type HIGH nothing crosses lanes.
#[actix_rt::test]
async fn skip_stale_with_both_lanes_is_refused() {
    let db = TestDb::new().await;
    let both = consumer("both", 3)
        .subscribe_high(HIGH_TYPE)
        .cursor(true)
        .skip_stale(true);
    let refused = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer(both, || Recorder {
            name: "both".into(),
            behaviour: Behaviour::default(),
        })
        .start()
        .await
        .err()
        .expect("skip_stale with both lanes must be refused");
    assert_eq!(refused.code().to_string(), "CONFIG_INVALID");
    let subs = "SELECT count(*) AS n FROM actix_outbox.consumer_subscriptions";
    assert_eq!(
        db.count(subs).await,
        0,
        "the refused start wrote subscriptions"
    );
    let high_only = ConsumerConfig::new("high_only")
        .subscribe_high(HIGH_TYPE)
        .cursor(true)
        .skip_stale(true);
    let rt = start(&db, vec![(high_only, Behaviour::default())]).await;
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// A revert that runs while a publisher stamps loses no HIGH event: the down migration locks
/// the subscriptions before its check, so a publishing claim cannot stamp between the check
/// and the drop of the HIGH lane (it fails on the dropped column once the revert commits, and
/// its events stay due). The consumer is paused so that nothing reads them in between.
#[actix_rt::test]
async fn a_revert_racing_a_publisher_loses_no_high_event() {
    const DOWN: &str = include_str!("../../migrations/2026-12-05-000026_lanes/down.sql");
    let (head, tail) = DOWN
        .split_once("DELETE FROM consumer_cursors")
        .expect("down.sql drops the HIGH cursors");
    let db = TestDb::new().await;
    let vip = consumer("vip", 3).subscribe_high(HIGH_TYPE).cursor(true);
    let rt = start(&db, vec![(vip, Behaviour::default())]).await;
    pause(&db, "vip").await;
    let mut revert = db.pool.get().await.unwrap();
    revert
        .batch_execute(&format!(
            "BEGIN; SET LOCAL search_path TO actix_outbox; {head}"
        ))
        .await
        .expect("nothing waits past a cursor yet");
    let events: Vec<NewEvent> = (0..3).map(|i| payment(&format!("p-{i}"))).collect();
    enqueue_events(&db, &events).await;
    rt.handle().wake();
    // Time for the publisher to claim them; with the check unlocked, it stamps them now.
    actix_rt::time::sleep(Duration::from_secs(1)).await;
    revert
        .batch_execute(&format!("DELETE FROM consumer_cursors {tail}; COMMIT"))
        .await
        .unwrap();
    drop(revert);
    rt.shutdown().await;
    let stranded = format!(
        "SELECT count(*) AS n FROM actix_outbox.outbox_events o \
         WHERE o.event_type = '{HIGH_TYPE}' AND o.status = 'PUBLISHED' \
           AND NOT EXISTS (SELECT FROM actix_outbox.log_stamps s WHERE o.id = ANY (s.events)) \
           AND NOT EXISTS (SELECT FROM actix_outbox.inbox_events i WHERE i.event_id = o.id)"
    );
    assert_eq!(
        db.count(&stranded).await,
        0,
        "events were published into a lane the revert dropped"
    );
    db.finish(&[]).await;
}
