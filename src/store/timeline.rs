//! The correlation timeline: every outbox and inbox record one request caused, in order.

use chrono::{DateTime, Utc};
use diesel::sql_types::{Integer, Nullable, Text, Timestamptz, Uuid as SqlUuid};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::Result;

/// One record in a correlation timeline. Metadata only, never the payload.
///
/// A cursor consumer ([`ConsumerConfig::cursor`](crate::ConsumerConfig::cursor)) has an inbox
/// row only for an exception. For an event of this database it has none of, its record is
/// read from its cursor: `inbox`, with the status IN_FLIGHT, RECEIVED or PROCESSED, no
/// attempts, `at` the event's publication and no `finished_at`.
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize)]
#[non_exhaustive]
pub struct TimelineEntry {
    /// `outbox` (the event as written) or `inbox` (one consumer's record of it).
    #[diesel(sql_type = Text)]
    pub kind: String,
    /// The event id.
    #[diesel(sql_type = SqlUuid)]
    pub event_id: uuid::Uuid,
    /// The event type.
    #[diesel(sql_type = Text)]
    pub event_type: String,
    /// The aggregate id.
    #[diesel(sql_type = Text)]
    pub aggregate_id: String,
    /// The consumer, for inbox records.
    #[diesel(sql_type = Nullable<Text>)]
    pub consumer: Option<String>,
    /// The record's status.
    #[diesel(sql_type = Text)]
    pub status: String,
    /// Attempts so far.
    #[diesel(sql_type = Integer)]
    pub attempts: i32,
    /// The last error code, if any.
    #[diesel(sql_type = Nullable<Text>)]
    pub error_code: Option<String>,
    /// What caused the event.
    #[diesel(sql_type = Nullable<Text>)]
    pub causation_id: Option<String>,
    /// When the record was created (outbox: written; inbox: received).
    #[diesel(sql_type = Timestamptz)]
    pub at: DateTime<Utc>,
    /// When it finished (outbox: published; inbox: processed).
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub finished_at: Option<DateTime<Utc>>,
}

/// At most this many records are returned; a correlation with more is a loop worth a look.
pub(crate) const TIMELINE_LIMIT: i64 = 1000;

pub(crate) async fn timeline(
    conn: &mut AsyncPgConnection,
    correlation_id: &str,
) -> Result<Vec<TimelineEntry>> {
    // How each part is found: `timeline.sql`. Not a cached statement: an operator's query,
    // planned afresh for the tables as they are.
    let rows = crate::store::sql(super::with_cursor_status(include_str!("timeline.sql")))
        .bind::<Text, _>(correlation_id)
        .bind::<diesel::sql_types::BigInt, _>(TIMELINE_LIMIT)
        .load(conn)
        .await?;
    Ok(rows)
}
