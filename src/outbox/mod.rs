//! Enqueue: writing events in the caller's own transaction.
//!
//! There is deliberately no function that takes a pool: an enqueue outside the business
//! transaction is the dual write this library exists to remove.

use diesel_async::AsyncPgConnection;

use crate::error::Result;
use crate::event::{EventId, NewEvent};
use crate::store;

/// Writes one event to the outbox on `conn`, which should be inside the caller's transaction.
///
/// If the caller's transaction rolls back, the event never existed; if this fails, the caller
/// propagates the error and the business change rolls back with it. The event becomes visible
/// to the publisher when the transaction commits; call
/// [`OutboxHandle::wake`](crate::OutboxHandle::wake) after the commit for immediate delivery
/// (otherwise the next poll finds it).
///
/// # Errors
/// [`Error::InvalidEvent`](crate::Error::InvalidEvent) (`EVENT_SCHEMA_INVALID`) before any write
/// when the event is malformed; [`Error::Database`](crate::Error::Database) when the insert
/// fails (e.g. the same event id twice).
pub async fn enqueue(conn: &mut AsyncPgConnection, event: &NewEvent) -> Result<EventId> {
    event.validate()?;
    store::outbox::insert_events(conn, std::slice::from_ref(event)).await?;
    tracing::debug!(
        name: "outbox.created",
        event_id = %event.id,
        event_type = %event.event_type,
        aggregate_id = %event.aggregate_id,
        "outbox.created"
    );
    Ok(event.id)
}

/// Writes several events with one statement. All are validated before anything is written:
/// either every event is inserted or none is.
///
/// # Errors
/// As [`enqueue`].
pub async fn enqueue_many(
    conn: &mut AsyncPgConnection,
    events: &[NewEvent],
) -> Result<Vec<EventId>> {
    for event in events {
        event.validate()?;
    }
    store::outbox::insert_events(conn, events).await?;
    Ok(events.iter().map(|e| e.id).collect())
}
