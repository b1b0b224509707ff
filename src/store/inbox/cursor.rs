//! Cursor delivery (`ConsumerConfig::cursor`, the migration `cursors`): a consumer's batch
//! leases the events past its cursor, and either commits them all processed, moving the
//! cursor, or *promotes* its lease first: the events not processed get inbox rows, the lease
//! names those rows, and the cursor moves past every event, in one statement; the batch's
//! commit settles those rows as an inbox batch's. The rule: an event a cursor moves past is
//! handled in the commit that moves it, or gets an inbox row in that same commit.
//!
//! The rows a cursor batch hands over are [`InboxRow`]s whose `id` is the event's outbox
//! `seq` until the batch is promoted ([`Promoted`] maps them).

use std::collections::HashMap;

use diesel::sql_types::{BigInt, Bool, Nullable, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::Result;
use crate::store::{self, Prepared};

use super::{guarded, InboxRow};

/// What a cursor [`claim`] leased.
pub(crate) struct CursorClaim {
    /// In cursor order; `id` is each event's outbox seq.
    pub rows: Vec<InboxRow>,
    /// Stamps wait past the cursor: claim again at once.
    pub more: bool,
}

/// Leases up to `limit` events of `consumer` past its cursor for `lease_ms` under `token`
/// (`cursor_claim.sql`), from the LOW lane first if `low_first` is `Some(true)`, from the HIGH
/// lane first if `Some(false)`, in stamp order across both if `None` (a consumer with no HIGH
/// type), in a transaction of its own (one round trip).
pub(crate) async fn claim(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    limit: i64,
    lease_ms: i64,
    token: i64,
    low_first: Option<bool>,
) -> Result<CursorClaim> {
    #[derive(QueryableByName)]
    struct More {
        #[diesel(sql_type = Bool)]
        more: bool,
    }
    let claim = Prepared(
        crate::store::sql(include_str!("../cursor_claim.sql"))
            .bind::<Text, _>(consumer)
            .bind::<BigInt, _>(limit)
            .bind::<BigInt, _>(lease_ms)
            .bind::<Text, _>(store::process_id())
            .bind::<BigInt, _>(token)
            .bind::<diesel::sql_types::Nullable<Bool>, _>(low_first),
    );
    // After the claim, in its transaction: whether entries lie past what it read, or past a
    // cursor no other batch holds (a slot another batch holds is that batch's to go on with:
    // a loop that claimed again for it would spin), unless the consumer is paused.
    let more = Prepared(
        crate::store::sql(
            "SELECT EXISTS (SELECT FROM actix_outbox.consumer_cursors k \
                 JOIN actix_outbox.log_stamps s ON s.part = k.part \
                     AND s.stamp >= coalesce(k.upto_stamp, k.stamp) \
                 WHERE k.consumer = $1 AND (k.token IS NULL OR k.token = $2) \
                   AND (s.stamp, cardinality(s.events)) \
                       > (coalesce(k.upto_stamp, k.stamp), coalesce(k.upto_idx, k.idx))) \
               AND NOT EXISTS (SELECT FROM actix_outbox.consumer_states s \
                 WHERE s.consumer = $1 AND s.paused \
                   AND (s.paused_until IS NULL OR s.paused_until > now())) AS more",
        )
        .bind::<Text, _>(consumer)
        .bind::<BigInt, _>(token),
    );
    guarded(conn, async |c| {
        let (mut a, mut b) = (c, c);
        let (rows, more) = futures_util::future::join(
            claim.load::<InboxRow>(&mut a),
            more.get_result::<More>(&mut b),
        )
        .await;
        let rows = rows?;
        let more = rows.len() as i64 >= limit || more?.more;
        Ok(CursorClaim { rows, more })
    })
    .await
}

/// Commits a cursor batch whose every event was processed, inside its open transaction:
/// the lease goes and the cursor moves to where the claim said, pipelined with `COMMIT`.
/// Fenced on the lease: if it was promoted or judged meanwhile (by the reaper, after it
/// expired), the statement raises `AO001` and the `COMMIT` rolls the effects back.
pub(crate) async fn commit(conn: &mut AsyncPgConnection, consumer: &str, token: i64) -> Result<()> {
    #[derive(QueryableByName)]
    struct Held {
        #[diesel(sql_type = BigInt)]
        #[allow(dead_code)]
        held: i64,
    }
    let fence = Prepared(
        crate::store::sql(
            "WITH l AS ( \
                 DELETE FROM actix_outbox.inbox_leases WHERE token = $1 AND held IS NULL \
                     AND cardinality(ids) = 0 AND cardinality(events) > 0 RETURNING 1 \
             ), moved AS ( \
                 UPDATE actix_outbox.consumer_cursors SET stamp = upto_stamp, idx = upto_idx, \
                     token = NULL, upto_stamp = NULL, upto_idx = NULL \
                 WHERE consumer = $2 AND token = $1 AND EXISTS (SELECT FROM l) \
             ) \
             SELECT actix_outbox.inbox_lease_held((SELECT count(*) FROM l), 1) AS held",
        )
        .bind::<BigInt, _>(token)
        .bind::<Text, _>(consumer),
    );
    let (f, committed) = {
        let c: &AsyncPgConnection = conn;
        let mut a = c;
        futures_util::future::join(fence.get_result::<Held>(&mut a), store::run(c, "COMMIT")).await
    };
    // Once `COMMIT` is answered the transaction is over either way (as in `settle_and_commit`).
    store::after_commit(conn, committed)?;
    f?;
    Ok(())
}

/// The events of cursor lease `token` among `seqs`, read again for a careful pass, in the
/// lease's order: none once the lease is gone or promoted (by the reaper), so a careful pass
/// never calls a handler with an event its batch no longer holds.
pub(crate) async fn reload(
    conn: &mut AsyncPgConnection,
    seqs: &[i64],
    token: i64,
) -> Result<Vec<InboxRow>> {
    let rows = Prepared(
        crate::store::sql(
            "SELECT o.seq AS id, o.id AS event_id, o.event_type, o.event_version, \
                 o.aggregate_type, o.aggregate_id, o.aggregate_version, o.payload, o.metadata, \
                 o.correlation_id, o.causation_id, o.created_at AS event_created_at, \
                 0 AS attempt_count, $2 AS lease_token, false AS alone, \
                 pg_backend_pid() AS backend \
             FROM actix_outbox.inbox_leases l \
             CROSS JOIN unnest(l.events) WITH ORDINALITY AS u(id, ord) \
             JOIN actix_outbox.outbox_events o ON o.id = u.id \
             WHERE l.token = $2 AND o.seq = ANY ($1::int8[]) ORDER BY u.ord",
        )
        .bind::<diesel::sql_types::Array<BigInt>, _>(seqs)
        .bind::<BigInt, _>(token),
    )
    .load(conn)
    .await?;
    Ok(rows)
}

/// The inbox rows a promotion gave a cursor batch's events: event seq → inbox id.
#[derive(Debug, Default)]
pub(crate) struct Promoted(HashMap<i64, i64>);

impl Promoted {
    /// The inbox id of the row handed over as `seq`; a seq with no row of the lease (an
    /// event already in the inbox) maps to none, and its outcome is dropped.
    pub(crate) fn id(&self, seq: i64) -> Option<i64> {
        self.0.get(&seq).copied()
    }
    /// `outcomes` of rows handed over as seqs, naming their inbox rows.
    pub(crate) fn remap(&self, outcomes: Vec<super::Outcome>) -> Vec<super::Outcome> {
        outcomes
            .into_iter()
            .filter_map(|o| {
                Some(super::Outcome {
                    id: self.id(o.id)?,
                    ..o
                })
            })
            .collect()
    }
}

/// Promotes cursor lease `token`: its events get inbox rows, the lease names them instead,
/// and the cursor moves past them, in one statement. Run inside the batch's transaction (its
/// commit then settles the rows) or in one of its own (`own`). A lease already promoted, or
/// gone, promotes nothing and, `fenced` (a batch's own lease), raises `AO001`: the reaper took
/// it, and the batch's effects must not commit. One whose every event already had an inbox
/// row goes.
///
/// `handled`: the seqs of events processed in the open transaction, which get no row: the
/// commit that moves the cursor past them commits their effects (the cursor's rule). Empty
/// outside a batch's own transaction.
pub(crate) async fn promote(
    conn: &mut AsyncPgConnection,
    token: i64,
    own: bool,
    fenced: bool,
    handled: &[i64],
) -> Result<Promoted> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Nullable<BigInt>)]
        id: Option<i64>,
        #[diesel(sql_type = Nullable<BigInt>)]
        event_seq: Option<i64>,
    }
    let promote = Prepared(
        crate::store::sql(
            "WITH l AS MATERIALIZED ( \
                 SELECT token, consumer, events FROM actix_outbox.inbox_leases \
                 WHERE token = $1 AND cardinality(events) > 0 FOR UPDATE \
             ), ins AS ( \
                 INSERT INTO actix_outbox.inbox_events (event_id, consumer, event_type, \
                     event_version, aggregate_type, aggregate_id, aggregate_version, payload, \
                     metadata, correlation_id, causation_id, event_created_at, event_seq) \
                 SELECT o.id, l.consumer, o.event_type, o.event_version, o.aggregate_type, \
                     o.aggregate_id, o.aggregate_version, o.payload, o.metadata, \
                     o.correlation_id, o.causation_id, o.created_at, o.seq \
                 FROM l CROSS JOIN unnest(l.events) AS u(id) \
                 JOIN actix_outbox.outbox_events o ON o.id = u.id \
                 WHERE o.seq <> ALL ($3::int8[]) \
                 ON CONFLICT (event_id, consumer) DO NOTHING RETURNING id, event_seq \
             ), lease AS ( \
                 UPDATE actix_outbox.inbox_leases p \
                 SET ids = p.ids || ARRAY(SELECT id FROM ins ORDER BY id), events = '{}' \
                 FROM l WHERE p.token = l.token \
                     AND (EXISTS (SELECT FROM ins) OR cardinality(p.ids) > 0) \
             ), emptied AS ( \
                 DELETE FROM actix_outbox.inbox_leases p USING l WHERE p.token = l.token \
                     AND NOT EXISTS (SELECT FROM ins) AND cardinality(p.ids) = 0 \
             ), moved AS ( \
                 UPDATE actix_outbox.consumer_cursors k SET stamp = upto_stamp, idx = upto_idx, \
                     token = NULL, upto_stamp = NULL, upto_idx = NULL \
                 FROM l WHERE k.consumer = l.consumer AND k.token = l.token \
             ) \
             SELECT i.id, i.event_seq FROM (SELECT actix_outbox.inbox_lease_held( \
                 (SELECT count(*) FROM l), CASE WHEN $2 THEN 1 END)) f \
             LEFT JOIN ins i ON true",
        )
        .bind::<BigInt, _>(token)
        .bind::<Bool, _>(fenced)
        .bind::<diesel::sql_types::Array<BigInt>, _>(handled),
    );
    let rows: Vec<Row> = if own {
        guarded(conn, async |mut c| {
            promote.load(&mut c).await.map_err(Into::into)
        })
        .await?
    } else {
        promote.load(conn).await?
    };
    Ok(Promoted(
        rows.into_iter()
            .filter_map(|r| Some((r.event_seq?, r.id?)))
            .collect(),
    ))
}

/// Promotes every cursor lease of `consumer` that the reaper judged dead ([`judge_dead`]
/// counts a cursor lease's events as rows its process held), so that [`judged`] finds their
/// rows. Returns how many leases it promoted.
///
/// [`judge_dead`]: super::judge_dead
/// [`judged`]: super::judged
pub(crate) async fn promote_judged(conn: &mut AsyncPgConnection, consumer: &str) -> Result<usize> {
    #[derive(QueryableByName)]
    struct Token {
        #[diesel(sql_type = BigInt)]
        token: i64,
    }
    let tokens: Vec<Token> = Prepared(
        crate::store::sql(
            "SELECT token FROM actix_outbox.inbox_leases \
             WHERE consumer = $1 AND held IS NOT NULL AND cardinality(events) > 0",
        )
        .bind::<Text, _>(consumer),
    )
    .load(conn)
    .await?;
    for t in &tokens {
        promote(conn, t.token, true, false, &[]).await?;
    }
    Ok(tokens.len())
}

/// Gives back what lease `token` holds, unspent: a cursor lease's events stay past the cursor,
/// a promoted lease's rows are due again. For a batch cut off in this process.
pub(crate) async fn give_back(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    token: i64,
) -> Result<()> {
    Prepared(
        crate::store::sql(
            "WITH l AS ( \
                 DELETE FROM actix_outbox.inbox_leases WHERE token = $1 AND held IS NULL \
                 RETURNING token \
             ) \
             UPDATE actix_outbox.consumer_cursors SET token = NULL, upto_stamp = NULL, \
                 upto_idx = NULL \
             WHERE consumer = $2 AND token = $1 AND EXISTS (SELECT FROM l)",
        )
        .bind::<BigInt, _>(token)
        .bind::<Text, _>(consumer),
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// What one [`spill`] did.
#[derive(QueryableByName)]
pub(crate) struct Spilled {
    /// Entries the cursor moved past (0: no cursor's backlog is that old).
    #[diesel(sql_type = BigInt)]
    pub passed: i64,
    /// Of those, events that got an inbox row.
    #[diesel(sql_type = BigInt)]
    pub moved: i64,
    #[diesel(sql_type = Nullable<Text>)]
    pub consumer: Option<String>,
}

/// Moves at most `limit` entries that have waited past one cursor for longer than `older_than`
/// into its consumer's inbox, and the cursor past them (`cursor_spill.sql`).
pub(crate) async fn spill(
    conn: &mut AsyncPgConnection,
    older_than: std::time::Duration,
    limit: i64,
) -> Result<Spilled> {
    Ok(crate::store::sql(include_str!("../cursor_spill.sql"))
        .bind::<BigInt, _>(store::millis(older_than))
        .bind::<BigInt, _>(limit)
        .get_result(conn)
        .await?)
}

/// Lists the transactions open now as the ones that may still stamp an event for `consumer`'s
/// cursors, which it is turning off: run after the commit that set its subscriptions' flag
/// off and its list to `{pending}`, since a claim that begins later fans its events out to
/// its inbox instead. Only sessions of this database can stamp here, so only theirs are
/// listed. Replaces only `{pending}`: a start with the cursor on since then has cleared it
/// (in the same statement as the flag), and the row's lock orders the two.
pub(crate) async fn turning_off(conn: &mut AsyncPgConnection, consumer: &str) -> Result<()> {
    crate::store::sql(
        "UPDATE actix_outbox.consumer_states SET cursor_off_vxids = \
             (SELECT coalesce(array_agg(l.virtualxid), '{}') FROM pg_locks l \
              WHERE l.locktype = 'virtualxid' AND l.pid <> pg_backend_pid() \
                AND l.pid IN (SELECT pid FROM pg_stat_activity \
                              WHERE datname = current_database())) \
         WHERE consumer = $1 AND cursor_off_vxids = '{pending}'",
    )
    .bind::<Text, _>(consumer)
    .execute(conn)
    .await?;
    Ok(())
}

/// Drops the cursors of `consumer`, which is turning them off, once it may: every transaction
/// listed by [`turning_off`] has ended, no subscription of it reads through a cursor, no
/// batch holds a cursor, and no entry past them is the consumer's (a subscribed type with no
/// inbox row of it). In this order: `pg_locks` is read (live, not a snapshot); then, in one
/// transaction, the consumer's state row is locked if it still holds that list (a start since
/// has replaced or cleared it), and the cursors are dropped by a statement whose snapshot,
/// taken after that read, holds every stamp a listed transaction made. Returns whether the
/// consumer has no cursors left (then it stops reading them).
pub(crate) async fn retire(conn: &mut AsyncPgConnection, consumer: &str) -> Result<bool> {
    use diesel_async::AsyncConnection;
    #[derive(QueryableByName)]
    struct Ready {
        #[diesel(sql_type = Nullable<diesel::sql_types::Array<Text>>)]
        listed: Option<Vec<String>>,
        #[diesel(sql_type = Bool)]
        none: bool,
    }
    #[derive(QueryableByName)]
    struct Dropped {
        #[diesel(sql_type = Bool)]
        dropped: bool,
    }
    let r: Ready = crate::store::sql(
        "SELECT (SELECT s.cursor_off_vxids FROM actix_outbox.consumer_states s \
                 WHERE s.consumer = $1 AND NOT 'pending' = ANY (s.cursor_off_vxids) \
                   AND NOT EXISTS (SELECT FROM pg_locks l WHERE l.locktype = 'virtualxid' \
                                     AND l.virtualxid = ANY (s.cursor_off_vxids))) AS listed, \
                NOT EXISTS (SELECT FROM actix_outbox.consumer_cursors WHERE consumer = $1) AS none",
    )
    .bind::<Text, _>(consumer)
    .get_result(conn)
    .await?;
    let Some(listed) = r.listed.filter(|_| !r.none) else {
        return Ok(r.none);
    };
    conn.transaction::<_, crate::Error, _>(async |c| {
        let held: Vec<Dropped> = crate::store::sql(
            "SELECT true AS dropped FROM actix_outbox.consumer_states \
             WHERE consumer = $1 AND cursor_off_vxids = $2 FOR UPDATE",
        )
        .bind::<Text, _>(consumer)
        .bind::<diesel::sql_types::Array<Text>, _>(&listed)
        .load(c)
        .await?;
        if !held.iter().any(|h| h.dropped) {
            return Ok(false);
        }
        let dropped: Vec<Dropped> = crate::store::sql(
            "WITH k AS MATERIALIZED ( \
                 SELECT part, stamp, idx, token FROM actix_outbox.consumer_cursors \
                 WHERE consumer = $1 FOR UPDATE \
             ), mine AS ( \
                 SELECT FROM k JOIN actix_outbox.log_stamps s \
                     ON s.part = k.part AND s.stamp >= k.stamp \
                 CROSS JOIN LATERAL unnest(s.events) WITH ORDINALITY AS u(id, ord) \
                 JOIN actix_outbox.outbox_events o ON o.id = u.id \
                 WHERE (s.stamp, u.ord) > (k.stamp, k.idx) \
                   AND o.event_type IN (SELECT event_type \
                                        FROM actix_outbox.consumer_subscriptions \
                                        WHERE consumer = $1) \
                   AND NOT EXISTS (SELECT FROM actix_outbox.inbox_events i \
                                   WHERE i.event_id = o.id AND i.consumer = $1) \
             ), gone AS ( \
                 DELETE FROM actix_outbox.consumer_cursors c WHERE c.consumer = $1 \
                   AND NOT EXISTS (SELECT FROM k WHERE k.token IS NOT NULL) \
                   AND NOT EXISTS (SELECT FROM mine) \
                   AND NOT EXISTS (SELECT FROM actix_outbox.consumer_subscriptions \
                                   WHERE consumer = $1 AND cursor) \
                 RETURNING 1 \
             ), off AS ( \
                 UPDATE actix_outbox.consumer_states SET cursor_off_vxids = NULL \
                 WHERE consumer = $1 AND EXISTS (SELECT FROM gone) \
             ) \
             SELECT true AS dropped FROM gone LIMIT 1",
        )
        .bind::<Text, _>(consumer)
        .load(c)
        .await?;
        Ok(dropped.iter().any(|d| d.dropped))
    })
    .await
}
