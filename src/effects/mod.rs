//! Side effects: calls to the world outside the database (a payment provider, an e-mail, a
//! partner's webhook) made for an event, at least once, each with an idempotency key the
//! provider can deduplicate on.
//!
//! Such a call cannot sit inside the inbox transaction: it cannot be rolled back, and the
//! transaction could be. So the handler only **records the intent** ([`record`]) in its
//! transaction, beside its other writes, and a worker of the runtime, registered with
//! [`OutboxBuilder::effect`](crate::OutboxBuilder::effect), **makes the call** outside any
//! transaction, with retries, dead letters and pacing like a consumer's.
//!
//! - **Exactly one intent per key.** The inbox makes the handler's writes happen once, and the
//!   table keeps one row per (kind, key): recording an intent again (a replay, a second
//!   event with the same key) adds nothing.
//! - **At least one call per intent, always with its key.** A worker that dies mid-call
//!   leaves the row leased until the call's timeout plus 30 s; then another worker (or the
//!   same after its restart) calls again with the same key. So pass [`Effect::key`] to the
//!   provider as its idempotency key (`Idempotency-Key`, a message id): it turns "at least
//!   once" into one effect at the provider.
//! - **Attempts are counted when claimed**, so a call that kills its process is dead-lettered
//!   after its attempts (`EFFECT_ATTEMPT_INTERRUPTED`) instead of killing every restart. A
//!   row whose worker died is claimed alone next time, so such a call charges no other row.
//!   A panic in the call is a failure (`EFFECT_PANICKED`, retried).
//!
//! The rule the table keeps, in one sentence: a row is due when PENDING and its
//! `next_attempt_at` has passed; a claim counts the attempt and moves `next_attempt_at` past
//! its lease, and an outcome is recorded only by the claim whose attempt is still the row's.
//! (A due row still marked in flight is one whose worker died; it is claimed alone.)

mod worker;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use diesel_async::AsyncPgConnection;

use crate::consumer::{Delivery, HandlerError};
use crate::error::{Error, Result};
use crate::event::EventId;
use crate::retry::RetryPolicy;
use crate::store::effects as stmt;

pub(crate) use worker::{EffectSpec, EffectWorker};

/// An intent to call the outside world, recorded by [`record`].
#[derive(Debug, Clone)]
pub struct NewEffect {
    kind: String,
    key: String,
    payload: serde_json::Value,
    event_id: Option<EventId>,
    consumer: Option<String>,
    correlation_id: Option<String>,
}

impl NewEffect {
    /// An effect of `kind` (the name of the worker that makes it) with the provider's
    /// idempotency `key`: one row, and so one outcome, per (kind, key).
    pub fn new(
        kind: impl Into<String>,
        key: impl Into<String>,
        payload: serde_json::Value,
    ) -> Self {
        NewEffect {
            kind: kind.into(),
            key: key.into(),
            payload,
            event_id: None,
            consumer: None,
            correlation_id: None,
        }
    }

    /// The effect of `kind` that handling `delivery` asks for, keyed
    /// `<consumer>:<event id>`: stable across redeliveries and replays of the event, and
    /// distinct per consumer. For several effects of one kind per event, use
    /// [`new`](Self::new) with keys of your own and [`caused_by`](Self::caused_by).
    pub fn of(delivery: &Delivery, kind: impl Into<String>, payload: serde_json::Value) -> Self {
        let key = format!("{}:{}", delivery.consumer(), delivery.event_id());
        NewEffect::new(kind, key, payload).caused_by(delivery)
    }

    /// Records which event and consumer asked for it, and the event's correlation id.
    pub fn caused_by(mut self, delivery: &Delivery) -> Self {
        self.event_id = Some(delivery.event_id());
        self.consumer = Some(delivery.consumer().to_string());
        self.correlation_id = Some(delivery.correlation_id().to_owned());
        self
    }

    /// The idempotency key.
    pub fn key(&self) -> &str {
        &self.key
    }
}

/// Records `effect` in the caller's transaction (a handler's [`Delivery::conn`]). Returns
/// false when an effect of the same kind and key was recorded before: nothing is added, and
/// the provider is not called again for it.
///
/// # Errors
/// [`Error::Config`] (`CONFIG_INVALID`) for an empty kind or key, or a NUL in either, before
/// any write; [`Error::Database`] when the insert fails.
pub async fn record(conn: &mut AsyncPgConnection, effect: &NewEffect) -> Result<bool> {
    for (what, s) in [("kind", &effect.kind), ("key", &effect.key)] {
        if s.is_empty() || s.contains('\0') {
            return Err(Error::Config(format!(
                "a side effect's {what} must be non-empty text without NUL"
            )));
        }
    }
    stmt::insert(
        conn,
        &effect.kind,
        &effect.key,
        &effect.payload,
        effect.event_id.map(|e| e.as_uuid()),
        effect.consumer.as_deref(),
        effect.correlation_id.as_deref(),
    )
    .await
}

/// One call to make, as the worker's function receives it.
#[derive(Debug, Clone)]
pub struct Effect {
    id: i64,
    kind: Arc<str>,
    key: String,
    payload: serde_json::Value,
    attempt: u32,
    event_id: Option<EventId>,
    correlation_id: Option<String>,
}

impl Effect {
    /// The row's id in `side_effects`.
    pub fn id(&self) -> i64 {
        self.id
    }
    /// The effect's kind.
    pub fn kind(&self) -> &str {
        &self.kind
    }
    /// The idempotency key: pass it to the provider, so that a second call (after a crash)
    /// has one effect there.
    pub fn key(&self) -> &str {
        &self.key
    }
    /// What the handler recorded.
    pub fn payload(&self) -> &serde_json::Value {
        &self.payload
    }
    /// 1 for the first call, counted when claimed (so a call cut short by a crash counts).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
    /// The event that asked for it, if recorded.
    pub fn event_id(&self) -> Option<EventId> {
        self.event_id
    }
    /// The event's correlation id, if recorded.
    pub fn correlation_id(&self) -> Option<&str> {
        self.correlation_id.as_deref()
    }
}

/// The worker's function: makes one call. `Ok` marks the effect DONE; an error is retried on
/// the policy, or dead-lettered when permanent or out of attempts, as a consumer's.
pub(crate) type Perform = Arc<
    dyn Fn(Effect) -> Pin<Box<dyn Future<Output = std::result::Result<(), HandlerError>>>>
        + Send
        + Sync,
>;

/// How one kind of side effect is called. Every setting has a setter that says its default.
#[derive(Debug, Clone)]
pub struct EffectConfig {
    pub(crate) kind: Arc<str>,
    pub(crate) retry: RetryPolicy,
    pub(crate) timeout: Duration,
    pub(crate) concurrency: u32,
    pub(crate) rate_limit: Option<f64>,
    pub(crate) poll_interval: Duration,
}

impl EffectConfig {
    /// The worker of effects of `kind`.
    pub fn new(kind: &str) -> Self {
        EffectConfig {
            kind: Arc::from(kind),
            retry: RetryPolicy::default(),
            timeout: Duration::from_secs(10),
            concurrency: 10,
            rate_limit: None,
            poll_interval: Duration::from_millis(500),
        }
    }

    /// Retries and dead letters, as for a consumer. Default [`RetryPolicy::default`].
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// How long one call may take, at most a day; past it, it counts as failed
    /// (`EFFECT_TIMEOUT`, retried). A claimed row whose worker died comes due again this plus
    /// 30 s after its claim. Keep it below `RuntimeConfig::shutdown_timeout`, or a deploy cuts
    /// calls off (they are then charged and made again). Default 10 s.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Calls at once, per instance. Default 10.
    pub fn concurrency(mut self, concurrency: u32) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// Calls per second, per instance: after an outage the backlog reaches the provider at
    /// this pace, not all at once. Default none.
    pub fn rate_limit(mut self, per_second: f64) -> Self {
        self.rate_limit = Some(per_second);
        self
    }

    /// How often an idle worker looks for due effects. Default 500 ms.
    pub fn poll_interval(mut self, poll_interval: Duration) -> Self {
        self.poll_interval = poll_interval;
        self
    }

    /// The claimed row's lease: the call's timeout plus the longest its outcome may take to
    /// be recorded (a connection, then one bounded statement), plus a margin. Only a worker
    /// that died leaves a row leased that long.
    pub(crate) fn lease(&self) -> Duration {
        self.timeout
            .saturating_add(worker::POOL_WAIT)
            .saturating_add(crate::store::DB_TIMEOUT)
            .saturating_add(Duration::from_secs(5))
    }

    /// Rows one claim takes: the concurrency, cut to a tenth of a second at the rate limit.
    pub(crate) fn claim_size(&self) -> u32 {
        let paced = self
            .rate_limit
            .map_or(u32::MAX, |r| (r / 10.0).ceil().max(1.0) as u32);
        self.concurrency.min(paced)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.kind.is_empty() || self.kind.contains('\0') {
            return Err(Error::Config(
                "a side effect's kind must be non-empty text without NUL".into(),
            ));
        }
        const DAY: Duration = Duration::from_secs(24 * 3600);
        if self.concurrency == 0
            || self.timeout.is_zero()
            || self.timeout > DAY
            || self.poll_interval.is_zero()
            || self.poll_interval > DAY
            || self
                .rate_limit
                .is_some_and(|r| !(r.is_finite() && r >= 0.001))
        {
            return Err(Error::Config(format!(
                "side effect {}: concurrency must be positive, timeout and poll_interval within \
                 a day, and rate_limit at least 0.001 calls per second",
                self.kind
            )));
        }
        self.retry.validate()
    }
}
