//! Inbox-side controls: business idempotency keys, used inside a consumer's transaction, and
//! the per-consumer pause switch.
//!
//! The inbox stops one event from causing its effect twice; a business key stops two
//! *different* events (or an event and a reconciler repair) from causing the same effect,
//! e.g. `notification:order_123:COMPLETED`.

use diesel::sql_types::{Nullable, Text, Uuid as SqlUuid};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::Result;
use crate::event::{ConsumerName, EventId};
use crate::store;

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
/// [`Error::Database`](crate::Error::Database) when the statement fails.
pub async fn claim_key(
    conn: &mut AsyncPgConnection,
    key: &str,
    claimed_by: &str,
    event_id: Option<EventId>,
) -> Result<KeyClaim> {
    if key.is_empty() {
        return Err(crate::Error::InvalidEvent(
            "an idempotency key must not be empty".into(),
        ));
    }
    let inserted = diesel::sql_query(
        "INSERT INTO idempotency_keys (key, claimed_by, event_id) VALUES ($1, $2, $3) \
         ON CONFLICT (key) DO NOTHING",
    )
    .bind::<Text, _>(key)
    .bind::<Text, _>(claimed_by)
    .bind::<Nullable<SqlUuid>, _>(event_id.map(|e| e.as_uuid()))
    .execute(conn)
    .await?;
    Ok(if inserted == 1 {
        KeyClaim::Claimed
    } else {
        KeyClaim::AlreadyDone
    })
}

/// Pauses a consumer on every instance: it claims no new inbox rows until resumed. Its rows
/// stay RECEIVED or RETRY_PENDING (nothing is acknowledged and dropped), publishing and the
/// other consumers carry on. The switch is a database row, so it survives restarts.
///
/// # Errors
/// [`Error::UnknownConsumer`](crate::Error::UnknownConsumer) when no runtime ever registered
/// `consumer`; [`Error::Database`](crate::Error::Database) when the update fails.
pub async fn pause_consumer(
    conn: &mut AsyncPgConnection,
    consumer: &ConsumerName,
    by: &str,
    reason: &str,
) -> Result<()> {
    set(conn, consumer, true, by, Some(reason)).await
}

/// Resumes a paused consumer; its backlog is claimed at its next poll.
///
/// # Errors
/// As [`pause_consumer`].
pub async fn resume_consumer(
    conn: &mut AsyncPgConnection,
    consumer: &ConsumerName,
    by: &str,
) -> Result<()> {
    set(conn, consumer, false, by, None).await
}

async fn set(
    conn: &mut AsyncPgConnection,
    consumer: &ConsumerName,
    paused: bool,
    by: &str,
    reason: Option<&str>,
) -> Result<()> {
    if store::inbox::set_paused(conn, consumer.as_str(), paused, by, reason).await? {
        tracing::info!(consumer = %consumer, paused, by, reason, "consumer pause switch set");
        Ok(())
    } else {
        Err(crate::Error::UnknownConsumer(consumer.to_string()))
    }
}
