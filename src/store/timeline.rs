//! The correlation timeline: every outbox and inbox record one request caused, in order.

use chrono::{DateTime, Utc};
use diesel::sql_types::{Integer, Nullable, Text, Timestamptz, Uuid as SqlUuid};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::Result;

/// One record in a correlation timeline. Metadata only, never the payload.
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
    // Inbox rows are found two ways, each through an index: those of events published from
    // this database through their outbox rows, those whose event has no outbox row here
    // (`external`: received from another database, or its outbox row deleted by retention)
    // through the inbox's partial correlation index. Not a cached statement: an
    // operator's query, planned afresh for the tables as they are.
    let rows = diesel::sql_query(
        "WITH o AS MATERIALIZED ( \
             SELECT id, event_type, aggregate_id, status, attempt_count, error_code, causation_id, \
                 created_at, published_at, seq \
             FROM outbox_events WHERE correlation_id = $1 \
         ) \
         SELECT * FROM ( \
             SELECT 'outbox' AS kind, id AS event_id, event_type, aggregate_id, NULL::text AS consumer, \
                 status, attempt_count AS attempts, error_code, causation_id, created_at AS at, \
                 published_at AS finished_at, seq AS ord \
             FROM o \
             UNION ALL \
             SELECT 'inbox', event_id, event_type, aggregate_id, consumer, status, attempt_count, \
                 error_code, causation_id, received_at, processed_at, id \
             FROM inbox_events WHERE event_id IN (SELECT id FROM o) \
             UNION ALL \
             SELECT 'inbox', event_id, event_type, aggregate_id, consumer, status, attempt_count, \
                 error_code, causation_id, received_at, processed_at, id \
             FROM inbox_events \
             WHERE external AND correlation_id = $1 AND event_id NOT IN (SELECT id FROM o) \
         ) t ORDER BY at, kind DESC, ord LIMIT $2",
    )
    .bind::<Text, _>(correlation_id)
    .bind::<diesel::sql_types::BigInt, _>(TIMELINE_LIMIT)
    .load(conn)
    .await?;
    Ok(rows)
}
