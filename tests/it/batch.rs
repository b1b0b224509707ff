//! Batch consumers against real PostgreSQL: a whole batch's effects in one handler call, and a
//! batch that fails as a whole (an error, a panic that kills the actor, a hang past the
//! timeout) narrowed down to the event that causes it. Every assertion counts rows.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use actix_outbox::RetryPolicy;
use common::*;
use diesel_async::SimpleAsyncConnection;

const MAX_EFFECTS_PER_EVENT: &str =
    "SELECT coalesce(max(c), 0) AS n FROM (SELECT count(*) AS c FROM effects GROUP BY consumer, event_id) x";

#[actix_rt::test]
async fn a_batch_consumer_gets_a_backlog_in_batches_and_writes_each_effect_once() {
    let db = TestDb::new().await;
    db.produce_batched(400, 100, "o").await;
    let behaviour = Behaviour::default();
    let largest = behaviour.largest_call.clone();
    let rt = start_batch(&db, vec![(consumer("bulk", 3).batch_size(50), behaviour)]).await;

    let done =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED' AND attempt_count = 1";
    assert_eq!(db.wait_for(done, 400, WAIT).await, 400);
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 400);
    assert_eq!(db.count(MAX_EFFECTS_PER_EVENT).await, 1);
    // The backlog was there before the runtime started: every claim was a full batch of 50,
    // handed over in one call.
    assert_eq!(largest.load(Ordering::Relaxed), 50);
    db.finish(&[&rt]).await;
}

/// One poison event among healthy ones, failing the way `poison` says. The batches holding it
/// fail whole; the runtime replays them one event per call, so only the poison event's
/// attempts are counted and it alone is dead-lettered, while every healthy event commits its
/// effect once, on its first counted attempt.
async fn poison_in_a_batch(poison: Poison, timeout: Duration, error: &str) {
    poison_in_a_batch_on(poison, timeout, error, false).await;
}

/// [`poison_in_a_batch`] with the consumer reading through its cursors (storage v2) if
/// `cursor`: processed means an effect, and only the poison event may get an inbox row.
async fn poison_in_a_batch_on(poison: Poison, timeout: Duration, error: &str, cursor: bool) {
    let db = TestDb::new().await;
    let conn = db.pool.get().await.unwrap();
    actix_outbox::enqueue(&conn, &order_event("healthy-first"))
        .await
        .unwrap();
    actix_outbox::enqueue(&conn, &order_event("poison"))
        .await
        .unwrap();
    drop(conn);
    db.produce_batched(300, 100, "healthy").await;
    let behaviour = Behaviour {
        poison_aggregate: Some("poison".into()),
        poison,
        ..Default::default()
    };
    let cfg = consumer("bulk", 2)
        .batch_size(20)
        .handler_timeout(timeout)
        .cursor(cursor);
    let rt = start_batch(&db, vec![(cfg, behaviour)]).await;

    let healthy = match cursor {
        false => {
            "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED' \
             AND attempt_count = 1 AND aggregate_id <> 'poison'"
        }
        true => {
            "SELECT count(DISTINCT e.event_id) AS n FROM effects e \
             JOIN actix_outbox.outbox_events o ON o.id = e.event_id \
             WHERE o.aggregate_id <> 'poison'"
        }
    };
    assert_eq!(db.wait_for(healthy, 301, WAIT).await, 301);
    let dead = format!(
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'DEAD_LETTER' \
         AND aggregate_id = 'poison' AND attempt_count = 2 \
         AND error_code = 'INBOX_CONSUMER_FAILED' AND last_error LIKE '%{error}%'"
    );
    assert_eq!(db.wait_for(&dead, 1, WAIT).await, 1);
    if cursor {
        assert!(read_through_cursors(&db, "bulk").await);
        // The narrowing's other events are processed past the cursor, not given rows.
        let others = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                      WHERE aggregate_id <> 'poison' AND attempt_count > 1";
        assert_eq!(db.count(others).await, 0, "a healthy event was charged");
    } else {
        assert_eq!(
            db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events")
                .await,
            302
        );
    }
    // The poison event's effects rolled back with each attempt; the others committed once.
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 301);
    assert_eq!(db.count(MAX_EFFECTS_PER_EVENT).await, 1);
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn a_batch_that_fails_is_narrowed_down_to_the_failing_event() {
    poison_in_a_batch(Poison::Fail, Duration::from_secs(30), "injected failure").await;
}

#[actix_rt::test]
async fn a_batch_that_kills_its_handler_is_narrowed_down_to_the_event_that_does() {
    poison_in_a_batch(Poison::Kill, Duration::from_secs(30), "panicked or stopped").await;
}

#[actix_rt::test]
async fn a_batch_that_hangs_is_narrowed_down_to_the_event_that_hangs() {
    poison_in_a_batch(
        Poison::Hang,
        Duration::from_millis(300),
        "did not finish within",
    )
    .await;
}

#[actix_rt::test]
async fn a_cursor_batch_that_fails_is_narrowed_down_to_the_failing_event() {
    let failure = "injected failure";
    poison_in_a_batch_on(Poison::Fail, Duration::from_secs(30), failure, true).await;
}

#[actix_rt::test]
async fn a_cursor_batch_that_kills_its_handler_is_narrowed_down_to_the_event_that_does() {
    let killed = "panicked or stopped";
    poison_in_a_batch_on(Poison::Kill, Duration::from_secs(30), killed, true).await;
}

#[actix_rt::test]
async fn a_cursor_batch_that_hangs_is_narrowed_down_to_the_event_that_hangs() {
    let hung = "did not finish within";
    poison_in_a_batch_on(Poison::Hang, Duration::from_millis(300), hung, true).await;
}

/// A consumer paused for over a day — as an operator pauses one whose events keep killing its
/// process — still has the lease its dead batch left settled, however many batches of other
/// consumers ran meanwhile: the interrupted attempt is counted, and stays counted when it
/// resumes.
#[actix_rt::test]
async fn a_day_old_lease_of_a_paused_consumer_is_still_charged() {
    let db = TestDb::new().await;
    let slow_retry = RetryPolicy::fixed(3, Duration::from_secs(3600));
    let rt = start(
        &db,
        vec![
            (consumer("c", 3).retry(slow_retry), Behaviour::default()),
            (consumer("d", 3), Behaviour::default()),
        ],
    )
    .await;
    let c = actix_outbox::event::ConsumerName::new("c").unwrap();
    let mut conn = db.pool.get().await.unwrap();
    actix_outbox::ops::pause_consumer(&mut conn, &c, "ops", "kills its process", None)
        .await
        .unwrap();
    db.produce(1, "x").await;
    let d_done =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'd' AND status = 'PROCESSED'";
    assert_eq!(db.wait_for(d_done, 1, WAIT).await, 1);
    // A batch of c leased its row alone, and the process died, a day ago.
    conn.batch_execute(
        "INSERT INTO actix_outbox.inbox_leases (token, consumer, locked_by, backend, claimed_at, \
             locked_until, ids) \
         SELECT 42, 'c', 'gone', 0, now() - interval '25 hours', now() - interval '25 hours', \
             array_agg(id) \
         FROM actix_outbox.inbox_events WHERE consumer = 'c'",
    )
    .await
    .unwrap();
    // d's batches run meanwhile.
    for i in 0..5 {
        db.produce(1, &format!("y{i}")).await;
        assert_eq!(db.wait_for(d_done, 2 + i, WAIT).await, 2 + i);
    }
    actix_outbox::ops::resume_consumer(&mut conn, &c, "ops")
        .await
        .unwrap();
    drop(conn);
    let counted = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'c' \
                   AND aggregate_id = 'x-0' AND status = 'RETRY_PENDING' AND attempt_count = 1 \
                   AND error_code = 'INBOX_ATTEMPT_INTERRUPTED'";
    assert_eq!(db.wait_for(counted, 1, WAIT).await, 1);
    db.finish(&[&rt]).await;
}

/// A batch whose last row is stale (an older version of an aggregate after a newer one, for a
/// consumer that skips stale events): the rows before it are still handed over, in the same
/// call, and commit at once; none is left in its lease for the reaper.
#[actix_rt::test]
async fn a_batch_ending_in_a_stale_event_still_hands_over_the_rest() {
    use diesel_async::AsyncConnection;
    let db = TestDb::new().await;
    let newer = order_event("a").aggregate_version(3);
    let older = order_event("a").aggregate_version(2);
    let mut conn = db.pool.get().await.unwrap();
    conn.transaction::<_, actix_outbox::Error, _>(async |c| {
        actix_outbox::enqueue_many(c, &[newer, older]).await?;
        Ok(())
    })
    .await
    .unwrap();
    drop(conn);
    // A lease far longer than the wait: a row left in it would not come back in time.
    let cfg = consumer("bulk", 3)
        .skip_stale(true)
        .lease(Duration::from_secs(600));
    let rt = start_batch(&db, vec![(cfg, Behaviour::default())]).await;

    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED' \
                AND attempt_count = 1";
    assert_eq!(db.wait_for(done, 2, Duration::from_secs(20)).await, 2);
    let stale =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE error_code = 'EVENT_STALE'";
    assert_eq!(db.count(stale).await, 1);
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 1);
    db.finish(&[&rt]).await;
}
