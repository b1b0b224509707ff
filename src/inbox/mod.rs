//! Inbox-side controls: business idempotency keys, used inside a consumer's transaction, and
//! the per-consumer pause switch.
//!
//! The inbox stops one event from causing its effect twice; a business key stops two
//! *different* events (or an event and a reconciler repair) from causing the same effect,
//! e.g. `notification:order_123:COMPLETED`.

mod replay;

pub use replay::{
    cancel_replay, replay, replays, ReplayRange, DEFAULT_REPLAY_RATE, MAX_REPLAY_RATE,
};

use diesel::sql_types::{Nullable, Text, Uuid as SqlUuid};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::Result;
use crate::event::{ConsumerName, EventId};
use crate::store;

/// The longest idempotency key [`claim_key`] accepts, in bytes: what a B-tree index entry
/// holds whatever the key (2,704 bytes with its headers), so that a longer key fails here with
/// its own code rather than, depending on how well it compresses, in PostgreSQL as a database
/// error retried until the event is dead-lettered.
pub const MAX_KEY_BYTES: usize = 2600;

/// The outcome of [`claim_key`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "skip the effect when the key was already claimed"]
pub enum KeyClaim {
    /// This transaction owns the key: perform the effect.
    Claimed,
    /// Someone already performed the effect: skip it. Not an error.
    AlreadyDone,
}

/// Claims the business idempotency `key` in the caller's transaction. If the transaction rolls
/// back, so does the claim. Two concurrent claims of one key: the second waits for the first
/// transaction and then reports [`KeyClaim::AlreadyDone`] (or claims it, if the first rolled
/// back).
///
/// `claimed_by` and `event_id` are recorded for operators.
///
/// # Errors
/// [`Error::InvalidKey`](crate::Error::InvalidKey) (`IDEMPOTENCY_KEY_INVALID`) before any
/// write for an empty key, a key longer than [`MAX_KEY_BYTES`], or a NUL in the key or in
/// `claimed_by` (a handler's `?` makes it a permanent failure: no retry can fix it);
/// [`Error::Database`](crate::Error::Database) when the statement fails.
pub async fn claim_key(
    conn: &mut AsyncPgConnection,
    key: &str,
    claimed_by: &str,
    event_id: Option<EventId>,
) -> Result<KeyClaim> {
    let invalid = if key.is_empty() {
        Some("must not be empty".to_owned())
    } else if key.len() > MAX_KEY_BYTES {
        Some(format!("{} bytes, more than {MAX_KEY_BYTES}", key.len()))
    } else if key.contains('\0') || claimed_by.contains('\0') {
        Some("a NUL in the key or in claimed_by".to_owned())
    } else {
        None
    };
    if let Some(why) = invalid {
        return Err(crate::Error::InvalidKey(why));
    }
    let inserted = crate::store::Prepared(
        crate::store::sql(
            "INSERT INTO actix_outbox.idempotency_keys (key, claimed_by, event_id) VALUES ($1, $2, $3) \
         ON CONFLICT (key) DO NOTHING",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(claimed_by)
        .bind::<Nullable<SqlUuid>, _>(event_id.map(|e| e.as_uuid())),
    )
    .execute(conn)
    .await?;
    Ok(if inserted == 1 {
        KeyClaim::Claimed
    } else {
        KeyClaim::AlreadyDone
    })
}

/// Pauses a consumer on every instance: it claims no new inbox rows until resumed, or until
/// `until` when given (the pause then lifts itself, on every instance at once). Its rows stay
/// RECEIVED or RETRY_PENDING (nothing is acknowledged and dropped), publishing and the other
/// consumers carry on. The switch is a database row, so it survives restarts. A consumer no
/// runtime has registered yet can be paused too: it starts paused, so that a new consumer can
/// ship switched off.
///
/// # Errors
/// [`Error::Database`](crate::Error::Database) when the write fails.
pub async fn pause_consumer(
    conn: &mut AsyncPgConnection,
    consumer: &ConsumerName,
    by: &str,
    reason: &str,
    until: Option<chrono::DateTime<chrono::Utc>>,
) -> Result<()> {
    store::inbox::pause(conn, consumer.as_str(), by, reason, until).await?;
    tracing::info!(consumer = %consumer, by, reason, until = ?until, "consumer paused");
    Ok(())
}

/// Resumes a paused consumer; its backlog is claimed at its next poll.
///
/// # Errors
/// [`Error::UnknownConsumer`](crate::Error::UnknownConsumer) when no runtime ever registered
/// `consumer` and nobody paused it; [`Error::Database`](crate::Error::Database) when the
/// update fails.
pub async fn resume_consumer(
    conn: &mut AsyncPgConnection,
    consumer: &ConsumerName,
    by: &str,
) -> Result<()> {
    if store::inbox::resume(conn, consumer.as_str(), by).await? {
        tracing::info!(consumer = %consumer, by, "consumer resumed");
        Ok(())
    } else {
        Err(crate::Error::UnknownConsumer(consumer.to_string()))
    }
}

/// Removes `consumer`'s subscription to `event_type` on every instance: events of that type
/// published from now on get no inbox row for it. Its inbox rows already written stay and are
/// delivered as usual. A runtime never removes a subscription by itself (one whose code no
/// longer subscribes logs a warning naming it at start), because during a rolling deployment
/// other instances may still run the code that handles it. Returns whether the subscription
/// existed.
///
/// # Errors
/// [`Error::UnknownConsumer`](crate::Error::UnknownConsumer) when no runtime ever registered
/// `consumer`; [`Error::Database`](crate::Error::Database) when the delete fails.
pub async fn unsubscribe(
    conn: &mut AsyncPgConnection,
    consumer: &ConsumerName,
    event_type: &str,
) -> Result<bool> {
    match store::inbox::remove_subscription(conn, consumer.as_str(), event_type).await? {
        Some(removed) => {
            tracing::info!(consumer = %consumer, event_type, removed, "subscription removed");
            Ok(removed)
        }
        None => Err(crate::Error::UnknownConsumer(consumer.to_string())),
    }
}

/// What [`receive`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Received {
    /// New inbox rows (one per subscribed consumer that did not have the event yet).
    pub new: usize,
    /// Consumers that already had the event: duplicates absorbed (`DUPLICATE_EVENT`, info).
    pub duplicates: usize,
}

/// The receiving side of an external transport: records `event` in the inbox of every consumer
/// subscribed to its type, in the caller's transaction. Receiving the same event again changes
/// nothing while its inbox rows exist, so a broker may redeliver freely; acknowledge the broker
/// only after this commits. Once [`Retention`](crate::retention::Retention) has deleted a PROCESSED row
/// (after `processed_inbox_after`, 30 days by default), the same event is new again: keep the
/// broker's redelivery window shorter than that.
///
/// # Errors
/// [`Error::Database`](crate::Error::Database) when the insert fails.
pub async fn receive(
    conn: &mut AsyncPgConnection,
    event: &crate::event::OutboxEvent,
) -> Result<Received> {
    let rows = store::inbox::receive(conn, event).await?;
    // Counted and logged per consumer, as the in-process fan-out does, so that the
    // duplicate-rate alarm sees the redeliveries of external transports. Counted when written:
    // a caller that then rolls back has counted them anyway.
    for row in &rows {
        let mut fields: crate::telemetry::EventFields<'_> = event.into();
        fields.consumer = Some(&row.consumer);
        if row.new {
            crate::telemetry::metrics::inbox_received(&row.consumer, 1);
            crate::telemetry::event!(debug, "event.received", fields);
        } else {
            crate::telemetry::metrics::inbox_duplicate(&row.consumer, 1);
            crate::telemetry::event!(info, "event.duplicate", fields, code = "DUPLICATE_EVENT");
        }
    }
    let new = rows.iter().filter(|r| r.new).count();
    let duplicates = rows.len() - new;
    Ok(Received { new, duplicates })
}

/// The log fields of an event a transport publishes or a receiving side records (here, the
/// lowest module that logs one; the publisher's external route uses it too).
impl<'a> From<&'a crate::event::OutboxEvent> for crate::telemetry::EventFields<'a> {
    fn from(e: &'a crate::event::OutboxEvent) -> Self {
        crate::telemetry::EventFields {
            consumer: None,
            event_id: e.id.as_uuid(),
            event_type: &e.event_type,
            aggregate_id: &e.aggregate_id,
            correlation_id: Some(&e.correlation_id),
            causation_id: e.causation_id.as_deref(),
            attempt: Some(i64::from(e.attempt)),
        }
    }
}
