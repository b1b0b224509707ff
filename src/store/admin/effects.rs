//! Side effects for the operator API: list, lock, retry, ignore (in the API's one
//! transaction per action).

use diesel::sql_types::{Array, BigInt, Bool, Integer, Nullable, Text, Uuid as SqlUuid};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::Result;
use crate::store::sql;

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
    let rows = sql(
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

/// Locks those of the rows `ids` that no call holds (a row claimed and not past its lease is
/// held: its call may be running), for the caller's transaction; returns their state and how
/// many of `ids` exist.
pub(crate) async fn lock(
    conn: &mut AsyncPgConnection,
    ids: &[i64],
) -> Result<(Vec<super::LockedRow>, i64)> {
    let rows: Vec<super::LockedRow> = sql(
        "SELECT id::text AS id, status, attempt_count, error_code, kind AS event_type, consumer \
         FROM actix_outbox.side_effects \
         WHERE id = ANY($1) AND NOT (in_flight AND next_attempt_at > now()) \
         ORDER BY id FOR UPDATE SKIP LOCKED",
    )
    .bind::<Array<BigInt>, _>(ids)
    .load(conn)
    .await?;
    if rows.len() == ids.len() {
        // Every row locked (the ids are distinct): no need to count what exists.
        return Ok((rows, ids.len() as i64));
    }
    let existing: super::Count =
        sql("SELECT count(*) AS n FROM actix_outbox.side_effects WHERE id = ANY($1)")
            .bind::<Array<BigInt>, _>(ids)
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
    let n = sql(
        "UPDATE actix_outbox.side_effects e SET status = 'PENDING', in_flight = false, \
             next_attempt_at = now() + coalesce((o.n - 1) / $2::float8, 0) * interval '1 second', \
             updated_at = now() \
         FROM (SELECT id, row_number() OVER (ORDER BY id) AS n FROM unnest($1::int8[]) AS u(id)) o \
         WHERE e.id = o.id AND e.status = 'DEAD_LETTER'",
    )
    .bind::<Array<BigInt>, _>(ids)
    .bind::<Nullable<Integer>, _>(per_second.map(|r| r as i32))
    .execute(conn)
    .await?;
    Ok(n)
}

/// Sets a dead-lettered or waiting effect aside for good: its call is never made (again).
pub(crate) async fn ignore(conn: &mut AsyncPgConnection, id: i64) -> Result<usize> {
    let n = sql(
        "UPDATE actix_outbox.side_effects SET status = 'IGNORED', in_flight = false, \
             updated_at = now() \
         WHERE id = $1 AND status IN ('DEAD_LETTER', 'PENDING')",
    )
    .bind::<BigInt, _>(id)
    .execute(conn)
    .await?;
    Ok(n)
}
