//! External transports: publishing outbox events to a broker (for consumers in other services)
//! under a lease, with fenced marks.
//!
//! The publish happens outside any database transaction, so its outcome can be unknown: a
//! publisher may die after the broker accepted the event and before the row was marked. The
//! lease makes that safe: the row stays PROCESSING until the lease expires, the reaper returns
//! it to RETRY_PENDING, and the event is published again. That duplicate is expected; the
//! receiving side ([`receive`](crate::transport::receive)) writes into an inbox that absorbs it.

use std::time::Duration;

use crate::error::{Error, ErrorCode};
use crate::event::redact::Redactor;
use crate::event::{EventId, OutboxEvent};
use crate::messages::BoxFuture;
use crate::retry::RetryPolicy;
use crate::store::lease::LeasedRow;

impl From<LeasedRow> for OutboxEvent {
    fn from(r: LeasedRow) -> Self {
        OutboxEvent {
            id: EventId::from_uuid(r.id),
            event_type: r.event_type,
            event_version: r.event_version,
            aggregate_type: r.aggregate_type,
            aggregate_id: r.aggregate_id,
            aggregate_version: r.aggregate_version,
            payload: r.payload,
            metadata: r.metadata,
            correlation_id: r.correlation_id,
            causation_id: r.causation_id,
            created_at: r.created_at,
            attempt: r.attempt_count.max(1) as u32,
        }
    }
}

/// Why a publish failed; decides between retry and dead letter.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The broker may accept it later (unreachable, overloaded): retried with backoff.
    #[error("publish failed: {0}")]
    Retryable(String),
    /// The broker did not confirm in time (its own acknowledgement timeout, shorter than
    /// [`ExternalConfig::publish_timeout`]): retried with backoff like `Retryable`, stored as
    /// `OUTBOX_PUBLISH_TIMEOUT`. The broker may have stored it: the retry keeps the event id.
    #[error("publish not confirmed: {0}")]
    Timeout(String),
    /// The broker will never accept it (rejected as malformed): dead-lettered at once.
    #[error("publish rejected: {message}")]
    Permanent {
        /// Stored as `error_code`.
        code: ErrorCode,
        /// Stored as `last_error`.
        message: String,
    },
}

/// Publishes outbox events to something outside the database.
pub trait Transport: 'static {
    /// Publishes one event. Called outside any transaction and cancelled at
    /// [`ExternalConfig::publish_timeout`]. It may be called more than once for one event
    /// (after a timeout or a crash), always with the same [`OutboxEvent::id`].
    fn publish<'a>(&'a self, event: &'a OutboxEvent) -> BoxFuture<'a, Result<(), TransportError>>;
}

/// How the publisher uses an external transport.
#[derive(Debug, Clone)]
pub struct ExternalConfig {
    pub(crate) owner: String,
    pub(crate) lease: Duration,
    pub(crate) publish_timeout: Duration,
    pub(crate) retry: RetryPolicy,
    pub(crate) reap_interval: Duration,
    pub(crate) batch_size: u32,
    pub(crate) concurrency: Option<u32>,
    pub(crate) rate_limit: Option<f64>,
    /// Set by the builder from [`RuntimeConfig::redact_errors`](crate::RuntimeConfig::redact_errors).
    pub(crate) redact: Redactor,
}

/// Setters, one per setting: start from the default and chain them; the runtime checks the
/// whole at start.
impl ExternalConfig {
    /// This publisher's name in `locked_by`. Default `publisher-<random>`.
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = owner.into();
        self
    }

    /// How long a claim holds a row. Must be well above `publish_timeout`. Default 60 s.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long one publish may take. Default 10 s.
    pub fn publish_timeout(mut self, publish_timeout: Duration) -> Self {
        self.publish_timeout = publish_timeout;
        self
    }

    /// Retry policy for failed publishes. Default [`RetryPolicy::default`].
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// How often expired leases are reaped. Default 5 s.
    pub fn reap_interval(mut self, reap_interval: Duration) -> Self {
        self.reap_interval = reap_interval;
        self
    }

    /// Rows claimed per lease. Default 100.
    pub fn batch_size(mut self, batch_size: u32) -> Self {
        self.batch_size = batch_size;
        self
    }

    /// At most this many publishes in flight at once (a batch is then at most this many rows,
    /// published together). Default: the batch size.
    pub fn concurrency(mut self, concurrency: u32) -> Self {
        self.concurrency = Some(concurrency);
        self
    }

    /// At most this many events published per second, per publisher (runtime instance): after
    /// an outage the backlog drains at this pace instead of at full speed, so the broker and
    /// the consumers behind it are not stormed. Batches are then cut to a tenth of a second's
    /// worth. Default: none.
    pub fn rate_limit(mut self, per_second: f64) -> Self {
        self.rate_limit = Some(per_second);
        self
    }

    /// Rows one claim takes: the batch size, cut to the concurrency and to a tenth of a
    /// second at the rate limit.
    pub(crate) fn claim_size(&self) -> u32 {
        let paced = self
            .rate_limit
            .map_or(u32::MAX, |r| (r / 10.0).ceil().max(1.0) as u32);
        self.batch_size
            .min(self.concurrency.unwrap_or(u32::MAX))
            .min(paced)
    }
}

impl Default for ExternalConfig {
    fn default() -> Self {
        ExternalConfig {
            owner: format!("publisher-{}", uuid::Uuid::now_v7().simple()),
            lease: Duration::from_secs(60),
            publish_timeout: Duration::from_secs(10),
            retry: RetryPolicy::default(),
            reap_interval: Duration::from_secs(5),
            batch_size: 100,
            concurrency: None,
            rate_limit: None,
            redact: Redactor::default(),
        }
    }
}

impl ExternalConfig {
    pub(crate) fn validate(&self) -> crate::Result<()> {
        self.retry.validate()?;
        if self.publish_timeout.is_zero() || self.reap_interval.is_zero() || self.batch_size == 0 {
            return Err(Error::Config(
                "publish_timeout, reap_interval and batch_size must be positive".into(),
            ));
        }
        if self.concurrency == Some(0)
            || self.rate_limit.is_some_and(|r| !(r.is_finite() && r > 0.0))
        {
            return Err(Error::Config(
                "concurrency must be at least 1, and rate_limit a positive number of events per second".into(),
            ));
        }
        if self.lease <= self.publish_timeout {
            return Err(Error::Config(
                "the lease must be longer than the publish timeout, or a slow publish loses its lease".into(),
            ));
        }
        Ok(())
    }
}
