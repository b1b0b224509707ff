//! The in-memory harness (`actix_outbox::testing::Harness`).
//!
//! The first group runs without a database and without real time: every retry fires because
//! the test moved the manual clock, never because time passed. Then the conformance check that
//! keeps the fake faithful: one scripted scenario runs through the harness and through the
//! real runtime on PostgreSQL, and every inbox row must end the same. The last group gives the
//! harness a database (`Harness::with_database`): handlers write through their deliveries in
//! real transactions, and the redelivery check tells consumers that write outside them.

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::prelude::*;
use actix_outbox::testing::{Harness, InboxStatus, OutboxStatus};
use actix_outbox::{
    event::ConsumerName, ops::pause_consumer, ops::resume_consumer, ConsumerConfig, Delivery,
    DeliveryBatch, ErrorCode, Event, EventId, EventRegistry, HandlerError, NewEvent, OutboxRuntime,
    RetryPolicy,
};
use common::{fast_runtime, inbox_states, InboxState, TestDb, WAIT};
use diesel_async::AsyncConnection;
use serde::{Deserialize, Serialize};

// ---------------------------------------------------------------------------------------------
// A scriptable consumer actor.

/// What the scripted handler does on one attempt.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Step {
    Ok,
    Retry,
    /// Retry, not before this many milliseconds.
    RetryAfter(u64),
    /// Permanent failure with code `SCRIPTED_PERMANENT`.
    Permanent,
    /// Panic inside `handle`: the actor stops.
    Panic,
}

type Script = Arc<dyn Fn(&Delivery) -> Step + Send + Sync>;
/// (aggregate id, attempt) of every delivery the handler saw, in order.
type Seen = Arc<Mutex<Vec<(String, u32)>>>;

#[derive(Clone)]
struct Scripted {
    script: Script,
    seen: Seen,
    /// Calls as a batch consumer.
    batches: Arc<AtomicU32>,
}

impl Actor for Scripted {
    type Context = Context<Self>;
}

impl Handler<Delivery> for Scripted {
    type Result = Result<(), HandlerError>;

    fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
        self.run(&d)
    }
}

impl Scripted {
    fn run(&self, d: &Delivery) -> Result<(), HandlerError> {
        self.seen
            .lock()
            .unwrap()
            .push((d.aggregate_id().to_owned(), d.attempt()));
        match (self.script)(d) {
            Step::Ok => Ok(()),
            Step::Retry => Err(HandlerError::retry("scripted retry")),
            Step::RetryAfter(ms) => Err(HandlerError::retry_after(
                Duration::from_millis(ms),
                "scripted retry-after",
            )),
            Step::Permanent => Err(HandlerError::permanent(
                ErrorCode::new("SCRIPTED_PERMANENT"),
                "scripted permanent failure",
            )),
            Step::Panic => panic!(
                "scripted panic for {} attempt {}",
                d.aggregate_id(),
                d.attempt()
            ),
        }
    }
}

/// As a batch consumer: the script runs on each event of the batch, and the first step that
/// is not `Ok` is the batch's outcome.
impl Handler<DeliveryBatch> for Scripted {
    type Result = Result<(), HandlerError>;

    fn handle(&mut self, b: DeliveryBatch, _: &mut Context<Self>) -> Self::Result {
        self.batches.fetch_add(1, Ordering::SeqCst);
        b.deliveries().iter().try_for_each(|d| self.run(d))
    }
}

/// A scripted consumer: the actor factory (counting its calls) and what the handlers saw.
struct Probe {
    actor: Scripted,
    built: Arc<AtomicU32>,
}

impl Probe {
    fn new(script: impl Fn(&Delivery) -> Step + Send + Sync + 'static) -> Probe {
        Probe {
            actor: Scripted {
                script: Arc::new(script),
                seen: Seen::default(),
                batches: Arc::default(),
            },
            built: Arc::default(),
        }
    }

    fn factory(&self) -> impl Fn() -> Scripted + 'static {
        let (actor, built) = (self.actor.clone(), self.built.clone());
        move || {
            built.fetch_add(1, Ordering::SeqCst);
            actor.clone()
        }
    }

    fn seen(&self) -> Vec<(String, u32)> {
        self.actor.seen.lock().unwrap().clone()
    }
}

fn config(name: &str, policy: RetryPolicy) -> ConsumerConfig {
    ConsumerConfig::new(name)
        .subscribe("ORDER_STATUS_CHANGED")
        .retry(policy)
}

fn event(aggregate: &str) -> NewEvent {
    NewEvent::new(
        "ORDER_STATUS_CHANGED",
        "order",
        aggregate,
        serde_json::json!({"order_id": aggregate}),
    )
}

fn ms(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis() as u64)
}

fn code(view: &actix_outbox::testing::InboxView) -> Option<&str> {
    view.error_code.as_ref().map(|c| c.as_str())
}

// ---------------------------------------------------------------------------------------------
// Enqueue.

#[test]
fn the_harness_refuses_the_events_enqueue_refuses() {
    let mut h = Harness::new();
    let plain = |payload| NewEvent::new("ORDER_PAID", "order", "o1", payload);
    let refused = [
        plain(serde_json::json!({"order_id": "o1", "userPassword": "x"})),
        plain(serde_json::json!({"order_id": "o1"}))
            .metadata(serde_json::json!({"X-Api-Key": "k"})),
    ];
    for event in &refused {
        let err = h.enqueue(event).unwrap_err();
        assert_eq!(err.code().as_str(), "EVENT_SCHEMA_INVALID", "{err}");
    }
    // Whole words, not fragments: an id and a count that only contain a sensitive word.
    let fine = plain(serde_json::json!({"payment_authorization_id": "p1", "tokens_used": 3}));
    assert!(h.enqueue(&fine).is_ok());
    assert_eq!(h.publish(), 1, "only the accepted event was written");
}

// ---------------------------------------------------------------------------------------------
// Retry timing.

#[actix_rt::test]
async fn a_retry_is_not_due_before_its_backoff_and_is_due_right_after() {
    // The default shape, jitter included: the harness must wait exactly what the runtime waits.
    let policy = RetryPolicy::default()
        .max_attempts(4)
        .base(Duration::from_secs(10));
    let probe = Probe::new(|_| Step::Retry);
    let mut h = Harness::new();
    h.consumer(config("c", policy.clone()), probe.factory())
        .unwrap();
    let id = h.enqueue(&event("o1")).unwrap();
    assert_eq!(h.publish(), 1);
    let seed = {
        let (a, b) = id.as_uuid().as_u64_pair();
        a ^ b
    };

    let first = h.deliver().await;
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].attempt, 1);
    for attempt in 1..=3u32 {
        let wait = ms(policy.delay(attempt, seed));
        let row = h.row("c", id).unwrap();
        assert_eq!(row.status, InboxStatus::RetryPending);
        assert_eq!(row.attempts, attempt);
        assert_eq!(row.next_attempt_at, h.now() + wait, "attempt {attempt}");

        h.advance(wait - Duration::from_millis(1));
        assert!(
            h.deliver().await.is_empty(),
            "attempt {} is not due 1 ms before its backoff",
            attempt + 1
        );
        h.advance(Duration::from_millis(1));
        let next = h.deliver().await;
        assert_eq!(next.len(), 1, "attempt {} is due right after", attempt + 1);
        assert_eq!(next[0].attempt, attempt + 1);
    }
    let row = h.row("c", id).unwrap();
    assert_eq!((row.status, row.attempts), (InboxStatus::DeadLetter, 4));
    assert_eq!(probe.seen().len(), 4);
}

#[actix_rt::test]
async fn exactly_max_attempts_then_dead_letter_with_its_code() {
    let probe = Probe::new(|_| Step::Retry);
    let mut h = Harness::new();
    h.consumer(
        config("c", RetryPolicy::fixed(3, Duration::from_secs(1))),
        probe.factory(),
    )
    .unwrap();
    let id = h.enqueue(&event("o1")).unwrap();

    let outcomes = h.run_until_idle().await;
    let attempts: Vec<u32> = outcomes.iter().map(|o| o.attempt).collect();
    assert_eq!(attempts, vec![1, 2, 3]);
    let row = h.row("c", id).unwrap();
    assert_eq!(row.status, InboxStatus::DeadLetter);
    assert_eq!(row.attempts, 3);
    assert_eq!(code(&row), Some("INBOX_CONSUMER_FAILED"));
    assert_eq!(row.last_error.as_deref(), Some("scripted retry"));

    // Dead is dead: no amount of time brings it back.
    h.advance(Duration::from_secs(86_400));
    assert!(h.deliver().await.is_empty());
    assert_eq!(probe.seen().len(), 3);
}

/// The harness hands a batch consumer one event per batch, as the runtime does when it replays
/// a failed batch, and applies the same retry rules per event.
#[actix_rt::test]
async fn a_batch_consumer_gets_one_event_per_call_under_the_same_rules() {
    let probe = Probe::new(|d| match (d.aggregate_id(), d.attempt()) {
        ("bad", _) => Step::Permanent,
        (_, 1) => Step::Retry,
        _ => Step::Ok,
    });
    let mut h = Harness::new();
    h.batch_consumer(
        config("c", RetryPolicy::fixed(3, Duration::from_secs(1))),
        probe.factory(),
    )
    .unwrap();
    let good = h.enqueue(&event("good")).unwrap();
    let bad = h.enqueue(&event("bad")).unwrap();

    h.run_until_idle().await;
    let row = h.row("c", good).unwrap();
    assert_eq!((row.status, row.attempts), (InboxStatus::Processed, 2));
    let row = h.row("c", bad).unwrap();
    assert_eq!((row.status, row.attempts), (InboxStatus::DeadLetter, 1));
    assert_eq!(code(&row), Some("SCRIPTED_PERMANENT"));
    let seen = probe.seen();
    assert_eq!(
        seen,
        vec![("good".into(), 1), ("bad".into(), 1), ("good".into(), 2)]
    );
    assert_eq!(
        probe.actor.batches.load(Ordering::SeqCst),
        3,
        "one call per event"
    );
}

#[actix_rt::test]
async fn retry_after_is_honoured_instead_of_the_backoff_but_not_past_the_last_attempt() {
    let probe = Probe::new(|d| match (d.aggregate_id(), d.attempt()) {
        (_, 1) => Step::RetryAfter(90_000),
        ("recovers", _) => Step::Ok,
        _ => Step::RetryAfter(90_000),
    });
    let mut h = Harness::new();
    h.consumer(
        config("c", RetryPolicy::fixed(2, Duration::from_secs(1))),
        probe.factory(),
    )
    .unwrap();
    let recovers = h.enqueue(&event("recovers")).unwrap();
    let gives_up = h.enqueue(&event("gives-up")).unwrap();
    h.publish();
    assert_eq!(h.deliver().await.len(), 2);
    let row = h.row("c", recovers).unwrap();
    assert_eq!(row.next_attempt_at, h.now() + Duration::from_secs(90));

    // The policy's 1 s does not apply: the handler asked for 90 s.
    h.advance(Duration::from_millis(89_999));
    assert!(h.deliver().await.is_empty());
    h.advance(Duration::from_millis(1));
    assert_eq!(h.deliver().await.len(), 2);

    let row = h.row("c", recovers).unwrap();
    assert_eq!((row.status, row.attempts), (InboxStatus::Processed, 2));
    assert_eq!(
        (code(&row), row.last_error.as_deref()),
        (None, None),
        "success clears the error"
    );
    // A retry-after on the last allowed attempt dead-letters: the limit wins.
    let row = h.row("c", gives_up).unwrap();
    assert_eq!((row.status, row.attempts), (InboxStatus::DeadLetter, 2));
}

#[derive(Debug, Serialize, Deserialize)]
struct StatusPayload {
    order_id: String,
    status: String,
}

#[actix_rt::test]
async fn a_permanent_error_dead_letters_on_the_first_attempt() {
    let probe = Probe::new(|d| match d.aggregate_id() {
        "declined" => Step::Permanent,
        // A payload that does not decode is permanent as well (EVENT_SCHEMA_INVALID).
        _ => match d.decode::<StatusPayload>() {
            Ok(_) => Step::Ok,
            Err(_) => Step::Permanent,
        },
    });
    let mut h = Harness::new();
    h.consumer(
        config("c", RetryPolicy::fixed(5, Duration::from_secs(1))),
        probe.factory(),
    )
    .unwrap();
    let declined = h.enqueue(&event("declined")).unwrap();
    let fine = h
        .enqueue(&NewEvent::new(
            "ORDER_STATUS_CHANGED",
            "order",
            "fine",
            serde_json::json!({"order_id": "fine", "status": "PAID"}),
        ))
        .unwrap();
    h.run_until_idle().await;

    let row = h.row("c", declined).unwrap();
    assert_eq!((row.status, row.attempts), (InboxStatus::DeadLetter, 1));
    assert_eq!(code(&row), Some("SCRIPTED_PERMANENT"));
    assert_eq!(
        row.last_error.as_deref(),
        Some("scripted permanent failure")
    );
    assert_eq!(h.row("c", fine).unwrap().status, InboxStatus::Processed);
}

// ---------------------------------------------------------------------------------------------
// Pause.

#[actix_rt::test]
async fn a_paused_consumer_keeps_its_events_and_resume_drains_them() {
    let paused = Probe::new(|_| Step::Ok);
    let other = Probe::new(|_| Step::Ok);
    let mut h = Harness::new();
    let policy = RetryPolicy::fixed(3, Duration::from_secs(1));
    h.consumer(config("paused", policy.clone()), paused.factory())
        .unwrap();
    h.consumer(config("other", policy), other.factory())
        .unwrap();
    assert_eq!(
        h.pause("nobody").unwrap_err().code().as_str(),
        "CONSUMER_UNKNOWN"
    );

    h.pause("paused").unwrap();
    for i in 0..3 {
        h.enqueue(&event(&format!("o{i}"))).unwrap();
    }
    assert_eq!(h.publish(), 3, "publishing carries on");
    assert_eq!(h.deliver().await.len(), 3, "the other consumer carries on");
    h.advance(Duration::from_secs(3600));
    assert!(h.deliver().await.is_empty());
    assert_eq!(
        h.next_due(),
        None,
        "a paused consumer's rows are not waiting"
    );

    let kept = h.inbox("paused");
    assert_eq!(kept.len(), 3, "nothing is dropped");
    assert!(kept
        .iter()
        .all(|r| r.status == InboxStatus::Received && r.attempts == 0));
    assert!(paused.seen().is_empty());
    assert!(h
        .inbox("other")
        .iter()
        .all(|r| r.status == InboxStatus::Processed));

    h.resume("paused").unwrap();
    let drained = h.deliver().await;
    assert_eq!(drained.len(), 3);
    assert!(drained
        .iter()
        .all(|o| o.consumer.as_str() == "paused" && o.status == InboxStatus::Processed));
    let order: Vec<String> = paused.seen().into_iter().map(|(a, _)| a).collect();
    assert_eq!(
        order,
        vec!["o0", "o1", "o2"],
        "the backlog drains in arrival order"
    );
}

// ---------------------------------------------------------------------------------------------
// Supervision of handler actors.

#[actix_rt::test]
async fn a_handler_actor_that_panics_is_rebuilt_and_its_attempt_counts_as_failed() {
    let probe = Probe::new(|d| {
        if d.attempt() == 1 {
            Step::Panic
        } else {
            Step::Ok
        }
    });
    let mut h = Harness::new();
    h.consumer(
        config("c", RetryPolicy::fixed(3, Duration::from_secs(5))),
        probe.factory(),
    )
    .unwrap();
    let ids: Vec<EventId> = (0..3)
        .map(|i| h.enqueue(&event(&format!("o{i}"))).unwrap())
        .collect();
    h.publish();

    let first = h.deliver().await;
    assert_eq!(first.len(), 3, "the rows after a panic are still delivered");
    assert!(first
        .iter()
        .all(|o| o.handler_lost && o.status == InboxStatus::RetryPending));
    // One rebuild per panic, each before the next delivery.
    assert_eq!(h.handler_restarts("c"), 3);
    assert_eq!(probe.built.load(Ordering::SeqCst), 4);
    for id in &ids {
        let row = h.row("c", *id).unwrap();
        assert_eq!(row.attempts, 1);
        assert_eq!(code(&row), Some("INBOX_CONSUMER_FAILED"));
        assert_eq!(
            row.last_error.as_deref(),
            Some("the handler panicked or stopped while handling")
        );
    }

    h.advance(Duration::from_secs(5));
    let second = h.deliver().await;
    assert!(second
        .iter()
        .all(|o| o.status == InboxStatus::Processed && !o.handler_lost));
    assert_eq!(
        h.handler_restarts("c"),
        3,
        "a healthy handler is not rebuilt"
    );
    assert_eq!(probe.built.load(Ordering::SeqCst), 4);
}

/// Panics inside the future a handler returns, not in `handle` itself.
struct PanicsInFuture;

impl Actor for PanicsInFuture {
    type Context = Context<Self>;
}

impl Handler<Delivery> for PanicsInFuture {
    type Result = ResponseFuture<Result<(), HandlerError>>;
    fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
        Box::pin(async move {
            if d.attempt() == 1 {
                panic!("panic inside the handler's future");
            }
            Ok(())
        })
    }
}

#[actix_rt::test]
async fn a_panic_inside_a_handler_future_fails_the_attempt_but_keeps_the_actor() {
    // actix runs a `ResponseFuture` as its own task: the panic ends that task, and the reply
    // channel closes, but the actor lives on. The runtime only rebuilds stopped actors.
    let built = Arc::new(AtomicU32::new(0));
    let counter = built.clone();
    let mut h = Harness::new();
    h.consumer(
        config("c", RetryPolicy::fixed(3, Duration::from_secs(5))),
        move || {
            counter.fetch_add(1, Ordering::SeqCst);
            PanicsInFuture
        },
    )
    .unwrap();
    let id = h.enqueue(&event("o1")).unwrap();
    h.publish();

    let first = h.deliver().await;
    assert!(first[0].result.is_err(), "the reply never came");
    assert!(!first[0].handler_lost, "the actor itself survived");
    assert_eq!(first[0].status, InboxStatus::RetryPending);
    h.advance(Duration::from_secs(5));
    h.deliver().await;
    assert_eq!(h.row("c", id).unwrap().status, InboxStatus::Processed);
    assert_eq!(h.handler_restarts("c"), 0);
    assert_eq!(built.load(Ordering::SeqCst), 1);
}

/// Replies, then stops itself.
struct StopsAfterReply;

impl Actor for StopsAfterReply {
    type Context = Context<Self>;
}

impl Handler<Delivery> for StopsAfterReply {
    type Result = Result<(), HandlerError>;
    fn handle(&mut self, _: Delivery, ctx: &mut Context<Self>) -> Self::Result {
        ctx.stop();
        Ok(())
    }
}

#[actix_rt::test]
async fn a_handler_that_stops_itself_is_replaced_before_the_next_delivery_at_no_attempt_cost() {
    // The runtime looks for a stopped handler before every delivery, so the event after the
    // stop goes to a fresh actor instead of failing against a closed mailbox.
    let mut h = Harness::new();
    h.consumer(
        config("c", RetryPolicy::fixed(3, Duration::from_secs(5))),
        || StopsAfterReply,
    )
    .unwrap();
    let a = h.enqueue(&event("a")).unwrap();
    let b = h.enqueue(&event("b")).unwrap();
    h.publish();
    let outcomes = h.deliver().await;
    assert_eq!(outcomes.len(), 2);
    assert_eq!(h.row("c", a).unwrap().status, InboxStatus::Processed);
    let row = h.row("c", b).unwrap();
    assert_eq!(
        (row.status, row.attempts, outcomes[1].handler_lost),
        (InboxStatus::Processed, 1, false)
    );
    assert_eq!(h.handler_restarts("c"), 1);
}

// ---------------------------------------------------------------------------------------------
// Fan-out and duplicates.

#[actix_rt::test]
async fn fan_out_gives_each_subscribed_consumer_one_row_and_absorbs_repeats() {
    let (a, b, c) = (
        Probe::new(|_| Step::Ok),
        Probe::new(|_| Step::Ok),
        Probe::new(|_| Step::Ok),
    );
    let policy = RetryPolicy::fixed(3, Duration::from_secs(1));
    let mut h = Harness::new();
    h.consumer(config("a", policy.clone()), a.factory())
        .unwrap();
    h.consumer(
        config("b", policy.clone()).subscribe("PAYMENT_CAPTURED"),
        b.factory(),
    )
    .unwrap();
    h.consumer(
        ConsumerConfig::new("c")
            .subscribe("SHIPMENT_SENT")
            .retry(policy),
        c.factory(),
    )
    .unwrap();

    let order = h.enqueue(&event("o1")).unwrap();
    let payment = h
        .enqueue(&NewEvent::new(
            "PAYMENT_CAPTURED",
            "payment",
            "p1",
            serde_json::json!({}),
        ))
        .unwrap();
    assert_eq!(h.publish(), 2);
    assert_eq!(h.publish(), 0, "nothing left to publish");
    let ids = |name: &str| -> Vec<EventId> { h.inbox(name).iter().map(|r| r.event_id).collect() };
    assert_eq!(ids("a"), vec![order]);
    assert_eq!(ids("b"), vec![order, payment]);
    assert!(ids("c").is_empty(), "not subscribed, no row");
    h.deliver().await;

    // The same event published again (a lost acknowledgement, an expired lease).
    assert!(h.republish(order));
    assert_eq!(h.publish(), 1);
    assert_eq!(h.inbox("a").len(), 1);
    assert_eq!(h.inbox("b").len(), 2);
    assert_eq!(
        (h.duplicates("a"), h.duplicates("b"), h.duplicates("c")),
        (1, 1, 0)
    );
    assert!(h.deliver().await.is_empty(), "a duplicate is never handled");
    assert_eq!(a.seen().len(), 1);
    assert_eq!(b.seen().len(), 2);
    let out = h.outbox();
    assert_eq!(out[0].status, OutboxStatus::Published);
    assert_eq!(out[0].attempts, 2);

    // Enqueue checks what the real enqueue checks.
    let invalid = h.enqueue(&NewEvent::new("", "order", "o2", serde_json::json!({})));
    assert_eq!(invalid.unwrap_err().code().as_str(), "EVENT_SCHEMA_INVALID");
    let again = h.enqueue(&event("o1").with_id(order)).unwrap_err();
    assert_eq!(again.code().as_str(), "DATABASE_ERROR");
    assert!(!again.is_transient());
    let twice = event("o3");
    assert!(h.enqueue_many(&[twice.clone(), twice]).is_err());
    assert_eq!(h.outbox().len(), 2, "a failed enqueue writes nothing");
}

#[actix_rt::test]
async fn events_can_be_delivered_out_of_order_and_more_than_once() {
    let probe = Probe::new(|_| Step::Ok);
    let mut h = Harness::new();
    h.consumer(
        config("c", RetryPolicy::fixed(3, Duration::from_secs(1))),
        probe.factory(),
    )
    .unwrap();
    let e1 = h.enqueue(&event("v1")).unwrap();
    let e2 = h.enqueue(&event("v2")).unwrap();
    let e3 = h.enqueue(&event("v3")).unwrap();
    h.publish();

    let out = h.deliver_out_of_order("c", &[e3, e1]).await;
    assert_eq!(out.len(), 2);
    assert_eq!(h.row("c", e2).unwrap().status, InboxStatus::Received);

    // A commit lost after the handler returned: the handler ran, the row did not move.
    let again = h.redeliver(e2, "c").await.unwrap();
    assert!(again.rolled_back && again.handler_ran);
    let row = h.row("c", e2).unwrap();
    assert_eq!((row.status, row.attempts), (InboxStatus::Received, 0));
    // So the next cycle delivers the same attempt once more.
    h.deliver().await;
    assert_eq!(h.row("c", e2).unwrap().status, InboxStatus::Processed);
    assert_eq!(
        probe.seen(),
        vec![
            ("v3".to_owned(), 1),
            ("v1".to_owned(), 1),
            ("v2".to_owned(), 1),
            ("v2".to_owned(), 1),
        ]
    );

    // A finished row is never handed out again; the inbox absorbs it.
    assert!(h.redeliver(e2, "c").await.is_none());
    assert_eq!(h.duplicates("c"), 1);
    assert!(
        h.deliver_out_of_order("c", &[e1]).await.is_empty(),
        "only due rows are delivered"
    );
    assert_eq!(probe.seen().len(), 4);
}

#[actix_rt::test]
async fn with_skip_stale_an_older_version_is_recorded_without_calling_the_handler() {
    let probe = Probe::new(|_| Step::Ok);
    let mut h = Harness::new();
    h.consumer(
        config("projection", RetryPolicy::fixed(3, Duration::from_secs(1))).skip_stale(true),
        probe.factory(),
    )
    .unwrap();
    let v2 = h.enqueue(&event("o1").aggregate_version(2)).unwrap();
    let v3 = h.enqueue(&event("o1").aggregate_version(3)).unwrap();
    h.publish();

    h.deliver_out_of_order("projection", &[v3]).await;
    let late = h.deliver().await;
    assert_eq!(late.len(), 1);
    assert!(!late[0].handler_ran);
    let row = h.row("projection", v2).unwrap();
    assert_eq!((row.status, row.attempts), (InboxStatus::Processed, 1));
    assert_eq!(code(&row), Some("EVENT_STALE"));
    assert_eq!(
        row.last_error.as_deref(),
        Some("stale: the consumer already applied aggregate version 3")
    );
    assert_eq!(probe.seen().len(), 1);
}

// ---------------------------------------------------------------------------------------------
// What the harness cannot do, and the runtime's guards it keeps.

struct NeedsDatabase;

impl Actor for NeedsDatabase {
    type Context = Context<Self>;
}

impl Handler<Delivery> for NeedsDatabase {
    type Result = ResponseFuture<Result<(), HandlerError>>;
    fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
        Box::pin(async move {
            let _conn = d.conn().await?;
            Ok(())
        })
    }
}

#[actix_rt::test]
async fn a_handler_that_needs_the_database_fails_under_the_harness() {
    let mut h = Harness::new();
    h.consumer(
        config("c", RetryPolicy::fixed(1, Duration::from_secs(1))),
        || NeedsDatabase,
    )
    .unwrap();
    let id = h.enqueue(&event("o1")).unwrap();
    let out = h.run_until_idle().await;
    assert!(out[0].result.is_err());
    let row = h.row("c", id).unwrap();
    assert_eq!(row.status, InboxStatus::DeadLetter);
    assert_eq!(code(&row), Some("INBOX_CONSUMER_FAILED"));
}

struct NeverAnswers;

impl Actor for NeverAnswers {
    type Context = Context<Self>;
}

impl Handler<Delivery> for NeverAnswers {
    type Result = ResponseFuture<Result<(), HandlerError>>;
    fn handle(&mut self, _: Delivery, _: &mut Context<Self>) -> Self::Result {
        Box::pin(std::future::pending())
    }
}

#[actix_rt::test]
async fn a_handler_that_overruns_its_timeout_fails_the_attempt() {
    let mut h = Harness::new();
    h.consumer(
        config("c", RetryPolicy::fixed(3, Duration::from_secs(1)))
            .handler_timeout(Duration::from_millis(5)),
        || NeverAnswers,
    )
    .unwrap();
    let id = h.enqueue(&event("o1")).unwrap();
    h.publish();
    let out = h.deliver().await;
    assert!(!out[0].handler_lost);
    let row = h.row("c", id).unwrap();
    assert_eq!((row.status, row.attempts), (InboxStatus::RetryPending, 1));
    assert_eq!(
        row.last_error.as_deref(),
        Some("the handler did not finish within 5ms")
    );
}

#[derive(Debug, Serialize, Deserialize)]
struct OrderPlaced {
    order_id: String,
    total_cents: i64,
}

impl Event for OrderPlaced {
    const TYPE: &'static str = "ORDER_PLACED";
    const VERSION: i32 = 2;
    const AGGREGATE_TYPE: &'static str = "order";
    fn aggregate_id(&self) -> String {
        self.order_id.clone()
    }
}

struct Totals(Arc<Mutex<Vec<i64>>>);

impl Actor for Totals {
    type Context = Context<Self>;
}

impl Handler<Delivery> for Totals {
    type Result = Result<(), HandlerError>;
    fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
        let placed: OrderPlaced = d.event()?;
        self.0.lock().unwrap().push(placed.total_cents);
        Ok(())
    }
}

#[actix_rt::test]
async fn old_versions_are_upcast_and_newer_ones_retried_for_a_newer_build() {
    let totals = Arc::new(Mutex::new(Vec::new()));
    let seen = totals.clone();
    let mut h = Harness::new();
    h.events(EventRegistry::new().register::<OrderPlaced>().upcaster(
        "ORDER_PLACED",
        1,
        |mut v| {
            let euros = v["total"].as_i64().ok_or("v1 has no total")?;
            v["total_cents"] = serde_json::json!(euros * 100);
            Ok(v)
        },
    ));
    h.consumer(
        ConsumerConfig::new("billing")
            .subscribe("ORDER_PLACED")
            .retry(RetryPolicy::fixed(5, Duration::from_secs(1))),
        move || Totals(seen.clone()),
    )
    .unwrap();
    let placed = |version: i32, payload| {
        NewEvent::new("ORDER_PLACED", "order", "o1", payload).version(version)
    };
    let old = h
        .enqueue(&placed(
            1,
            serde_json::json!({"order_id": "o1", "total": 5}),
        ))
        .unwrap();
    let future = h
        .enqueue(&placed(
            3,
            serde_json::json!({"order_id": "o1", "total_cents": 1}),
        ))
        .unwrap();
    h.run_until_idle().await;

    assert_eq!(
        h.row("billing", old).unwrap().status,
        InboxStatus::Processed
    );
    assert_eq!(*totals.lock().unwrap(), vec![500]);
    // Not dead-lettered at once but retried on the policy (5 attempts), in case an instance of
    // a newer build claims it; none does here.
    let row = h.row("billing", future).unwrap();
    assert_eq!((row.status, row.attempts), (InboxStatus::DeadLetter, 5));
    assert_eq!(code(&row), Some("EVENT_VERSION_UNSUPPORTED"));
}

// ---------------------------------------------------------------------------------------------
// Conformance: the harness and the runtime on PostgreSQL agree.

/// The scripted outcome of `consumer` handling `aggregate` on `attempt`; past the script, Ok.
fn conformance_step(consumer: &str, aggregate: &str, attempt: u32) -> Step {
    use Step::*;
    let script: &[Step] = match (consumer, aggregate) {
        ("alpha", "flaky") => &[Retry, Ok],
        ("alpha", "panic") => &[Panic, Ok],
        ("alpha", "perm") => &[Permanent],
        ("alpha", "exhaust") => &[Retry, Retry, Retry],
        ("beta", "flaky") => &[Retry, Retry],
        ("beta", "perm") => &[RetryAfter(30), Ok],
        ("beta", "exhaust") => &[Panic, Panic],
        ("gamma", "flaky") => &[Retry, Ok],
        ("gamma", "perm") => &[Permanent],
        _ => &[Ok],
    };
    script
        .get(attempt.saturating_sub(1) as usize)
        .copied()
        .unwrap_or(Ok)
}

/// The same consumers, with the same policies, on both sides. `gamma` starts paused.
fn conformance_consumers() -> Vec<(ConsumerConfig, Probe)> {
    let cfg = |name: &str, attempts: u32| {
        ConsumerConfig::new(name)
            .subscribe("ORDER_STATUS_CHANGED")
            .retry(RetryPolicy::fixed(attempts, Duration::from_millis(20)))
            .poll_interval(Duration::from_millis(100))
    };
    ["alpha", "beta", "gamma"]
        .into_iter()
        .map(|name| {
            let config = match name {
                "beta" => cfg(name, 2).subscribe("PAYMENT_CAPTURED"),
                _ => cfg(name, 3),
            };
            let probe = Probe::new(move |d| conformance_step(name, d.aggregate_id(), d.attempt()));
            (config, probe)
        })
        .collect()
}

/// The scenario's events with their script keys (the aggregate ids).
fn conformance_events() -> Vec<(&'static str, NewEvent)> {
    let mut events: Vec<(&str, NewEvent)> = ["ok", "flaky", "panic", "perm", "exhaust"]
        .into_iter()
        .map(|agg| (agg, event(agg)))
        .collect();
    events.push((
        "payment",
        NewEvent::new(
            "PAYMENT_CAPTURED",
            "payment",
            "payment",
            serde_json::json!({}),
        ),
    ));
    events.push((
        "unseen",
        NewEvent::new("NOBODY_LISTENS", "order", "unseen", serde_json::json!({})),
    ));
    events
}

type States = BTreeMap<(uuid::Uuid, String), InboxState>;

fn harness_states(h: &Harness) -> States {
    let mut out = States::new();
    for name in ["alpha", "beta", "gamma"] {
        for row in h.inbox(name) {
            out.insert(
                (row.event_id.as_uuid(), name.to_owned()),
                (
                    row.status.as_str().to_owned(),
                    row.attempts,
                    row.error_code.map(|c| c.as_str().to_owned()),
                ),
            );
        }
    }
    out
}

/// The states readable by a person: (aggregate, consumer) → (status, attempts, code).
fn named(states: &States, events: &[(&str, NewEvent)]) -> BTreeMap<(String, String), InboxState> {
    let key = |id: &uuid::Uuid| {
        events
            .iter()
            .find(|(_, e)| e.id().as_uuid() == *id)
            .map_or("?", |(k, _)| *k)
            .to_owned()
    };
    states
        .iter()
        .map(|((id, consumer), s)| ((key(id), consumer.clone()), s.clone()))
        .collect()
}

fn expected(
    rows: &[(&str, &str, &str, u32, Option<&str>)],
) -> BTreeMap<(String, String), InboxState> {
    rows.iter()
        .map(|(agg, consumer, status, attempts, code)| {
            (
                (agg.to_string(), consumer.to_string()),
                (status.to_string(), *attempts, code.map(str::to_owned)),
            )
        })
        .collect()
}

#[actix_rt::test]
async fn the_harness_and_the_postgres_runtime_agree_on_a_scripted_scenario() {
    let scenario = conformance_events();
    let events: Vec<NewEvent> = scenario.iter().map(|(_, e)| e.clone()).collect();
    const P: &str = "PROCESSED";
    const D: &str = "DEAD_LETTER";
    const R: &str = "RECEIVED";
    const FAILED: Option<&str> = Some("INBOX_CONSUMER_FAILED");
    const PERM: Option<&str> = Some("SCRIPTED_PERMANENT");
    let active = [
        ("ok", "alpha", P, 1, None),
        ("flaky", "alpha", P, 2, None),
        ("panic", "alpha", P, 2, None),
        ("perm", "alpha", D, 1, PERM),
        ("exhaust", "alpha", D, 3, FAILED),
        ("ok", "beta", P, 1, None),
        ("flaky", "beta", D, 2, FAILED),
        ("panic", "beta", P, 1, None),
        ("perm", "beta", P, 2, None),
        ("exhaust", "beta", D, 2, FAILED),
        ("payment", "beta", P, 1, None),
    ];
    let mut paused = active.to_vec();
    for agg in ["ok", "flaky", "panic", "perm", "exhaust"] {
        paused.push((agg, "gamma", R, 0, None));
    }
    let mut resumed = active.to_vec();
    resumed.extend([
        ("ok", "gamma", P, 1, None),
        ("flaky", "gamma", P, 2, None),
        ("panic", "gamma", P, 1, None),
        ("perm", "gamma", D, 1, PERM),
        ("exhaust", "gamma", P, 1, None),
    ]);
    let (paused, resumed) = (expected(&paused), expected(&resumed));

    // The harness.
    let mut h = Harness::new();
    for (config, probe) in conformance_consumers() {
        h.consumer(config, probe.factory()).unwrap();
    }
    h.pause("gamma").unwrap();
    h.enqueue_many(&events).unwrap();
    h.run_until_idle().await;
    let harness_paused = harness_states(&h);
    assert_eq!(
        named(&harness_paused, &scenario),
        paused,
        "harness, gamma paused"
    );
    h.resume("gamma").unwrap();
    h.run_until_idle().await;
    let harness_resumed = harness_states(&h);
    assert_eq!(
        named(&harness_resumed, &scenario),
        resumed,
        "harness, gamma resumed"
    );
    assert!(h
        .outbox()
        .iter()
        .all(|o| o.status == OutboxStatus::Published && o.attempts == 1));

    // The runtime on PostgreSQL, same consumers, same events (same ids).
    let db = TestDb::new().await;
    let mut builder = OutboxRuntime::builder(db.pool.clone()).config(fast_runtime());
    for (config, probe) in conformance_consumers() {
        builder = builder.consumer(config, probe.factory());
    }
    let rt = builder.start().await.expect("start runtime");
    let mut conn = db.pool.get().await.unwrap();
    let gamma = ConsumerName::new("gamma").unwrap();
    pause_consumer(&mut conn, &gamma, "test", "conformance", None)
        .await
        .unwrap();
    conn.transaction::<_, actix_outbox::Error, _>(async |conn| {
        actix_outbox::enqueue_many(conn, &events).await?;
        Ok(())
    })
    .await
    .unwrap();
    rt.handle().wake();

    let finished = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                    WHERE status IN ('PROCESSED', 'DEAD_LETTER')";
    let gamma_rows = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'gamma'";
    assert_eq!(db.wait_for(gamma_rows, 5, WAIT).await, 5);
    assert_eq!(
        db.wait_for(finished, active.len() as i64, WAIT).await,
        active.len() as i64
    );
    let pg_paused = inbox_states(&db).await;
    assert_eq!(
        named(&pg_paused, &scenario),
        paused,
        "postgres, gamma paused"
    );
    assert_eq!(pg_paused, harness_paused);

    resume_consumer(&mut conn, &gamma, "test").await.unwrap();
    let all = resumed.len() as i64;
    assert_eq!(db.wait_for(finished, all, WAIT).await, all);
    let pg_resumed = inbox_states(&db).await;
    assert_eq!(
        named(&pg_resumed, &scenario),
        resumed,
        "postgres, gamma resumed"
    );
    assert_eq!(pg_resumed, harness_resumed);
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'PUBLISHED' AND attempt_count = 1"
        )
        .await,
        events.len() as i64
    );
    drop(conn);
    db.finish(&[&rt]).await;
}

// ---------------------------------------------------------------------------------------------
// With a database (`Harness::with_database`): each attempt is a real transaction.

/// Where a [`Writer`] writes its effect on each attempt.
#[derive(Clone, Copy, PartialEq)]
enum Writes {
    /// An `effects` row through the delivery's connection: commits with the delivery.
    ThroughDelivery,
    /// A `sent_mail` row on a pool connection of its own, outside the delivery's transaction.
    OwnConnection,
    /// A `sent_mail_keyed` row on its own connection, keyed by the event id.
    OwnConnectionKeyed,
}

/// A consumer that writes one row per attempt, and fails its first attempt (after writing)
/// for the aggregates listed in `fail_first`.
#[derive(Clone)]
struct Writer {
    writes: Writes,
    pool: actix_outbox::PgPool,
    fail_first: &'static [&'static str],
    /// Handler calls, failed ones included.
    calls: Arc<AtomicU32>,
}

impl Writer {
    fn new(writes: Writes, pool: &actix_outbox::PgPool) -> Writer {
        Writer {
            writes,
            pool: pool.clone(),
            fail_first: &[],
            calls: Arc::default(),
        }
    }

    async fn write(&self, d: &Delivery) -> Result<(), HandlerError> {
        use diesel::sql_types::{Integer, Text, Uuid as SqlUuid};
        use diesel_async::RunQueryDsl;
        self.calls.fetch_add(1, Ordering::SeqCst);
        let id = d.event_id().as_uuid();
        match self.writes {
            Writes::ThroughDelivery => {
                let mut conn = d.conn().await?;
                diesel::sql_query(
                    "INSERT INTO effects (consumer, event_id, attempt) VALUES ($1, $2, $3)",
                )
                .bind::<Text, _>(d.consumer().as_str())
                .bind::<SqlUuid, _>(id)
                .bind::<Integer, _>(d.attempt() as i32)
                .execute(&mut *conn)
                .await?;
            }
            Writes::OwnConnection | Writes::OwnConnectionKeyed => {
                let sql = if self.writes == Writes::OwnConnection {
                    "INSERT INTO sent_mail (event_id) VALUES ($1)"
                } else {
                    "INSERT INTO sent_mail_keyed (event_id) VALUES ($1) ON CONFLICT DO NOTHING"
                };
                let mut conn = self.pool.get().await.map_err(actix_outbox::Error::from)?;
                diesel::sql_query(sql)
                    .bind::<SqlUuid, _>(id)
                    .execute(&mut conn)
                    .await?;
            }
        }
        if d.attempt() == 1 && self.fail_first.contains(&d.aggregate_id()) {
            return Err(HandlerError::retry(
                "fails its first attempt, after writing",
            ));
        }
        Ok(())
    }
}

impl Actor for Writer {
    type Context = Context<Self>;
}

impl Handler<Delivery> for Writer {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
        let me = self.clone();
        Box::pin(async move { me.write(&d).await })
    }
}

impl Handler<DeliveryBatch> for Writer {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, b: DeliveryBatch, _: &mut Context<Self>) -> Self::Result {
        let me = self.clone();
        Box::pin(async move {
            for d in b.deliveries() {
                me.write(d).await?;
            }
            Ok(())
        })
    }
}

/// A database of the test's own, with the tables the [`Writer`]s write to.
async fn writer_db() -> TestDb {
    use diesel_async::SimpleAsyncConnection;
    let db = TestDb::new().await;
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(
        "CREATE TABLE sent_mail (event_id uuid NOT NULL);
         CREATE TABLE sent_mail_keyed (event_id uuid PRIMARY KEY);",
    )
    .await
    .unwrap();
    drop(conn);
    db
}

/// `(event_id, attempt)` of every `effects` row of `consumer`, sorted.
async fn effects_of(db: &TestDb, consumer: &str) -> Vec<(uuid::Uuid, i32)> {
    use diesel::sql_types::{Integer, Uuid as SqlUuid};
    use diesel_async::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Effect {
        #[diesel(sql_type = SqlUuid)]
        event_id: uuid::Uuid,
        #[diesel(sql_type = Integer)]
        attempt: i32,
    }
    let mut conn = db.pool.get().await.unwrap();
    let rows: Vec<Effect> = diesel::sql_query(
        "SELECT event_id, attempt FROM effects WHERE consumer = $1 ORDER BY event_id, attempt",
    )
    .bind::<diesel::sql_types::Text, _>(consumer)
    .load(&mut conn)
    .await
    .unwrap();
    rows.into_iter().map(|e| (e.event_id, e.attempt)).collect()
}

fn sorted(mut v: Vec<(uuid::Uuid, i32)>) -> Vec<(uuid::Uuid, i32)> {
    v.sort();
    v
}

#[actix_rt::test]
async fn with_a_database_a_failed_attempt_rolls_back_and_each_event_commits_one_effect() {
    let db = writer_db().await;
    let mut h = Harness::with_database(db.pool.clone());
    let retry = RetryPolicy::fixed(3, Duration::from_secs(60));
    let one = Writer {
        fail_first: &["o2"],
        ..Writer::new(Writes::ThroughDelivery, &db.pool)
    };
    let batch = Writer {
        fail_first: &["o2"],
        ..Writer::new(Writes::ThroughDelivery, &db.pool)
    };
    h.consumer(config("one", retry.clone()), {
        let one = one.clone();
        move || one.clone()
    })
    .unwrap();
    h.batch_consumer(config("batch", retry), {
        let batch = batch.clone();
        move || batch.clone()
    })
    .unwrap();
    let ids: Vec<EventId> = ["o1", "o2", "o3"]
        .iter()
        .map(|o| h.enqueue(&event(o)).unwrap())
        .collect();
    h.publish();

    let out = h.deliver().await;
    assert_eq!(out.len(), 6);
    for consumer in ["one", "batch"] {
        let failed = h.row(consumer, ids[1]).unwrap();
        assert_eq!(
            (failed.status, failed.attempts),
            (InboxStatus::RetryPending, 1)
        );
        // o2's first attempt wrote its row before failing: the rollback took it away.
        assert_eq!(
            effects_of(&db, consumer).await,
            sorted(vec![(ids[0].as_uuid(), 1), (ids[2].as_uuid(), 1)]),
            "{consumer}: the failed attempt's write must roll back"
        );
    }

    h.advance(Duration::from_secs(60));
    let out = h.deliver().await;
    assert_eq!(out.len(), 2, "only o2 was due again");
    for consumer in ["one", "batch"] {
        assert!(h
            .inbox(consumer)
            .iter()
            .all(|r| r.status == InboxStatus::Processed));
        assert_eq!(
            effects_of(&db, consumer).await,
            sorted(vec![
                (ids[0].as_uuid(), 1),
                (ids[1].as_uuid(), 2),
                (ids[2].as_uuid(), 1)
            ]),
            "{consumer}: exactly one effect per event, from its committed attempt"
        );
    }
    // The handlers did run four times each: the missing row is the rollback's doing.
    assert_eq!(one.calls.load(Ordering::SeqCst), 4);
    assert_eq!(batch.calls.load(Ordering::SeqCst), 4);
    db.finish(&[]).await;
}

#[actix_rt::test]
async fn the_redelivery_check_passes_a_consumer_that_writes_through_its_delivery() {
    let db = writer_db().await;
    let mut h = Harness::with_database(db.pool.clone());
    let writer = Writer::new(Writes::ThroughDelivery, &db.pool);
    h.consumer(config("one", RetryPolicy::default()), {
        let writer = writer.clone();
        move || writer.clone()
    })
    .unwrap();
    let ids: Vec<EventId> = ["o1", "o2", "o3"]
        .iter()
        .map(|o| h.enqueue(&event(o)).unwrap())
        .collect();
    h.publish();

    let report = h
        .check_redelivery("SELECT consumer, event_id FROM effects")
        .await
        .unwrap();
    report.assert_idempotent();
    assert_eq!(report.checks.len(), 3, "{report}");
    for (check, id) in report.checks.iter().zip(&ids) {
        assert_eq!(check.event_id, *id);
        assert_eq!(check.event_type, "ORDER_STATUS_CHANGED");
        assert!(check.crash.is_empty(), "{report}");
        // The committed redelivery wrote its row: the check saw the effect.
        assert_eq!(check.redelivery.added.len(), 1, "{report}");
        assert_eq!(check.outcome.status, InboxStatus::Processed);
    }
    // Two deliveries per event, one of them committed, as the runtime would leave it.
    assert_eq!(writer.calls.load(Ordering::SeqCst), 6);
    assert_eq!(
        effects_of(&db, "one").await,
        sorted(ids.iter().map(|id| (id.as_uuid(), 1)).collect())
    );
    assert!(h
        .inbox("one")
        .iter()
        .all(|r| (r.status, r.attempts) == (InboxStatus::Processed, 1)));
    assert!(h
        .check_redelivery("SELECT 1")
        .await
        .unwrap()
        .checks
        .is_empty());
    db.finish(&[]).await;
}

#[actix_rt::test]
async fn the_redelivery_check_reports_a_consumer_that_writes_outside_its_transaction() {
    let db = writer_db().await;
    let mut h = Harness::with_database(db.pool.clone());
    h.consumer(config("mailer", RetryPolicy::default()), {
        let w = Writer::new(Writes::OwnConnection, &db.pool);
        move || w.clone()
    })
    .unwrap();
    h.consumer(config("keyed", RetryPolicy::default()), {
        let w = Writer::new(Writes::OwnConnectionKeyed, &db.pool);
        move || w.clone()
    })
    .unwrap();
    let ids: Vec<EventId> = ["o1", "o2"]
        .iter()
        .map(|o| h.enqueue(&event(o)).unwrap())
        .collect();
    h.publish();

    let report = h
        .check_redelivery(
            "SELECT 'mail' AS kind, event_id FROM sent_mail
             UNION ALL SELECT 'keyed', event_id FROM sent_mail_keyed",
        )
        .await
        .unwrap();
    assert_eq!(report.checks.len(), 4, "{report}");
    assert!(!report.is_idempotent());
    let findings: Vec<_> = report.findings().collect();
    assert_eq!(findings.len(), 2, "{report}");
    for (finding, id) in findings.iter().zip(&ids) {
        assert_eq!(finding.consumer.as_str(), "mailer");
        assert_eq!(finding.event_id, *id);
        let row = format!(r#"{{"kind": "mail", "event_id": "{id}"}}"#);
        assert_eq!(finding.crash.added, vec![row.clone()], "{report}");
        assert_eq!(finding.redelivery.added, vec![row], "{report}");
    }
    // The keyed consumer's crash leaves its row behind too, but the redelivery adds nothing.
    let keyed: Vec<_> = report
        .checks
        .iter()
        .filter(|c| c.consumer.as_str() == "keyed")
        .collect();
    assert_eq!(keyed.len(), 2);
    assert!(keyed
        .iter()
        .all(|c| c.is_idempotent() && c.crash.added.len() == 1 && c.redelivery.is_empty()));

    let message =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| report.assert_idempotent()))
            .expect_err("assert_idempotent must fail")
            .downcast::<String>()
            .unwrap();
    for id in &ids {
        assert!(message.contains(&id.to_string()), "{message}");
    }
    assert!(message.contains("mailer ORDER_STATUS_CHANGED"), "{message}");
    // Every row ends processed all the same: one committed delivery per event.
    for consumer in ["mailer", "keyed"] {
        assert!(h
            .inbox(consumer)
            .iter()
            .all(|r| r.status == InboxStatus::Processed));
    }
    assert_eq!(db.count("SELECT count(*) AS n FROM sent_mail").await, 4);
    db.finish(&[]).await;
}

/// How a [`RuleBreaker`]'s first attempt misuses its delivery's connection.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Breaks {
    /// Keeps the connection past its return (until `release`), and writes then.
    KeepsConnection,
    /// Leaves a transaction of its own open (diesel's depth 2).
    OpensTransaction,
    /// Swallows a failed statement and returns Ok from the aborted transaction.
    SwallowsFailure,
    /// Runs `COMMIT` itself, out of sight of diesel's depth.
    CommitsByHand,
}

/// Writes an `effects` row on each attempt; attempt 1 breaks the lending rules as `breaks`
/// says and returns Ok. Attempt 2 behaves.
#[derive(Clone)]
struct RuleBreaker {
    breaks: Breaks,
    release: Arc<Mutex<Option<tokio::sync::oneshot::Receiver<()>>>>,
    done: Arc<Mutex<Option<tokio::sync::oneshot::Sender<()>>>>,
}

impl RuleBreaker {
    fn new(breaks: Breaks) -> RuleBreaker {
        RuleBreaker {
            breaks,
            release: Arc::default(),
            done: Arc::default(),
        }
    }
}

impl Actor for RuleBreaker {
    type Context = Context<Self>;
}

impl Handler<Delivery> for RuleBreaker {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
        use diesel::sql_types::{Integer, Text, Uuid as SqlUuid};
        use diesel_async::{AnsiTransactionManager, RunQueryDsl, TransactionManager};
        let me = self.clone();
        Box::pin(async move {
            let mut conn = d.conn().await?;
            let breaks = (d.attempt() == 1).then_some(me.breaks);
            if breaks == Some(Breaks::OpensTransaction) {
                AnsiTransactionManager::begin_transaction(&mut *conn).await?;
            }
            let insert = diesel::sql_query(
                "INSERT INTO effects (consumer, event_id, attempt) VALUES ($1, $2, $3)",
            )
            .bind::<Text, _>(d.consumer().as_str().to_owned())
            .bind::<SqlUuid, _>(d.event_id().as_uuid())
            .bind::<Integer, _>(d.attempt() as i32);
            if breaks == Some(Breaks::KeepsConnection) {
                let release = me.release.lock().unwrap().take().unwrap();
                let done = me.done.lock().unwrap().take().unwrap();
                actix_rt::spawn(async move {
                    let _ = release.await;
                    // Into a transaction nobody will commit.
                    let _ = insert.execute(&mut *conn).await;
                    drop(conn);
                    let _ = done.send(());
                });
                return Ok(());
            }
            insert.execute(&mut *conn).await?;
            match breaks {
                Some(Breaks::SwallowsFailure) => {
                    let _ = diesel::sql_query("SELECT 1 / 0").execute(&mut *conn).await;
                }
                Some(Breaks::CommitsByHand) => {
                    diesel::sql_query("COMMIT").execute(&mut *conn).await?;
                }
                _ => {}
            }
            Ok(())
        })
    }
}

#[actix_rt::test]
async fn a_handler_that_misuses_its_connection_fails_that_attempt_and_the_next_commits() {
    use Breaks::*;
    let db = writer_db().await;
    let mut h = Harness::with_database(db.pool.clone());
    let (release, released) = tokio::sync::oneshot::channel();
    let (done, finished) = tokio::sync::oneshot::channel();
    let keeper = RuleBreaker {
        release: Arc::new(Mutex::new(Some(released))),
        done: Arc::new(Mutex::new(Some(done))),
        ..RuleBreaker::new(KeepsConnection)
    };
    let retry = RetryPolicy::fixed(3, Duration::from_secs(1));
    h.consumer(config("keeps", retry.clone()), move || keeper.clone())
        .unwrap();
    let others = [
        ("opens", OpensTransaction),
        ("swallows", SwallowsFailure),
        ("commits", CommitsByHand),
    ];
    for (name, breaks) in others {
        let breaker = RuleBreaker::new(breaks);
        h.consumer(config(name, retry.clone()), move || breaker.clone())
            .unwrap();
    }
    let id = h.enqueue(&event("o1")).unwrap();
    h.publish();

    let out = h.deliver().await;
    assert_eq!(out.len(), 4);
    let message = |consumer: &str| {
        let o = out
            .iter()
            .find(|o| o.consumer.as_str() == consumer)
            .unwrap();
        o.result.as_ref().unwrap_err().message().to_owned()
    };
    assert!(message("keeps").contains("kept its connection"), "{out:?}");
    assert!(message("opens").contains("another depth"), "{out:?}");
    assert!(message("swallows").contains("could not commit"), "{out:?}");
    assert!(
        message("commits").contains("ended the delivery's transaction itself"),
        "{out:?}"
    );
    for consumer in ["keeps", "opens", "swallows", "commits"] {
        let row = h.row(consumer, id).unwrap();
        assert_eq!((row.status, row.attempts), (InboxStatus::RetryPending, 1));
    }
    // The kept connection writes now, then lets go: its transaction never commits.
    release.send(()).unwrap();
    finished.await.unwrap();
    for consumer in ["keeps", "opens", "swallows"] {
        assert!(effects_of(&db, consumer).await.is_empty(), "{consumer}");
    }
    // A COMMIT by hand cannot be undone: the harness fails the attempt, and says so.
    assert_eq!(effects_of(&db, "commits").await, vec![(id.as_uuid(), 1)]);

    // The next attempt gets a sound transaction, and commits.
    h.advance(Duration::from_secs(1));
    h.deliver().await;
    for consumer in ["keeps", "opens", "swallows"] {
        assert_eq!(h.row(consumer, id).unwrap().status, InboxStatus::Processed);
        assert_eq!(effects_of(&db, consumer).await, vec![(id.as_uuid(), 2)]);
    }
    assert_eq!(h.row("commits", id).unwrap().status, InboxStatus::Processed);
    db.finish(&[]).await;
}

#[actix_rt::test]
async fn the_redelivery_check_needs_a_database_and_a_valid_effects_query() {
    let mut h = Harness::new();
    let err = h.check_redelivery("SELECT 1").await.unwrap_err();
    assert_eq!(err.code().as_str(), "CONFIG_INVALID");

    let db = writer_db().await;
    let mut h = Harness::with_database(db.pool.clone());
    h.consumer(config("one", RetryPolicy::default()), {
        let w = Writer::new(Writes::ThroughDelivery, &db.pool);
        move || w.clone()
    })
    .unwrap();
    let id = h.enqueue(&event("o1")).unwrap();
    h.publish();
    let err = h
        .check_redelivery("SELECT nothing FROM no_such_table")
        .await
        .unwrap_err();
    assert_eq!(err.code().as_str(), "DATABASE_ERROR");
    // Refused before anything was delivered.
    assert_eq!(h.row("one", id).unwrap().status, InboxStatus::Received);
    db.finish(&[]).await;
}
