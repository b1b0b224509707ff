//! Asking for a replay: an operator re-applies events one consumer already processed. The
//! consumer's own engine runs it (`consumer/replay.rs`); here are the request, its checks and
//! its audit row.

use chrono::{DateTime, Utc};
use diesel_async::{AsyncConnection, AsyncPgConnection};

use crate::error::{Error, Result};
use crate::event::ConsumerName;
use crate::store::replay::{self as stmt, Replay};

/// The default rate limit of a replay, in events per second: slow enough to leave the
/// database and the handler's downstream to live traffic.
pub const DEFAULT_REPLAY_RATE: f64 = 50.0;
/// The highest rate limit a replay takes, in events per second.
pub const MAX_REPLAY_RATE: f64 = 10_000.0;
/// Replays [`replays`] lists at most.
const LIST_LIMIT: i64 = 100;

/// Which of a consumer's processed events a replay re-applies, and how fast. Every filter
/// narrows the range; with none, it is every event the consumer processed.
///
/// ```
/// use actix_outbox::ops::ReplayRange;
/// let since = chrono::DateTime::parse_from_rfc3339("2026-11-30T00:00:00Z").unwrap().to_utc();
/// let range = ReplayRange::all()
///     .event_type("ORDER_COMPLETED")
///     .created_from(since)
///     .rate(200.0);
/// ```
#[derive(Debug, Clone)]
pub struct ReplayRange {
    event_types: Vec<String>,
    from: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    correlation_id: Option<String>,
    rate: f64,
}

impl Default for ReplayRange {
    fn default() -> Self {
        Self::all()
    }
}

impl ReplayRange {
    /// Every event the consumer processed, at [`DEFAULT_REPLAY_RATE`].
    pub fn all() -> Self {
        ReplayRange {
            event_types: Vec::new(),
            from: None,
            until: None,
            correlation_id: None,
            rate: DEFAULT_REPLAY_RATE,
        }
    }
    /// Only events of this type (call again to add more types).
    pub fn event_type(mut self, event_type: &str) -> Self {
        if !self.event_types.iter().any(|t| t == event_type) {
            self.event_types.push(event_type.to_owned());
        }
        self
    }
    /// Only events written (enqueued) at or after `at`.
    pub fn created_from(mut self, at: DateTime<Utc>) -> Self {
        self.from = Some(at);
        self
    }
    /// Only events written before `at`.
    pub fn created_until(mut self, at: DateTime<Utc>) -> Self {
        self.until = Some(at);
        self
    }
    /// Only events of this correlation id (one request's).
    pub fn correlation_id(mut self, id: &str) -> Self {
        self.correlation_id = Some(id.to_owned());
        self
    }
    /// The rate limit, in events per second (default [`DEFAULT_REPLAY_RATE`], at most
    /// [`MAX_REPLAY_RATE`]).
    pub fn rate(mut self, per_second: f64) -> Self {
        self.rate = per_second;
        self
    }

    fn validate(&self) -> Result<()> {
        let invalid = |m: String| Err(Error::InvalidReplay(m));
        if !(self.rate > 0.0 && self.rate <= MAX_REPLAY_RATE) {
            return invalid(format!(
                "rate {} is not within (0, {MAX_REPLAY_RATE}] events per second",
                self.rate
            ));
        }
        if let (Some(from), Some(until)) = (self.from, self.until) {
            if from >= until {
                return invalid(format!("the window {from} .. {until} is empty"));
            }
        }
        if self.event_types.iter().any(|t| t.is_empty()) {
            return invalid("an empty event type".into());
        }
        if self.correlation_id.as_deref() == Some("") {
            return invalid("an empty correlation id".into());
        }
        Ok(())
    }
}

/// Asks for a replay of `range` to `consumer` alone, audited as `by` with `reason`, in one
/// transaction (a savepoint of the caller's, if it has one open). The consumer's runtimes run
/// it from their next poll, at the range's rate, without touching its inbox rows: live events
/// flow beside it, and the handler sees [`DeliveryMode::Replay`](crate::DeliveryMode::Replay).
/// Its progress is the returned [`Replay`]'s `done` of `total`, as [`replays`] shows it.
///
/// What counts: the events the consumer's handler applied (PROCESSED, not as stale) when the
/// replay is asked for. Each is re-applied once, in inbox order, each step's effects
/// committing with the replay's progress. A step that fails is retried by the consumer's
/// [`RetryPolicy`](crate::RetryPolicy); past it, the replay ends `FAILED` at that event.
///
/// A consumer that reads through [cursors](crate::ConsumerConfig::cursor) has no inbox row of
/// what it handled there; for it, what counts is also every published event of its types
/// with no inbox row of it that its cursors read before its oldest unread event (by stamp,
/// the log's commit order) when the replay is asked for, as long as the outbox keeps it.
/// These are re-applied first, in the order they were published, then its inbox rows. Not
/// replayed: an event it handled past an older one still unread when the replay was asked
/// for, and what it read through cursors it has since dropped (turned off).
///
/// # Errors
/// Before any write: [`Error::InvalidReplay`] (`REPLAY_INVALID`) for an empty window, an empty
/// type or correlation id, or a rate out of range; [`Error::UnknownConsumer`] for a consumer
/// never registered; [`Error::NotReplaySafe`] (`CONSUMER_NOT_REPLAY_SAFE`) for one whose code
/// does not set [`ConsumerConfig::replay_safe`](crate::ConsumerConfig::replay_safe).
/// [`Error::Database`] when a statement fails.
pub async fn replay(
    conn: &mut AsyncPgConnection,
    consumer: &ConsumerName,
    range: &ReplayRange,
    by: &str,
    reason: &str,
) -> Result<Replay> {
    range.validate()?;
    let name = consumer.as_str();
    let replay = conn
        .transaction::<_, Error, _>(async |conn| {
            match stmt::replay_safe(conn, name).await? {
                None => return Err(Error::UnknownConsumer(name.to_owned())),
                Some(false) => return Err(Error::NotReplaySafe(name.to_owned())),
                Some(true) => {}
            }
            let r = stmt::Range {
                consumer: name,
                event_types: &range.event_types,
                from: range.from,
                until: range.until,
                correlation_id: range.correlation_id.as_deref(),
            };
            let reason = Some(reason).filter(|r| !r.is_empty());
            let replay = stmt::insert(conn, &r, range.rate, by, reason).await?;
            let details = serde_json::json!({ "replay": replay.id, "total": replay.total,
                "event_types": replay.event_types, "created_from": replay.created_from,
                "created_until": replay.created_until, "correlation_id": replay.correlation_id,
                "rate": replay.rate });
            let target = format!("consumer:{name}");
            crate::store::audit::insert_audit(
                conn,
                by,
                "consumer.replay",
                &target,
                reason,
                &details,
            )
            .await?;
            Ok(replay)
        })
        .await?;
    tracing::info!(consumer = %consumer, replay = replay.id, total = replay.total, by, reason,
        "replay requested");
    Ok(replay)
}

/// Cancels a running replay, audited as `by`: it stops before its next step, and what it
/// re-applied stays. A step in flight finishes first (the call waits for it). A replay that
/// already ended is returned as it is.
///
/// # Errors
/// [`Error::UnknownReplay`] (`REPLAY_UNKNOWN`) for an unknown id; [`Error::Database`] when a
/// statement fails.
pub async fn cancel_replay(conn: &mut AsyncPgConnection, id: i64, by: &str) -> Result<Replay> {
    let replay = conn
        .transaction::<_, Error, _>(async |conn| {
            let replay = stmt::cancel(conn, id)
                .await?
                .ok_or(Error::UnknownReplay(id))?;
            let details = serde_json::json!({ "replay": id, "done": replay.done,
                "total": replay.total, "status": replay.status });
            let target = format!("consumer:{}", replay.consumer);
            crate::store::audit::insert_audit(
                conn,
                by,
                "consumer.replay.cancel",
                &target,
                None,
                &details,
            )
            .await?;
            Ok(replay)
        })
        .await?;
    tracing::info!(consumer = %replay.consumer, replay = id, by, "replay cancelled");
    Ok(replay)
}

/// The newest replays (at most 100), of one consumer or of all.
///
/// # Errors
/// [`Error::Database`] when the query fails.
pub async fn replays(
    conn: &mut AsyncPgConnection,
    consumer: Option<&ConsumerName>,
) -> Result<Vec<Replay>> {
    stmt::list(conn, consumer.map(|c| c.as_str()), LIST_LIMIT).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_that_cannot_run_is_refused_before_any_write() {
        let code = |r: ReplayRange| r.validate().unwrap_err().code().as_str().to_owned();
        assert!(ReplayRange::all().validate().is_ok());
        assert_eq!(code(ReplayRange::all().rate(0.0)), "REPLAY_INVALID");
        assert_eq!(code(ReplayRange::all().rate(f64::NAN)), "REPLAY_INVALID");
        assert_eq!(
            code(ReplayRange::all().rate(MAX_REPLAY_RATE * 2.0)),
            "REPLAY_INVALID"
        );
        let t = Utc::now();
        assert_eq!(
            code(ReplayRange::all().created_from(t).created_until(t)),
            "REPLAY_INVALID"
        );
        assert_eq!(code(ReplayRange::all().event_type("")), "REPLAY_INVALID");
        assert_eq!(
            code(ReplayRange::all().correlation_id("")),
            "REPLAY_INVALID"
        );
        assert!(ReplayRange::all()
            .created_until(t)
            .created_from(t - chrono::TimeDelta::seconds(1))
            .validate()
            .is_ok());
    }
}
