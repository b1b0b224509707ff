//! Replay statements (migration `replays`): a replay walks its consumer's PROCESSED inbox rows
//! that match its range, in inbox order, and `cursor_id` moves in the transaction that applies
//! them. So the rows it has re-applied are exactly the matching rows up to its cursor, on
//! every instance and through any crash. It never writes an inbox row.
//!
//! A consumer that reads through cursors has no inbox row of an event it handled there, so a
//! replay first walks those events in the outbox (migration `replay_log`): *the published
//! events of its range that it had no inbox row of when the replay was asked for, and whose
//! stamp lies between the one its cursors started at and its oldest unread stamp then.*
//! Stamps become visible in number order, so that set is fixed when it is asked for: a later
//! stamp has a larger number. The walk's position,
//! (`log_at`, `log_id`), moves in the step's transaction as `cursor_id` does, and retention
//! keeps the outbox rows it has yet to reach.

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

/// The outbox rows a replay walks before its inbox rows: events the consumer read through its
/// cursors (a stamp below `log_below`, past the one its cursors started at and past the last
/// one when it subscribed to the type, no inbox row of it when the replay was asked for). An
/// event stamped for another consumer's cursor while this one read the type from its inbox
/// has an inbox row of it. One whose PROCESSED inbox row retention deleted before the replay
/// was asked for is walked here: it was applied (a stale mark stays while the event is in
/// the outbox). Retention keeps the consumer's inbox rows of the range up to
/// `log_inbox_upto` while the walk runs, so none of them goes and lets its event in.
const LOG_MATCHING: &str = "o.status = 'PUBLISHED' AND o.stamp < r.log_below \
     AND o.stamp > r.log_above \
     AND o.published_at <= r.requested_at \
     AND EXISTS (SELECT FROM actix_outbox.consumer_subscriptions s WHERE s.consumer = r.consumer \
                 AND s.event_type = o.event_type AND o.stamp > coalesce(s.since, 0)) \
     AND NOT EXISTS (SELECT FROM actix_outbox.inbox_events i \
                     WHERE i.event_id = o.id AND i.consumer = r.consumer \
                       AND i.id <= r.log_inbox_upto) \
     AND (r.event_types IS NULL OR o.event_type = ANY (r.event_types)) \
     AND (r.created_from IS NULL OR o.created_at >= r.created_from) \
     AND (r.created_until IS NULL OR o.created_at < r.created_until) \
     AND (r.correlation_id IS NULL OR o.correlation_id = r.correlation_id)";

/// The consumer's oldest stamp with an entry past its cursor of that stamp's slot (a batch's
/// leased entries are past it until the batch commits), or the next stamp when none is:
/// every event of a smaller stamp that it subscribes to, it has read. NULL, and no walk of
/// the outbox, for a consumer with no cursors: it read nothing through them, or it has
/// dropped them (turned off), and what it read there is not replayed.
const OLDEST_UNREAD: &str = "CASE WHEN EXISTS (SELECT FROM actix_outbox.consumer_cursors \
                                            WHERE consumer = $1) THEN least( \
     (SELECT min(st.stamp) FROM actix_outbox.consumer_cursors k \
      JOIN actix_outbox.log_stamps st ON st.part = k.part AND st.stamp >= k.stamp \
           AND (st.stamp, cardinality(st.events)) > (k.stamp, k.idx) \
      WHERE k.consumer = $1), \
     (SELECT last + 1 FROM actix_outbox.log_head)) END";

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
                           $5::text AS correlation_id, clock_timestamp() AS requested_at, \
                           {OLDEST_UNREAD} AS log_below, \
                           (SELECT coalesce(max(since), 0) FROM actix_outbox.consumer_cursors \
                            WHERE consumer = $1) AS log_above, \
                           (SELECT coalesce(max(id), 0) FROM actix_outbox.inbox_events) \
                               AS log_inbox_upto), \
              m AS (SELECT count(*) AS total, min(i.id) AS first, max(i.id) AS last \
                    FROM r JOIN actix_outbox.inbox_events i ON {MATCHING}), \
              l AS (SELECT count(*) AS total FROM r JOIN actix_outbox.outbox_events o ON {LOG_MATCHING}) \
         INSERT INTO actix_outbox.replays (consumer, event_types, created_from, created_until, correlation_id, \
                              upto_id, cursor_id, total, rate, requested_by, reason, requested_at, \
                              status, finished_at, log_below, log_at, log_id, log_inbox_upto, \
                              log_above) \
         SELECT r.consumer, r.event_types, r.created_from, r.created_until, r.correlation_id, \
                coalesce(m.last, 0), coalesce(m.first - 1, 0), m.total + l.total, $6, $7, $8, \
                r.requested_at, \
                CASE WHEN m.total + l.total = 0 THEN 'DONE' ELSE 'RUNNING' END, \
                CASE WHEN m.total + l.total = 0 THEN now() END, \
                CASE WHEN l.total > 0 THEN r.log_below END, '-infinity', \
                '00000000-0000-0000-0000-000000000000', r.log_inbox_upto, \
                r.log_above \
         FROM r, m, l RETURNING {COLUMNS}"
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
        "SELECT id, attempts, rate, now() AS since, log_below IS NOT NULL AS log \
         FROM actix_outbox.replays \
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
    /// Whether it still walks the events its consumer read through cursors
    /// ([`rows`]), before its inbox rows.
    #[diesel(sql_type = Bool)]
    pub log: bool,
}

/// Of `rows`, the events older than the version `consumer` has recorded for their
/// aggregate: a consumer that skips stale events would not apply them live, and does not
/// re-apply them.
pub(crate) async fn stale(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    rows: &[InboxRow],
) -> Result<Vec<uuid::Uuid>> {
    #[derive(QueryableByName)]
    struct Id {
        #[diesel(sql_type = diesel::sql_types::Uuid)]
        event_id: uuid::Uuid,
    }
    let (mut ids, mut types, mut aggregates, mut versions) = (vec![], vec![], vec![], vec![]);
    for r in rows {
        ids.push(r.event_id);
        types.push(r.aggregate_type.as_str());
        aggregates.push(r.aggregate_id.as_str());
        versions.push(r.aggregate_version);
    }
    let stale: Vec<Id> = crate::store::sql(
        "SELECT e.event_id FROM unnest($2::uuid[], $3::text[], $4::text[], $5::int8[]) \
                AS e(event_id, aggregate_type, aggregate_id, version) \
         JOIN actix_outbox.aggregate_versions v ON v.consumer = $1 \
              AND v.aggregate_type = e.aggregate_type AND v.aggregate_id = e.aggregate_id \
         WHERE e.version < v.version",
    )
    .bind::<Text, _>(consumer)
    .bind::<Array<diesel::sql_types::Uuid>, _>(ids)
    .bind::<Array<Text>, _>(types)
    .bind::<Array<Text>, _>(aggregates)
    .bind::<Array<Nullable<BigInt>>, _>(versions)
    .load(conn)
    .await?;
    Ok(stale.into_iter().map(|r| r.event_id).collect())
}

/// The next `limit` rows of replay `id` past its position, as deliveries of attempt
/// `attempts + 1` of the step: of its walk through the events its consumer read through
/// cursors ([`LOG_MATCHING`]) when `log`, of its inbox rows otherwise.
///
/// In the outbox, the index of `published_at` gives the order, not (`published_at`, `id`):
/// so the statement first finds the `published_at` of the `limit`-th event past the position,
/// in index order, then sorts the events up to it. Each step reads about `limit` rows and the
/// ties of one instant (one claim's events), wherever the walk stands.
pub(crate) async fn rows(
    conn: &mut AsyncPgConnection,
    id: i64,
    limit: i64,
    log: bool,
) -> Result<Vec<InboxRow>> {
    let sql = if log {
        format!(
            "SELECT o.seq AS id, o.id AS event_id, o.event_type, o.event_version, o.aggregate_type, \
                o.aggregate_id, o.aggregate_version, o.payload, o.metadata, o.correlation_id, \
                o.causation_id, o.created_at AS event_created_at, r.attempts AS attempt_count, \
                0::int8 AS lease_token, false AS alone, pg_backend_pid() AS backend \
         FROM actix_outbox.replays r CROSS JOIN LATERAL ( \
             SELECT o.* FROM actix_outbox.outbox_events o \
             WHERE o.published_at >= r.log_at AND o.published_at <= ( \
                       SELECT max(o.published_at) FROM ( \
                           SELECT o.published_at FROM actix_outbox.outbox_events o \
                           WHERE o.published_at >= r.log_at \
                             AND (o.published_at, o.id) > (r.log_at, r.log_id) AND {LOG_MATCHING} \
                           ORDER BY o.published_at LIMIT $2) o) \
               AND (o.published_at, o.id) > (r.log_at, r.log_id) AND {LOG_MATCHING} \
             ORDER BY o.published_at, o.id LIMIT $2) o \
         WHERE r.id = $1 ORDER BY o.published_at, o.id"
        )
    } else {
        format!(
            "SELECT i.id, i.event_id, i.event_type, i.event_version, i.aggregate_type, \
                    i.aggregate_id, i.aggregate_version, i.payload, i.metadata, i.correlation_id, \
                    i.causation_id, i.event_created_at, r.attempts AS attempt_count, \
                    0::int8 AS lease_token, false AS alone, pg_backend_pid() AS backend \
             FROM actix_outbox.replays r JOIN actix_outbox.inbox_events i \
                  ON i.id > r.cursor_id AND i.id <= r.upto_id AND {MATCHING} \
             WHERE r.id = $1 ORDER BY i.id LIMIT $2"
        )
    };
    let rows = crate::store::sql(sql)
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(limit)
        .load(conn)
        .await?;
    Ok(rows)
}

/// Moves replay `id`'s walk through the outbox past event `last` with `applied` events more
/// done, in the step's transaction, or (`None`: none was left) ends that walk, so that the
/// next step walks its inbox rows. Fails if `last` is not a published event, so that a step
/// never commits effects without moving.
pub(crate) async fn log_advance(
    conn: &mut AsyncPgConnection,
    id: i64,
    last: Option<uuid::Uuid>,
    applied: i64,
) -> Result<()> {
    let moved =
        match last {
            // None left: the walk of the outbox is over, and the next step walks the inbox rows.
            None => crate::store::sql(
                "UPDATE actix_outbox.replays SET log_below = NULL, log_at = NULL, log_id = NULL, \
                        attempts = 0, error_code = NULL, last_error = NULL, next_step_at = now() \
                 WHERE id = $1 AND log_below IS NOT NULL",
            )
            .bind::<BigInt, _>(id)
            .execute(conn)
            .await?,
            Some(last) => {
                crate::store::sql(
                    "UPDATE actix_outbox.replays r SET log_at = o.published_at, log_id = o.id, \
                        done = r.done + $3, attempts = 0, error_code = NULL, last_error = NULL, \
                        next_step_at = now() + make_interval(secs => $3 / r.rate) \
                 FROM actix_outbox.outbox_events o \
                 WHERE r.id = $1 AND r.log_below IS NOT NULL AND o.id = $2 \
                   AND o.status = 'PUBLISHED'",
                )
                .bind::<BigInt, _>(id)
                .bind::<diesel::sql_types::Uuid, _>(last)
                .bind::<BigInt, _>(applied)
                .execute(conn)
                .await?
            }
        };
    if moved == 1 {
        Ok(())
    } else {
        // The event is gone (retention keeps it; an operator's DELETE does not): the step
        // rolls back, and the next one walks on without it.
        Err(diesel::result::Error::NotFound.into())
    }
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
