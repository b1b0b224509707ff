//! The claim of a batch: one lease row naming the rows it takes.

use chrono::{DateTime, Utc};
use diesel::sql_types::{Array, BigInt, Bool, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::Result;
use crate::store::{self, Prepared};

use super::{guarded, InboxRow};

/// Leases up to `limit` due rows of `consumer` for `lease_ms` to this process and commits
/// (`inbox_claim.sql`, in a transaction of its own behind the [`PLAN_GUARD`](store::PLAN_GUARD),
/// pipelined: one round trip). Rows another lease names are skipped; a paused consumer claims
/// nothing; an ordered consumer's rows only when each is the earliest unfinished event of its
/// aggregate (with `dead_blocks`, a dead letter counts as unfinished). Every row returned has lease `token`, which the caller makes ([`new_token`]) so
/// that it knows it even when the answer is lost.
///
/// The consumer's claims take turns on an advisory lock, taken in a statement of its own so
/// that the claim's snapshot, taken after it, holds every lease committed before (the
/// process's turn to take a suspect is tried the same way): the claim
/// writes no row it leases, so nothing else would keep two claims from leasing the same row.
/// A claim is one short statement; only claims of the same consumer wait for each other.
///
/// `after`: read the due rows past this place (`(next_attempt_at, id)`, see
/// [`scan`](store::scan)); `None`, from the start. The answer's [`Claimed::last`] is the
/// place of the last row taken past it.
pub(crate) async fn claim(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    limit: i64,
    lease_ms: i64,
    token: i64,
    dead_blocks: bool,
    after: Option<Place>,
) -> Result<Claimed> {
    let process = store::process_id();
    let (after_at, after_id) = (after.and_then(|a| a.0), after.map_or(i64::MIN, |a| a.1));
    let claim = Prepared(
        crate::store::sql(include_str!("../inbox_claim.sql"))
            .bind::<Text, _>(consumer)
            .bind::<BigInt, _>(limit)
            .bind::<BigInt, _>(lease_ms)
            .bind::<Text, _>(process)
            .bind::<BigInt, _>(token)
            .bind::<Bool, _>(dead_blocks)
            .bind::<Nullable<Timestamptz>, _>(after_at)
            .bind::<BigInt, _>(after_id),
    );
    let turn = Prepared(
        crate::store::sql(
            "SELECT pg_advisory_xact_lock(hashtextextended('actix_outbox.claim:' || $1, 0))",
        )
        .bind::<Text, _>(consumer),
    );
    // The process's turn to take a suspect, when one of this consumer is due and no other
    // claim of the process has the turn now: tried, never waited for, so that it is a turn and
    // not a lock shared by the process; recorded in a setting of the transaction, which the
    // claim reads (reading `pg_locks` instead would cost every claim a scan of the lock table).
    let suspect_turn = Prepared(
        crate::store::sql(
            "SELECT set_config('actix_outbox.alone_turn', \
                 pg_try_advisory_xact_lock(hashtextextended('actix_outbox.alone:' || $1, 0))::text, \
                 true) \
             WHERE EXISTS (SELECT FROM actix_outbox.inbox_events a \
                           WHERE a.consumer = $2 AND a.alone \
                             AND a.status IN ('RECEIVED', 'RETRY_PENDING') \
                             AND a.next_attempt_at <= now())",
        )
        .bind::<Text, _>(process)
        .bind::<Text, _>(consumer),
    );
    guarded(conn, async |c| {
        let (mut a, mut b, mut d) = (c, c, c);
        let (turn, suspect_turn, rows) = futures_util::future::join3(
            turn.execute(&mut a),
            suspect_turn.execute(&mut b),
            claim.load::<ClaimedRow>(&mut d),
        )
        .await;
        turn?;
        suspect_turn?;
        let rows = rows?;
        // The ordering test skips rows that its claim's own rows make due once processed:
        // they lie behind any start past those, so the next claim reads from the start.
        let last = if rows.iter().any(|r| r.ordered) {
            None
        } else {
            rows.last().map(|r| (r.place_at, r.inbox.id))
        };
        Ok(Claimed {
            rows: rows.into_iter().map(|r| r.inbox).collect(),
            last,
        })
    })
    .await
}

/// A row's place in a consumer's due index: `(next_attempt_at, id)`, `None` for a
/// `next_attempt_at` of `-infinity` (which no `DateTime` holds).
pub(crate) type Place = (Option<DateTime<Utc>>, i64);

/// What a [`claim`] leased.
pub(crate) struct Claimed {
    /// In claim order.
    pub rows: Vec<InboxRow>,
    /// The place of the last row taken; `None` when a row the ordering test applied to was
    /// taken. (A row claimed alone is taken from no place: its caller does not use it.)
    pub last: Option<Place>,
}

#[derive(QueryableByName)]
struct ClaimedRow {
    #[diesel(embed)]
    inbox: InboxRow,
    #[diesel(sql_type = Bool)]
    ordered: bool,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    place_at: Option<DateTime<Utc>>,
}

/// A new lease token: 63 bits of a UUIDv7 (a millisecond clock and random bits), unique for
/// every purpose a lease has. Made by the claimer, not the database, so that a claim whose
/// answer never came can still be expired by its token.
pub(crate) fn new_token() -> i64 {
    (uuid::Uuid::now_v7().as_u128() as u64 & i64::MAX as u64) as i64
}

/// The rows of lease `token` among `ids` that it still holds, as [`claim`] returned them, for
/// a batch that hands them over again one per call (their payloads went to the first call).
/// Reached from the ids by primary key, as in `settle::processed`.
pub(crate) async fn reload(
    conn: &mut AsyncPgConnection,
    ids: &[i64],
    token: i64,
) -> Result<Vec<InboxRow>> {
    let rows = Prepared(
        crate::store::sql(
            "SELECT i.id, i.event_id, i.event_type, i.event_version, i.aggregate_type, \
                 i.aggregate_id, i.aggregate_version, i.payload, i.metadata, i.correlation_id, \
                 i.causation_id, i.event_created_at, i.attempt_count, $2 AS lease_token, \
                 i.alone, pg_backend_pid() AS backend \
             FROM unnest($1::int8[]) AS n(id) JOIN actix_outbox.inbox_events i ON i.id = n.id \
             WHERE i.status IN ('RECEIVED', 'RETRY_PENDING') \
               AND n.id IN (SELECT unnest(ids) FROM actix_outbox.inbox_leases WHERE token = $2) \
             ORDER BY i.next_attempt_at, i.id",
        )
        .bind::<Array<BigInt>, _>(ids)
        .bind::<BigInt, _>(token),
    )
    .load(conn)
    .await?;
    Ok(rows)
}
