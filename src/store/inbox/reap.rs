//! The leases of loops that died: judging their processes, and expiring or extending a
//! lease.

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Integer, Text, Timestamptz, Uuid as SqlUuid};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::Result;
use crate::store::Prepared;

use super::guarded;

/// One row of `consumer` held by a process that was judged dead ([`judge_dead`]).
#[derive(Debug, Clone, QueryableByName)]
pub(crate) struct ExpiredRow {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = BigInt)]
    pub lease_token: i64,
    #[diesel(sql_type = SqlUuid)]
    pub event_id: uuid::Uuid,
    /// Attempts before the one its process died in.
    #[diesel(sql_type = Integer)]
    pub attempt_count: i32,
    /// How many rows its process held when it was judged.
    #[diesel(sql_type = Integer)]
    pub held: i32,
    /// Deaths with other rows it was in flight at since its last outcome.
    #[diesel(sql_type = Integer)]
    pub suspicions: i32,
}

/// Judges the processes that hold a dead lease of `consumer`. A lease is dead when the
/// database session that claimed it is gone (if it still names it: a hung call's lease does
/// not) (its process was killed: the server saw its
/// sockets close), or when it has been expired for longer than one bounded statement
/// ([`DB_TIMEOUT`](crate::store::DB_TIMEOUT), the same for every consumer's leases, so that
/// one judgement counts every consumer's alike): a live process settles its batch within
/// that, however slow its commit. A process is judged once every lease it holds is dead, or
/// once one has been expired for `patience_ms` (a live process would have settled it by then:
/// it is stuck). Every dead lease of a judged process, of any consumer, gets `held`, how many rows
/// the process holds: one statement for all of them, so that settling one consumer's rows never
/// makes another's look held alone.
pub(crate) async fn judge_dead(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    patience_ms: i64,
) -> Result<usize> {
    let judge = Prepared(
        crate::store::sql(
            "WITH live AS MATERIALIZED (SELECT array_agg(pid) AS pids FROM pg_stat_activity), \
             leases AS ( \
                 SELECT l.token, l.consumer, l.locked_by, l.held, l.locked_until, \
                     cardinality(l.ids) + cardinality(l.events) AS n, \
                     (l.locked_until < now() - $3 * interval '1 millisecond' \
                      OR coalesce(NOT l.backend = ANY ((SELECT pids FROM live)::int4[]), false)) AS dead \
                 FROM actix_outbox.inbox_leases l \
             ), judged AS ( \
                 SELECT locked_by, sum(n)::int4 AS n FROM leases \
                 WHERE locked_by IN (SELECT locked_by FROM leases \
                                     WHERE consumer = $1 AND held IS NULL AND dead) \
                 GROUP BY locked_by \
                 HAVING bool_and(dead) \
                     OR min(locked_until) < now() - $2 * interval '1 millisecond' \
             ) \
             UPDATE actix_outbox.inbox_leases l SET held = j.n \
             FROM leases x JOIN judged j USING (locked_by) \
             WHERE l.token = x.token AND x.dead AND l.held IS NULL",
        )
        .bind::<Text, _>(consumer)
        .bind::<BigInt, _>(patience_ms)
        .bind::<BigInt, _>(crate::store::millis(crate::store::DB_TIMEOUT)),
    );
    guarded(conn, async |mut c| {
        judge.execute(&mut c).await.map_err(Into::into)
    })
    .await
}

/// Makes lease `token` look expired for `patience_ms` already, so that the next reap judges it
/// at once: its loop failed while its process lives (a broken connection, a crashed backend)
/// and settles nothing itself, since its own handler may be what broke it.
pub(crate) async fn expire(
    conn: &mut AsyncPgConnection,
    token: i64,
    patience_ms: i64,
) -> Result<()> {
    Prepared(
        crate::store::sql(
            "UPDATE actix_outbox.inbox_leases SET locked_until = now() - ($2 + 1) * interval '1 millisecond' \
             WHERE token = $1",
        )
        .bind::<BigInt, _>(token)
        .bind::<BigInt, _>(patience_ms),
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Extends lease `token` to `lease_ms` from now, and takes it off its session: its rows'
/// handler still runs past its timeout, in a process that lives, and its session may end (the
/// engine ends it past a grace) without the lease looking dead; it lives by its expiry alone
/// from now on, which its process renews. Such a lease tests no suspect any more (the hung call
/// was charged its timeout), so it no longer keeps the process's next suspect waiting
/// (`inbox_claim.sql`). Returns when the lease was claimed (`None`: it is gone, or its process
/// was judged dead and the reaper takes it), which [`end_session`] needs.
pub(crate) async fn extend(
    conn: &mut AsyncPgConnection,
    token: i64,
    lease_ms: i64,
) -> Result<Option<DateTime<Utc>>> {
    #[derive(QueryableByName)]
    struct Claimed {
        #[diesel(sql_type = Timestamptz)]
        claimed_at: DateTime<Utc>,
    }
    let claimed: Vec<Claimed> = Prepared(
        crate::store::sql(
            "UPDATE actix_outbox.inbox_leases SET locked_until = now() + $2 * interval '1 millisecond', \
                 alone = false, backend = NULL \
             WHERE token = $1 AND held IS NULL RETURNING claimed_at",
        )
        .bind::<BigInt, _>(token)
        .bind::<BigInt, _>(lease_ms),
    )
    .load(conn)
    .await?;
    Ok(claimed.into_iter().next().map(|c| c.claimed_at))
}

/// Ends database session `backend`, which a lease claimed at `claimed_at` was taken on: its
/// transaction rolls back, and its locks and its hold on the vacuum horizon go with it. Only
/// that session is ended: one that started after the claim is another that was given the same
/// pid. Returns whether it was signalled. It is not waited for: a statement waiting would hold
/// a snapshot itself.
pub(crate) async fn end_session(
    conn: &mut AsyncPgConnection,
    backend: i32,
    claimed_at: DateTime<Utc>,
) -> Result<bool> {
    #[derive(QueryableByName)]
    struct Ended {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        ended: bool,
    }
    let r: Ended = Prepared(
        crate::store::sql(
            "SELECT coalesce(bool_or(pg_terminate_backend(pid)), false) AS ended \
             FROM pg_stat_activity WHERE pid = $1 AND backend_start <= $2",
        )
        .bind::<Integer, _>(backend)
        .bind::<Timestamptz, _>(claimed_at),
    )
    .get_result(conn)
    .await?;
    Ok(r.ended)
}

/// The rows of `consumer` that a judged process held, up to `limit`.
pub(crate) async fn judged(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    limit: i64,
) -> Result<Vec<ExpiredRow>> {
    let judged = Prepared(
        crate::store::sql(
            "SELECT i.id, l.token AS lease_token, i.event_id, i.attempt_count, l.held, \
                 i.suspicions \
             FROM actix_outbox.inbox_leases l CROSS JOIN unnest(l.ids) AS u(id) \
             JOIN actix_outbox.inbox_events i ON i.id = u.id \
             WHERE l.consumer = $1 AND l.held IS NOT NULL \
             ORDER BY i.id LIMIT $2",
        )
        .bind::<Text, _>(consumer)
        .bind::<BigInt, _>(limit),
    );
    guarded(conn, async |mut c| {
        judged.load(&mut c).await.map_err(Into::into)
    })
    .await
}
