//! What a handler receives: [`Delivery`] (one event) or [`DeliveryBatch`] (several), each with
//! the open inbox transaction its effects must be written in ([`TxConn`]).

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use actix::Message;
use chrono::{DateTime, Utc};
use diesel_async::AsyncPgConnection;
use serde::de::DeserializeOwned;
use tokio::sync::{OwnedRwLockMappedWriteGuard, OwnedRwLockReadGuard, OwnedRwLockWriteGuard};

use super::lend::Slot;
use super::HandlerError;
use crate::error::ErrorCode;
use crate::event::{ConsumerName, Event, EventId, EventRegistry, NewEvent, PayloadRules};
use crate::store::inbox::InboxRow;
use crate::store::OwnedConn;

/// One event delivered to one consumer, with the transaction its effect must be written in.
///
/// The handler returns `Ok(())` to have the event marked PROCESSED in that transaction, or a
/// [`HandlerError`] to have its writes rolled back and the event retried or dead-lettered by
/// the consumer's [`RetryPolicy`](crate::RetryPolicy).
pub struct Delivery {
    pub(crate) row: InboxRow,
    pub(crate) consumer: ConsumerName,
    /// The connection is lent, not given: the runtime takes it back when the handler returns,
    /// so a handler that keeps a clone of the delivery cannot write outside the transaction.
    pub(crate) slot: Slot,
    /// The runtime's event registry, which [`Delivery::enqueue`] validates follow-ups with.
    pub(crate) events: Option<Arc<EventRegistry>>,
    pub(crate) mode: DeliveryMode,
    /// `outbox.deliver` with the feature `otel`, else a disabled span.
    pub(crate) span: tracing::Span,
}

/// Why a handler sees an event: its live delivery, or an operator's replay of an event the
/// consumer already processed ([`ops::replay`](crate::ops::replay)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DeliveryMode {
    /// The event's own delivery (or a retry of it), marked in the consumer's inbox.
    #[default]
    Live,
    /// A replay: the event was processed before and its inbox row stays as it is; the replay
    /// records its progress instead. A handler may skip what must happen once per event (a
    /// follow-up event, a mail) when it sees this mode.
    Replay,
}

impl Message for Delivery {
    type Result = Result<(), HandlerError>;
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("consumer", &self.consumer)
            .field("event_id", &self.row.event_id)
            .field("event_type", &self.row.event_type)
            .field("attempt", &self.attempt())
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl Delivery {
    /// The event's id, the same in every delivery of it.
    pub fn event_id(&self) -> EventId {
        EventId::from_uuid(self.row.event_id)
    }
    /// The event type, e.g. `ORDER_STATUS_CHANGED`.
    pub fn event_type(&self) -> &str {
        &self.row.event_type
    }
    /// The payload's schema version.
    pub fn event_version(&self) -> i32 {
        self.row.event_version
    }
    /// The aggregate type, e.g. `order`.
    pub fn aggregate_type(&self) -> &str {
        &self.row.aggregate_type
    }
    /// The aggregate id.
    pub fn aggregate_id(&self) -> &str {
        &self.row.aggregate_id
    }
    /// The aggregate's version after the change, if the producer set one.
    pub fn aggregate_version(&self) -> Option<i64> {
        self.row.aggregate_version
    }
    /// The raw payload.
    pub fn payload(&self) -> &serde_json::Value {
        &self.row.payload
    }
    /// The event metadata (trace context and the like).
    pub fn metadata(&self) -> &serde_json::Value {
        &self.row.metadata
    }
    /// The correlation id shared by everything one request caused.
    pub fn correlation_id(&self) -> &str {
        &self.row.correlation_id
    }
    /// What caused this event, if known.
    pub fn causation_id(&self) -> Option<&str> {
        self.row.causation_id.as_deref()
    }
    /// When the producer's transaction wrote the event.
    pub fn created_at(&self) -> DateTime<Utc> {
        self.row.event_created_at
    }
    /// This attempt's number, starting at 1.
    pub fn attempt(&self) -> u32 {
        (self.row.attempt_count + 1).max(1) as u32
    }
    /// The consumer this delivery is for.
    pub fn consumer(&self) -> &ConsumerName {
        &self.consumer
    }
    /// The span this delivery runs in. With the feature `otel` it is `outbox.deliver`, with
    /// the event's ids as fields and the producer's span (carried in the event's metadata) as
    /// its parent: instrument the handler's own work with it
    /// (`fut.instrument(d.span().clone())`) to keep it in the producer's trace. Without the
    /// feature it is disabled and costs nothing.
    pub fn span(&self) -> &tracing::Span {
        &self.span
    }
    /// [`DeliveryMode::Replay`] when an operator replays the event, [`DeliveryMode::Live`]
    /// otherwise.
    pub fn mode(&self) -> DeliveryMode {
        self.mode
    }

    /// Decodes the payload. A payload that does not fit `T` is a permanent
    /// `EVENT_SCHEMA_INVALID` failure: retrying cannot make it fit.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, HandlerError> {
        serde_json::from_value(self.row.payload.clone()).map_err(|e| {
            HandlerError::permanent(
                ErrorCode::EVENT_SCHEMA_INVALID,
                format!("{} payload does not decode: {e}", self.row.event_type),
            )
        })
    }

    /// Decodes the payload as the typed event `E`, checking type and version first. After the
    /// runtime's upcasting a registered type always arrives at its current version.
    ///
    /// # Errors
    /// A permanent [`HandlerError`]: `EVENT_SCHEMA_INVALID` for another type or a payload that
    /// does not decode, `EVENT_VERSION_UNSUPPORTED` for an older version. A newer version is
    /// `EVENT_VERSION_UNSUPPORTED` too, but retried: during a rolling deploy an instance of the
    /// newer build may handle it.
    pub fn event<E: Event>(&self) -> Result<E, HandlerError> {
        if self.row.event_type != E::TYPE {
            return Err(HandlerError::permanent(
                ErrorCode::EVENT_SCHEMA_INVALID,
                format!(
                    "delivered {}, the handler reads {}",
                    self.row.event_type,
                    E::TYPE
                ),
            ));
        }
        if self.row.event_version != E::VERSION {
            let message = format!(
                "{} v{} delivered, the handler reads v{}",
                E::TYPE,
                self.row.event_version,
                E::VERSION
            );
            let code = ErrorCode::EVENT_VERSION_UNSUPPORTED;
            return Err(if self.row.event_version > E::VERSION {
                HandlerError::Retry { code, message }
            } else {
                HandlerError::permanent(code, message)
            });
        }
        self.decode()
    }

    /// Enqueues `event` as caused by this delivery — same correlation id, this event's id as
    /// causation id — in the delivery's transaction, so it commits with the inbox mark. With
    /// an [`EventRegistry`] given to the runtime
    /// ([`OutboxBuilder::events`](crate::OutboxBuilder::events)), an event of a type it
    /// registers is validated as [`EventRegistry::enqueue`] would (version and payload), and
    /// any other with the registry's payload rules.
    ///
    /// # Errors
    /// As [`enqueue`](crate::enqueue) or [`EventRegistry::enqueue`], as a [`HandlerError`]: an
    /// invalid event is a permanent failure with its code.
    pub async fn enqueue(&self, event: NewEvent) -> Result<EventId, HandlerError> {
        let event = self.follow_up(event);
        // Before taking the connection: an invalid event needs none.
        match &self.events {
            Some(registry) => registry.validate_follow_up(&event)?,
            None => event.validate(&PayloadRules::default())?,
        }
        let conn = self.shared_conn().await?;
        // With a notification, pipelined, that wakes the publishers (this instance's too) when
        // the delivery's batch commits: a handler cannot wake them after that commit itself,
        // and a chain of events would otherwise move one publisher poll per link.
        futures_util::future::try_join(
            crate::outbox::insert_validated(&conn, std::slice::from_ref(&event)),
            crate::store::outbox::notify(&conn, crate::messages::OUTBOX_CHANNEL, ""),
        )
        .await?;
        Ok(event.id)
    }

    /// An event caused by this one: same correlation id, this event's id as causation id.
    /// Enqueue it on [`Delivery::conn`] so it commits with the inbox mark.
    ///
    /// The trace goes on too: the follow-up's metadata gets this delivery's trace context as
    /// `traceparent` / `tracestate` (with the feature `otel`, this delivery's span as its
    /// parent; without, the context this event carried), unless it sets its own.
    pub fn follow_up(&self, event: NewEvent) -> NewEvent {
        let mut event = event
            .correlation_id(self.row.correlation_id.clone())
            .causation_id(self.row.event_id.to_string());
        crate::telemetry::carry_trace(&self.span, &self.row.metadata, &mut event.metadata);
        event
    }

    /// The inbox transaction's connection. Hold at most one at a time and drop it before the
    /// handler returns.
    ///
    /// # Errors
    /// A retryable [`HandlerError`] if the delivery has already finished (the handler kept the
    /// delivery past its return).
    pub async fn conn(&self) -> Result<TxConn, HandlerError> {
        lend(&self.slot).await
    }

    /// The inbox transaction's connection, shared: the deliveries that a consumer with
    /// [`ConsumerConfig::pipeline`](super::ConsumerConfig::pipeline) handles at once hold it
    /// together, and the statements they run through it are *pipelined*, sent without waiting
    /// for one another's answers. Run a statement with `.execute(&mut &*conn)`; a handler that
    /// needs the connection to itself (a nested transaction, say) takes [`Delivery::conn`],
    /// which waits until no other delivery holds either.
    ///
    /// Why: a handler that writes one row per event waits a round trip per event, and the
    /// database wakes up once per statement. Pipelined, a batch's statements arrive together
    /// and are run back to back: see the performance notes in the README.
    ///
    /// ```no_run
    /// use actix::prelude::*;
    /// use actix_outbox::{db::Prepared, Delivery, HandlerError};
    /// use diesel::sql_types::Text;
    /// use diesel_async::RunQueryDsl;
    ///
    /// struct Audit;
    /// impl Actor for Audit {
    ///     type Context = Context<Self>;
    /// }
    /// impl Handler<Delivery> for Audit {
    ///     type Result = ResponseFuture<Result<(), HandlerError>>;
    ///     fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
    ///         Box::pin(async move {
    ///             let conn = d.shared_conn().await?;
    ///             let insert = diesel::sql_query("INSERT INTO audit (order_id) VALUES ($1)")
    ///                 .bind::<Text, _>(d.aggregate_id());
    ///             Prepared(insert).execute(&mut &*conn).await?;
    ///             Ok(())
    ///         })
    ///     }
    /// }
    /// // OutboxRuntime::builder(pool).consumer(ConsumerConfig::new("audit")
    /// //     .subscribe("ORDER_PLACED").pipeline(64), || Audit)
    /// ```
    ///
    /// # Errors
    /// As [`Delivery::conn`].
    pub async fn shared_conn(&self) -> Result<SharedConn, HandlerError> {
        let guard = self.slot.clone().read_owned().await;
        OwnedRwLockReadGuard::try_map(guard, |slot| slot.as_deref())
            .map(SharedConn)
            .map_err(|_| finished())
    }
}

/// Locks a delivery's connection slot for the handler alone.
async fn lend(slot: &Slot) -> Result<TxConn, HandlerError> {
    let guard: OwnedRwLockWriteGuard<Option<OwnedConn>> = slot.clone().write_owned().await;
    OwnedRwLockWriteGuard::try_map(guard, |slot| slot.as_mut())
        .map(TxConn)
        .map_err(|_| finished())
}

fn finished() -> HandlerError {
    HandlerError::retry("the delivery has finished; its transaction is gone")
}

/// Several events for one batch consumer, delivered in one call with the transaction they are
/// all marked in. Registered with
/// [`OutboxBuilder::batch_consumer`](crate::OutboxBuilder::batch_consumer).
///
/// Why: a handler that writes one row per event pays a round trip per event, and at a few
/// thousand events per second that round trip is most of a consumer's cost. Given the whole
/// batch, it can write every effect in one statement (`INSERT … SELECT … FROM unnest(…)`).
///
/// `Ok(())` marks every event of the batch PROCESSED in the batch's transaction. An error
/// rolls back the batch's writes and, for a batch of several events, charges none of them: the
/// runtime hands those events over again one per call (a batch of one), each in a savepoint,
/// so that the failure is recorded against the event that causes it and the other events
/// still commit. A panic, or a timeout ([`ConsumerConfig::handler_timeout`](super::ConsumerConfig::handler_timeout)
/// applies to the whole call) with the connection kept, charges none either: each event is
/// then handed over alone in a batch of its own. A one-event batch that fails is charged at
/// once, like any delivery. A batch is never empty; each
/// [`Delivery`] in it has the usual accessors, and [`Delivery::conn`] and
/// [`Delivery::enqueue`] work on the batch's transaction too.
///
/// ```no_run
/// use actix::prelude::*;
/// use actix_outbox::{DeliveryBatch, HandlerError, db::Prepared};
/// use diesel::sql_types::{Array, Text};
/// use diesel_async::RunQueryDsl;
///
/// struct Ledger;
/// impl Actor for Ledger {
///     type Context = Context<Self>;
/// }
/// impl Handler<DeliveryBatch> for Ledger {
///     type Result = ResponseFuture<Result<(), HandlerError>>;
///     fn handle(&mut self, b: DeliveryBatch, _: &mut Context<Self>) -> Self::Result {
///         let orders: Vec<String> =
///             b.deliveries().iter().map(|d| d.aggregate_id().to_owned()).collect();
///         Box::pin(async move {
///             let mut conn = b.conn().await?; // the batch's inbox transaction
///             Prepared(
///                 diesel::sql_query("INSERT INTO ledger (order_id) SELECT unnest($1::text[])")
///                     .bind::<Array<Text>, _>(&orders),
///             )
///             .execute(&mut *conn)
///             .await?; // commits with every event's PROCESSED mark
///             Ok(())
///         })
///     }
/// }
/// // OutboxRuntime::builder(pool).batch_consumer(ConsumerConfig::new("ledger")
/// //     .subscribe("ORDER_PLACED").batch_size(500), || Ledger)
/// ```
pub struct DeliveryBatch {
    pub(crate) deliveries: Vec<Delivery>,
    pub(crate) slot: Slot,
}

impl Message for DeliveryBatch {
    type Result = Result<(), HandlerError>;
}

impl std::fmt::Debug for DeliveryBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(&self.deliveries).finish()
    }
}

impl DeliveryBatch {
    /// The events, in claim order.
    pub fn deliveries(&self) -> &[Delivery] {
        &self.deliveries
    }
    /// How many events the batch holds (at least one).
    pub fn len(&self) -> usize {
        self.deliveries.len()
    }
    /// Always false: a batch holds at least one event.
    pub fn is_empty(&self) -> bool {
        self.deliveries.is_empty()
    }
    /// The batch transaction's connection, as [`Delivery::conn`].
    ///
    /// # Errors
    /// A retryable [`HandlerError`] if the batch has already finished.
    pub async fn conn(&self) -> Result<TxConn, HandlerError> {
        lend(&self.slot).await
    }
}

/// The connection of a delivery's open transaction, held alone; derefs to
/// [`AsyncPgConnection`].
pub struct TxConn(OwnedRwLockMappedWriteGuard<Option<OwnedConn>, OwnedConn>);

impl Deref for TxConn {
    type Target = AsyncPgConnection;
    fn deref(&self) -> &AsyncPgConnection {
        &self.0
    }
}

impl DerefMut for TxConn {
    fn deref_mut(&mut self) -> &mut AsyncPgConnection {
        &mut self.0
    }
}

/// The connection of a delivery's open transaction, shared with the other deliveries handled
/// at the same time ([`Delivery::shared_conn`]); derefs to [`AsyncPgConnection`], through
/// which statements are pipelined (`.execute(&mut &*conn)`).
pub struct SharedConn(OwnedRwLockReadGuard<Option<OwnedConn>, AsyncPgConnection>);

impl Deref for SharedConn {
    type Target = AsyncPgConnection;
    fn deref(&self) -> &AsyncPgConnection {
        &self.0
    }
}
