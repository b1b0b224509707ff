//! Replay statements (migration `replays`): a replay walks its consumer's PROCESSED inbox rows
//! that match its range, in inbox order, and `cursor_id` moves in the transaction that applies
//! them. So the rows it has re-applied are exactly the matching rows up to its cursor, on
//! every instance and through any crash. It never writes an inbox row.

use chrono::{DateTime, Utc};
use diesel::sql_types::{Array, BigInt, Bool, Double, Integer, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::Serialize;

use super::inbox::{error_text, truncate, Failure, InboxRow};
use crate::error::Result;
use crate::event::redact::Redactor;

/// What an operator asks to re-apply: a consumer's processed events, optionally narrowed by
/// type, by the time the events were written, and by correlation id.
#[derive(Debug, Clone)]
pub(crate) struct Range<'a> {
    pub consumer: &'a str,
    /// Empty: every type.
    pub event_types: &'a [String],
    pub from: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
    pub correlation_id: Option<&'a str>,
}

/// The rows a replay walks, beyond its cursor. Only what the handler applied counts: a row
/// marked processed as stale, or ignored by an operator, was never applied, so it is not
/// re-applied either. `processed_at <= requested_at` keeps the set to what was processed when
/// the replay was asked for.
const MATCHING: &str =
    "i.consumer = r.consumer AND i.status = 'PROCESSED' AND i.error_code IS NULL \
     AND i.processed_at <= r.requested_at \
     AND (r.event_types IS NULL OR i.event_type = ANY (r.event_types)) \
     AND (r.created_from IS NULL OR i.event_created_at >= r.created_from) \
     AND (r.created_until IS NULL OR i.event_created_at < r.created_until) \
     AND (r.correlation_id IS NULL OR i.correlation_id = r.correlation_id)";

/// One replay, as the operator API and [`ops::replays`](crate::ops::replays) show it.
#[derive(Debug, Clone, PartialEq, QueryableByName, Serialize)]
#[non_exhaustive]
pub struct Replay {
    /// The replay's id.
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    /// The one consumer it re-applies events to.
    #[diesel(sql_type = Text)]
    pub consumer: String,
    /// The event types it covers; `None` for every type.
    #[diesel(sql_type = Nullable<Array<Text>>)]
    pub event_types: Option<Vec<String>>,
    /// Events written at or after this time, if set.
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub created_from: Option<DateTime<Utc>>,
    /// Events written before this time, if set.
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub created_until: Option<DateTime<Utc>>,
    /// Events of this correlation id, if set.
    #[diesel(sql_type = Nullable<Text>)]
    pub correlation_id: Option<String>,
    /// The events it covered when it was asked for.
    #[diesel(sql_type = BigInt)]
    pub total: i64,
    /// The events re-applied so far.
    #[diesel(sql_type = BigInt)]
    pub done: i64,
    /// Its rate limit, in events per second.
    #[diesel(sql_type = Double)]
    pub rate: f64,
    /// `RUNNING`, `DONE`, `FAILED` (a step failed past the consumer's retry policy; see
    /// `last_error`) or `CANCELLED`.
    #[diesel(sql_type = Text)]
    pub status: String,
    /// Failed attempts of the step it is at.
    #[diesel(sql_type = Integer)]
    pub attempts: i32,
    /// The code of the last failure, if its step has not succeeded since.
    #[diesel(sql_type = Nullable<Text>)]
    pub error_code: Option<String>,
    /// The message of the last failure, likewise.
    #[diesel(sql_type = Nullable<Text>)]
    pub last_error: Option<String>,
    /// Who asked for it.
    #[diesel(sql_type = Text)]
    pub requested_by: String,
    /// Why.
    #[diesel(sql_type = Nullable<Text>)]
    pub reason: Option<String>,
    /// When.
    #[diesel(sql_type = Timestamptz)]
    pub requested_at: DateTime<Utc>,
    /// When it ended (done, failed or cancelled).
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub finished_at: Option<DateTime<Utc>>,
}

const COLUMNS: &str = "id, consumer, event_types, created_from, created_until, correlation_id, \
     total, done, rate, status, attempts, error_code, last_error, requested_by, reason, \
     requested_at, finished_at";

/// Whether the consumer was ever registered, and if so whether its code marks it replay-safe.
pub(crate) async fn replay_safe(
    conn: &mut AsyncPgConnection,
    consumer: &str,
) -> Result<Option<bool>> {
    #[derive(QueryableByName)]
    struct Safe {
        #[diesel(sql_type = Bool)]
        replay_safe: bool,
    }
    let row: Option<Safe> = crate::store::sql(
        "SELECT replay_safe FROM actix_outbox.consumer_states WHERE consumer = $1",
    )
    .bind::<Text, _>(consumer)
    .get_result(conn)
    .await
    .map(Some)
    .or_else(|e| match e {
        diesel::result::Error::NotFound => Ok(None),
        e => Err(e),
    })?;
    Ok(row.map(|r| r.replay_safe))
}

/// Writes a RUNNING replay of `range`, counting its rows now. Its cursor starts just before
/// the first matching row, so that no step reads the history before it.
pub(crate) async fn insert(
    conn: &mut AsyncPgConnection,
    range: &Range<'_>,
    rate: f64,
    by: &str,
    reason: Option<&str>,
) -> Result<Replay> {
    let types = (!range.event_types.is_empty()).then_some(range.event_types);
    let sql = format!(
        "WITH r AS (SELECT $1::text AS consumer, $2::text[] AS event_types, \
                           $3::timestamptz AS created_from, $4::timestamptz AS created_until, \
                           $5::text AS correlation_id, now() AS requested_at), \
              m AS (SELECT count(*) AS total, min(i.id) AS first, max(i.id) AS last \
                    FROM r JOIN actix_outbox.inbox_events i ON {MATCHING}) \
         INSERT INTO actix_outbox.replays (consumer, event_types, created_from, created_until, correlation_id, \
                              upto_id, cursor_id, total, rate, requested_by, reason, requested_at, \
                              status, finished_at) \
         SELECT r.consumer, r.event_types, r.created_from, r.created_until, r.correlation_id, \
                coalesce(m.last, 0), coalesce(m.first - 1, 0), m.total, $6, $7, $8, r.requested_at, \
                CASE WHEN m.total = 0 THEN 'DONE' ELSE 'RUNNING' END, \
                CASE WHEN m.total = 0 THEN now() END \
         FROM r, m RETURNING {COLUMNS}"
    );
    let row = crate::store::sql(sql)
        .bind::<Text, _>(range.consumer)
        .bind::<Nullable<Array<Text>>, _>(types)
        .bind::<Nullable<Timestamptz>, _>(range.from)
        .bind::<Nullable<Timestamptz>, _>(range.until)
        .bind::<Nullable<Text>, _>(range.correlation_id)
        .bind::<Double, _>(rate)
        .bind::<Text, _>(by)
        .bind::<Nullable<Text>, _>(reason)
        .get_result(conn)
        .await?;
    Ok(row)
}

/// Cancels a running replay (what it applied stays applied). Waits for a step in flight to
/// end. `None` for an unknown id; a replay that already ended is returned as it is.
pub(crate) async fn cancel(conn: &mut AsyncPgConnection, id: i64) -> Result<Option<Replay>> {
    let sql = format!(
        "WITH c AS (UPDATE actix_outbox.replays SET status = 'CANCELLED', finished_at = now() \
                    WHERE id = $1 AND status = 'RUNNING' RETURNING {COLUMNS}) \
         SELECT {COLUMNS} FROM c \
         UNION ALL SELECT {COLUMNS} FROM actix_outbox.replays WHERE id = $1 AND NOT EXISTS (SELECT 1 FROM c)"
    );
    let rows: Vec<Replay> = crate::store::sql(sql)
        .bind::<BigInt, _>(id)
        .load(conn)
        .await?;
    Ok(rows.into_iter().next())
}

/// Replays, newest first: one consumer's, or all.
pub(crate) async fn list(
    conn: &mut AsyncPgConnection,
    consumer: Option<&str>,
    limit: i64,
) -> Result<Vec<Replay>> {
    let rows = crate::store::sql(include_str!("replay_list.sql"))
        .bind::<Nullable<Text>, _>(consumer)
        .bind::<BigInt, _>(limit)
        .load(conn)
        .await?;
    Ok(rows)
}

/// How long until the consumer's soonest running replay is due (zero: now); `None` when it
/// has none running, or is paused (a replay waits for its consumer's resume, as its live
/// deliveries do). Outside any transaction: the poll of a consumer with no replay costs
/// this one round trip.
pub(crate) async fn next_due(
    conn: &mut AsyncPgConnection,
    consumer: &str,
) -> Result<Option<std::time::Duration>> {
    #[derive(QueryableByName)]
    struct Wait {
        #[diesel(sql_type = Nullable<BigInt>)]
        ms: Option<i64>,
    }
    // No row when none runs (`greatest` alone would make a NULL minimum 0: due now).
    let rows: Vec<Wait> = crate::store::sql(
        "SELECT greatest(ceil(extract(epoch FROM min(next_step_at) - now()) * 1000), 0)::int8 \
                AS ms \
         FROM actix_outbox.replays WHERE consumer = $1 AND status = 'RUNNING' \
           AND NOT EXISTS (SELECT FROM actix_outbox.consumer_states s WHERE s.consumer = $1 \
               AND s.paused AND (s.paused_until IS NULL OR s.paused_until > now())) \
         HAVING count(*) > 0",
    )
    .bind::<Text, _>(consumer)
    .load(conn)
    .await?;
    Ok(rows
        .into_iter()
        .next()
        .and_then(|r| r.ms)
        .map(|ms| std::time::Duration::from_millis(ms.max(0) as u64)))
}

/// A due replay of the consumer, locked for this step's transaction, so that no two
/// instances step one replay at once: `(id, attempts, rate)`. `None` when none is due or
/// another instance holds it.
pub(crate) async fn lock_due(
    conn: &mut AsyncPgConnection,
    consumer: &str,
) -> Result<Option<Locked>> {
    let rows: Vec<Locked> = crate::store::sql(
        "SELECT id, attempts, rate, now() AS since FROM actix_outbox.replays \
         WHERE consumer = $1 AND status = 'RUNNING' AND next_step_at <= now() \
           AND NOT EXISTS (SELECT FROM actix_outbox.consumer_states s WHERE s.consumer = $1 \
               AND s.paused AND (s.paused_until IS NULL OR s.paused_until > now())) \
         ORDER BY next_step_at, id LIMIT 1 FOR UPDATE SKIP LOCKED",
    )
    .bind::<Text, _>(consumer)
    .load(conn)
    .await?;
    Ok(rows.into_iter().next())
}

/// Holds replay `id`'s next step off for `ms` from now (at least): a step's handler still runs,
/// outside the step's transaction, which is gone.
pub(crate) async fn hold_off(conn: &mut AsyncPgConnection, id: i64, ms: i64) -> Result<()> {
    crate::store::sql(
        "UPDATE actix_outbox.replays \
         SET next_step_at = greatest(next_step_at, now() + $2 * interval '1 millisecond') \
         WHERE id = $1 AND status = 'RUNNING'",
    )
    .bind::<BigInt, _>(id)
    .bind::<BigInt, _>(ms)
    .execute(conn)
    .await?;
    Ok(())
}

/// A replay locked for a step.
#[derive(QueryableByName)]
pub(crate) struct Locked {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    /// Failed attempts of the step it is at.
    #[diesel(sql_type = Integer)]
    pub attempts: i32,
    #[diesel(sql_type = Double)]
    pub rate: f64,
    /// The step's transaction's start: its session existed by then.
    #[diesel(sql_type = Timestamptz)]
    pub since: DateTime<Utc>,
}

/// Of `ids`, the rows older than the version their consumer has recorded for their aggregate:
/// a consumer that skips stale events would not apply them live, and does not re-apply them.
pub(crate) async fn stale(conn: &mut AsyncPgConnection, ids: &[i64]) -> Result<Vec<i64>> {
    #[derive(QueryableByName)]
    struct Id {
        #[diesel(sql_type = BigInt)]
        id: i64,
    }
    let rows: Vec<Id> = crate::store::sql(
        "SELECT i.id FROM actix_outbox.inbox_events i \
         JOIN actix_outbox.aggregate_versions v ON v.consumer = i.consumer \
              AND v.aggregate_type = i.aggregate_type AND v.aggregate_id = i.aggregate_id \
         WHERE i.id = ANY ($1) AND i.aggregate_version < v.version",
    )
    .bind::<Array<BigInt>, _>(ids)
    .load(conn)
    .await?;
    Ok(rows.into_iter().map(|r| r.id).collect())
}

/// The next `limit` rows of replay `id` past its cursor, as deliveries of attempt
/// `attempts + 1` of the step.
pub(crate) async fn rows(
    conn: &mut AsyncPgConnection,
    id: i64,
    limit: i64,
) -> Result<Vec<InboxRow>> {
    let sql = format!(
        "SELECT i.id, i.event_id, i.event_type, i.event_version, i.aggregate_type, \
                i.aggregate_id, i.aggregate_version, i.payload, i.metadata, i.correlation_id, \
                i.causation_id, i.event_created_at, r.attempts AS attempt_count, \
                0::int8 AS lease_token, false AS alone, pg_backend_pid() AS backend \
         FROM actix_outbox.replays r JOIN actix_outbox.inbox_events i ON i.id > r.cursor_id AND i.id <= r.upto_id \
              AND {MATCHING} \
         WHERE r.id = $1 ORDER BY i.id LIMIT $2"
    );
    let rows = crate::store::sql(sql)
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(limit)
        .load(conn)
        .await?;
    Ok(rows)
}

/// Moves the cursor past `last` with `applied` rows more done, in the step's transaction; the
/// next step is due when the rate allows. Done when the cursor reached the end (`last` is
/// `None`: no rows were left), or FAILED with `REPLAY_GAP` if fewer rows were done than it
/// counted when it was asked for: rows of its range were deleted before it reached them.
pub(crate) async fn advance(
    conn: &mut AsyncPgConnection,
    id: i64,
    last: Option<i64>,
    applied: i64,
) -> Result<()> {
    crate::store::sql(
        "UPDATE actix_outbox.replays r SET cursor_id = e.cursor_id, done = r.done + $3, attempts = 0, \
                error_code = CASE WHEN e.gap THEN 'REPLAY_GAP' END, \
                last_error = CASE WHEN e.gap THEN (r.total - r.done - $3) || ' of the ' || r.total \
                    || ' rows it counted were deleted (by retention?) before it reached them' END, \
                next_step_at = now() + make_interval(secs => $3 / r.rate), \
                status = CASE WHEN e.gap THEN 'FAILED' WHEN e.ended THEN 'DONE' ELSE r.status END, \
                finished_at = CASE WHEN e.ended THEN now() END \
         FROM (SELECT coalesce($2, upto_id) AS cursor_id, coalesce($2, upto_id) >= upto_id AS ended, \
                      coalesce($2, upto_id) >= upto_id AND done + $3 < total AS gap \
               FROM actix_outbox.replays WHERE id = $1) e \
         WHERE r.id = $1",
    )
    .bind::<BigInt, _>(id)
    .bind::<Nullable<BigInt>, _>(last)
    .bind::<BigInt, _>(applied)
    .execute(conn)
    .await?;
    Ok(())
}

/// Records a failed step (its transaction rolled back): tried again after `delay_ms` (or later,
/// if the step is held off longer: a hung step's handler still runs), or, when
/// `dead`, the replay ends FAILED with the error (as `redact` leaves it), its cursor at the
/// row that failed.
pub(crate) async fn failed(
    conn: &mut AsyncPgConnection,
    id: i64,
    failure: &Failure,
    redact: &Redactor,
) -> Result<()> {
    crate::store::sql(
        "UPDATE actix_outbox.replays SET attempts = attempts + 1, error_code = $3, last_error = $4, \
                next_step_at = greatest(next_step_at, now() + $5 * interval '1 millisecond'), \
                status = CASE WHEN $2 THEN 'FAILED' ELSE status END, \
                finished_at = CASE WHEN $2 THEN now() END \
         WHERE id = $1 AND status = 'RUNNING'",
    )
    .bind::<BigInt, _>(id)
    .bind::<Bool, _>(failure.dead)
    .bind::<Text, _>(truncate(&failure.code, 200))
    .bind::<Text, _>(error_text(redact, &failure.message))
    .bind::<BigInt, _>(failure.delay_ms)
    .execute(conn)
    .await?;
    Ok(())
}
