//! Side-effect statements (migration `side_effects`, whose header states the rule the table
//! keeps).

use diesel::sql_types::{BigInt, Bool, Integer, Jsonb, Nullable, Text, Uuid as SqlUuid};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::Result;

/// Inserts a side effect in the caller's transaction; returns false when one of the same kind
/// and key exists already (the effect was asked for before: nothing is added).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn insert(
    conn: &mut AsyncPgConnection,
    kind: &str,
    key: &str,
    payload: &serde_json::Value,
    event_id: Option<uuid::Uuid>,
    consumer: Option<&str>,
    correlation_id: Option<&str>,
) -> Result<bool> {
    let n = super::sql(
        "INSERT INTO actix_outbox.side_effects \
             (kind, key, payload, event_id, consumer, correlation_id) \
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (kind, key) DO NOTHING",
    )
    .bind::<Text, _>(kind)
    .bind::<Text, _>(key)
    .bind::<Jsonb, _>(payload)
    .bind::<Nullable<SqlUuid>, _>(event_id)
    .bind::<Nullable<Text>, _>(consumer)
    .bind::<Nullable<Text>, _>(correlation_id)
    .execute(conn)
    .await?;
    Ok(n == 1)
}

/// A claimed row: the call to make, or (`spent`) a row whose last attempt never finished and
/// that the claim dead-lettered instead.
#[derive(Debug, QueryableByName)]
pub(crate) struct Claimed {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = Text)]
    pub key: String,
    #[diesel(sql_type = Jsonb)]
    pub payload: serde_json::Value,
    #[diesel(sql_type = Nullable<SqlUuid>)]
    pub event_id: Option<uuid::Uuid>,
    #[diesel(sql_type = Nullable<Text>)]
    pub correlation_id: Option<String>,
    #[diesel(sql_type = Integer)]
    pub attempt_count: i32,
    #[diesel(sql_type = Bool)]
    pub spent: bool,
}

/// The code of a row whose worker stopped (killed, most likely) during its last attempt
/// (`ErrorCode::EFFECT_ATTEMPT_INTERRUPTED`).
pub(crate) const INTERRUPTED: &str = "EFFECT_ATTEMPT_INTERRUPTED";

/// Claims due rows of `kind` for `lease_ms`: one interrupted row (still in flight once due:
/// its worker died during the call) alone, if there is one, else up to `limit`. Claimed
/// alone, a call that kills its process charges no other row. An interrupted row that has
/// used all of `max_attempts` is dead-lettered here instead of being called again.
pub(crate) async fn claim(
    conn: &mut AsyncPgConnection,
    kind: &str,
    limit: i64,
    lease_ms: i64,
    max_attempts: i32,
) -> Result<Vec<Claimed>> {
    let rows = super::sql(
        "WITH suspect AS ( \
             SELECT id FROM actix_outbox.side_effects \
             WHERE kind = $1 AND status = 'PENDING' AND in_flight AND next_attempt_at <= now() \
             ORDER BY next_attempt_at, id LIMIT 1 \
             FOR UPDATE SKIP LOCKED \
         ), due AS ( \
             SELECT id FROM actix_outbox.side_effects \
             WHERE kind = $1 AND status = 'PENDING' AND next_attempt_at <= now() \
               AND NOT EXISTS (SELECT 1 FROM suspect) \
             ORDER BY next_attempt_at, id LIMIT $2 \
             FOR UPDATE SKIP LOCKED \
         ), picked AS ( \
             SELECT id FROM suspect UNION ALL SELECT id FROM due \
         ) \
         UPDATE actix_outbox.side_effects e SET \
             status = CASE WHEN e.in_flight AND e.attempt_count >= $4 \
                 THEN 'DEAD_LETTER' ELSE 'PENDING' END, \
             in_flight = NOT (e.in_flight AND e.attempt_count >= $4), \
             attempt_count = e.attempt_count \
                 + CASE WHEN e.in_flight AND e.attempt_count >= $4 THEN 0 ELSE 1 END, \
             next_attempt_at = CASE WHEN e.in_flight AND e.attempt_count >= $4 \
                 THEN e.next_attempt_at ELSE now() + $3 * interval '1 millisecond' END, \
             error_code = CASE WHEN e.in_flight AND e.attempt_count >= $4 \
                 THEN $5 ELSE e.error_code END, \
             last_error = CASE WHEN e.in_flight AND e.attempt_count >= $4 \
                 THEN 'its worker stopped during its last attempt (killed?)' \
                 ELSE e.last_error END, \
             updated_at = now() \
         FROM picked WHERE e.id = picked.id \
         RETURNING e.id, e.key, e.payload, e.event_id, e.correlation_id, e.attempt_count, \
             e.status = 'DEAD_LETTER' AS spent",
    )
    .bind::<Text, _>(kind)
    .bind::<BigInt, _>(limit)
    .bind::<BigInt, _>(lease_ms)
    .bind::<Integer, _>(max_attempts)
    .bind::<Text, _>(INTERRUPTED)
    .load(conn)
    .await?;
    Ok(rows)
}

/// One call's outcome.
#[derive(Debug)]
pub(crate) struct Outcome {
    pub id: i64,
    /// The attempt the claim counted: the fence.
    pub attempt: i32,
    /// Done (`None`), or failed: dead-lettered, or due again after the delay.
    pub failed: Option<Failed>,
}

#[derive(Debug)]
pub(crate) struct Failed {
    pub dead: bool,
    pub delay_ms: i64,
    pub code: String,
    pub message: String,
}

/// Records one call's outcome, only if its claim's attempt is still the row's: a call that
/// outlived its lease, whose row another worker claimed again, records nothing. Returns
/// whether it was recorded.
pub(crate) async fn settle(conn: &mut AsyncPgConnection, o: &Outcome) -> Result<bool> {
    let failed = o.failed.as_ref();
    let n = super::sql(
        "UPDATE actix_outbox.side_effects SET \
             status = CASE WHEN $3 THEN 'DONE' WHEN $4 THEN 'DEAD_LETTER' ELSE 'PENDING' END, \
             in_flight = false, \
             next_attempt_at = CASE WHEN $3 OR $4 THEN now() \
                 ELSE now() + $5 * interval '1 millisecond' END, \
             done_at = CASE WHEN $3 THEN now() END, \
             error_code = $6, last_error = $7, updated_at = now() \
         WHERE id = $1 AND attempt_count = $2 AND status = 'PENDING' AND in_flight",
    )
    .bind::<BigInt, _>(o.id)
    .bind::<Integer, _>(o.attempt)
    .bind::<Bool, _>(failed.is_none())
    .bind::<Bool, _>(failed.is_some_and(|f| f.dead))
    .bind::<BigInt, _>(failed.map_or(0, |f| f.delay_ms))
    .bind::<Nullable<Text>, _>(failed.map(|f| f.code.as_str()))
    .bind::<Nullable<Text>, _>(failed.map(|f| f.message.as_str()))
    .execute(conn)
    .await?;
    Ok(n == 1)
}

// ---------------------------------------------------------------------------------------------
// The operator's side: list, lock, retry, ignore (through the operator API's one transaction).

/// One side effect as the operator API lists it (no payload: it may hold personal data).
#[derive(Debug, Clone, QueryableByName, serde::Serialize)]
pub(crate) struct EffectItem {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = Text)]
    pub kind: String,
    #[diesel(sql_type = Text)]
    pub key: String,
    #[diesel(sql_type = Text)]
    pub status: String,
    #[diesel(sql_type = Bool)]
    pub in_flight: bool,
    #[diesel(sql_type = Integer)]
    pub attempt_count: i32,
    #[diesel(sql_type = Nullable<Text>)]
    pub error_code: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub last_error: Option<String>,
    #[diesel(sql_type = Nullable<SqlUuid>)]
    pub event_id: Option<uuid::Uuid>,
    #[diesel(sql_type = Nullable<Text>)]
    pub consumer: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub correlation_id: Option<String>,
    #[diesel(sql_type = diesel::sql_types::Timestamptz)]
    pub created_at: chrono::DateTime<chrono::Utc>,
    #[diesel(sql_type = diesel::sql_types::Timestamptz)]
    pub next_attempt_at: chrono::DateTime<chrono::Utc>,
    #[diesel(sql_type = Nullable<diesel::sql_types::Timestamptz>)]
    pub done_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// The statuses a side effect is stored with.
pub(crate) const STATUSES: &[&str] = &["PENDING", "DONE", "DEAD_LETTER", "IGNORED"];

/// Newest first, by id; `before` is the last id of the previous page.
pub(crate) async fn list(
    conn: &mut AsyncPgConnection,
    status: Option<&str>,
    kind: Option<&str>,
    before: Option<i64>,
    limit: i64,
) -> Result<Vec<EffectItem>> {
    let rows = super::sql(
        "SELECT id, kind, key, status, in_flight, attempt_count, error_code, last_error, \
             event_id, consumer, correlation_id, created_at, next_attempt_at, done_at \
         FROM actix_outbox.side_effects \
         WHERE ($1::text IS NULL OR status = $1) AND ($2::text IS NULL OR kind = $2) \
           AND ($3::int8 IS NULL OR id < $3) \
         ORDER BY id DESC LIMIT $4",
    )
    .bind::<Nullable<Text>, _>(status)
    .bind::<Nullable<Text>, _>(kind)
    .bind::<Nullable<BigInt>, _>(before)
    .bind::<BigInt, _>(limit)
    .load(conn)
    .await?;
    Ok(rows)
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Locks those of the rows `ids` that no call holds (a row claimed and not past its lease is
/// held: its call may be running), for the caller's transaction; returns their state and how
/// many of `ids` exist.
pub(crate) async fn lock(
    conn: &mut AsyncPgConnection,
    ids: &[i64],
) -> Result<(Vec<super::admin::LockedRow>, i64)> {
    let rows: Vec<super::admin::LockedRow> = super::sql(
        "SELECT id::text AS id, status, attempt_count, error_code, kind AS event_type, consumer \
         FROM actix_outbox.side_effects \
         WHERE id = ANY($1) AND NOT (in_flight AND next_attempt_at > now()) \
         ORDER BY id FOR UPDATE SKIP LOCKED",
    )
    .bind::<diesel::sql_types::Array<BigInt>, _>(ids)
    .load(conn)
    .await?;
    let existing: Count =
        super::sql("SELECT count(*) AS n FROM actix_outbox.side_effects WHERE id = ANY($1)")
            .bind::<diesel::sql_types::Array<BigInt>, _>(ids)
            .get_result(conn)
            .await?;
    Ok((rows, existing.n))
}

/// Dead letters back to their worker: PENDING, attempt count kept (so the policy allows one
/// more attempt), due now or, with `per_second`, one after another at that pace.
pub(crate) async fn retry(
    conn: &mut AsyncPgConnection,
    ids: &[i64],
    per_second: Option<u32>,
) -> Result<usize> {
    let n = super::sql(
        "UPDATE actix_outbox.side_effects e SET status = 'PENDING', in_flight = false, \
             next_attempt_at = now() + coalesce((o.n - 1) / $2::float8, 0) * interval '1 second', \
             updated_at = now() \
         FROM (SELECT id, row_number() OVER (ORDER BY id) AS n FROM unnest($1::int8[]) AS u(id)) o \
         WHERE e.id = o.id AND e.status = 'DEAD_LETTER'",
    )
    .bind::<diesel::sql_types::Array<BigInt>, _>(ids)
    .bind::<Nullable<Integer>, _>(per_second.map(|r| r as i32))
    .execute(conn)
    .await?;
    Ok(n)
}

/// Sets a dead-lettered or waiting effect aside for good: its call is never made (again).
pub(crate) async fn ignore(conn: &mut AsyncPgConnection, id: i64) -> Result<usize> {
    let n = super::sql(
        "UPDATE actix_outbox.side_effects SET status = 'IGNORED', in_flight = false, \
             updated_at = now() \
         WHERE id = $1 AND status IN ('DEAD_LETTER', 'PENDING')",
    )
    .bind::<BigInt, _>(id)
    .execute(conn)
    .await?;
    Ok(n)
}
