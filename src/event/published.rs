//! The event as it leaves the outbox for a broker and arrives at a receiving inbox.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::EventId;

/// An event as a transport publishes it and a receiving side records it. Serializable, so a
/// broker can carry it as JSON; the id is the outbox id, unchanged through every retry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct OutboxEvent {
    /// The event id, the inbox's deduplication key.
    pub id: EventId,
    /// The event type.
    pub event_type: String,
    /// The payload's schema version.
    pub event_version: i32,
    /// The aggregate type.
    pub aggregate_type: String,
    /// The aggregate id.
    pub aggregate_id: String,
    /// The aggregate's version after the change.
    pub aggregate_version: Option<i64>,
    /// The payload.
    pub payload: serde_json::Value,
    /// Trace context and other metadata.
    pub metadata: serde_json::Value,
    /// The correlation id.
    pub correlation_id: String,
    /// The causation id.
    pub causation_id: Option<String>,
    /// When the producer's transaction wrote it.
    pub created_at: DateTime<Utc>,
    /// This publish attempt, from 1.
    pub attempt: u32,
}
