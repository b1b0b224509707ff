//! Side-effect statements (migration `side_effects`). The rule the table keeps: a row is due
//! when PENDING and `next_attempt_at` has passed. A claim counts the attempt and moves
//! `next_attempt_at` past its lease, so a worker that dies mid-call leaves a row that comes
//! due again once the lease ends, already charged; an outcome is recorded only by the claim
//! whose attempt is still the row's.

use diesel::sql_types::{Array, BigInt, Bool, Integer, Jsonb, Nullable, Text, Uuid as SqlUuid};
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

/// The code of a row whose worker stopped (killed, most likely) during its last attempt.
/// (`ErrorCode::EFFECT_ATTEMPT_INTERRUPTED`).
pub(crate) const INTERRUPTED: &str = "EFFECT_ATTEMPT_INTERRUPTED";

/// Claims up to `limit` due rows of `kind` for `lease_ms`. A due row that has used all of
/// `max_attempts` (its worker died during the last one) is dead-lettered here instead of
/// being called again: a call that kills its process cannot kill every restart.
pub(crate) async fn claim(
    conn: &mut AsyncPgConnection,
    kind: &str,
    limit: i64,
    lease_ms: i64,
    max_attempts: i32,
) -> Result<Vec<Claimed>> {
    let rows = super::sql(
        "WITH due AS ( \
             SELECT id, attempt_count >= $4 AS spent FROM actix_outbox.side_effects \
             WHERE kind = $1 AND status = 'PENDING' AND next_attempt_at <= now() \
             ORDER BY next_attempt_at, id LIMIT $2 \
             FOR UPDATE SKIP LOCKED \
         ) \
         UPDATE actix_outbox.side_effects e SET \
             status = CASE WHEN due.spent THEN 'DEAD_LETTER' ELSE 'PENDING' END, \
             attempt_count = e.attempt_count + CASE WHEN due.spent THEN 0 ELSE 1 END, \
             next_attempt_at = CASE WHEN due.spent THEN e.next_attempt_at \
                 ELSE now() + $3 * interval '1 millisecond' END, \
             error_code = CASE WHEN due.spent THEN $5 ELSE e.error_code END, \
             last_error = CASE WHEN due.spent \
                 THEN 'its worker stopped during its last attempt (killed?)' \
                 ELSE e.last_error END, \
             updated_at = now() \
         FROM due WHERE e.id = due.id \
         RETURNING e.id, e.key, e.payload, e.event_id, e.correlation_id, e.attempt_count, \
             due.spent",
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

/// Records outcomes, each only if its claim's attempt is still the row's: a call that
/// outlived its lease, whose row another worker claimed again, records nothing. Returns how
/// many were recorded.
pub(crate) async fn settle(conn: &mut AsyncPgConnection, outcomes: &[Outcome]) -> Result<usize> {
    let ids: Vec<i64> = outcomes.iter().map(|o| o.id).collect();
    let attempts: Vec<i32> = outcomes.iter().map(|o| o.attempt).collect();
    let ok: Vec<bool> = outcomes.iter().map(|o| o.failed.is_none()).collect();
    let dead: Vec<bool> = outcomes
        .iter()
        .map(|o| o.failed.as_ref().is_some_and(|f| f.dead))
        .collect();
    let delays: Vec<i64> = outcomes
        .iter()
        .map(|o| o.failed.as_ref().map_or(0, |f| f.delay_ms))
        .collect();
    let codes: Vec<Option<String>> = outcomes
        .iter()
        .map(|o| o.failed.as_ref().map(|f| f.code.clone()))
        .collect();
    let messages: Vec<Option<String>> = outcomes
        .iter()
        .map(|o| o.failed.as_ref().map(|f| f.message.clone()))
        .collect();
    let n = super::sql(
        "UPDATE actix_outbox.side_effects e SET \
             status = CASE WHEN r.ok THEN 'DONE' WHEN r.dead THEN 'DEAD_LETTER' ELSE 'PENDING' END, \
             next_attempt_at = CASE WHEN r.ok OR r.dead THEN now() \
                 ELSE now() + r.delay_ms * interval '1 millisecond' END, \
             done_at = CASE WHEN r.ok THEN now() END, \
             error_code = r.code, last_error = r.message, updated_at = now() \
         FROM unnest($1::int8[], $2::int4[], $3::bool[], $4::bool[], $5::int8[], $6::text[], \
                     $7::text[]) AS r(id, attempt, ok, dead, delay_ms, code, message) \
         WHERE e.id = r.id AND e.attempt_count = r.attempt AND e.status = 'PENDING'",
    )
    .bind::<Array<BigInt>, _>(ids)
    .bind::<Array<Integer>, _>(attempts)
    .bind::<Array<Bool>, _>(ok)
    .bind::<Array<Bool>, _>(dead)
    .bind::<Array<BigInt>, _>(delays)
    .bind::<Array<Nullable<Text>>, _>(codes)
    .bind::<Array<Nullable<Text>>, _>(messages)
    .execute(conn)
    .await?;
    Ok(n)
}
