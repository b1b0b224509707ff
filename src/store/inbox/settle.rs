//! Settling leased rows: each row's mark, fenced on the lease that names it, takes it out
//! of the lease; the lease goes with its last row.

use diesel::sql_types::{Array, BigInt, Integer, Nullable, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::Result;
use crate::event::redact::Redactor;
use crate::store::{self, Prepared};

use super::{error_text, guarded, truncate};

/// How one leased row is settled: its mark, which also takes it out of its lease.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Settle {
    /// The handler succeeded: PROCESSED, in the transaction of its effect.
    Processed,
    /// Not applied, the consumer being at this later aggregate version: PROCESSED with
    /// `EVENT_STALE`.
    Stale(i64),
    /// The attempt failed: RETRY_PENDING after the delay, or DEAD_LETTER.
    Failed(Failure),
    /// Given back unhandled, its attempt not counted: due again at once, in its place in line.
    /// Only its lease changes; the row is not written (so rows given back again and again are
    /// not overtaken for ever by rows that fail and fall due again meanwhile).
    Release,
    /// Given back unhandled and not counted, to be claimed on its own from now on: it was in a
    /// call that overran its timeout with other rows, so which one hung is unknown.
    Isolate,
    /// Its process died holding it alone: the attempt is counted, and so are the deaths it
    /// was suspected of: `attempts` is its count from now on.
    Died { failure: Failure, attempts: i32 },
    /// Its process died holding it and other rows: not counted, suspected, and claimed alone
    /// from then on, after `delay_ms`. See [`settle_expired`](crate::consumer::decide::settle_expired).
    Suspect { delay_ms: i64 },
}

/// A failed attempt, as decided by its retry policy: a handler's (consumer), or a publish's
/// (external transport, [`mark_failed`](crate::store::lease::mark_failed)).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Failure {
    pub dead: bool,
    pub delay_ms: i64,
    pub code: String,
    pub message: String,
}

/// One row's settlement, fenced on the lease that holds it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Outcome {
    pub id: i64,
    pub token: i64,
    pub settle: Settle,
}

/// Settles `outcomes` inside the open transaction that holds their effects and commits it, in
/// one round trip: the [`PLAN_GUARD`](store::PLAN_GUARD), the marks and `COMMIT` are
/// pipelined. Should any row no longer be held by its lease, the marks raise an error, so the
/// `COMMIT` rolls the effects back instead of committing them beside another delivery's; so
/// does a transaction a handler left failed. An error with the `COMMIT` answered leaves the
/// connection outside any transaction; one without, inside, for the pool to close. Failures'
/// messages are stored as `redact` leaves them.
pub(crate) async fn settle_and_commit(
    conn: &mut AsyncPgConnection,
    outcomes: &[Outcome],
    redact: &Redactor,
) -> Result<()> {
    let (g, s, committed) = {
        let c: &AsyncPgConnection = conn;
        futures_util::future::join3(
            store::run(c, store::PLAN_GUARD),
            settle(c, outcomes, redact, true),
            store::run(c, "COMMIT"),
        )
        .await
    };
    // Once `COMMIT` is answered the transaction is over either way: in a transaction that a
    // statement failed, PostgreSQL takes it as `ROLLBACK`, and one it refuses rolls back. The
    // connection is then reusable.
    store::after_commit(conn, committed)?;
    g?;
    s?;
    Ok(())
}

/// Settles `outcomes` in a transaction of their own (pipelined, one round trip). A row its
/// lease no longer holds is left as it is. Returns how many rows changed. Failures' messages
/// are stored as `redact` leaves them.
pub(crate) async fn settle_now(
    conn: &mut AsyncPgConnection,
    outcomes: &[Outcome],
    redact: &Redactor,
) -> Result<usize> {
    if outcomes.is_empty() {
        return Ok(0);
    }
    guarded(conn, async |c| settle(c, outcomes, redact, false).await).await
}

/// The one statement that marks leased rows and takes them out of their leases (a lease goes
/// with its last row). Fenced on each row's lease: a row its lease no longer names (the reaper
/// settled it, after the lease died) is not touched, nor is one an operator moved out of its
/// due status. With `check`, a row not touched raises `AO001` (`actix_outbox.inbox_lease_held`). The leases
/// are locked first, in token order, so a batch and the reaper settling the same lease take
/// turns. A row given back (`release`) is not written at all: nothing of it changes but its
/// lease, so it only counts as held (a failing consumer gives most of its batch back).
async fn settle(
    mut conn: &AsyncPgConnection,
    outcomes: &[Outcome],
    redact: &Redactor,
    check: bool,
) -> Result<usize> {
    if outcomes.is_empty() {
        return Ok(0);
    }
    let token = outcomes[0].token;
    if check
        && outcomes
            .iter()
            .all(|o| o.token == token && o.settle == Settle::Processed)
    {
        return processed(conn, outcomes, token).await;
    }
    let mut ids = Vec::with_capacity(outcomes.len());
    let mut tokens = Vec::with_capacity(outcomes.len());
    let mut kinds = Vec::with_capacity(outcomes.len());
    let mut numbers = Vec::with_capacity(outcomes.len());
    let mut codes: Vec<Option<String>> = Vec::with_capacity(outcomes.len());
    let mut messages: Vec<Option<String>> = Vec::with_capacity(outcomes.len());
    let mut attempts = Vec::with_capacity(outcomes.len());
    for o in outcomes {
        ids.push(o.id);
        attempts.push(match &o.settle {
            Settle::Died { attempts, .. } => *attempts,
            _ => 0,
        });
        tokens.push(o.token);
        let (kind, n, code, message) = match &o.settle {
            Settle::Processed => ("processed", 0, None, None),
            Settle::Stale(v) => ("stale", *v, None, None),
            Settle::Failed(f) => (
                if f.dead { "dead" } else { "retry" },
                f.delay_ms,
                Some(truncate(&f.code, 200)),
                Some(error_text(redact, &f.message)),
            ),
            Settle::Died { failure: f, .. } => (
                if f.dead { "died_dead" } else { "died_retry" },
                f.delay_ms,
                Some(truncate(&f.code, 200)),
                Some(error_text(redact, &f.message)),
            ),
            Settle::Release => ("release", 0, None, None),
            Settle::Isolate => ("isolate", 0, None, None),
            Settle::Suspect { delay_ms } => ("suspect", *delay_ms, None, None),
        };
        kinds.push(kind);
        numbers.push(n);
        codes.push(code);
        messages.push(message);
    }
    let expected = check.then_some(outcomes.len() as i64);
    let r: Held = Prepared(
        crate::store::sql(
            "WITH o AS ( \
                 SELECT * FROM unnest($1::int8[], $2::int8[], $3::text[], $4::int8[], \
                     $5::text[], $6::text[], $8::int4[]) \
                     AS o(id, token, kind, n, code, message, attempts) \
             ), l AS MATERIALIZED ( \
                 SELECT token, ids, held FROM actix_outbox.inbox_leases \
                 WHERE token = ANY ($2::int8[]) ORDER BY token FOR UPDATE \
             ), named AS MATERIALIZED ( \
                 SELECT l.token, x AS id, l.held FROM l CROSS JOIN unnest(l.ids) AS x \
             ), settled AS ( \
                 UPDATE actix_outbox.inbox_events i SET \
                     status = CASE \
                         WHEN o.kind IN ('processed', 'stale') THEN 'PROCESSED' \
                         WHEN o.kind IN ('dead', 'died_dead') THEN 'DEAD_LETTER' \
                         WHEN o.kind IN ('retry', 'died_retry') THEN 'RETRY_PENDING' \
                         ELSE i.status END, \
                     attempt_count = CASE \
                         WHEN o.kind IN ('isolate', 'suspect') THEN i.attempt_count \
                         WHEN o.kind IN ('died_retry', 'died_dead') THEN o.attempts \
                         ELSE i.attempt_count + 1 END, \
                     suspicions = CASE WHEN o.kind = 'suspect' THEN i.suspicions + 1 \
                         WHEN o.kind = 'isolate' THEN i.suspicions ELSE 0 END, \
                     alone = i.alone OR o.kind IN ('isolate', 'suspect'), \
                     processed_at = CASE WHEN o.kind IN ('processed', 'stale') \
                         THEN clock_timestamp() ELSE i.processed_at END, \
                     next_attempt_at = CASE \
                         WHEN o.kind IN ('retry', 'died_retry', 'suspect') \
                             THEN clock_timestamp() + o.n * interval '1 millisecond' \
                         WHEN o.kind = 'isolate' THEN now() \
                         ELSE i.next_attempt_at END, \
                     error_code = CASE \
                         WHEN o.kind = 'processed' THEN NULL \
                         WHEN o.kind = 'stale' THEN 'EVENT_STALE' \
                         WHEN o.kind = 'suspect' THEN 'INBOX_ATTEMPT_INTERRUPTED' \
                         WHEN o.kind = 'isolate' THEN i.error_code \
                         ELSE o.code END, \
                     last_error = CASE \
                         WHEN o.kind = 'processed' THEN NULL \
                         WHEN o.kind = 'stale' \
                             THEN 'stale: the consumer already applied aggregate version ' || o.n \
                         WHEN o.kind = 'suspect' THEN 'its process died holding it and ' \
                             || (l.held - 1) || ' other events: not counted; handled alone \
                             from now on' \
                         WHEN o.kind = 'isolate' THEN i.last_error \
                         ELSE o.message END, \
                     updated_at = now() \
                 FROM o JOIN named l USING (token, id) \
                 WHERE i.id = o.id AND i.status IN ('RECEIVED', 'RETRY_PENDING') \
                     AND o.kind <> 'release' \
                 RETURNING 1 \
             ), released AS ( \
                 SELECT FROM o JOIN named USING (token, id) JOIN actix_outbox.inbox_events i ON i.id = o.id \
                 WHERE o.kind = 'release' AND i.status IN ('RECEIVED', 'RETRY_PENDING') \
             ), rest AS ( \
                 SELECT n.token, coalesce(array_agg(n.id) FILTER (WHERE o.id IS NULL), '{}') AS ids \
                 FROM named n LEFT JOIN o USING (token, id) GROUP BY n.token \
             ), shrunk AS ( \
                 UPDATE actix_outbox.inbox_leases p SET ids = r.ids FROM rest r \
                 WHERE p.token = r.token AND cardinality(r.ids) > 0 \
             ), gone AS ( \
                 DELETE FROM actix_outbox.inbox_leases p USING rest r \
                 WHERE p.token = r.token AND cardinality(r.ids) = 0 \
             ) \
             SELECT actix_outbox.inbox_lease_held( \
                 (SELECT count(*) FROM settled) + (SELECT count(*) FROM released), $7) AS held",
        )
        .bind::<Array<BigInt>, _>(ids)
        .bind::<Array<BigInt>, _>(tokens)
        .bind::<Array<Text>, _>(kinds)
        .bind::<Array<BigInt>, _>(numbers)
        .bind::<Array<Nullable<Text>>, _>(codes)
        .bind::<Array<Nullable<Text>>, _>(messages)
        .bind::<Nullable<BigInt>, _>(expected)
        .bind::<Array<Integer>, _>(attempts),
    )
    .get_result(&mut conn)
    .await?;
    Ok(r.held as usize)
}

#[derive(QueryableByName)]
struct Held {
    #[diesel(sql_type = BigInt)]
    held: i64,
}

/// [`settle`]'s common case, in a statement of its own: every row of `outcomes` processed,
/// all under lease `token`, checked; as a batch whose handlers all succeeded commits. The
/// same marks as `processed` in [`settle`], without reading an outcome per row: this is the
/// statement nearly every event goes through. The lease goes when it named only these rows.
/// The rows are reached from the ids, by primary key (`mine`): planned from stale statistics,
/// `id = ANY ($1)` alone was once read as a scan of the whole due index, comparing each row
/// with every id.
async fn processed(
    mut conn: &AsyncPgConnection,
    outcomes: &[Outcome],
    token: i64,
) -> Result<usize> {
    let ids: Vec<i64> = outcomes.iter().map(|o| o.id).collect();
    let r: Held = Prepared(
        crate::store::sql(
            "WITH l AS MATERIALIZED ( \
                 SELECT ids FROM actix_outbox.inbox_leases WHERE token = $2 FOR UPDATE \
             ), mine AS MATERIALIZED ( \
                 SELECT n.id FROM unnest($1::int8[]) AS n(id) \
                 WHERE n.id IN (SELECT unnest(ids) FROM l) \
             ), settled AS ( \
                 UPDATE actix_outbox.inbox_events i SET status = 'PROCESSED', \
                     attempt_count = i.attempt_count + 1, suspicions = 0, \
                     processed_at = clock_timestamp(), error_code = NULL, last_error = NULL, \
                     updated_at = now() \
                 FROM mine WHERE i.id = mine.id AND i.status IN ('RECEIVED', 'RETRY_PENDING') \
                 RETURNING 1 \
             ), gone AS ( \
                 DELETE FROM actix_outbox.inbox_leases WHERE token = $2 \
                     AND cardinality(ids) = cardinality($1::int8[]) \
             ), shrunk AS ( \
                 UPDATE actix_outbox.inbox_leases SET ids = ARRAY(SELECT x FROM unnest(ids) AS x \
                                                     WHERE x <> ALL ($1)) \
                 WHERE token = $2 AND cardinality(ids) <> cardinality($1::int8[]) \
             ) \
             SELECT actix_outbox.inbox_lease_held((SELECT count(*) FROM settled), $3) AS held",
        )
        .bind::<Array<BigInt>, _>(&ids)
        .bind::<BigInt, _>(token)
        .bind::<Nullable<BigInt>, _>(Some(ids.len() as i64)),
    )
    .get_result(&mut conn)
    .await?;
    Ok(r.held as usize)
}
