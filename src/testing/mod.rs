//! Test support for applications and for the library's own tests (feature `testing`).
//!
//! [`ScriptedTransport`] is an external [`Transport`] whose every publish follows a script:
//! succeed, fail, hang past the timeout, or "crash" after a successful publish and before the
//! mark. A successful publish records the event in this database's inboxes through
//! [`receive`](crate::transport::receive), as a broker delivering to a consumer service would.
//!
//! [`Harness`] runs consumer actors against an in-memory outbox and inbox with a manual clock.

mod harness;
#[doc(inline)]
pub use crate::runtime::Fault;
pub use harness::{Harness, InboxStatus, InboxView, OutboxStatus, OutboxView, Outcome};

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
