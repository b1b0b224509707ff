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

/// One kind's side effects that wait: due now (and for how long the oldest has been), and
/// dead-lettered. Kinds with neither are left out.
#[derive(
    Debug, Clone, Default, PartialEq, QueryableByName, serde::Serialize, serde::Deserialize,
)]
#[serde(default)]
pub(crate) struct EffectGauges {
    #[diesel(sql_type = Text)]
    pub kind: String,
    #[diesel(sql_type = BigInt)]
    pub due: i64,
    #[diesel(sql_type = diesel::sql_types::Double)]
    pub oldest_due_age_seconds: f64,
    #[diesel(sql_type = BigInt)]
    pub dead_letter: i64,
}

/// [`EffectGauges`] per kind, read through the partial indexes of due and dead-lettered rows.
pub(crate) async fn gauges(conn: &mut AsyncPgConnection) -> Result<Vec<EffectGauges>> {
    let rows = super::sql(
        "SELECT kind, sum(due)::int8 AS due, max(age)::float8 AS oldest_due_age_seconds, \
             sum(dead)::int8 AS dead_letter \
         FROM ( \
             SELECT kind, count(*) AS due, \
                 extract(epoch FROM now() - min(next_attempt_at)) AS age, 0 AS dead \
             FROM actix_outbox.side_effects \
             WHERE status = 'PENDING' AND next_attempt_at <= now() GROUP BY kind \
             UNION ALL \
             SELECT kind, 0, 0, count(*) FROM actix_outbox.side_effects \
             WHERE status = 'DEAD_LETTER' GROUP BY kind \
         ) k GROUP BY kind ORDER BY kind",
    )
    .load(conn)
    .await?;
    Ok(rows)
}
