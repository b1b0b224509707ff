//! Outbox statements for external transports: the leased claim, the fenced marks and the
//! reaper. `PENDING|RETRY_PENDING → PROCESSING (lease) → PUBLISHED | RETRY_PENDING | DEAD_LETTER`.
//! Every time comparison uses the database clock (`now()`), never the process's.

use chrono::{DateTime, Utc};
use diesel::sql_types::{
    BigInt, Bool, Integer, Jsonb, Nullable, Text, Timestamptz, Uuid as SqlUuid,
};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::Result;
use crate::event::redact::Redactor;
use crate::store::inbox::{error_text, truncate, Failure};
use crate::store::Prepared;

/// One leased outbox row.
#[derive(Debug, Clone, QueryableByName)]
pub(crate) struct LeasedRow {
    #[diesel(sql_type = SqlUuid)]
    pub id: uuid::Uuid,
    #[diesel(sql_type = BigInt)]
    pub lease_token: i64,
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
    #[diesel(sql_type = Jsonb)]
    pub payload: serde_json::Value,
    #[diesel(sql_type = Jsonb)]
    pub metadata: serde_json::Value,
    #[diesel(sql_type = Text)]
    pub correlation_id: String,
    #[diesel(sql_type = Nullable<Text>)]
    pub causation_id: Option<String>,
    #[diesel(sql_type = Timestamptz)]
    pub created_at: DateTime<Utc>,
    /// Attempts including this one (counted at claim, before any outcome).
    #[diesel(sql_type = Integer)]
    pub attempt_count: i32,
    /// Leased on its own: its earlier lease expired together with others'.
    #[diesel(sql_type = Bool)]
    pub alone: bool,
    /// Its place in the due index.
    #[diesel(sql_type = BigInt)]
    pub seq: i64,
}

/// Claims up to `limit` due rows for `owner` with a lease of `lease_ms`, in one statement
/// (`lease_claim.sql`), reading the due index past seq `after` (`None`: from the start; see
/// [`scan`](crate::store::scan)). The attempt is counted here, so a publisher that dies
/// mid-publish still used an attempt. A due row marked `alone` by the reaper is claimed on its
/// own, before any other (see the migration `outbox_alone`).
pub(crate) async fn claim_leased(
    conn: &mut AsyncPgConnection,
    owner: &str,
    limit: i64,
    lease_ms: i64,
    after: Option<i64>,
) -> Result<Vec<LeasedRow>> {
    let rows = Prepared(
        crate::store::sql(include_str!("lease_claim.sql"))
            .bind::<BigInt, _>(limit)
            .bind::<Text, _>(owner)
            .bind::<BigInt, _>(lease_ms)
            .bind::<BigInt, _>(after.unwrap_or(i64::MIN)),
    )
    .load(conn)
    .await?;
    Ok(rows)
}

/// Marks a leased row PUBLISHED. Returns false when the lease was lost (expired and reaped, or
/// claimed by another publisher): then nothing changed.
pub(crate) async fn mark_published(
    conn: &mut AsyncPgConnection,
    id: uuid::Uuid,
    token: i64,
) -> Result<bool> {
    let n = Prepared(crate::store::sql(
        "UPDATE actix_outbox.outbox_events SET status = 'PUBLISHED', published_at = now(), updated_at = now(), \
             locked_by = NULL, locked_until = NULL, last_error = NULL, error_code = NULL \
         WHERE id = $1 AND status = 'PROCESSING' AND lease_token = $2",
    )
    .bind::<SqlUuid, _>(id)
    .bind::<BigInt, _>(token))
    .execute(conn)
    .await?;
    Ok(n == 1)
}

/// Records a failed publish of a leased row: RETRY_PENDING at `now() + delay_ms`, or
/// DEAD_LETTER, its message as `redact` leaves it. Fenced like [`mark_published`].
pub(crate) async fn mark_failed(
    conn: &mut AsyncPgConnection,
    id: uuid::Uuid,
    token: i64,
    failure: &Failure,
    redact: &Redactor,
) -> Result<bool> {
    let n = Prepared(crate::store::sql(
        "UPDATE actix_outbox.outbox_events SET \
             status = CASE WHEN $3 THEN 'DEAD_LETTER' ELSE 'RETRY_PENDING' END, \
             next_attempt_at = now() + $4 * interval '1 millisecond', \
             locked_by = NULL, locked_until = NULL, error_code = $5, last_error = $6, updated_at = now() \
         WHERE id = $1 AND status = 'PROCESSING' AND lease_token = $2",
    )
    .bind::<SqlUuid, _>(id)
    .bind::<BigInt, _>(token)
    .bind::<Bool, _>(failure.dead)
    .bind::<BigInt, _>(failure.delay_ms)
    .bind::<Text, _>(truncate(&failure.code, 200))
    .bind::<Text, _>(error_text(redact, &failure.message)))
    .execute(conn)
    .await?;
    Ok(n == 1)
}

/// The lease reaper: rows whose lease has expired (their publisher died or hung after
/// claiming) go back to RETRY_PENDING, due at once, or to DEAD_LETTER when their attempts are
/// used up. Their event may already have been published; publishing it again is expected and
/// the receiving inbox absorbs the duplicate. Returns how many rows were reset.
///
/// Rows leased by one claim share its owner and its `locked_until` (the claim's `now()` plus
/// the lease). When several of them expire together, which one made their publisher die or
/// hang is unknown: none is charged the attempt, and each is marked `alone`, to be published
/// on its own from then on. A row leased alone whose lease expires is charged. A reap takes
/// whole leases (`limit` of them), and counts a lease's rows from the table, not from the rows
/// it locked, so neither its limit nor a concurrent reaper splits a lease into rows that would
/// each look leased alone.
pub(crate) async fn reap_expired(
    conn: &mut AsyncPgConnection,
    max_attempts: i32,
    limit: i64,
) -> Result<usize> {
    let n = Prepared(crate::store::sql(
        "WITH expired AS ( \
             SELECT e.id, (SELECT count(*) FROM actix_outbox.outbox_events p WHERE p.status = 'PROCESSING' \
                     AND p.locked_by = e.locked_by AND p.locked_until = e.locked_until) > 1 \
                 AS shared \
             FROM (SELECT id, locked_by, locked_until FROM actix_outbox.outbox_events \
                   WHERE status = 'PROCESSING' AND locked_until IN ( \
                       SELECT DISTINCT locked_until FROM actix_outbox.outbox_events \
                       WHERE status = 'PROCESSING' AND locked_until < now() \
                       ORDER BY locked_until LIMIT $2) \
                   FOR UPDATE SKIP LOCKED) e \
         ) \
         UPDATE actix_outbox.outbox_events o SET \
             attempt_count = CASE WHEN x.shared THEN greatest(o.attempt_count - 1, 0) \
                 ELSE o.attempt_count END, \
             status = CASE WHEN NOT x.shared AND o.attempt_count >= $1 THEN 'DEAD_LETTER' \
                 ELSE 'RETRY_PENDING' END, \
             alone = true, next_attempt_at = now(), locked_by = NULL, locked_until = NULL, \
             error_code = 'OUTBOX_PUBLISH_TIMEOUT', \
             last_error = 'lease of ' || coalesce(o.locked_by, '?') || ' expired before the publish was marked' \
                 || CASE WHEN x.shared THEN ' (with other rows: not counted; published alone from now on)' \
                    ELSE '' END, \
             updated_at = now() \
         FROM expired x WHERE o.id = x.id",
    )
    .bind::<Integer, _>(max_attempts)
    .bind::<BigInt, _>(limit))
    .execute(conn)
    .await?;
    Ok(n)
}
