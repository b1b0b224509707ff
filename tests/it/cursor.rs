//! Cursor delivery (`ConsumerConfig::cursor`, storage v2's first step): events reach a
//! cursor consumer exactly once, with no inbox row unless something went wrong, through
//! stalled producers, a stalled stamp, failures, a hung handler and a dead lease.
use crate::common;

use std::time::Duration;

use actix_outbox::{NewEvent, OutboxRuntime};
use common::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};

/// Every event applied exactly once by `name`: `total` distinct, `total` in all.
async fn assert_once(db: &TestDb, name: &str, total: i64) {
    let done =
        format!("SELECT count(DISTINCT event_id) AS n FROM effects WHERE consumer = '{name}'");
    assert_eq!(
        db.wait_for(&done, total, Duration::from_secs(60)).await,
        total,
        "{name}: events were never applied"
    );
    let all = format!("SELECT count(*) AS n FROM effects WHERE consumer = '{name}'");
    assert_eq!(
        db.count(&all).await,
        total,
        "{name}: an effect was applied twice"
    );
}

fn inbox_rows(name: &str) -> String {
    format!("SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = '{name}'")
}

/// The happy path writes no inbox row: a cursor consumer beside an inbox consumer of the
/// same events gets every one exactly once, and only the inbox consumer has rows.
#[actix_rt::test]
async fn a_cursor_consumer_gets_every_event_once_and_no_inbox_row() {
    let db = TestDb::new().await;
    let consumers = vec![
        (consumer("cur", 3).cursor(true), Behaviour::default()),
        (consumer("box", 3), Behaviour::default()),
    ];
    let rt = start(&db, consumers).await;
    for chunk in 0..10 {
        let events: Vec<NewEvent> = (0..50).map(|i| order(&format!("o-{chunk}-{i}"))).collect();
        enqueue_events(&db, &events).await;
        rt.handle().wake();
    }
    assert_once(&db, "cur", 500).await;
    assert_once(&db, "box", 500).await;
    assert_eq!(
        db.count(&inbox_rows("cur")).await,
        0,
        "the happy path wrote inbox rows"
    );
    assert_eq!(db.count(&inbox_rows("box")).await, 500);
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// A batch reads every slot with new entries, not one: events of 16 aggregates, spread over
/// several slots, are applied by one batch (one transaction: their effects share an `xmin`),
/// so a trickle of events over many aggregates waits for one batch, not one per slot.
#[actix_rt::test]
async fn one_batch_reads_every_slot_with_new_entries() {
    let db = TestDb::new().await;
    let rt = start(
        &db,
        vec![(consumer("wide_cur", 3).cursor(true), Behaviour::default())],
    )
    .await;
    pause(&db, "wide_cur").await;
    let events: Vec<NewEvent> = (0..16).map(|i| order(&format!("o-wide-{i}"))).collect();
    stamp(&db, &rt, &events, 16).await;
    let slots = "SELECT count(DISTINCT part) AS n FROM actix_outbox.log_stamps";
    assert!(db.count(slots).await > 1, "the events share one slot");
    resume(&db, "wide_cur").await;
    rt.handle().wake();
    assert_once(&db, "wide_cur", 16).await;
    let batches = "SELECT count(DISTINCT xmin::text) AS n FROM effects WHERE consumer = 'wide_cur'";
    assert_eq!(
        db.count(batches).await,
        1,
        "the slots were read one batch each"
    );
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// The fill-up skips a slot another claim holds, whole: it neither waits for the lock nor
/// moves that slot's cursor. With the cursor row of one slot locked (as a concurrent claim
/// locks it), the events of the other slots are applied and the held slot's are not; once
/// the lock goes they are applied too, every event exactly once.
#[actix_rt::test]
async fn the_fill_up_skips_a_slot_another_claim_holds_and_reads_it_later() {
    let db = TestDb::new().await;
    let rt = start(
        &db,
        vec![(consumer("held_cur", 3).cursor(true), Behaviour::default())],
    )
    .await;
    pause(&db, "held_cur").await;
    let events: Vec<NewEvent> = (0..16).map(|i| order(&format!("o-held-{i}"))).collect();
    stamp(&db, &rt, &events, 16).await;
    // The last slot with entries: a claim starts from the first, so it reaches this one only
    // by filling up.
    let last = "(SELECT max(part) FROM actix_outbox.log_stamps)";
    let slots = "SELECT count(DISTINCT part) AS n FROM actix_outbox.log_stamps";
    assert!(db.count(slots).await > 1, "the events share one slot");
    let held = db
        .count(&format!(
            "SELECT sum(cardinality(events))::int8 AS n FROM actix_outbox.log_stamps \
             WHERE part = {last}"
        ))
        .await;
    let mut holder = AsyncPgConnection::establish(&db.url).await.unwrap();
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT FROM actix_outbox.consumer_cursors \
             WHERE consumer = 'held_cur' AND part = {last} FOR UPDATE"
        ))
        .await
        .unwrap();
    resume(&db, "held_cur").await;
    rt.handle().wake();
    let applied = "SELECT count(DISTINCT event_id) AS n FROM effects WHERE consumer = 'held_cur'";
    assert_eq!(db.wait_for(applied, 16 - held, WAIT).await, 16 - held);
    // A few more polls: the held slot's events still wait, its cursor unmoved.
    actix_rt::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(db.count(applied).await, 16 - held, "a held slot was read");
    let unmoved = format!(
        "SELECT count(*) AS n FROM actix_outbox.consumer_cursors \
         WHERE consumer = 'held_cur' AND part = {last} AND token IS NULL \
           AND stamp < (SELECT min(stamp) FROM actix_outbox.log_stamps WHERE part = {last})"
    );
    assert_eq!(db.count(&unmoved).await, 1, "the held slot's cursor moved");
    holder.batch_execute("COMMIT").await.unwrap();
    rt.handle().wake();
    assert_once(&db, "held_cur", 16).await;
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// The invariant: a stamp's number comes from `log_head`, whose lock its transaction holds to
/// its commit. A stamping transaction held open for a second (here the test's own, publishing
/// events of its own) holds every later stamp back, and no cursor passes it: with 16
/// producers, half of them stalled mid-commit, every event reaches the cursor consumer and
/// the inbox consumer exactly once.
#[actix_rt::test]
async fn no_cursor_passes_a_stamp_that_commits_late() {
    const PRODUCERS: usize = 16;
    const EACH: usize = 30;
    const STAMPED_BY_HAND: usize = 20;
    let db = TestDb::new().await;
    let config = fast_runtime().publish_batch_size(10);
    let consumers = vec![
        (consumer("gap_cur", 3).cursor(true), Behaviour::default()),
        (consumer("gap_box", 3), Behaviour::default()),
    ];
    let rt = start_with(db.pool.clone(), config, consumers).await;
    let handle = rt.handle();
    let stamper = {
        let url = db.url.clone();
        async move {
            let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
            actix_rt::time::sleep(Duration::from_millis(200)).await;
            // A publisher's claim, by hand: events published and stamped in one transaction,
            // which stalls a second before its commit.
            let mut sql = String::from(
                "BEGIN; \
                 CREATE TEMP TABLE mine ON COMMIT DROP AS \
                 SELECT gen_random_uuid() AS id, g AS n FROM generate_series(1, ",
            );
            sql.push_str(&format!(
                "{STAMPED_BY_HAND}) g; \
                 INSERT INTO actix_outbox.outbox_events (id, event_type, aggregate_type, \
                     aggregate_id, payload, correlation_id, status, published_at) \
                 SELECT id, 'ORDER_STATUS_CHANGED', 'order', 'hand-' || n, '{{}}', 'hand', \
                     'PUBLISHED', now() FROM mine; \
                 INSERT INTO actix_outbox.inbox_events (event_id, consumer, event_type, \
                     event_version, aggregate_type, aggregate_id, payload, correlation_id, \
                     event_created_at) \
                 SELECT id, 'gap_box', 'ORDER_STATUS_CHANGED', 1, 'order', 'hand-' || n, '{{}}', \
                     'hand', now() FROM mine; \
                 UPDATE actix_outbox.log_head SET last = last + 1; \
                 INSERT INTO actix_outbox.log_stamps (part, stamp, events) \
                 SELECT 0, (SELECT last FROM actix_outbox.log_head), array_agg(id ORDER BY n) \
                 FROM mine;"
            ));
            conn.batch_execute(&sql).await.unwrap();
            actix_rt::time::sleep(Duration::from_secs(1)).await;
            conn.batch_execute("COMMIT").await.unwrap();
        }
    };
    let producers = stalled_producers(&db.url, &handle, PRODUCERS, EACH);
    within(WAIT, futures_util::future::join(stamper, producers)).await;
    handle.wake();
    let total = (PRODUCERS * EACH + STAMPED_BY_HAND) as i64;
    assert_once(&db, "gap_cur", total).await;
    assert_once(&db, "gap_box", total).await;
    assert_eq!(db.count(&inbox_rows("gap_cur")).await, 0);
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// A failure is an exception: the event gets an inbox row in the batch's commit and is
/// retried from the inbox; every event is applied once, and only the failed ones have rows.
#[actix_rt::test]
async fn failed_events_get_inbox_rows_and_are_retried_from_there() {
    let db = TestDb::new().await;
    let poisoned = Behaviour {
        poison_aggregate: Some("o-7".into()),
        ..Behaviour::default()
    };
    let consumers = vec![
        (
            consumer("fail_cur", 5).cursor(true),
            Behaviour {
                fail_attempts: 1,
                ..Behaviour::default()
            },
        ),
        (consumer("poison_cur", 2).cursor(true), poisoned),
    ];
    let rt = start(&db, consumers).await;
    let events: Vec<NewEvent> = (0..40).map(|i| order(&format!("o-{i}"))).collect();
    enqueue_events(&db, &events).await;
    rt.handle().wake();
    assert_once(&db, "fail_cur", 40).await;
    let processed = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                     WHERE consumer = 'fail_cur' AND status = 'PROCESSED' AND attempt_count = 2";
    assert_eq!(db.wait_for(processed, 40, WAIT).await, 40);
    // The poison event is dead-lettered after its two attempts, and the others went on.
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                WHERE consumer = 'poison_cur' AND status = 'DEAD_LETTER' AND aggregate_id = 'o-7'";
    assert_eq!(db.wait_for(dead, 1, WAIT).await, 1);
    let others = "SELECT count(DISTINCT event_id) AS n FROM effects e \
                  WHERE consumer = 'poison_cur' AND NOT EXISTS (SELECT FROM actix_outbox.outbox_events o \
                      WHERE o.id = e.event_id AND o.aggregate_id = 'o-7')";
    assert_eq!(db.wait_for(others, 39, WAIT).await, 39);
    let twice = "SELECT count(*) AS n FROM (SELECT event_id FROM effects e \
                 WHERE consumer = 'poison_cur' AND NOT EXISTS (SELECT FROM actix_outbox.outbox_events o \
                     WHERE o.id = e.event_id AND o.aggregate_id = 'o-7') \
                 GROUP BY event_id HAVING count(*) > 1) t";
    assert_eq!(db.count(twice).await, 0, "an effect was applied twice");
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// A failure costs an inbox row for the failed event only: the batch's processed events pass
/// with the cursor in the same commit, as on the happy path. One poison event among 40 in
/// one batch: it alone has a row (dead-lettered), and the other 39 are applied once each.
#[actix_rt::test]
async fn a_failure_in_a_cursor_batch_gives_only_the_failed_event_an_inbox_row() {
    let db = TestDb::new().await;
    let poisoned = Behaviour {
        poison_aggregate: Some("o-7".into()),
        ..Behaviour::default()
    };
    let cfg = consumer("one_row_cur", 2).cursor(true).batch_size(100);
    let rt = start(&db, vec![(cfg, poisoned)]).await;
    // o-0, o-2, o-7 and o-8 share a slot (by a hash of the aggregate, checked below): the 40
    // events are one stamp row, read by one batch.
    let events: Vec<NewEvent> = (0..40)
        .map(|i| {
            let agg = if i == 7 {
                "o-7"
            } else {
                ["o-0", "o-2", "o-8"][i % 3]
            };
            NewEvent::new(
                "ORDER_STATUS_CHANGED",
                "order",
                agg,
                serde_json::json!({ "i": i }),
            )
        })
        .collect();
    enqueue_events(&db, &events).await;
    rt.handle().wake();
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                WHERE consumer = 'one_row_cur' AND status = 'DEAD_LETTER'";
    assert_eq!(db.wait_for(dead, 1, WAIT).await, 1);
    let slots = "SELECT count(DISTINCT part) AS n FROM actix_outbox.log_stamps";
    assert_eq!(
        db.count(slots).await,
        1,
        "the events were spread over slots"
    );
    let others = "SELECT count(DISTINCT event_id) AS n FROM effects WHERE consumer = 'one_row_cur'";
    assert_eq!(db.wait_for(others, 39, WAIT).await, 39);
    let all = "SELECT count(*) AS n FROM effects WHERE consumer = 'one_row_cur'";
    assert_eq!(db.count(all).await, 39, "an effect was applied twice");
    assert_eq!(
        db.count(&inbox_rows("one_row_cur")).await,
        1,
        "processed events of the failed event's batch got inbox rows"
    );
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// A handler that hangs past its timeout in a cursor batch: the batch's events get inbox rows,
/// the hung one is charged once its handler lets go, and every event is applied exactly once.
#[actix_rt::test]
async fn a_hung_handler_in_a_cursor_batch_costs_its_own_event_only() {
    let db = TestDb::new().await;
    let hang = Behaviour {
        poison_aggregate: Some("o-3".into()),
        poison: Poison::Hang,
        ..Behaviour::default()
    };
    let cfg = consumer("hang_cur", 5)
        .cursor(true)
        .handler_timeout(Duration::from_millis(300));
    let rt = start(&db, vec![(cfg, hang)]).await;
    let events: Vec<NewEvent> = (0..20).map(|i| order(&format!("o-{i}"))).collect();
    enqueue_events(&db, &events).await;
    rt.handle().wake();
    let others = "SELECT count(DISTINCT event_id) AS n FROM effects e \
                  WHERE consumer = 'hang_cur' AND NOT EXISTS (SELECT FROM actix_outbox.outbox_events o \
                      WHERE o.id = e.event_id AND o.aggregate_id = 'o-3')";
    assert_eq!(db.wait_for(others, 19, WAIT).await, 19);
    let all = "SELECT count(*) AS n FROM (SELECT event_id FROM effects \
               WHERE consumer = 'hang_cur' GROUP BY event_id HAVING count(*) > 1) t";
    assert_eq!(db.count(all).await, 0, "an effect was applied twice");
    let charged = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                   WHERE consumer = 'hang_cur' AND aggregate_id = 'o-3' AND attempt_count >= 1";
    assert_eq!(
        db.wait_for(charged, 1, WAIT).await,
        1,
        "the hung event was not charged"
    );
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// A cursor lease whose process died (its database session is gone): the reaper gives its
/// events inbox rows and judges them as any dead lease's: several rows, so none is charged and
/// each is handled alone, once.
#[actix_rt::test]
async fn a_dead_cursor_lease_is_promoted_and_judged_by_the_reaper() {
    let db = TestDb::new().await;
    let cfg = consumer("dead_cur", 3).cursor(true);
    let rt = start(&db, vec![(cfg, Behaviour::default())]).await;
    pause(&db, "dead_cur").await;
    let events: Vec<NewEvent> = (0..5).map(|i| order(&format!("o-{i}"))).collect();
    stamp(&db, &rt, &events, 5).await;
    {
        // A process leases the cursor's events, as a claim does, and dies.
        let mut dying = AsyncPgConnection::establish(&db.url).await.unwrap();
        dying
            .batch_execute(
                "BEGIN; \
                 INSERT INTO actix_outbox.inbox_leases (token, consumer, locked_by, backend, \
                     locked_until, ids, events) \
                 SELECT 4242, 'dead_cur', 'dead-process', pg_backend_pid(), now() + interval '1 hour', \
                     '{}', (SELECT array_agg(u ORDER BY o) FROM actix_outbox.log_stamps s, \
                            unnest(s.events) WITH ORDINALITY AS x(u, o)); \
                 UPDATE actix_outbox.consumer_cursors SET token = 4242, \
                     upto_stamp = (SELECT max(stamp) FROM actix_outbox.log_stamps), \
                     upto_idx = 9223372036854775807 WHERE consumer = 'dead_cur'; \
                 COMMIT;",
            )
            .await
            .unwrap();
    }
    resume(&db, "dead_cur").await;
    rt.handle().wake();
    assert_once(&db, "dead_cur", 5).await;
    let suspects = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                    WHERE consumer = 'dead_cur' AND status = 'PROCESSED' AND alone \
                      AND attempt_count = 1";
    assert_eq!(
        db.wait_for(suspects, 5, WAIT).await,
        5,
        "not judged as a death of several"
    );
    let cursor = "SELECT count(*) AS n FROM actix_outbox.consumer_cursors \
                  WHERE consumer = 'dead_cur' AND token IS NULL";
    assert_eq!(
        db.count(cursor).await,
        16,
        "a slot's cursor is still leased"
    );
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// Turning a cursor off again (the migration `cursor_off`). A backlog of 30 events waits past
/// the cursors when the consumer restarts with `cursor(false)`; a transaction open at that
/// start then stamps one more event for the cursors and commits late, as a publisher's claim
/// that began before the switch would. Every event is applied exactly once: the backlog and
/// the late one through the cursors, the events published after the switch through inbox
/// rows. The cursors are kept while that transaction is open, dropped once it has ended,
/// and `ordered` is refused while they remain.
#[actix_rt::test]
async fn turning_a_cursor_off_delivers_every_event_once_and_drops_the_cursors() {
    let db = TestDb::new().await;
    let rt = start(
        &db,
        vec![(consumer("off_cur", 3).cursor(true), Behaviour::default())],
    )
    .await;
    pause(&db, "off_cur").await;
    stamp(
        &db,
        &rt,
        &(0..30)
            .map(|i| order(&format!("b-{i}")))
            .collect::<Vec<_>>(),
        30,
    )
    .await;
    rt.shutdown().await;

    // Open before the switch; it stamps for the cursors only after it.
    let mut late = AsyncPgConnection::establish(&db.url).await.unwrap();
    late.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let rt = start(&db, vec![(consumer("off_cur", 3), Behaviour::default())]).await;
    let flags = "SELECT count(*) AS n FROM actix_outbox.consumer_subscriptions \
                 WHERE consumer = 'off_cur' AND cursor";
    assert_eq!(
        db.count(flags).await,
        0,
        "the subscription still reads a cursor"
    );
    actix_outbox::enqueue(&late, &order("late")).await.unwrap();
    late.batch_execute(
        "UPDATE actix_outbox.outbox_events SET status = 'PUBLISHED', published_at = now() \
             WHERE aggregate_id = 'late'; \
         WITH head AS (UPDATE actix_outbox.log_head SET last = last + 1 RETURNING last) \
         INSERT INTO actix_outbox.log_stamps (part, stamp, events) \
         SELECT abs(hashtext(o.aggregate_type || chr(31) || o.aggregate_id) % 8), head.last, \
                ARRAY[o.id] \
         FROM actix_outbox.outbox_events o, head WHERE o.aggregate_id = 'late'",
    )
    .await
    .unwrap();
    resume(&db, "off_cur").await;
    let after: Vec<NewEvent> = (0..20).map(|i| order(&format!("a-{i}"))).collect();
    enqueue_events(&db, &after).await;
    rt.handle().wake();
    let applied = "SELECT count(DISTINCT event_id) AS n FROM effects WHERE consumer = 'off_cur'";
    assert_eq!(db.wait_for(applied, 50, WAIT).await, 50);
    assert_eq!(
        db.count(&inbox_rows("off_cur")).await,
        20,
        "the new events' rows"
    );
    let cursors =
        "SELECT count(*) AS n FROM actix_outbox.consumer_cursors WHERE consumer = 'off_cur'";
    // Several of its loops have found nothing left meanwhile (100 ms polls).
    actix_rt::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        db.count(cursors).await,
        16,
        "dropped while a transaction open at the switch ran"
    );
    let ordered = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer(consumer("off_cur", 3).ordered(true), || Recorder {
            name: "off_cur".into(),
            behaviour: Behaviour::default(),
        })
        .start()
        .await
        .err()
        .expect("ordered with cursors left must be refused");
    assert_eq!(ordered.code().to_string(), "CONFIG_INVALID");

    late.batch_execute("COMMIT").await.unwrap();
    rt.handle().wake();
    assert_eq!(
        db.wait_for(applied, 51, WAIT).await,
        51,
        "the late stamp was lost"
    );
    assert_eq!(
        db.wait_for(cursors, 0, WAIT).await,
        0,
        "the cursors were never dropped"
    );
    let more: Vec<NewEvent> = (0..5).map(|i| order(&format!("c-{i}"))).collect();
    enqueue_events(&db, &more).await;
    rt.handle().wake();
    assert_once(&db, "off_cur", 56).await;
    assert_eq!(db.count(&inbox_rows("off_cur")).await, 25);
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// The fence on a batch's promotion. A cursor batch runs out of lease time (its last events
/// are given back unhandled), and meanwhile its lease is judged dead and promoted (as the
/// reaper does, here by hand): the batch's own promotion must then fail and roll its effects
/// back, or they would commit beside the reaper's inbox rows, each handled again as a suspect.
#[actix_rt::test]
async fn a_batch_whose_lease_the_reaper_promoted_commits_no_effect() {
    let db = TestDb::new().await;
    let slow = Behaviour {
        work: Duration::from_millis(500),
        ..Behaviour::default()
    };
    let cfg = consumer("fence_cur", 3)
        .cursor(true)
        .batch_size(5)
        .handler_timeout(Duration::from_secs(1))
        .lease(Duration::from_secs(3));
    let rt = start(&db, vec![(cfg, slow)]).await;
    // One aggregate: one slot, so that one batch leases all five.
    let events: Vec<NewEvent> = (0..5).map(|_| order("o-fence")).collect();
    enqueue_events(&db, &events).await;
    rt.handle().wake();
    let leased = "SELECT count(*) AS n FROM actix_outbox.inbox_leases \
                  WHERE consumer = 'fence_cur' AND cardinality(events) > 0";
    assert_eq!(db.wait_for(leased, 1, WAIT).await, 1);
    let promoted = promote_by_hand(&db, "fence_cur").await;
    assert_eq!(promoted, 5, "the lease was not there to promote");
    assert_once(&db, "fence_cur", 5).await;
    // Settled by the inbox: each a suspect, handled alone, once.
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                WHERE consumer = 'fence_cur' AND status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 5, WAIT).await, 5);
    actix_rt::time::sleep(Duration::from_millis(500)).await;
    let all = "SELECT count(*) AS n FROM effects WHERE consumer = 'fence_cur'";
    assert_eq!(db.count(all).await, 5, "an effect was applied twice");
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// Judges `consumer`'s cursor lease dead and promotes it, as the reaper does: its events get
/// inbox rows that the lease holds, expired. Returns how many rows it made.
async fn promote_by_hand(db: &TestDb, consumer: &str) -> i64 {
    let sql = format!(
        "WITH l AS (SELECT token, consumer, events FROM actix_outbox.inbox_leases \
                 WHERE consumer = '{consumer}' AND cardinality(events) > 0 FOR UPDATE), \
             ins AS (INSERT INTO actix_outbox.inbox_events (event_id, consumer, event_type, \
                 event_version, aggregate_type, aggregate_id, aggregate_version, payload, \
                 metadata, correlation_id, causation_id, event_created_at, event_seq) \
                 SELECT o.id, l.consumer, o.event_type, o.event_version, o.aggregate_type, \
                     o.aggregate_id, o.aggregate_version, o.payload, o.metadata, \
                     o.correlation_id, o.causation_id, o.created_at, o.seq \
                 FROM l CROSS JOIN unnest(l.events) AS u(id) \
                 JOIN actix_outbox.outbox_events o ON o.id = u.id RETURNING id), \
             lease AS (UPDATE actix_outbox.inbox_leases p \
                 SET ids = ARRAY(SELECT id FROM ins), events = '{{}}', \
                     held = cardinality(l.events), locked_until = now() - interval '1 hour' \
                 FROM l WHERE p.token = l.token), \
             moved AS (UPDATE actix_outbox.consumer_cursors k SET stamp = upto_stamp, \
                 idx = upto_idx, token = NULL, upto_stamp = NULL, upto_idx = NULL \
                 FROM l WHERE k.consumer = l.consumer AND k.token = l.token) \
             SELECT count(*) AS n FROM ins",
    );
    db.count(&sql).await
}

/// Retention of published outbox rows after `published`, everything else kept an hour.
fn outbox_after(published: Duration) -> actix_outbox::retention::RetentionConfig {
    actix_outbox::retention::RetentionConfig::default()
        .published_outbox_after(published)
        .processed_inbox_after(Duration::from_secs(3600))
        .idempotency_keys_after(Duration::from_secs(3600))
}

/// Told to keep a cursor's backlog in the log (`cursor_backlog_after(Duration::MAX)`),
/// retention deletes no outbox row a cursor has yet to read (a paused cursor consumer's whole
/// backlog stays, however old), and once every event is read it deletes them all, and the
/// stamps: a slot that never had an event does not hold the floor.
#[actix_rt::test]
async fn retention_keeps_what_a_cursor_has_not_read_and_no_more() {
    use actix_outbox::retention::Retention;
    let db = TestDb::new().await;
    let rt = start(
        &db,
        vec![(consumer("keep_cur", 3).cursor(true), Behaviour::default())],
    )
    .await;
    pause(&db, "keep_cur").await;
    // Three aggregates: most slots never see an event.
    let events: Vec<NewEvent> = (0..30).map(|i| order(&format!("o-{}", i % 3))).collect();
    stamp(&db, &rt, &events, 30).await;
    actix_rt::time::sleep(Duration::from_millis(50)).await;
    let now = outbox_after(Duration::from_millis(1)).cursor_backlog_after(Duration::MAX);
    let retention = Retention::new(db.pool.clone(), now).unwrap();
    retention.run_once().await.unwrap();
    let outbox = "SELECT count(*) AS n FROM actix_outbox.outbox_events";
    assert_eq!(
        db.count(outbox).await,
        30,
        "retention deleted events no cursor has read"
    );
    assert_eq!(db.count(&inbox_rows("keep_cur")).await, 0, "events moved");
    resume(&db, "keep_cur").await;
    rt.handle().wake();
    assert_once(&db, "keep_cur", 30).await;
    actix_rt::time::sleep(Duration::from_millis(50)).await;
    retention.run_once().await.unwrap();
    assert_eq!(db.count(outbox).await, 0, "read events were kept");
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.log_stamps")
            .await,
        0,
        "read stamps were kept"
    );
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// By default a cursor's backlog older than the outbox's retention moves into its consumer's
/// inbox, so a paused cursor consumer does not hold the log back for everyone: retention then
/// deletes the outbox rows and stamps every consumer is done with, the paused consumer's
/// events wait as inbox rows of its own, and once it resumes it applies each exactly once.
/// Without the move, the outbox keeps all 30 rows.
#[actix_rt::test]
async fn a_paused_cursor_consumers_old_backlog_moves_into_its_inbox() {
    use actix_outbox::retention::Retention;
    let db = TestDb::new().await;
    let rt = start(
        &db,
        vec![
            (consumer("held_cur", 3).cursor(true), Behaviour::default()),
            (consumer("busy_cur", 3).cursor(true), Behaviour::default()),
        ],
    )
    .await;
    pause(&db, "held_cur").await;
    let events: Vec<NewEvent> = (0..30).map(|i| order(&format!("o-{i}"))).collect();
    enqueue_events(&db, &events).await;
    rt.handle().wake();
    assert_once(&db, "busy_cur", 30).await;
    actix_rt::time::sleep(Duration::from_millis(50)).await;
    let config = outbox_after(Duration::from_millis(1));
    let retention = Retention::new(db.pool.clone(), config).unwrap();
    let report = retention.run_once().await.unwrap();
    assert_eq!(report.cursor_events_moved, 30);
    let waiting = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                   WHERE consumer = 'held_cur' AND status = 'RECEIVED'";
    assert_eq!(db.count(waiting).await, 30, "the backlog did not move");
    let outbox = "SELECT count(*) AS n FROM actix_outbox.outbox_events";
    assert_eq!(db.count(outbox).await, 0, "the log was held back");
    let stamps = "SELECT count(*) AS n FROM actix_outbox.log_stamps";
    assert_eq!(
        db.count(stamps).await,
        0,
        "stamps every cursor passed were kept"
    );
    assert_eq!(db.count(&inbox_rows("busy_cur")).await, 0);
    resume(&db, "held_cur").await;
    rt.handle().wake();
    assert_once(&db, "held_cur", 30).await;
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// The move takes only a prefix of the log past the cursor: never past a stamp younger than
/// the limit, though older ones follow it (a stamp's time is its transaction's start, not its
/// place in the log). Here the third of four stamps is made young: the first two move, the
/// cursor stops before the third, and the rest is read by the cursor once the consumer
/// resumes. Every event is applied once.
#[actix_rt::test]
async fn the_backlog_move_never_passes_a_younger_stamp() {
    use actix_outbox::retention::Retention;
    let db = TestDb::new().await;
    let rt = start(
        &db,
        vec![(consumer("prefix_cur", 3).cursor(true), Behaviour::default())],
    )
    .await;
    pause(&db, "prefix_cur").await;
    // One aggregate: one slot. Four publishes, so four stamps of 5.
    for _ in 0..4 {
        let events: Vec<NewEvent> = (0..5).map(|_| order("o-1")).collect();
        enqueue_events(&db, &events).await;
        rt.handle().wake();
        let published = "SELECT count(*) AS n FROM actix_outbox.outbox_events \
                         WHERE status <> 'PUBLISHED'";
        assert_eq!(db.wait_for(published, 0, WAIT).await, 0);
    }
    let stamps = "SELECT count(*) AS n FROM actix_outbox.log_stamps";
    assert_eq!(db.count(stamps).await, 4, "one stamp per publish");
    let mut conn = AsyncPgConnection::establish(&db.url).await.unwrap();
    conn.batch_execute(
        "UPDATE actix_outbox.log_stamps SET stamped_at = CASE \
             WHEN stamp = (SELECT stamp FROM actix_outbox.log_stamps ORDER BY stamp \
                           OFFSET 2 LIMIT 1) THEN now() + interval '1 hour' \
             ELSE now() - interval '1 hour' END",
    )
    .await
    .unwrap();
    drop(conn);
    let config = outbox_after(Duration::from_secs(60));
    let retention = Retention::new(db.pool.clone(), config).unwrap();
    let report = retention.run_once().await.unwrap();
    assert_eq!(
        report.cursor_events_moved, 10,
        "the move passed a younger stamp, or stopped short"
    );
    resume(&db, "prefix_cur").await;
    rt.handle().wake();
    assert_once(&db, "prefix_cur", 20).await;
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// Loops of a consumer whose only slot with a backlog another batch holds do not claim again
/// and again until it is done (a review found them spinning): the whole drain costs the
/// database a bounded number of transactions per batch, not thousands.
#[actix_rt::test]
async fn loops_do_not_spin_on_a_slot_another_batch_holds() {
    let db = TestDb::new().await;
    let slow = Behaviour {
        work: Duration::from_millis(300),
        ..Behaviour::default()
    };
    let cfg = consumer("spin_cur", 3)
        .cursor(true)
        .concurrency(4)
        .batch_size(5);
    let rt = start(&db, vec![(cfg, slow)]).await;
    // Every claim (and nothing of the test's) reads the cursors' index.
    let xacts = "SELECT (coalesce(idx_scan, 0) + coalesce(seq_scan, 0))::int8 AS n \
                 FROM pg_stat_user_tables WHERE relid = 'actix_outbox.consumer_cursors'::regclass";
    actix_rt::time::sleep(Duration::from_millis(1500)).await;
    let before = db.count(xacts).await;
    // One aggregate: one slot, four batches of five, each holding the slot for 1.5 s.
    let events: Vec<NewEvent> = (0..20).map(|_| order("o-hot")).collect();
    enqueue_events(&db, &events).await;
    rt.handle().wake();
    assert_once(&db, "spin_cur", 20).await;
    // Backends report their counts once idle for a second.
    actix_rt::time::sleep(Duration::from_millis(2500)).await;
    let spent = db.count(xacts).await - before;
    assert!(
        spent < 4 * 200,
        "{spent} reads of the cursors for 4 batches: the other loops claimed in a loop"
    );
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// Health sees a cursor consumer's backlog, which has no inbox row: its paused consumer's
/// stamped events are counted, and it is reported paused with them waiting; once resumed and
/// drained, nothing waits.
#[actix_rt::test]
async fn health_counts_what_waits_past_a_cursor() {
    use actix_outbox::health::{HealthConfig, StatsConfig, StatsSampler};
    let db = TestDb::new().await;
    let rt = start(
        &db,
        vec![(consumer("lag_cur", 3).cursor(true), Behaviour::default())],
    )
    .await;
    pause(&db, "lag_cur").await;
    let events: Vec<NewEvent> = (0..12).map(|i| order(&format!("o-{i}"))).collect();
    stamp(&db, &rt, &events, 12).await;
    actix_rt::time::sleep(Duration::from_millis(50)).await;
    let health = HealthConfig::default()
        .inbox_warn_after(Duration::from_millis(10))
        .inbox_critical_after(Duration::from_secs(3600));
    let sampler =
        StatsSampler::new(db.pool.clone(), StatsConfig::default().health(health)).unwrap();
    let report = sampler.run_once().await.unwrap();
    let mine = report
        .consumers
        .iter()
        .find(|c| c.consumer == "lag_cur")
        .unwrap();
    assert_eq!(mine.backlog, 12, "{report:?}");
    assert!(mine.oldest_due_age_seconds > 0.0, "{report:?}");
    assert!(
        report
            .reasons
            .iter()
            .any(|r| r.code == "CONSUMER_PAUSED" && r.consumer.as_deref() == Some("lag_cur")),
        "{report:?}"
    );
    resume(&db, "lag_cur").await;
    rt.handle().wake();
    assert_once(&db, "lag_cur", 12).await;
    let report = sampler.run_once().await.unwrap();
    let mine = report
        .consumers
        .iter()
        .find(|c| c.consumer == "lag_cur")
        .unwrap();
    assert_eq!(mine.backlog, 0, "{report:?}");
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// The process the cursor SIGKILL and abort tests run, kill and restart: a cursor consumer
/// `kc` on `AO_CHILD_DB` (with `AO_CHILD_POISON`, its handler aborts the process on the events
/// of aggregate `poison`). Not a test of its own.
#[actix_rt::test]
#[ignore = "entry point of the cursor tests' child process"]
async fn cursor_child_entry() {
    let url = std::env::var("AO_CHILD_DB").expect("started by a child-process test");
    let poison = std::env::var("AO_CHILD_POISON").is_ok();
    let behaviour = Behaviour {
        poison_aggregate: poison.then(|| "poison".to_owned()),
        poison: Poison::Abort,
        ..Behaviour::default()
    };
    let pool = actix_outbox::connect(&url, 10).await.unwrap();
    let _rt = start_on(pool, vec![(killed_consumer(poison), behaviour)]).await;
    std::future::pending::<()>().await;
}

/// The child's consumer: short leases, so that a death is judged within the test's time.
fn killed_consumer(poison: bool) -> actix_outbox::ConsumerConfig {
    consumer("kc", if poison { 2 } else { 10 })
        .cursor(true)
        .batch_size(50)
        .handler_timeout(Duration::from_secs(1))
        .lease(Duration::from_secs(2))
}

const KC_DISTINCT: &str = "SELECT count(DISTINCT event_id) AS n FROM effects WHERE consumer = 'kc'";
const KC_ALL: &str = "SELECT count(*) AS n FROM effects WHERE consumer = 'kc'";

/// SIGKILLs of the process running a cursor consumer, mid-drain, while events are produced:
/// every event is applied exactly once, counted in the database.
#[actix_rt::test]
async fn sigkills_of_a_cursor_consumers_process_lose_and_double_nothing() {
    const EVENTS: i64 = 5_000;
    let db = TestDb::new().await;
    // Registered before any event exists, as a deployed service would be.
    start(&db, vec![(killed_consumer(false), Behaviour::default())])
        .await
        .shutdown()
        .await;
    let spawn = || spawn_entry(&db.url, "cursor::cursor_child_entry", &[]);
    let (kills, mut child) = kill_while_producing(&db, spawn, KC_DISTINCT, EVENTS, 300).await;
    let applied = db
        .wait_for(KC_DISTINCT, EVENTS, Duration::from_secs(120))
        .await;
    child.kill().ok();
    child.wait().ok();
    assert!(
        kills >= 3,
        "killed {kills} times; the test needs at least 3"
    );
    assert_eq!(applied, EVENTS, "events were lost");
    assert_eq!(
        db.count(KC_ALL).await,
        EVENTS,
        "an effect was applied twice"
    );
    db.finish(&[]).await;
}

/// An event whose handler aborts the process, in a cursor batch: the batch's lease is judged
/// dead by the next process, its events get inbox rows and are handled alone, the killer is
/// charged each death and dead-lettered after its attempts, and every other event is applied
/// exactly once.
#[actix_rt::test]
async fn an_event_that_kills_a_cursor_consumers_process_is_dead_lettered_alone() {
    let db = TestDb::new().await;
    start(&db, vec![(killed_consumer(true), Behaviour::default())])
        .await
        .shutdown()
        .await;
    let healthy: Vec<NewEvent> = (0..30).map(|i| order(&format!("h-{i}"))).collect();
    enqueue_events(&db, &healthy[..15]).await;
    enqueue_events(&db, &[order("poison")]).await;
    enqueue_events(&db, &healthy[15..]).await;
    let env = [("AO_CHILD_POISON", "1")];
    let mut child = spawn_entry(&db.url, "cursor::cursor_child_entry", &env);
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'kc' \
                AND aggregate_id = 'poison' AND status = 'DEAD_LETTER' \
                AND error_code = 'INBOX_ATTEMPT_INTERRUPTED'";
    let others = "SELECT count(DISTINCT e.event_id) AS n FROM effects e \
                  JOIN actix_outbox.outbox_events o ON o.id = e.event_id \
                  WHERE e.consumer = 'kc' AND o.aggregate_id <> 'poison'";
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let mut deaths = 0;
    while std::time::Instant::now() < deadline {
        if db.count(dead).await == 1 && db.count(others).await == 30 {
            break;
        }
        if child.try_wait().unwrap().is_some() {
            deaths += 1;
            child = spawn_entry(&db.url, "cursor::cursor_child_entry", &env);
        }
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().ok();
    child.wait().ok();
    assert_eq!(db.count(dead).await, 1, "the killer was not dead-lettered");
    assert_eq!(db.count(others).await, 30, "healthy events were lost");
    let twice = "SELECT count(*) AS n FROM (SELECT event_id FROM effects WHERE consumer = 'kc' \
                 GROUP BY event_id HAVING count(*) > 1) t";
    assert_eq!(db.count(twice).await, 0, "an effect was applied twice");
    assert!(
        deaths >= 2,
        "{deaths} deaths: the killer's two attempts each kill the process"
    );
    db.finish(&[]).await;
}

/// A runtime whose role has only `Role::Runtime`'s grants (no DDL right) runs a cursor
/// consumer: the publisher's stamps, the cursors and their leases are within the library's
/// grants, and every event is applied once.
#[actix_rt::test]
async fn a_cursor_consumer_runs_as_the_least_privileged_runtime_role() {
    use crate::embedding::{as_role, Roles};
    use actix_outbox::db::{self, Role};
    let db = TestDb::new().await;
    let roles = Roles::create(&db, &["rt"]).await;
    let runtime_role = roles.get(0);
    {
        let mut owner = db.pool.get().await.unwrap();
        db::grant(&mut owner, Role::Runtime, runtime_role)
            .await
            .unwrap();
        owner
            .batch_execute(&format!(
                "GRANT INSERT ON public.effects TO {runtime_role}; \
                 GRANT USAGE ON SEQUENCE public.effects_id_seq TO {runtime_role};"
            ))
            .await
            .unwrap();
    }
    let pool = actix_outbox::connect(&as_role(&db.url, runtime_role), 10)
        .await
        .unwrap();
    let rt = start_on(
        pool,
        vec![(consumer("role_cur", 3).cursor(true), Behaviour::default())],
    )
    .await;
    let events: Vec<NewEvent> = (0..50).map(|i| order(&format!("o-{i}"))).collect();
    enqueue_events(&db, &events).await;
    rt.handle().wake();
    assert_once(&db, "role_cur", 50).await;
    assert_eq!(db.count(&inbox_rows("role_cur")).await, 0);
    rt.shutdown().await;
    db.finish(&[]).await;
    roles.drop_all().await;
}

/// Upgrade: an inbox consumer with rows in every state is restarted with `cursor(true)`, and
/// nothing is lost or done twice. Before the switch it has processed events, one dead letter
/// (the poison event), events waiting (RECEIVED), events waiting for a retry, one an operator
/// ignored, two leased by a process that died, and events still unpublished in the outbox.
/// After it: every event but the dead letter and the ignored one is applied exactly once, the
/// dead letter and the ignored row stay an operator's to decide, and events published after
/// the switch get no inbox row.
#[actix_rt::test]
async fn an_inbox_consumer_with_rows_in_every_state_switches_to_a_cursor() {
    let db = TestDb::new().await;
    let poison = Behaviour {
        poison_aggregate: Some("poison".into()),
        ..Behaviour::default()
    };
    let rt = start(&db, vec![(consumer("up_cur", 2), poison.clone())]).await;
    let first: Vec<NewEvent> = (0..20)
        .map(|i| order(&format!("a-{i}")))
        .chain(std::iter::once(order("poison")))
        .collect();
    enqueue_events(&db, &first).await;
    rt.handle().wake();
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                WHERE consumer = 'up_cur' AND status = 'DEAD_LETTER'";
    assert_eq!(db.wait_for(dead, 1, WAIT).await, 1);
    let processed = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                     WHERE consumer = 'up_cur' AND status = 'PROCESSED'";
    assert_eq!(db.wait_for(processed, 20, WAIT).await, 20);
    // Paused, the consumer gets rows it does not handle: 12 fanned out, waiting.
    pause(&db, "up_cur").await;
    let waiting: Vec<NewEvent> = (0..12).map(|i| order(&format!("b-{i}"))).collect();
    enqueue_events(&db, &waiting).await;
    rt.handle().wake();
    let received = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                    WHERE consumer = 'up_cur' AND status = 'RECEIVED'";
    assert_eq!(db.wait_for(received, 12, WAIT).await, 12);
    rt.shutdown().await;
    // Three wait for a retry, one is ignored, two are leased by a process that dies.
    let mut conn = AsyncPgConnection::establish(&db.url).await.unwrap();
    conn.batch_execute(
        "UPDATE actix_outbox.inbox_events SET status = 'RETRY_PENDING', attempt_count = 1, \
             next_attempt_at = now() + interval '1 second', error_code = 'INBOX_CONSUMER_FAILED', \
             last_error = 'injected' \
         WHERE consumer = 'up_cur' AND aggregate_id IN ('b-0', 'b-1', 'b-2'); \
         UPDATE actix_outbox.inbox_events SET status = 'IGNORED' \
         WHERE consumer = 'up_cur' AND aggregate_id = 'b-3'; \
         BEGIN; \
         INSERT INTO actix_outbox.inbox_leases (token, consumer, locked_by, backend, \
             locked_until, ids) \
         SELECT 4343, 'up_cur', 'dead-process', pg_backend_pid(), now() + interval '1 hour', \
             array_agg(id) FROM actix_outbox.inbox_events \
         WHERE consumer = 'up_cur' AND aggregate_id IN ('b-4', 'b-5'); \
         COMMIT;",
    )
    .await
    .unwrap();
    drop(conn);
    // Events committed while no runtime runs: still unpublished at the switch.
    let pending: Vec<NewEvent> = (0..10).map(|i| order(&format!("c-{i}"))).collect();
    enqueue_events(&db, &pending).await;
    resume(&db, "up_cur").await;

    let cfg = consumer("up_cur", 2).cursor(true);
    let rt = start(&db, vec![(cfg, poison)]).await;
    rt.handle().wake();
    let after: Vec<NewEvent> = (0..10).map(|i| order(&format!("d-{i}"))).collect();
    enqueue_events(&db, &after).await;
    rt.handle().wake();
    // 20 before, 11 of the 12 waiting (one ignored), 10 unpublished, 10 after.
    assert_once(&db, "up_cur", 51).await;
    let kept = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'up_cur' \
                AND ((aggregate_id = 'poison' AND status = 'DEAD_LETTER') \
                  OR (aggregate_id = 'b-3' AND status = 'IGNORED'))";
    assert_eq!(db.count(kept).await, 2, "an operator's rows changed");
    let applied_kept = "SELECT count(*) AS n FROM effects e JOIN actix_outbox.outbox_events o \
                        ON o.id = e.event_id WHERE e.consumer = 'up_cur' AND o.aggregate_id = 'b-3'";
    assert_eq!(
        db.count(applied_kept).await,
        0,
        "the ignored event was applied"
    );
    let new_rows = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                    WHERE consumer = 'up_cur' AND aggregate_id LIKE 'd-%'";
    assert_eq!(
        db.count(new_rows).await,
        0,
        "events after the switch got inbox rows"
    );
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// A graceful shutdown in the middle of a cursor consumer's drain: the batches in flight stop
/// between events, what they handled commits, and what they never offered is given back
/// (as inbox rows, uncharged). After a restart every event is applied exactly once, and no
/// event was charged an attempt for the deploy.
#[actix_rt::test]
async fn a_graceful_shutdown_mid_drain_loses_doubles_and_charges_nothing() {
    let db = TestDb::new().await;
    let slow = Behaviour {
        work: Duration::from_millis(5),
        ..Default::default()
    };
    let cfg = || {
        consumer("stop_cur", 3)
            .cursor(true)
            .batch_size(20)
            .concurrency(2)
    };
    let rt = start(&db, vec![(cfg(), slow.clone())]).await;
    let events: Vec<NewEvent> = (0..400).map(|i| order(&format!("o-{i}"))).collect();
    enqueue_events(&db, &events).await;
    rt.handle().wake();
    let applied = "SELECT count(*) AS n FROM effects WHERE consumer = 'stop_cur'";
    let deadline = std::time::Instant::now() + WAIT;
    while db.count(applied).await < 30 && std::time::Instant::now() < deadline {
        actix_rt::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(rt.shutdown().await, "in-flight batches finished in time");
    let at_stop = db.count(applied).await;
    assert!(
        at_stop < 400,
        "the shutdown came mid-drain ({at_stop} applied)"
    );
    assert_eq!(db.idle_in_transaction().await, 0);
    let leases = "SELECT count(*) AS n FROM actix_outbox.inbox_leases WHERE consumer = 'stop_cur'";
    assert_eq!(db.count(leases).await, 0, "a batch left its lease behind");

    let rt = start(&db, vec![(cfg(), slow)]).await;
    rt.handle().wake();
    assert_once(&db, "stop_cur", 400).await;
    let charged = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                   WHERE consumer = 'stop_cur' AND (attempt_count > 1 OR error_code IS NOT NULL)";
    assert_eq!(db.count(charged).await, 0, "the deploy charged an event");
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// Writes its effect; on its first call for version 3 of an aggregate it also writes a row
/// whose deferred foreign key fails only at `COMMIT`: the batch's commit is refused after the
/// handler returned Ok.
#[derive(Clone, Default)]
struct RefusesCommit(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl actix::Actor for RefusesCommit {
    type Context = actix::Context<Self>;
}

impl actix::Handler<actix_outbox::Delivery> for RefusesCommit {
    type Result = actix::ResponseFuture<Result<(), actix_outbox::HandlerError>>;

    fn handle(&mut self, d: actix_outbox::Delivery, _: &mut Self::Context) -> Self::Result {
        use diesel_async::RunQueryDsl;
        let refused = self.0.clone();
        Box::pin(async move {
            let mut conn = d.conn().await?;
            write_effect(&mut conn, "refused_cur", &d).await?;
            if d.aggregate_version() == Some(3)
                && !refused.swap(true, std::sync::atomic::Ordering::SeqCst)
            {
                diesel::sql_query("INSERT INTO deferred_child (parent) VALUES (42)")
                    .execute(&mut *conn)
                    .await?;
            }
            Ok(())
        })
    }
}

/// A cursor batch whose commit is refused after the batch gave some of its events inbox rows
/// in that same transaction (here a stale event, which is recorded rather than applied; one
/// aggregate, so one slot and one batch): the promotion rolls back with the commit, the batch
/// stays a cursor batch, promotes again with its careful pass's commit, and nothing is lost
/// or doubled.
/// Every other event is applied once, the stale one never, the refused effect is not kept,
/// and no event gets two inbox rows. No event is judged as if its process had died: the
/// refused `COMMIT` ended the transaction, so the batch's careful pass settles it (until the
/// engine took a refused `COMMIT` for a broken connection, the batch failed and the reaper
/// judged all eight).
#[actix_rt::test]
async fn a_refused_commit_after_a_promotion_in_the_batch_loses_and_doubles_nothing() {
    let db = TestDb::new().await;
    let mut conn = AsyncPgConnection::establish(&db.url).await.unwrap();
    conn.batch_execute(
        "CREATE TABLE deferred_parent (id int PRIMARY KEY); \
         CREATE TABLE deferred_child (parent int REFERENCES deferred_parent (id) \
             DEFERRABLE INITIALLY DEFERRED);",
    )
    .await
    .unwrap();
    drop(conn);
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer(
            consumer("refused_cur", 3).cursor(true).skip_stale(true),
            RefusesCommit::default,
        )
        .start()
        .await
        .unwrap();
    pause(&db, "refused_cur").await;
    let events: Vec<NewEvent> = [2, 1, 3, 4, 5, 6, 7, 8]
        .into_iter()
        .map(|v| order("s").aggregate_version(v))
        .collect();
    stamp(&db, &rt, &events, 8).await;
    resume(&db, "refused_cur").await;
    rt.handle().wake();
    assert_once(&db, "refused_cur", 7).await;
    let refused = "SELECT count(*) AS n FROM effects e JOIN actix_outbox.outbox_events o \
                   ON o.id = e.event_id WHERE o.aggregate_version = 3";
    assert_eq!(
        db.count(refused).await,
        1,
        "the refused commit's effect stayed"
    );
    let stale = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                 WHERE consumer = 'refused_cur' AND status = 'PROCESSED' AND error_code = 'EVENT_STALE'";
    let rows = "SELECT count(*) AS n FROM (SELECT event_id FROM actix_outbox.inbox_events \
                WHERE consumer = 'refused_cur' GROUP BY event_id HAVING count(*) > 1) x";
    assert_eq!(db.count(rows).await, 0, "an event got two inbox rows");
    assert_eq!(
        db.wait_for(stale, 1, WAIT).await,
        1,
        "the stale event was not recorded"
    );
    let judged = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                  WHERE consumer = 'refused_cur' AND (alone OR attempt_count <> 1)";
    assert_eq!(db.count(judged).await, 0, "an event was judged or charged");
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// A cursor batch whose last handler swallows a failed statement and returns Ok, beside an
/// event the batch cannot process (newer than this build reads; one aggregate, so one slot
/// and one batch): the promotion that would give that event its inbox row is refused in the
/// failed transaction, which rolls back, and the careful pass settles the batch, as after a
/// refused commit. Every readable event is applied once, only the unreadable one gets an inbox
/// row, and no event is judged as if its process had died (until a refused promotion counted
/// as a broken connection, the batch failed and the reaper judged all four).
#[actix_rt::test]
async fn a_promotion_refused_in_a_failed_transaction_loses_doubles_and_judges_nothing() {
    let db = TestDb::new().await;
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .events(actix_outbox::EventRegistry::new().register::<OrderChanged>())
        .consumer(consumer("swallow_cur", 1).cursor(true), Swallows::default)
        .start()
        .await
        .unwrap();
    pause(&db, "swallow_cur").await;
    let events = vec![
        order("w"),
        order("w").version(2),
        order("w"),
        order("w").aggregate_version(9),
    ];
    stamp(&db, &rt, &events, 4).await;
    resume(&db, "swallow_cur").await;
    rt.handle().wake();
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                WHERE consumer = 'swallow_cur' AND status = 'DEAD_LETTER'";
    assert_eq!(db.wait_for(dead, 1, WAIT).await, 1);
    assert_once(&db, "swallow_cur", 3).await;
    assert_eq!(
        db.count(&inbox_rows("swallow_cur")).await,
        1,
        "processed events got inbox rows"
    );
    let judged = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                  WHERE consumer = 'swallow_cur' AND (alone OR attempt_count <> 1)";
    assert_eq!(db.count(judged).await, 0, "an event was judged or charged");
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// `ORDER_STATUS_CHANGED` at version 1, as [`order`] writes it.
#[derive(serde::Serialize, serde::Deserialize)]
struct OrderChanged {
    order_id: String,
}

impl actix_outbox::Event for OrderChanged {
    const TYPE: &'static str = "ORDER_STATUS_CHANGED";
    const AGGREGATE_TYPE: &'static str = "order";
    fn aggregate_id(&self) -> String {
        self.order_id.clone()
    }
}

/// Writes its effect; on its first call for an event of aggregate version 9 it then runs a
/// statement that fails and returns Ok all the same, leaving the transaction failed.
#[derive(Clone, Default)]
struct Swallows(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl actix::Actor for Swallows {
    type Context = actix::Context<Self>;
}

impl actix::Handler<actix_outbox::Delivery> for Swallows {
    type Result = actix::ResponseFuture<Result<(), actix_outbox::HandlerError>>;

    fn handle(&mut self, d: actix_outbox::Delivery, _: &mut Self::Context) -> Self::Result {
        use diesel_async::RunQueryDsl;
        let swallowed = self.0.clone();
        Box::pin(async move {
            let mut conn = d.conn().await?;
            write_effect(&mut conn, "swallow_cur", &d).await?;
            if d.aggregate_version() == Some(9)
                && !swallowed.swap(true, std::sync::atomic::Ordering::SeqCst)
            {
                let failed = diesel::sql_query("SELECT 1/0").execute(&mut *conn).await;
                assert!(failed.is_err(), "1/0 succeeded");
            }
            Ok(())
        })
    }
}

/// Enqueues `events` in one transaction, wakes the runtime and waits until the stamps list
/// `total` events in all (those of earlier calls included).
async fn stamp(db: &TestDb, rt: &OutboxRuntime, events: &[NewEvent], total: i64) {
    enqueue_events(db, events).await;
    rt.handle().wake();
    let stamped =
        "SELECT coalesce(sum(cardinality(events)), 0)::int8 AS n FROM actix_outbox.log_stamps";
    assert_eq!(db.wait_for(stamped, total, WAIT).await, total);
}

/// Enqueues versions 1..=`n` of aggregate `aggregate` (one slot) while `consumer` is paused,
/// waits until they are stamped, and resumes it: its first batch leases them all.
async fn one_batch(db: &TestDb, rt: &OutboxRuntime, consumer: &str, aggregate: &str, n: i64) {
    pause(db, consumer).await;
    let events: Vec<NewEvent> = (1..=n)
        .map(|v| order(aggregate).aggregate_version(v))
        .collect();
    stamp(db, rt, &events, n).await;
    resume(db, consumer).await;
    rt.handle().wake();
}

/// A handler driven by the aggregate version of its event: the first call for `fail` returns
/// a retryable error, the first for `hang` writes its effect and holds its connection for
/// two seconds, and every other call writes its effect after `work`. It records each call's
/// version, in order.
#[derive(Clone, Default)]
struct Script {
    name: &'static str,
    fail: i64,
    hang: i64,
    work: Duration,
    calls: std::sync::Arc<std::sync::Mutex<Vec<i64>>>,
}

impl Script {
    fn calls(&self) -> Vec<i64> {
        self.calls.lock().unwrap().clone()
    }
}

impl actix::Actor for Script {
    type Context = actix::Context<Self>;
}

impl actix::Handler<actix_outbox::Delivery> for Script {
    type Result = actix::ResponseFuture<Result<(), actix_outbox::HandlerError>>;

    fn handle(&mut self, d: actix_outbox::Delivery, _: &mut Self::Context) -> Self::Result {
        let this = self.clone();
        Box::pin(async move {
            let v = d.aggregate_version().unwrap_or(0);
            let first = {
                let mut calls = this.calls.lock().unwrap();
                let first = !calls.contains(&v);
                calls.push(v);
                first
            };
            if first && v == this.fail {
                return Err(actix_outbox::HandlerError::retry("scripted failure"));
            }
            let mut conn = d.conn().await?;
            write_effect(&mut conn, this.name, &d).await?;
            if first && v == this.hang {
                actix_rt::time::sleep(Duration::from_secs(2)).await;
            } else {
                actix_rt::time::sleep(this.work).await;
            }
            Ok(())
        })
    }
}

/// A handler that hangs in a cursor batch's careful pass (the batch's first event failed in
/// its fast pass): the batch's events get inbox rows, the hung event is charged once, the
/// events after it are given back uncharged, and every event is applied exactly once.
#[actix_rt::test]
async fn a_hang_in_a_cursor_batchs_careful_pass_costs_its_own_event_only() {
    let db = TestDb::new().await;
    let script = Script {
        name: "careful_hang",
        fail: 1,
        hang: 2,
        ..Script::default()
    };
    let cfg = consumer("careful_hang", 5)
        .cursor(true)
        .handler_timeout(Duration::from_millis(300));
    let handler = script.clone();
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer(cfg, move || handler.clone())
        .start()
        .await
        .unwrap();
    one_batch(&db, &rt, "careful_hang", "ch", 4).await;
    assert_once(&db, "careful_hang", 4).await;
    assert_eq!(
        script.calls()[..2],
        [1, 2],
        "the hang was not in the careful pass"
    );
    let charged = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                   WHERE consumer = 'careful_hang' AND attempt_count = 2 \
                       AND aggregate_version IN (1, 2)";
    assert_eq!(
        db.wait_for(charged, 2, WAIT).await,
        2,
        "the failed and the hung event were not charged one attempt each"
    );
    let spared = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                  WHERE consumer = 'careful_hang' AND aggregate_version IN (3, 4) \
                      AND attempt_count > 1";
    assert_eq!(db.count(spared).await, 0, "an event given back was charged");
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// The fence on a careful pass's promotion: the batch's first event fails in its fast pass,
/// and while its careful pass runs, its lease is judged dead and promoted (as the reaper does,
/// here by hand). The careful pass's commit must then fail and roll its effects back, or they
/// would commit beside the reaper's inbox rows, each handled again.
#[actix_rt::test]
async fn a_careful_pass_whose_lease_the_reaper_promoted_commits_no_effect() {
    let db = TestDb::new().await;
    let script = Script {
        name: "careful_fence",
        fail: 1,
        work: Duration::from_millis(300),
        ..Script::default()
    };
    let cfg = consumer("careful_fence", 3)
        .cursor(true)
        .batch_size(5)
        .handler_timeout(Duration::from_secs(1))
        .lease(Duration::from_secs(4));
    let handler = script.clone();
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer(cfg, move || handler.clone())
        .start()
        .await
        .unwrap();
    one_batch(&db, &rt, "careful_fence", "cf", 5).await;
    // Version 2's first call is the careful pass's first.
    let deadline = std::time::Instant::now() + WAIT;
    while !script.calls().contains(&2) {
        assert!(std::time::Instant::now() < deadline, "no careful pass");
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        promote_by_hand(&db, "careful_fence").await,
        5,
        "the lease was not there to promote"
    );
    assert_once(&db, "careful_fence", 5).await;
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                WHERE consumer = 'careful_fence' AND status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 5, WAIT).await, 5);
    let all = "SELECT count(*) AS n FROM effects WHERE consumer = 'careful_fence'";
    assert_eq!(db.count(all).await, 5, "an effect was applied twice");
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// A cursor consumer whose handler fails every event, in batches of 10: the first batch tries
/// its first event in the fast pass and three more in the careful pass, which then gives up
/// (`decide::PROBE`): the batch's other events are given back with their attempts unspent, and
/// nothing more is tried before the poll (an hour away). The events past that batch stay past
/// the cursor, with no inbox row.
#[actix_rt::test]
async fn a_cursor_batch_failing_everything_tries_a_few_and_rests() {
    let db = TestDb::new().await;
    let failing = Behaviour {
        poison_aggregate: Some("*".into()),
        ..Default::default()
    };
    let cfg = consumer("failing_cur", 1000)
        .cursor(true)
        .batch_size(10)
        .concurrency(1)
        .poll_interval(Duration::from_secs(3600));
    let rt = start(&db, vec![(cfg, failing.clone())]).await;
    let events: Vec<NewEvent> = (0..100).map(|_| order("all")).collect();
    enqueue_events(&db, &events).await;
    rt.handle().wake();
    let charged = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE attempt_count > 0";
    assert_eq!(db.wait_for(charged, 4, WAIT).await, 4);
    for _ in 0..5 {
        rt.handle().wake();
        actix_rt::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        db.count(charged).await,
        4,
        "it tried more of its batch, or claimed again before its poll"
    );
    let over = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE attempt_count > 1";
    assert_eq!(db.count(over).await, 0);
    assert_eq!(
        failing
            .poison_calls
            .load(std::sync::atomic::Ordering::Relaxed),
        4
    );
    assert_eq!(
        db.count(&inbox_rows("failing_cur")).await,
        10,
        "not the first batch's events alone got inbox rows"
    );
    db.finish(&[&rt]).await;
}

/// The correlation timeline shows what a cursor consumer did with each event, though it has an
/// inbox row only for the one that failed: PROCESSED for the one it handled, the failed one's
/// row (DEAD_LETTER), and RECEIVED for one past its cursor while it is paused; each
/// (event, consumer) once, beside an inbox consumer's records of the same events.
#[actix_rt::test]
async fn the_timeline_shows_what_a_cursor_consumer_did_with_each_event() {
    let db = TestDb::new().await;
    let poisoned = Behaviour {
        poison_aggregate: Some("o-bad".into()),
        ..Behaviour::default()
    };
    let rt = start(
        &db,
        vec![
            (consumer("tl_cur", 1).cursor(true), poisoned),
            (consumer("tl_inbox", 1), Behaviour::default()),
        ],
    )
    .await;
    let of = |agg: &str| order(agg).correlation_id("corr-tl");
    enqueue_events(&db, &[of("o-1"), of("o-bad")]).await;
    rt.handle().wake();
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                WHERE consumer = 'tl_cur' AND status = 'DEAD_LETTER'";
    assert_eq!(db.wait_for(dead, 1, WAIT).await, 1);
    let applied = "SELECT count(*) AS n FROM effects WHERE consumer = 'tl_cur'";
    assert_eq!(db.wait_for(applied, 1, WAIT).await, 1);
    pause(&db, "tl_cur").await;
    enqueue_events(&db, &[of("o-2")]).await;
    rt.handle().wake();
    let processed = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                     WHERE consumer = 'tl_inbox' AND status = 'PROCESSED'";
    assert_eq!(db.wait_for(processed, 3, WAIT).await, 3);

    let mut conn = db.pool.get().await.unwrap();
    let timeline = actix_outbox::ops::timeline(&mut conn, "corr-tl")
        .await
        .unwrap();
    let of_consumer = |c: &str| -> Vec<(String, String)> {
        timeline
            .iter()
            .filter(|e| e.kind == "inbox" && e.consumer.as_deref() == Some(c))
            .map(|e| (e.aggregate_id.clone(), e.status.clone()))
            .collect()
    };
    let mut cursor = of_consumer("tl_cur");
    cursor.sort();
    let want = [
        ("o-1", "PROCESSED"),
        ("o-2", "RECEIVED"),
        ("o-bad", "DEAD_LETTER"),
    ];
    assert_eq!(
        cursor,
        want.map(|(a, s)| (a.to_owned(), s.to_owned())),
        "{timeline:#?}"
    );
    assert_eq!(of_consumer("tl_inbox").len(), 3, "{timeline:#?}");
    let outbox = timeline.iter().filter(|e| e.kind == "outbox").count();
    assert_eq!(outbox, 3, "{timeline:#?}");
    drop(conn);
    db.finish(&[&rt]).await;
}

/// A consumer turning its cursors off never drops them while a subscription of it reads
/// through a cursor again: here an instance of a build without the off switch (or a start
/// racing this one) sets the flag back on after the switch, leaving the list of open
/// transactions in place. Events stamped from then on are read through the cursors, by the
/// consumer still reading them, exactly once; dropping them would lose every later event.
#[actix_rt::test]
async fn cursors_are_not_dropped_while_the_flag_is_back_on() {
    let db = TestDb::new().await;
    let rt = start(
        &db,
        vec![(consumer("flip", 3).cursor(true), Behaviour::default())],
    )
    .await;
    rt.shutdown().await;
    // A transaction open across the switch, so that it is listed and no drop is tried before
    // the flag is back on (a drop checks the flag under the consumer's state row, which the
    // UPDATE below does not take: racing it, the drop could still win).
    let mut open = AsyncPgConnection::establish(&db.url).await.unwrap();
    open.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let rt = start(&db, vec![(consumer("flip", 3), Behaviour::default())]).await;
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(
        "UPDATE actix_outbox.consumer_subscriptions SET cursor = true WHERE consumer = 'flip'",
    )
    .await
    .unwrap();
    drop(conn);
    open.batch_execute("COMMIT").await.unwrap();
    let events: Vec<NewEvent> = (0..20).map(|i| order(&format!("f-{i}"))).collect();
    enqueue_events(&db, &events).await;
    rt.handle().wake();
    assert_once(&db, "flip", 20).await;
    // Its loops have found nothing left many times over (100 ms polls).
    actix_rt::time::sleep(Duration::from_millis(500)).await;
    let cursors = "SELECT count(*) AS n FROM actix_outbox.consumer_cursors WHERE consumer = 'flip'";
    assert_eq!(db.count(cursors).await, 16, "dropped while the flag was on");
    let more: Vec<NewEvent> = (0..5).map(|i| order(&format!("g-{i}"))).collect();
    enqueue_events(&db, &more).await;
    rt.handle().wake();
    assert_once(&db, "flip", 25).await;
    assert_eq!(db.count(&inbox_rows("flip")).await, 0);
    rt.shutdown().await;
    db.finish(&[]).await;
}

/// A start that turns the cursor on again while a drop of the cursors is under way waits for
/// it, then makes new cursors: here a session holds the consumer's state row as the drop does
/// from its check to its commit, and drops the cursors while the start waits. A start that
/// looks for its cursors before it waits (a statement's writing parts run in no set order)
/// finds the old ones, makes none, and commits the flag on with no cursor left: every later
/// event lost. Without the start's lock taken first, this failed one run in three.
#[actix_rt::test]
async fn a_start_turning_the_cursor_on_waits_for_a_drop_under_way() {
    let db = TestDb::new().await;
    let on = || consumer("race", 3).cursor(true);
    start(&db, vec![(on(), Behaviour::default())])
        .await
        .shutdown()
        .await;
    start(&db, vec![(consumer("race", 3), Behaviour::default())])
        .await
        .shutdown()
        .await;

    let mut drop_ = AsyncPgConnection::establish(&db.url).await.unwrap();
    drop_
        .batch_execute(
            "BEGIN; SELECT FROM actix_outbox.consumer_states WHERE consumer = 'race' FOR UPDATE",
        )
        .await
        .unwrap();
    let pool = db.pool.clone();
    let starting =
        actix_rt::spawn(async move { start_on(pool, vec![(on(), Behaviour::default())]).await });
    // Once its registration waits for the row.
    let waiting = "SELECT count(*) AS n FROM pg_stat_activity \
                   WHERE datname = current_database() AND wait_event_type = 'Lock'";
    assert_eq!(
        db.wait_for(waiting, 1, WAIT).await,
        1,
        "the start never waited"
    );
    drop_
        .batch_execute(
            "DELETE FROM actix_outbox.consumer_cursors WHERE consumer = 'race'; \
             UPDATE actix_outbox.consumer_states SET cursor_off_vxids = NULL \
             WHERE consumer = 'race'; COMMIT",
        )
        .await
        .unwrap();
    let rt = starting.await.unwrap();
    let cursors = "SELECT count(*) AS n FROM actix_outbox.consumer_cursors WHERE consumer = 'race'";
    assert_eq!(db.count(cursors).await, 16, "the start made no cursors");
    let events: Vec<NewEvent> = (0..10).map(|i| order(&format!("r-{i}"))).collect();
    enqueue_events(&db, &events).await;
    rt.handle().wake();
    assert_once(&db, "race", 10).await;
    rt.shutdown().await;
    db.finish(&[]).await;
}
