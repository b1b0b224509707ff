//! Test support for applications and for the library's own tests (feature `testing`).
//!
//! [`ScriptedTransport`] is an external [`Transport`] whose every publish follows a script:
//! succeed, fail, hang past the timeout, or "crash" after a successful publish and before the
//! mark. A successful publish records the event in this database's inboxes through
//! [`receive`](crate::transport::receive), as a broker delivering to a consumer service would.
//!
//! [`Harness`] runs consumer actors against an in-memory outbox and inbox with a manual clock.
//!
//! # Consumers that write
//!
//! Most consumers write their effect through [`Delivery::conn`](crate::Delivery::conn), in the
//! transaction that marks the event processed. [`Harness::with_database`] gives the harness a
//! pool: each attempt then runs in a real transaction on it, committed when the handler
//! succeeds and rolled back when the attempt fails or crashes, while the clock, the delivery
//! order and the inbox stay the harness's. The test counts the effect rows in the database.
//!
//! Why a check on top: the inbox never delivers a processed event twice, so a consumer that
//! writes outside its transaction (a pool connection of its own, a mail sent before the
//! commit) passes every ordinary test and repeats its effect only when the process dies
//! between the handler and the commit. [`Harness::check_redelivery`] makes that crash happen
//! for every due event and compares the effects before the crash, after it, and after the
//! redelivery; [`RedeliveryReport::assert_idempotent`] fails the test with the events whose
//! effect the crash repeated.
//!
//! The database must have the library's tables ([`migrate`](crate::migrate)) for handlers
//! that enqueue follow-ups, and the application's tables the handlers write to. A database per
//! test keeps tests apart.
//!
//! A test for a notification consumer (as in the order-service example), which writes one
//! job per status change through its delivery:
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use actix::prelude::*;
//! use actix_outbox::testing::{Harness, InboxStatus};
//! use actix_outbox::{ConsumerConfig, Delivery, HandlerError, NewEvent, RetryPolicy};
//! use diesel::sql_types::{BigInt, Text};
//! use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
//!
//! #[derive(serde::Deserialize)]
//! struct StatusChanged {
//!     order_id: String,
//!     status: String,
//! }
//!
//! /// One notification job per status change, written in the delivery's transaction.
//! struct NotificationConsumer;
//!
//! impl Actor for NotificationConsumer {
//!     type Context = Context<Self>;
//! }
//!
//! impl Handler<Delivery> for NotificationConsumer {
//!     type Result = ResponseFuture<Result<(), HandlerError>>;
//!
//!     fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
//!         Box::pin(async move {
//!             let change: StatusChanged = d.decode()?;
//!             let mut conn = d.conn().await?;
//!             diesel::sql_query("INSERT INTO notification_jobs (order_id, status) VALUES ($1, $2)")
//!                 .bind::<Text, _>(&change.order_id)
//!                 .bind::<Text, _>(&change.status)
//!                 .execute(&mut *conn)
//!                 .await?;
//!             if change.status == "SHIPPED" && d.attempt() == 1 {
//!                 // The job above rolls back with this attempt.
//!                 return Err(HandlerError::retry("mail gateway busy"));
//!             }
//!             Ok(())
//!         })
//!     }
//! }
//!
//! #[derive(diesel::QueryableByName)]
//! struct Count {
//!     #[diesel(sql_type = BigInt)]
//!     n: i64,
//! }
//!
//! // In a test: #[actix_rt::test] async fn notifications_are_written_once_per_event()
//! async fn notifications_are_written_once_per_event() -> actix_outbox::Result<()> {
//!     // A fresh database of the test's own.
//!     let url = std::env::var("DATABASE_URL").expect("a test database");
//!     actix_outbox::migrate(&url).await?;
//!     let pool = actix_outbox::connect(&url, 4).await?;
//!     let mut conn = pool.get().await?;
//!     conn.batch_execute("CREATE TABLE notification_jobs (order_id text, status text)")
//!         .await?;
//!
//!     let mut h = Harness::with_database(pool.clone());
//!     let retry = RetryPolicy::fixed(3, Duration::from_secs(60));
//!     let config = ConsumerConfig::new("notifications")
//!         .subscribe("ORDER_STATUS_CHANGED")
//!         .retry(retry);
//!     h.consumer(config, || NotificationConsumer)?;
//!     for (order, status) in [("o1", "PAID"), ("o2", "SHIPPED")] {
//!         let payload = serde_json::json!({ "order_id": order, "status": status });
//!         h.enqueue(&NewEvent::new("ORDER_STATUS_CHANGED", "order", order, payload))?;
//!     }
//!     h.publish();
//!
//!     // Each event crashes before its commit and is delivered again: no job may be left
//!     // behind by the crash. o2's redelivery fails (its first attempt) and rolls back.
//!     h.check_redelivery("SELECT order_id, status FROM notification_jobs")
//!         .await?
//!         .assert_idempotent();
//!     h.advance(Duration::from_secs(60));
//!     h.deliver().await; // o2, attempt 2
//!
//!     let inbox = h.inbox("notifications");
//!     assert!(inbox.iter().all(|r| r.status == InboxStatus::Processed));
//!     let jobs: Count = diesel::sql_query("SELECT count(*) AS n FROM notification_jobs")
//!         .get_result(&mut conn)
//!         .await?;
//!     assert_eq!(jobs.n, 2, "one job per event");
//!     Ok(())
//! }
//! # fn main() {
//! #     actix_rt::System::new().block_on(notifications_are_written_once_per_event()).unwrap();
//! # }
//! ```

mod harness;
#[doc(inline)]
pub use crate::runtime::Fault;
pub use harness::{
    EffectChanges, Harness, InboxStatus, InboxView, OutboxStatus, OutboxView, Outcome,
    RedeliveryCheck, RedeliveryReport,
};

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::ErrorCode;
use crate::event::EventId;
use crate::event::OutboxEvent;
use crate::publisher::{Transport, TransportError};
use crate::reconciler::BoxFuture;
use crate::store::PgPool;

/// What one publish call does.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Step {
    /// Deliver to the inbox and report success.
    Ok,
    /// Report a retryable failure without delivering.
    Fail,
    /// Report a permanent rejection without delivering.
    Reject,
    /// Wait this long, then deliver and report success (a slow broker; past the publisher's
    /// timeout the call is cancelled before delivering).
    Hang(Duration),
    /// Deliver, then panic before the publisher can mark the row: the publisher actor dies
    /// with the row still leased.
    CrashAfterPublish,
}

/// One publish call as the transport saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// The event id (the same on every retry).
    pub event_id: EventId,
    /// The publish attempt.
    pub attempt: u32,
    /// The step that was played.
    pub step: Step,
    /// Whether the call ran to its end (a cancelled `Hang` did not).
    pub finished: bool,
}

/// A scriptable [`Transport`]; cheap to clone, all clones share the script and the call log.
#[derive(Clone)]
pub struct ScriptedTransport {
    pool: PgPool,
    script: Arc<Mutex<VecDeque<Step>>>,
    calls: Arc<Mutex<Vec<Call>>>,
}

impl ScriptedTransport {
    /// A transport that delivers into the inboxes of the database behind `pool`. With an
    /// empty script every publish succeeds.
    pub fn new(pool: PgPool) -> Self {
        ScriptedTransport {
            pool,
            script: Arc::default(),
            calls: Arc::default(),
        }
    }

    /// Appends steps to the script; each publish call takes the next one.
    pub fn script(&self, steps: impl IntoIterator<Item = Step>) {
        self.script
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(steps);
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn log(&self, event: &OutboxEvent, step: &Step, finished: bool) -> usize {
        let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        calls.push(Call {
            event_id: event.id,
            attempt: event.attempt,
            step: step.clone(),
            finished,
        });
        calls.len() - 1
    }

    async fn deliver(&self, event: &OutboxEvent) -> Result<(), TransportError> {
        let mut conn = self
            .pool
            .get()
            .await
            .map_err(|e| TransportError::Retryable(e.to_string()))?;
        crate::transport::receive(&mut conn, event)
            .await
            .map_err(|e| TransportError::Retryable(e.to_string()))?;
        Ok(())
    }
}

impl Transport for ScriptedTransport {
    fn publish<'a>(&'a self, event: &'a OutboxEvent) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let step = self
                .script
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop_front()
                .unwrap_or(Step::Ok);
            match step {
                Step::Ok => {
                    self.deliver(event).await?;
                    self.log(event, &step, true);
                    Ok(())
                }
                Step::Fail => {
                    self.log(event, &step, true);
                    Err(TransportError::Retryable("scripted failure".into()))
                }
                Step::Reject => {
                    self.log(event, &step, true);
                    Err(TransportError::Permanent {
                        code: ErrorCode::new("SCRIPTED_REJECT"),
                        message: "scripted rejection".into(),
                    })
                }
                Step::Hang(d) => {
                    let i = self.log(event, &step, false);
                    tokio::time::sleep(d).await;
                    self.deliver(event).await?;
                    self.calls.lock().unwrap_or_else(|e| e.into_inner())[i].finished = true;
                    Ok(())
                }
                Step::CrashAfterPublish => {
                    self.deliver(event).await?;
                    self.log(event, &step, true);
                    panic!("scripted crash after publishing {}", event.id);
                }
            }
        })
    }
}
