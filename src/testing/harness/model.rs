//! The harness's in-memory rows, and the views of them it hands out.
use std::collections::HashMap;

use chrono::{DateTime, Utc};

use crate::consumer::actor::HandlerRef;
use crate::consumer::{ConsumerConfig, HandlerError};
use crate::error::ErrorCode;
use crate::event::{ConsumerName, EventId, NewEvent};
use crate::store::inbox::InboxRow;

pub use crate::store::status::{InboxStatus, OutboxStatus};

/// One consumer's inbox row, as an operator would see it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct InboxView {
    /// The event.
    pub event_id: EventId,
    /// The event type.
    pub event_type: String,
    /// The row's state.
    pub status: InboxStatus,
    /// Attempts made so far (`attempt_count`).
    pub attempts: u32,
    /// The last failure's code; cleared when the row is processed (except `EVENT_STALE`).
    pub error_code: Option<ErrorCode>,
    /// The last failure's message, cut at 2000 characters as in the database.
    pub last_error: Option<String>,
    /// When a claim may pick the row (for RECEIVED rows: when it was received).
    pub next_attempt_at: DateTime<Utc>,
}

/// One outbox row.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct OutboxView {
    /// The event.
    pub event_id: EventId,
    /// The event type.
    pub event_type: String,
    /// The row's state.
    pub status: OutboxStatus,
    /// Publish cycles that took the row (`attempt_count`).
    pub attempts: u32,
    /// When the row was last published.
    pub published_at: Option<DateTime<Utc>>,
}

/// What one delivery of one inbox row did.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Outcome {
    /// The consumer.
    pub consumer: ConsumerName,
    /// The event.
    pub event_id: EventId,
    /// The attempt number the delivery carried ([`Delivery::attempt`](crate::Delivery::attempt)).
    pub attempt: u32,
    /// What the handler returned, or the error the runtime records in its place (the handler
    /// actor stopped, the handler overran its timeout, the event's version cannot be read).
    /// `Ok` for an event recorded as stale.
    pub result: std::result::Result<(), HandlerError>,
    /// The row's state after the delivery.
    pub status: InboxStatus,
    /// Whether the handler actor was called (not for a stale or unreadable event, nor when
    /// the harness could not open the attempt's transaction).
    pub handler_ran: bool,
    /// The handler actor stopped while handling (a panic in `handle`); it is rebuilt from its
    /// factory before the next delivery.
    pub handler_lost: bool,
    /// The delivery's transaction was rolled back ([`Harness::redeliver`](super::Harness::redeliver)): the row is as it
    /// was before.
    pub rolled_back: bool,
}

pub(super) struct OutboxEntry {
    pub(super) event: NewEvent,
    pub(super) correlation_id: String,
    pub(super) created_at: DateTime<Utc>,
    pub(super) status: OutboxStatus,
    pub(super) attempts: i32,
    pub(super) published_at: Option<DateTime<Utc>>,
}

pub(super) struct InboxEntry {
    /// The row as a claim returns it; `row.id` orders claims like the `bigserial` does.
    pub(super) row: InboxRow,
    pub(super) consumer: ConsumerName,
    pub(super) status: InboxStatus,
    pub(super) next_attempt_at: DateTime<Utc>,
    pub(super) error_code: Option<String>,
    pub(super) last_error: Option<String>,
}

/// Builds a consumer's handler actor, as `OutboxBuilder::consumer`'s factory does.
pub(super) type Factory = Box<dyn Fn() -> HandlerRef>;

pub(super) struct ConsumerSlot {
    pub(super) cfg: ConsumerConfig,
    pub(super) factory: Factory,
    /// The live handler; replaced through `factory` once found disconnected, at the points
    /// where the runtime's `ConsumerActor::pump` looks.
    pub(super) handler: HandlerRef,
    /// The `consumer_states.paused` switch.
    pub(super) paused: bool,
    pub(super) restarts: u32,
    pub(super) duplicates: usize,
    /// `aggregate_versions` for this consumer: (aggregate type, aggregate id) → last applied.
    pub(super) versions: HashMap<(String, String), i64>,
}
