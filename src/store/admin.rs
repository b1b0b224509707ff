//! Statements of the operator API: bounded lists, the status changes operators may make and
//! the audit rows written with them. (The correlation timeline is the library's own
//! [`timeline`](crate::ops::timeline).)
//!
//! Each list's statement is a file under `admin/`, which `tests/it/plan.rs` includes too and
//! explains on a million-row history: every filter is read through an index.
//!
//! Lists never read `payload` unless the caller asks for it (the application enabled a
//! redacted view): a column that is not selected cannot leak.

#![cfg(feature = "admin")]

pub(crate) mod effects;

use super::status::InboxStatus;
use chrono::{DateTime, Utc};
use diesel::sql_types::{
    Array, BigInt, Bool, Integer, Jsonb, Nullable, Text, Timestamptz, Uuid as SqlUuid,
};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::Serialize;

pub(crate) use super::audit::insert_audit;
use crate::error::Result;

/// One outbox row as operators see it.
#[derive(Debug, Clone, QueryableByName, Serialize)]
pub(crate) struct OutboxItem {
    #[diesel(sql_type = SqlUuid)]
    pub id: uuid::Uuid,
    #[diesel(sql_type = Text)]
    pub event_type: String,
    #[diesel(sql_type = Integer)]
    pub event_version: i32,
    #[diesel(sql_type = Text)]
    pub aggregate_type: String,
    #[diesel(sql_type = Text)]
    pub aggregate_id: String,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub aggregate_version: Option<i64>,
    #[diesel(sql_type = Text)]
    pub status: String,
    #[diesel(sql_type = Integer)]
    pub attempt_count: i32,
    #[diesel(sql_type = Nullable<Text>)]
    pub error_code: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub last_error: Option<String>,
    #[diesel(sql_type = Text)]
    pub correlation_id: String,
    #[diesel(sql_type = Nullable<Text>)]
    pub causation_id: Option<String>,
    #[diesel(sql_type = Timestamptz)]
    pub created_at: DateTime<Utc>,
    #[diesel(sql_type = Timestamptz)]
    pub next_attempt_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub published_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Timestamptz)]
    pub updated_at: DateTime<Utc>,
    /// Only selected when the application enabled a redacted payload view.
    #[diesel(sql_type = Nullable<Jsonb>)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload: Option<serde_json::Value>,
}

/// One inbox row as operators see it.
#[derive(Debug, Clone, QueryableByName, Serialize)]
pub(crate) struct InboxItem {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = SqlUuid)]
    pub event_id: uuid::Uuid,
    #[diesel(sql_type = Text)]
    pub consumer: String,
    #[diesel(sql_type = Text)]
    pub event_type: String,
    #[diesel(sql_type = Integer)]
    pub event_version: i32,
    #[diesel(sql_type = Text)]
    pub aggregate_type: String,
    #[diesel(sql_type = Text)]
    pub aggregate_id: String,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub aggregate_version: Option<i64>,
    #[diesel(sql_type = Text)]
    pub status: String,
    #[diesel(sql_type = Integer)]
    pub attempt_count: i32,
    #[diesel(sql_type = Nullable<Text>)]
    pub error_code: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub last_error: Option<String>,
    #[diesel(sql_type = Text)]
    pub correlation_id: String,
    #[diesel(sql_type = Nullable<Text>)]
    pub causation_id: Option<String>,
    #[diesel(sql_type = Timestamptz)]
    pub event_created_at: DateTime<Utc>,
    #[diesel(sql_type = Timestamptz)]
    pub received_at: DateTime<Utc>,
    #[diesel(sql_type = Timestamptz)]
    pub next_attempt_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub processed_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Timestamptz)]
    pub updated_at: DateTime<Utc>,
    /// Only selected when the application enabled a redacted payload view.
    #[diesel(sql_type = Nullable<Jsonb>)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload: Option<serde_json::Value>,
    /// An IN_FLIGHT row's lease: since when a batch holds it, which process (runtime instance)
    /// and until when (renewed while a hung handler still runs).
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub leased_since: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Text>)]
    pub leased_by: Option<String>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub leased_until: Option<DateTime<Utc>>,
}

/// The status an inbox list shows for a row a lease names.
pub(crate) const IN_FLIGHT: &str = "IN_FLIGHT";

/// What became of one event for one consumer: a consumer that has a row for it, or is
/// subscribed to its type now and has none (subscribed after it was published).
#[derive(Debug, Clone, QueryableByName, Serialize)]
pub(crate) struct Fanout {
    #[diesel(sql_type = Text)]
    pub consumer: String,
    /// Subscribed to the event's type now.
    #[diesel(sql_type = Bool)]
    pub subscribed: bool,
    /// The event reached the consumer: it has an inbox row for it, or its cursor has read,
    /// holds or will read it (`cursor`).
    #[diesel(sql_type = Bool)]
    pub got: bool,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub inbox_id: Option<i64>,
    #[diesel(sql_type = Nullable<Text>)]
    pub status: Option<String>,
    /// Reads the event's type through its cursor: with no inbox row (`inbox_id` null), the
    /// status comes from the cursor (RECEIVED: past it, IN_FLIGHT: a batch holds it,
    /// PROCESSED: the cursor has moved past it), and attempts and times are not recorded.
    #[diesel(sql_type = Bool)]
    pub cursor: bool,
    #[diesel(sql_type = Nullable<Integer>)]
    pub attempt_count: Option<i32>,
    #[diesel(sql_type = Nullable<Text>)]
    pub error_code: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub last_error: Option<String>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub received_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub processed_at: Option<DateTime<Utc>>,
    /// Received from a broker (`receive`) rather than fanned out from this database's outbox.
    #[diesel(sql_type = Nullable<Bool>)]
    pub external: Option<bool>,
}

/// One event's outbox row (if this database's outbox has it) and what became of it for each
/// consumer. Both read by key: the outbox's primary key, the inbox's `(event_id, consumer)`.
pub(crate) async fn event_fanout(
    conn: &mut AsyncPgConnection,
    id: uuid::Uuid,
    with_payload: bool,
) -> Result<(Option<OutboxItem>, Vec<Fanout>)> {
    let outbox: Vec<OutboxItem> = crate::store::sql(include_str!("admin/event_outbox.sql"))
        .bind::<SqlUuid, _>(id)
        .bind::<Bool, _>(with_payload)
        .load(conn)
        .await?;
    let consumers: Vec<Fanout> = crate::store::sql(super::with_cursor_status(include_str!(
        "admin/event_fanout.sql"
    )))
    .bind::<SqlUuid, _>(id)
    .load(conn)
    .await?;
    Ok((outbox.into_iter().next(), consumers))
}

/// Filters of a list; `None` matches everything. Statuses are validated by the caller.
#[derive(Debug, Clone, Default)]
pub(crate) struct ListFilter {
    pub status: Option<String>,
    pub event_type: Option<String>,
    pub consumer: Option<String>,
    pub limit: i64,
    pub with_payload: bool,
}

/// Newest first (UUID v7 ids are time-ordered, so the primary key serves the order and the
/// `before` cursor).
pub(crate) async fn list_outbox(
    conn: &mut AsyncPgConnection,
    f: &ListFilter,
    before: Option<uuid::Uuid>,
) -> Result<Vec<OutboxItem>> {
    let rows = crate::store::sql(include_str!("admin/list_outbox.sql"))
        .bind::<Nullable<Text>, _>(f.status.as_deref())
        .bind::<Nullable<Text>, _>(f.event_type.as_deref())
        .bind::<Nullable<SqlUuid>, _>(before)
        .bind::<BigInt, _>(f.limit)
        .bind::<Bool, _>(f.with_payload)
        .load(conn)
        .await?;
    Ok(rows)
}

/// Newest first, by id; `before` is the last id of the previous page. A row a lease names
/// shows as [`IN_FLIGHT`], which is also a status filter.
pub(crate) async fn list_inbox(
    conn: &mut AsyncPgConnection,
    f: &ListFilter,
    before: Option<i64>,
) -> Result<Vec<InboxItem>> {
    let sql = if f.status.as_deref() == Some(IN_FLIGHT) {
        include_str!("admin/list_inbox_in_flight.sql")
    } else {
        include_str!("admin/list_inbox.sql")
    };
    let rows = crate::store::sql(sql)
        .bind::<Nullable<Text>, _>(f.status.as_deref())
        .bind::<Nullable<Text>, _>(f.event_type.as_deref())
        .bind::<Nullable<Text>, _>(f.consumer.as_deref())
        .bind::<Nullable<BigInt>, _>(before)
        .bind::<BigInt, _>(f.limit)
        .bind::<Bool, _>(f.with_payload)
        .load(conn)
        .await?;
    Ok(rows)
}

/// A row's state as locked before an operator's change.
#[derive(Debug, Clone, QueryableByName, Serialize)]
pub(crate) struct LockedRow {
    /// The inbox id or the outbox event id, as text.
    #[diesel(sql_type = Text)]
    pub id: String,
    #[diesel(sql_type = Text)]
    pub status: String,
    #[diesel(sql_type = Integer)]
    pub attempt_count: i32,
    #[diesel(sql_type = Nullable<Text>)]
    pub error_code: Option<String>,
    #[diesel(sql_type = Text)]
    pub event_type: String,
    #[diesel(sql_type = Nullable<Text>)]
    pub consumer: Option<String>,
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Locks those of the inbox rows `ids` that nobody else holds, for the caller's transaction,
/// and returns their state, with how many of `ids` exist (locked or not). A row held by a
/// consumer batch in progress is left out (`SKIP LOCKED`) rather than waited for: a handler
/// that overran its timeout may hold it for as long as it hangs. The caller tries again.
pub(crate) async fn lock_inbox(
    conn: &mut AsyncPgConnection,
    ids: &[i64],
    in_flight_matters: bool,
) -> Result<(Vec<LockedRow>, i64)> {
    if !in_flight_matters {
        // A retry changes only dead letters, which no lease names: no claim turn is taken.
        return lock_inbox_rows(conn, ids, false).await;
    }
    // The rows' consumers' claim turns first (a claim holds one for milliseconds), so that no
    // claim leases a row between the check below and this transaction's commit, and the
    // check's snapshot, taken after, holds every lease committed before. A row a lease names
    // is in flight: its batch would fail to settle beside an operator's change, and roll back
    // the effects of every other row in it. It counts as held, like a row a commit locks.
    crate::store::sql(
        "SELECT count(pg_advisory_xact_lock(hashtextextended('actix_outbox.claim:' || c, 0))) \
             AS n \
         FROM (SELECT DISTINCT consumer AS c FROM actix_outbox.inbox_events \
               WHERE id = ANY($1) ORDER BY 1) x",
    )
    .bind::<Array<BigInt>, _>(ids)
    .execute(conn)
    .await?;
    lock_inbox_rows(conn, ids, true).await
}

/// The rows of `ids` this transaction locks (those a lease names left out when `leased_held`),
/// and how many exist.
async fn lock_inbox_rows(
    conn: &mut AsyncPgConnection,
    ids: &[i64],
    leased_held: bool,
) -> Result<(Vec<LockedRow>, i64)> {
    let rows = crate::store::sql(
        "SELECT i.id::text AS id, i.status, i.attempt_count, i.error_code, i.event_type, \
             i.consumer \
         FROM actix_outbox.inbox_events i WHERE i.id = ANY($1) \
           AND NOT ($2 AND EXISTS (SELECT FROM actix_outbox.inbox_leases l \
                                   WHERE l.consumer = i.consumer AND i.id = ANY (l.ids))) \
         ORDER BY i.id FOR UPDATE OF i SKIP LOCKED",
    )
    .bind::<Array<BigInt>, _>(ids)
    .bind::<Bool, _>(leased_held)
    .load(conn)
    .await?;
    if rows.len() == ids.len() {
        // Every row locked (the ids are distinct): no need to count what exists.
        return Ok((rows, ids.len() as i64));
    }
    let existing: Count =
        crate::store::sql("SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE id = ANY($1)")
            .bind::<Array<BigInt>, _>(ids)
            .get_result(conn)
            .await?;
    Ok((rows, existing.n))
}

/// As [`lock_inbox`], for outbox rows.
pub(crate) async fn lock_outbox(
    conn: &mut AsyncPgConnection,
    ids: &[uuid::Uuid],
) -> Result<(Vec<LockedRow>, i64)> {
    let rows = crate::store::sql(
        "SELECT id::text AS id, status, attempt_count, error_code, event_type, NULL::text AS consumer \
         FROM actix_outbox.outbox_events WHERE id = ANY($1) ORDER BY id FOR UPDATE SKIP LOCKED",
    )
    .bind::<Array<SqlUuid>, _>(ids)
    .load(conn)
    .await?;
    if rows.len() == ids.len() {
        // Every row locked (the ids are distinct): no need to count what exists.
        return Ok((rows, ids.len() as i64));
    }
    let existing: Count = crate::store::sql(
        "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE id = ANY($1)",
    )
    .bind::<Array<SqlUuid>, _>(ids)
    .get_result(conn)
    .await?;
    Ok((rows, existing.n))
}

/// Dead letters back to the consumer: RETRY_PENDING, attempt count kept (so the consumer's
/// policy allows one more attempt before dead-lettering again), due now or, with
/// `per_second`, one after another at that pace, in id order.
pub(crate) async fn retry_inbox(
    conn: &mut AsyncPgConnection,
    ids: &[i64],
    per_second: Option<u32>,
) -> Result<usize> {
    let n = crate::store::sql(
        "UPDATE actix_outbox.inbox_events i SET status = 'RETRY_PENDING', \
             next_attempt_at = now() + coalesce((o.n - 1) / $2::float8, 0) * interval '1 second', \
             updated_at = now() \
         FROM (SELECT id, row_number() OVER (ORDER BY id) AS n FROM unnest($1::int8[]) AS u(id)) o \
         WHERE i.id = o.id AND i.status = 'DEAD_LETTER'",
    )
    .bind::<Array<BigInt>, _>(ids)
    .bind::<Nullable<Integer>, _>(per_second.map(|r| r as i32))
    .execute(conn)
    .await?;
    Ok(n)
}

/// Dead letters back to the publisher: PENDING, lease cleared, attempt count kept, due as
/// [`retry_inbox`] makes them.
pub(crate) async fn retry_outbox(
    conn: &mut AsyncPgConnection,
    ids: &[uuid::Uuid],
    per_second: Option<u32>,
) -> Result<usize> {
    let n = crate::store::sql(
        "UPDATE actix_outbox.outbox_events e SET status = 'PENDING', \
             next_attempt_at = now() + coalesce((o.n - 1) / $2::float8, 0) * interval '1 second', \
             locked_by = NULL, locked_until = NULL, updated_at = now() \
         FROM (SELECT id, row_number() OVER (ORDER BY id) AS n FROM unnest($1::uuid[]) AS u(id)) o \
         WHERE e.id = o.id AND e.status = 'DEAD_LETTER'",
    )
    .bind::<Array<SqlUuid>, _>(ids)
    .bind::<Nullable<Integer>, _>(per_second.map(|r| r as i32))
    .execute(conn)
    .await?;
    Ok(n)
}

/// Statuses an operator may mark IGNORED: the event will not be delivered (to this consumer).
pub(crate) const IGNORABLE: &[&str] = &[
    InboxStatus::DeadLetter.as_str(),
    InboxStatus::RetryPending.as_str(),
];

/// Statuses an operator may retry: dead letters (outbox and inbox spell them alike).
pub(crate) const RETRYABLE: &[&str] = &[InboxStatus::DeadLetter.as_str()];

pub(crate) async fn ignore_inbox(conn: &mut AsyncPgConnection, id: i64) -> Result<usize> {
    let n = crate::store::sql(
        "UPDATE actix_outbox.inbox_events SET status = 'IGNORED', updated_at = now() \
         WHERE id = $1 AND status IN ('DEAD_LETTER', 'RETRY_PENDING')",
    )
    .bind::<BigInt, _>(id)
    .execute(conn)
    .await?;
    Ok(n)
}

pub(crate) async fn ignore_outbox(conn: &mut AsyncPgConnection, id: uuid::Uuid) -> Result<usize> {
    let n = crate::store::sql(
        "UPDATE actix_outbox.outbox_events SET status = 'IGNORED', locked_by = NULL, locked_until = NULL, \
             updated_at = now() \
         WHERE id = $1 AND status IN ('DEAD_LETTER', 'RETRY_PENDING')",
    )
    .bind::<SqlUuid, _>(id)
    .execute(conn)
    .await?;
    Ok(n)
}

/// One audit row.
#[derive(Debug, Clone, QueryableByName, Serialize)]
pub(crate) struct AuditEntry {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = Text)]
    pub who: String,
    #[diesel(sql_type = Text)]
    pub action: String,
    #[diesel(sql_type = Text)]
    pub target: String,
    #[diesel(sql_type = Nullable<Text>)]
    pub reason: Option<String>,
    #[diesel(sql_type = Jsonb)]
    pub details: serde_json::Value,
    #[diesel(sql_type = Timestamptz)]
    pub at: DateTime<Utc>,
}

/// Newest first; `before` is the last id of the previous page.
pub(crate) async fn list_audit(
    conn: &mut AsyncPgConnection,
    before: Option<i64>,
    limit: i64,
) -> Result<Vec<AuditEntry>> {
    let rows = crate::store::sql(include_str!("admin/list_audit.sql"))
        .bind::<Nullable<BigInt>, _>(before)
        .bind::<BigInt, _>(limit)
        .load(conn)
        .await?;
    Ok(rows)
}

/// An aggregate an ordered consumer cannot move on with: its earliest unfinished event (the
/// head) failed and waits for a retry or a decision, and `waiting` events stand behind it.
#[derive(Debug, Clone, QueryableByName, Serialize)]
pub(crate) struct BlockedAggregate {
    #[diesel(sql_type = Text)]
    pub consumer: String,
    #[diesel(sql_type = Text)]
    pub aggregate_type: String,
    #[diesel(sql_type = Text)]
    pub aggregate_id: String,
    #[diesel(sql_type = BigInt)]
    pub waiting: i64,
    /// The head's inbox row id (for its retry or ignore) and what it is.
    #[diesel(sql_type = BigInt)]
    pub head_id: i64,
    #[diesel(sql_type = SqlUuid)]
    pub event_id: uuid::Uuid,
    #[diesel(sql_type = Text)]
    pub event_type: String,
    #[diesel(sql_type = Text)]
    pub status: String,
    #[diesel(sql_type = Integer)]
    pub attempt_count: i32,
    #[diesel(sql_type = Nullable<Text>)]
    pub error_code: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub last_error: Option<String>,
    #[diesel(sql_type = Timestamptz)]
    pub next_attempt_at: DateTime<Utc>,
}

/// The aggregates ordered consumers are held up on (all consumers, or `consumer`'s), most
/// events waiting first. Read through `inbox_events_ordered`, which holds only ordered
/// consumers' unfinished rows.
pub(crate) async fn blocked_aggregates(
    conn: &mut AsyncPgConnection,
    consumer: Option<&str>,
    limit: i64,
) -> Result<Vec<BlockedAggregate>> {
    let rows = crate::store::sql(include_str!("admin/blocked_aggregates.sql"))
        .bind::<Nullable<Text>, _>(consumer)
        .bind::<BigInt, _>(limit)
        .load(conn)
        .await?;
    Ok(rows)
}

/// A consumer's pause switch as operators see it.
#[derive(Debug, Clone, QueryableByName, Serialize)]
pub(crate) struct ConsumerState {
    #[diesel(sql_type = Text)]
    pub consumer: String,
    #[diesel(sql_type = Bool)]
    pub paused: bool,
    #[diesel(sql_type = Nullable<Text>)]
    pub paused_by: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub reason: Option<String>,
    /// When the pause lifts itself, if it does.
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub paused_until: Option<DateTime<Utc>>,
    #[diesel(sql_type = Timestamptz)]
    pub updated_at: DateTime<Utc>,
    #[diesel(sql_type = Array<Text>)]
    pub subscriptions: Vec<String>,
}

/// Whether consumer `s` is paused now: its switch is on and its end, if any, is ahead.
const PAUSED_NOW: &str = "(s.paused AND (s.paused_until IS NULL OR s.paused_until > now()))";

pub(crate) async fn consumer_states(conn: &mut AsyncPgConnection) -> Result<Vec<ConsumerState>> {
    let rows = crate::store::sql(format!(
        "SELECT s.consumer, {PAUSED_NOW} AS paused, s.paused_by, s.reason, \
             CASE WHEN {PAUSED_NOW} THEN s.paused_until END AS paused_until, s.updated_at, \
             coalesce((SELECT array_agg(event_type ORDER BY event_type) FROM actix_outbox.consumer_subscriptions c \
                 WHERE c.consumer = s.consumer), '{{}}') AS subscriptions \
         FROM actix_outbox.consumer_states s ORDER BY s.consumer",
    ))
    .load(conn)
    .await?;
    Ok(rows)
}

/// Locks a consumer's state row for the caller's transaction: `Some(paused)`, or `None` when
/// no runtime ever registered it.
pub(crate) async fn lock_consumer(
    conn: &mut AsyncPgConnection,
    consumer: &str,
) -> Result<Option<bool>> {
    #[derive(QueryableByName)]
    struct Paused {
        #[diesel(sql_type = Bool)]
        paused: bool,
    }
    let rows: Vec<Paused> = crate::store::sql(format!(
        "SELECT {PAUSED_NOW} AS paused FROM actix_outbox.consumer_states s WHERE consumer = $1 FOR UPDATE"
    ))
    .bind::<Text, _>(consumer)
    .load(conn)
    .await?;
    Ok(rows.into_iter().next().map(|r| r.paused))
}
