//! Enqueue: writing events in the caller's own transaction.
//!
//! There is deliberately no function that takes a pool: an enqueue outside the business
//! transaction is the dual write this library exists to remove.

use diesel::pg::Pg;
use diesel::query_builder::QueryFragment;
use diesel_async::AsyncPgConnection;

mod registered;

use crate::error::Result;
use crate::event::{EventId, NewEvent, PayloadRules};
use crate::store;

/// Writes one event to the outbox on `conn`, which should be inside the caller's transaction.
///
/// If the caller's transaction rolls back, the event never existed; if this fails, the caller
/// propagates the error and the business change rolls back with it. The event becomes visible
/// to the publisher when the transaction commits; call
/// [`OutboxHandle::wake`](crate::OutboxHandle::wake) after the commit for immediate delivery
/// (otherwise the next poll finds it).
///
/// This checks the envelope, the payload's size, and the keys of payload and metadata (nothing
/// secret-looking); for type, version and payload-shape checks against registered types,
/// enqueue through an [`EventRegistry`](crate::EventRegistry).
///
/// It takes a shared reference so that it can be *pipelined* with the business statements of
/// the same transaction: futures polled together on one connection are sent without waiting
/// for each answer, so the business row and the event cost one round trip instead of two.
///
/// ```no_run
/// # use actix_outbox::{enqueue, NewEvent};
/// # use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
/// # async fn place(conn: &mut AsyncPgConnection, event: NewEvent) -> actix_outbox::Result<()> {
/// conn.transaction::<_, actix_outbox::Error, _>(async |conn| {
///     let conn: &AsyncPgConnection = conn;
///     let order = diesel::sql_query("INSERT INTO orders (id) VALUES (1)");
///     futures_util::try_join!(
///         async { Ok(order.execute(&mut &*conn).await?) },
///         enqueue(conn, &event),
///     )?;
///     Ok(())
/// })
/// .await
/// # }
/// ```
///
/// # Errors
/// [`Error::InvalidEvent`](crate::Error::InvalidEvent) (`EVENT_SCHEMA_INVALID`) before any write
/// when the event is malformed; [`Error::Database`](crate::Error::Database) when the insert
/// fails (e.g. the same event id twice).
pub async fn enqueue(conn: &AsyncPgConnection, event: &NewEvent) -> Result<EventId> {
    event.validate(&PayloadRules::default())?;
    insert_validated(conn, std::slice::from_ref(event)).await?;
    Ok(event.id)
}

/// Writes several events with one statement. All are validated before anything is written:
/// either every event is inserted or none is.
///
/// # Errors
/// As [`enqueue`].
pub async fn enqueue_many(conn: &AsyncPgConnection, events: &[NewEvent]) -> Result<Vec<EventId>> {
    validate_all(events)?;
    insert_validated(conn, events).await?;
    Ok(events.iter().map(|e| e.id).collect())
}

/// Runs one business statement and writes `events` in the **same SQL statement**
/// (`WITH business AS (…) INSERT INTO actix_outbox.outbox_events …`): the business transaction in one round
/// trip, where [`enqueue`] in a transaction costs three (`BEGIN`, the pipelined statements,
/// `COMMIT`).
///
/// A single statement is atomic on its own: outside a transaction, it commits the business
/// row and its events together or neither, with no `BEGIN` or `COMMIT` to send; inside one,
/// it is part of it like any other statement. For a request that makes one write, such as
/// placing an order, this halves the cost of the write.
///
/// The events are written only if `business` **returned a row**, so it must have a
/// `RETURNING` clause (PostgreSQL rejects it otherwise: a `Database` error before anything is
/// written). That makes a conditional write safe: an `UPDATE … WHERE status = 'PLACED'` that
/// found nothing, or an `INSERT … ON CONFLICT DO NOTHING` that skipped, writes no event.
/// Returns whether the events were written. `business` may not itself contain a `WITH` that
/// writes (PostgreSQL allows those only at the top level). At least one event is required.
///
/// The rows `business` returns are not handed back, so an event cannot carry a value the
/// database generates (a serial id); use ids made by the application, or a transaction. As
/// with [`enqueue`], call [`OutboxHandle::wake`](crate::OutboxHandle::wake) after it returns
/// (outside a transaction, that is when it committed) for immediate delivery.
///
/// Wrap a business statement whose SQL text never changes in [`Prepared`](crate::db::Prepared):
/// a plain `sql_query`, and diesel's `update(…)`, upserts and inserts with optional fields,
/// are otherwise prepared again on every call, which costs the round trip this saves. Never
/// wrap text that varies (built with `format!`, or a multi-row insert of varying length):
/// each distinct text stays prepared for the life of the connection. A raw statement must
/// bind every `$n` it uses; numbers beyond its own binds would refer to the events' arrays.
///
/// ```no_run
/// # use actix_outbox::{enqueue_with, NewEvent, db::Prepared};
/// # use diesel::sql_types::Text;
/// # async fn place(conn: &mut diesel_async::AsyncPgConnection, event: NewEvent) -> actix_outbox::Result<()> {
/// let order = Prepared(
///     diesel::sql_query("INSERT INTO orders (id) VALUES ($1) RETURNING id").bind::<Text, _>("o1"),
/// );
/// let placed = enqueue_with(conn, order, &[event]).await?;
/// assert!(placed);
/// # Ok(()) }
/// ```
///
/// # Errors
/// As [`enqueue_many`], and [`Error::InvalidEvent`](crate::Error::InvalidEvent) for an empty
/// `events`; nothing of either part is written when it fails.
pub async fn enqueue_with<B>(
    conn: &AsyncPgConnection,
    business: B,
    events: &[NewEvent],
) -> Result<bool>
where
    B: QueryFragment<Pg> + Send,
{
    validate_all(events)?;
    insert_validated_with(conn, business, events).await
}

/// Checks every event against the default payload rules, before anything is written.
fn validate_all(events: &[NewEvent]) -> Result<()> {
    let rules = PayloadRules::default();
    events.iter().try_for_each(|e| e.validate(&rules))
}

/// The one insert path, shared with [`EventRegistry`](crate::EventRegistry).
pub(crate) async fn insert_validated(conn: &AsyncPgConnection, events: &[NewEvent]) -> Result<()> {
    store::outbox::insert_events(conn, events).await?;
    enqueued(events);
    Ok(())
}

/// [`insert_validated`] behind a business statement.
pub(crate) async fn insert_validated_with<B>(
    conn: &AsyncPgConnection,
    business: B,
    events: &[NewEvent],
) -> Result<bool>
where
    B: QueryFragment<Pg> + Send,
{
    if events.is_empty() {
        // Nothing would tell whether the statement returned a row.
        return Err(crate::Error::InvalidEvent(
            "enqueue_with needs at least one event; run a statement without events on its own"
                .into(),
        ));
    }
    let written = store::outbox::insert_events_with(conn, business, events).await?;
    if written {
        enqueued(events);
    }
    Ok(written)
}

/// Written in the caller's transaction, which may still roll back: `outbox.enqueued`. The
/// event's `outbox.created` comes from the publisher, which sees only committed events.
fn enqueued(events: &[NewEvent]) {
    for e in events {
        crate::telemetry::event!(debug, "outbox.enqueued", e.into());
    }
}

impl<'a> From<&'a NewEvent> for crate::telemetry::EventFields<'a> {
    fn from(e: &'a NewEvent) -> Self {
        crate::telemetry::EventFields {
            consumer: None,
            event_id: e.id.as_uuid(),
            event_type: &e.event_type,
            aggregate_id: &e.aggregate_id,
            correlation_id: e.correlation_id.as_deref(),
            causation_id: e.causation_id.as_deref(),
            attempt: None,
        }
    }
}

/// Every outbox and inbox record of `correlation_id` (at most 1,000), ordered by time: what one
/// request caused, which consumers handled it, and what they caused in turn.
///
/// # Errors
/// [`Error::Database`](crate::Error::Database) when the query fails.
pub async fn timeline(
    conn: &mut AsyncPgConnection,
    correlation_id: &str,
) -> Result<Vec<store::timeline::TimelineEntry>> {
    store::timeline::timeline(conn, correlation_id).await
}

/// Wakes the publishers of every instance that listens ([`RuntimeConfig::listen`](crate::RuntimeConfig::listen))
/// when the caller's transaction commits. For producers that run no runtime of their own
/// (a separate web tier); a process with a runtime calls [`OutboxHandle::wake`](crate::OutboxHandle::wake)
/// instead. Several calls in one transaction send one notification, but every NOTIFY takes a
/// lock at commit that serialises committing transactions, so use it where latency across
/// processes matters more than peak enqueue rate; otherwise the publishers' poll finds the rows.
///
/// # Errors
/// [`Error::Database`](crate::Error::Database) when the statement fails.
pub async fn notify_publishers(conn: &mut AsyncPgConnection) -> Result<()> {
    store::outbox::notify(conn, crate::messages::OUTBOX_CHANNEL, "").await
}
