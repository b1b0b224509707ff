//! Inbox statements: consumer registration, the per-consumer lease (claim, settle, expired
//! leases) and the stale-event check. `RECEIVED|RETRY_PENDING` (named by a lease while in
//! flight) `→ PROCESSED | RETRY_PENDING | DEAD_LETTER`, or back unhandled; see the migrations
//! `inbox_lease` and `inbox_lease_table`.

use chrono::{DateTime, Utc};
use diesel::sql_types::{
    Array, BigInt, Integer, Jsonb, Nullable, Text, Timestamptz, Uuid as SqlUuid,
};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::Result;
use crate::store::{self, Prepared};

/// One claimed inbox row: everything a handler needs without re-reading the outbox.
#[derive(Debug, Clone, QueryableByName)]
pub(crate) struct InboxRow {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = SqlUuid)]
    pub event_id: uuid::Uuid,
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
    pub event_created_at: DateTime<Utc>,
    /// Attempts before this one.
    #[diesel(sql_type = Integer)]
    pub attempt_count: i32,
    /// The claim's lease, which every mark of the row is fenced on.
    #[diesel(sql_type = BigInt)]
    pub lease_token: i64,
    /// Claimed on its own (see the migration `inbox_lease`).
    #[diesel(sql_type = diesel::sql_types::Bool)]
    pub alone: bool,
    /// The database session (backend pid) the row was claimed on, which its handler writes in.
    #[diesel(sql_type = Integer)]
    pub backend: i32,
}

impl InboxRow {
    /// A copy without the (possibly large) payload and metadata.
    pub(crate) fn clone_without_payload(&self) -> InboxRow {
        InboxRow {
            payload: serde_json::Value::Null,
            metadata: serde_json::Value::Null,
            event_type: self.event_type.clone(),
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
            correlation_id: self.correlation_id.clone(),
            causation_id: self.causation_id.clone(),
            ..*self
        }
    }
}

impl<'a> From<&'a InboxRow> for crate::telemetry::EventFields<'a> {
    fn from(r: &'a InboxRow) -> Self {
        crate::telemetry::EventFields {
            consumer: None,
            event_id: r.event_id,
            event_type: &r.event_type,
            aggregate_id: &r.aggregate_id,
            correlation_id: Some(&r.correlation_id),
            causation_id: r.causation_id.as_deref(),
            attempt: None,
        }
    }
}

/// Records a consumer and its subscriptions. Idempotent; several instances may run it at once.
/// Subscriptions are only ever added here: removing one is an operator's decision
/// ([`unsubscribe`](crate::unsubscribe)), since another instance may still run the older code.
/// Returns the subscriptions in the database that `event_types` no longer lists.
pub(crate) async fn register_consumer(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    event_types: &[String],
) -> Result<Vec<String>> {
    #[derive(QueryableByName)]
    struct Subscription {
        #[diesel(sql_type = Text)]
        event_type: String,
    }
    let extra: Vec<Subscription> = Prepared(diesel::sql_query(
        "WITH c AS (INSERT INTO consumer_states (consumer) VALUES ($1) ON CONFLICT DO NOTHING), \
              s AS (INSERT INTO consumer_subscriptions (consumer, event_type) \
                    SELECT $1, t FROM unnest($2::text[]) AS t ON CONFLICT DO NOTHING) \
         SELECT event_type FROM consumer_subscriptions \
         WHERE consumer = $1 AND event_type <> ALL ($2::text[]) ORDER BY event_type",
    )
    .bind::<Text, _>(consumer)
    .bind::<Array<Text>, _>(event_types))
    .load(conn)
    .await?;
    Ok(extra.into_iter().map(|s| s.event_type).collect())
}

/// Removes one subscription. `None` when the consumer was never registered, else whether the
/// subscription existed.
pub(crate) async fn remove_subscription(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    event_type: &str,
) -> Result<Option<bool>> {
    #[derive(QueryableByName)]
    struct Removed {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        known: bool,
        #[diesel(sql_type = BigInt)]
        removed: i64,
    }
    let r: Removed = Prepared(
        diesel::sql_query(
            "WITH d AS (DELETE FROM consumer_subscriptions WHERE consumer = $1 AND event_type = $2 \
                        RETURNING 1) \
             SELECT EXISTS (SELECT 1 FROM consumer_states WHERE consumer = $1) AS known, \
                    (SELECT count(*) FROM d) AS removed",
        )
        .bind::<Text, _>(consumer)
        .bind::<Text, _>(event_type),
    )
    .get_result(conn)
    .await?;
    Ok(r.known.then_some(r.removed > 0))
}

/// Leases up to `limit` due rows of `consumer` for `lease_ms` to this process and commits
/// (`inbox_claim.sql`, in a transaction of its own behind the [`PLAN_GUARD`](store::PLAN_GUARD),
/// pipelined: one round trip). Rows another lease names are skipped; a paused consumer claims
/// nothing. Every row returned has lease `token`, which the caller makes ([`new_token`]) so
/// that it knows it even when the answer is lost.
///
/// The consumer's claims take turns on an advisory lock, taken in a statement of its own so
/// that the claim's snapshot, taken after it, holds every lease committed before: the claim
/// writes no row it leases, so nothing else would keep two claims from leasing the same row.
/// A claim is one short statement; only claims of the same consumer wait for each other.
pub(crate) async fn claim(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    limit: i64,
    lease_ms: i64,
    token: i64,
) -> Result<Vec<InboxRow>> {
    let process = store::process_id();
    let claim = Prepared(
        diesel::sql_query(include_str!("inbox_claim.sql"))
            .bind::<Text, _>(consumer)
            .bind::<BigInt, _>(limit)
            .bind::<BigInt, _>(lease_ms)
            .bind::<Text, _>(process)
            .bind::<BigInt, _>(token),
    );
    let turn = Prepared(
        diesel::sql_query(
            "SELECT pg_advisory_xact_lock(hashtextextended('actix_outbox.claim:' || $1, 0))",
        )
        .bind::<Text, _>(consumer),
    );
    guarded(conn, async |c| {
        let (mut a, mut b) = (c, c);
        let (turn, rows) =
            futures_util::future::join(turn.execute(&mut a), claim.load(&mut b)).await;
        turn?;
        rows.map_err(Into::into)
    })
    .await
}

/// A new lease token: 63 bits of a UUIDv7 (a millisecond clock and random bits), unique for
/// every purpose a lease has. Made by the claimer, not the database, so that a claim whose
/// answer never came can still be expired by its token.
pub(crate) fn new_token() -> i64 {
    (uuid::Uuid::now_v7().as_u128() as u64 & i64::MAX as u64) as i64
}

/// The rows of lease `token` among `ids` that it still holds, as [`claim`] returned them, for
/// a batch that hands them over again one per call (their payloads went to the first call).
/// Reached from the ids by primary key, as in [`processed`].
pub(crate) async fn reload(
    conn: &mut AsyncPgConnection,
    ids: &[i64],
    token: i64,
) -> Result<Vec<InboxRow>> {
    let rows = Prepared(
        diesel::sql_query(
            "SELECT i.id, i.event_id, i.event_type, i.event_version, i.aggregate_type, \
                 i.aggregate_id, i.aggregate_version, i.payload, i.metadata, i.correlation_id, \
                 i.causation_id, i.event_created_at, i.attempt_count, $2 AS lease_token, \
                 i.alone, pg_backend_pid() AS backend \
             FROM unnest($1::int8[]) AS n(id) JOIN inbox_events i ON i.id = n.id \
             WHERE i.status IN ('RECEIVED', 'RETRY_PENDING') \
               AND n.id IN (SELECT unnest(ids) FROM inbox_leases WHERE token = $2) \
             ORDER BY i.next_attempt_at, i.id",
        )
        .bind::<Array<BigInt>, _>(ids)
        .bind::<BigInt, _>(token),
    )
    .load(conn)
    .await?;
    Ok(rows)
}

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
    /// Given back unhandled, its attempt not counted: due again at once, in its place in line
    /// (its `next_attempt_at` is kept, so rows given back again and again are not overtaken
    /// for ever by rows that fail and fall due again meanwhile).
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

/// A failed attempt, as decided by the consumer's retry policy.
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
/// connection outside any transaction; one without, inside, for the pool to close.
pub(crate) async fn settle_and_commit(
    conn: &mut AsyncPgConnection,
    outcomes: &[Outcome],
) -> Result<()> {
    let (g, s, committed) = {
        let c: &AsyncPgConnection = conn;
        futures_util::future::join3(
            store::run(c, store::PLAN_GUARD),
            settle(c, outcomes, true),
            store::run(c, "COMMIT"),
        )
        .await
    };
    // Once `COMMIT` is answered the transaction is over either way: in a transaction that a
    // statement failed, PostgreSQL takes it as `ROLLBACK`. The connection is then reusable.
    committed?;
    store::left_transaction(conn)?;
    g?;
    s?;
    Ok(())
}

/// Settles `outcomes` in a transaction of their own (pipelined, one round trip). A row its
/// lease no longer holds is left as it is. Returns how many rows changed.
pub(crate) async fn settle_now(
    conn: &mut AsyncPgConnection,
    outcomes: &[Outcome],
) -> Result<usize> {
    if outcomes.is_empty() {
        return Ok(0);
    }
    guarded(conn, async |c| settle(c, outcomes, false).await).await
}

/// The one statement that marks leased rows and takes them out of their leases (a lease goes
/// with its last row). Fenced on each row's lease: a row its lease no longer names (the reaper
/// settled it, after the lease died) is not touched, nor is one an operator moved out of its
/// due status. With `check`, a row not touched raises `AO001` (`inbox_lease_held`). The leases
/// are locked first, in token order, so a batch and the reaper settling the same lease take
/// turns.
async fn settle(mut conn: &AsyncPgConnection, outcomes: &[Outcome], check: bool) -> Result<usize> {
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
                Some(truncate(&f.message, 2000)),
            ),
            Settle::Died { failure: f, .. } => (
                if f.dead { "died_dead" } else { "died_retry" },
                f.delay_ms,
                Some(truncate(&f.code, 200)),
                Some(truncate(&f.message, 2000)),
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
        diesel::sql_query(
            "WITH o AS ( \
                 SELECT * FROM unnest($1::int8[], $2::int8[], $3::text[], $4::int8[], \
                     $5::text[], $6::text[], $8::int4[]) \
                     AS o(id, token, kind, n, code, message, attempts) \
             ), l AS MATERIALIZED ( \
                 SELECT token, ids, held FROM inbox_leases \
                 WHERE token = ANY ($2::int8[]) ORDER BY token FOR UPDATE \
             ), named AS MATERIALIZED ( \
                 SELECT l.token, x AS id, l.held FROM l CROSS JOIN unnest(l.ids) AS x \
             ), settled AS ( \
                 UPDATE inbox_events i SET \
                     status = CASE \
                         WHEN o.kind IN ('processed', 'stale') THEN 'PROCESSED' \
                         WHEN o.kind IN ('dead', 'died_dead') THEN 'DEAD_LETTER' \
                         WHEN o.kind IN ('retry', 'died_retry') THEN 'RETRY_PENDING' \
                         ELSE i.status END, \
                     attempt_count = CASE \
                         WHEN o.kind IN ('release', 'isolate', 'suspect') THEN i.attempt_count \
                         WHEN o.kind IN ('died_retry', 'died_dead') THEN o.attempts \
                         ELSE i.attempt_count + 1 END, \
                     suspicions = CASE WHEN o.kind = 'suspect' THEN i.suspicions + 1 \
                         WHEN o.kind IN ('release', 'isolate') THEN i.suspicions ELSE 0 END, \
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
                         WHEN o.kind IN ('release', 'isolate') THEN i.error_code \
                         ELSE o.code END, \
                     last_error = CASE \
                         WHEN o.kind = 'processed' THEN NULL \
                         WHEN o.kind = 'stale' \
                             THEN 'stale: the consumer already applied aggregate version ' || o.n \
                         WHEN o.kind = 'suspect' THEN 'its process died holding it and ' \
                             || (l.held - 1) || ' other events: not counted; handled alone \
                             from now on' \
                         WHEN o.kind IN ('release', 'isolate') THEN i.last_error \
                         ELSE o.message END, \
                     updated_at = now() \
                 FROM o JOIN named l USING (token, id) \
                 WHERE i.id = o.id AND i.status IN ('RECEIVED', 'RETRY_PENDING') \
                 RETURNING 1 \
             ), rest AS ( \
                 SELECT n.token, coalesce(array_agg(n.id) FILTER (WHERE o.id IS NULL), '{}') AS ids \
                 FROM named n LEFT JOIN o USING (token, id) GROUP BY n.token \
             ), shrunk AS ( \
                 UPDATE inbox_leases p SET ids = r.ids FROM rest r \
                 WHERE p.token = r.token AND cardinality(r.ids) > 0 \
             ), gone AS ( \
                 DELETE FROM inbox_leases p USING rest r \
                 WHERE p.token = r.token AND cardinality(r.ids) = 0 \
             ) \
             SELECT inbox_lease_held((SELECT count(*) FROM settled), $7) AS held",
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
        diesel::sql_query(
            "WITH l AS MATERIALIZED ( \
                 SELECT ids FROM inbox_leases WHERE token = $2 FOR UPDATE \
             ), mine AS MATERIALIZED ( \
                 SELECT n.id FROM unnest($1::int8[]) AS n(id) \
                 WHERE n.id IN (SELECT unnest(ids) FROM l) \
             ), settled AS ( \
                 UPDATE inbox_events i SET status = 'PROCESSED', \
                     attempt_count = i.attempt_count + 1, suspicions = 0, \
                     processed_at = clock_timestamp(), error_code = NULL, last_error = NULL, \
                     updated_at = now() \
                 FROM mine WHERE i.id = mine.id AND i.status IN ('RECEIVED', 'RETRY_PENDING') \
                 RETURNING 1 \
             ), gone AS ( \
                 DELETE FROM inbox_leases WHERE token = $2 \
                     AND cardinality(ids) = cardinality($1::int8[]) \
             ), shrunk AS ( \
                 UPDATE inbox_leases SET ids = ARRAY(SELECT x FROM unnest(ids) AS x \
                                                     WHERE x <> ALL ($1)) \
                 WHERE token = $2 AND cardinality(ids) <> cardinality($1::int8[]) \
             ) \
             SELECT inbox_lease_held((SELECT count(*) FROM settled), $3) AS held",
        )
        .bind::<Array<BigInt>, _>(&ids)
        .bind::<BigInt, _>(token)
        .bind::<Nullable<BigInt>, _>(Some(ids.len() as i64)),
    )
    .get_result(&mut conn)
    .await?;
    Ok(r.held as usize)
}

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

/// Judges the processes that hold a dead lease of `consumer`. A lease is dead when it has
/// expired or the database session that claimed it is gone (its process was killed: the server
/// saw its sockets close). A process is judged once every lease it holds is dead, or once one
/// has been expired for `patience_ms` more (a live process would have settled it by then: it
/// is stuck). Every dead lease of a judged process, of any consumer, gets `held`, how many rows
/// the process holds: one statement for all of them, so that settling one consumer's rows never
/// makes another's look held alone.
pub(crate) async fn judge_dead(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    patience_ms: i64,
) -> Result<usize> {
    let judge = Prepared(
        diesel::sql_query(
            "WITH live AS MATERIALIZED (SELECT array_agg(pid) AS pids FROM pg_stat_activity), \
             leases AS ( \
                 SELECT l.token, l.consumer, l.locked_by, l.held, l.locked_until, \
                     cardinality(l.ids) AS n, \
                     (l.locked_until < now() \
                      OR coalesce(NOT l.backend = ANY ((SELECT pids FROM live)::int4[]), false)) AS dead \
                 FROM inbox_leases l \
             ), judged AS ( \
                 SELECT locked_by, sum(n)::int4 AS n FROM leases \
                 WHERE locked_by IN (SELECT locked_by FROM leases \
                                     WHERE consumer = $1 AND held IS NULL AND dead) \
                 GROUP BY locked_by \
                 HAVING bool_and(dead) \
                     OR min(locked_until) < now() - $2 * interval '1 millisecond' \
             ) \
             UPDATE inbox_leases l SET held = j.n \
             FROM leases x JOIN judged j USING (locked_by) \
             WHERE l.token = x.token AND x.dead AND l.held IS NULL",
        )
        .bind::<Text, _>(consumer)
        .bind::<BigInt, _>(patience_ms),
    );
    guarded(conn, async |mut c| {
        judge.execute(&mut c).await.map_err(Into::into)
    })
    .await
}

/// Runs `f` in a transaction of its own behind the [`PLAN_GUARD`](store::PLAN_GUARD), all
/// pipelined (one round trip): the claim and the reaper's statements read the inbox through
/// its indexes, and must not be planned into a scan of the whole inbox while it was small.
async fn guarded<T>(
    conn: &mut AsyncPgConnection,
    f: impl AsyncFnOnce(&AsyncPgConnection) -> Result<T>,
) -> Result<T> {
    store::entered_transaction(conn)?;
    let (b, g, r, committed) = {
        let c: &AsyncPgConnection = conn;
        futures_util::future::join4(
            store::run(c, "BEGIN"),
            store::run(c, store::PLAN_GUARD),
            f(c),
            store::run(c, "COMMIT"),
        )
        .await
    };
    b?;
    g?;
    let r = r?;
    committed?;
    store::left_transaction(conn)?;
    Ok(r)
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
        diesel::sql_query(
            "UPDATE inbox_leases SET locked_until = now() - ($2 + 1) * interval '1 millisecond' \
             WHERE token = $1",
        )
        .bind::<BigInt, _>(token)
        .bind::<BigInt, _>(patience_ms),
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Extends lease `token` to `lease_ms` from now: its rows' handler still runs past its
/// timeout, in a process that lives.
pub(crate) async fn extend(conn: &mut AsyncPgConnection, token: i64, lease_ms: i64) -> Result<()> {
    Prepared(
        diesel::sql_query(
            "UPDATE inbox_leases SET locked_until = now() + $2 * interval '1 millisecond' \
             WHERE token = $1",
        )
        .bind::<BigInt, _>(token)
        .bind::<BigInt, _>(lease_ms),
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Whether database session `backend` still exists. A handler's transaction whose session is
/// gone (ended by `idle_in_transaction_session_timeout`, a crash, an operator) can never commit.
pub(crate) async fn session_alive(conn: &mut AsyncPgConnection, backend: i32) -> Result<bool> {
    #[derive(QueryableByName)]
    struct Alive {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        alive: bool,
    }
    let r: Alive = Prepared(
        diesel::sql_query("SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1) AS alive")
            .bind::<Integer, _>(backend),
    )
    .get_result(conn)
    .await?;
    Ok(r.alive)
}

/// The rows of `consumer` that a judged process held, up to `limit`.
pub(crate) async fn judged(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    limit: i64,
) -> Result<Vec<ExpiredRow>> {
    let judged = Prepared(
        diesel::sql_query(
            "SELECT i.id, l.token AS lease_token, i.event_id, i.attempt_count, l.held, \
                 i.suspicions \
             FROM inbox_leases l CROSS JOIN unnest(l.ids) AS u(id) \
             JOIN inbox_events i ON i.id = u.id \
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

/// `s` as a `text` value PostgreSQL accepts: at most `max` characters (then `…`), and without
/// NUL, which `text` refuses. An error text copied from elsewhere (a response body, a C
/// library's message) may hold one, and a refused mark would fail the whole batch.
pub(crate) fn truncate(s: &str, max: usize) -> String {
    let s = match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    };
    if s.contains('\0') {
        s.replace('\0', "\u{FFFD}")
    } else {
        s
    }
}

/// Sets a consumer's pause switch. Returns false when no such consumer was ever registered.
pub(crate) async fn set_paused(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    paused: bool,
    by: &str,
    reason: Option<&str>,
) -> Result<bool> {
    let n = Prepared(diesel::sql_query(
        "UPDATE consumer_states SET paused = $2, paused_by = $3, reason = $4, updated_at = now() \
         WHERE consumer = $1",
    )
    .bind::<Text, _>(consumer)
    .bind::<diesel::sql_types::Bool, _>(paused)
    .bind::<Text, _>(by)
    .bind::<Nullable<Text>, _>(reason))
    .execute(conn)
    .await?;
    Ok(n == 1)
}

/// One subscribed consumer of a received event, and whether its inbox row is new (else it
/// already had the event).
#[derive(QueryableByName)]
pub(crate) struct ReceiveRow {
    #[diesel(sql_type = Text)]
    pub consumer: String,
    #[diesel(sql_type = diesel::sql_types::Bool)]
    pub new: bool,
}

/// The receiving side of an external transport: one inbox row per consumer subscribed to the
/// event's type. Returns each subscribed consumer and whether its row is new.
pub(crate) async fn receive(
    conn: &mut AsyncPgConnection,
    e: &crate::event::OutboxEvent,
) -> Result<Vec<ReceiveRow>> {
    let rows = Prepared(diesel::sql_query(
        "WITH subs AS (SELECT consumer FROM consumer_subscriptions WHERE event_type = $2), \
         ins AS ( \
             INSERT INTO inbox_events (event_id, consumer, event_type, event_version, aggregate_type, \
                 aggregate_id, aggregate_version, payload, metadata, correlation_id, causation_id, \
                 event_created_at, external) \
             SELECT $1, consumer, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, true FROM subs \
             ON CONFLICT (event_id, consumer) DO NOTHING RETURNING consumer \
         ) \
         SELECT s.consumer, i.consumer IS NOT NULL AS new FROM subs s LEFT JOIN ins i USING (consumer)",
    )
    .bind::<SqlUuid, _>(e.id.as_uuid())
    .bind::<Text, _>(&e.event_type)
    .bind::<Integer, _>(e.event_version)
    .bind::<Text, _>(&e.aggregate_type)
    .bind::<Text, _>(&e.aggregate_id)
    .bind::<Nullable<BigInt>, _>(e.aggregate_version)
    .bind::<Jsonb, _>(&e.payload)
    .bind::<Jsonb, _>(&e.metadata)
    .bind::<Text, _>(&e.correlation_id)
    .bind::<Nullable<Text>, _>(e.causation_id.as_deref())
    .bind::<Timestamptz, _>(e.created_at))
    .load(conn)
    .await?;
    Ok(rows)
}

#[derive(QueryableByName)]
struct AdvanceRow {
    #[diesel(sql_type = diesel::sql_types::Bool)]
    locked: bool,
    #[diesel(sql_type = BigInt)]
    applied: i64,
    #[diesel(sql_type = Nullable<BigInt>)]
    current: Option<i64>,
}

/// The outcome of [`advance_version`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Advance {
    /// Not older than what the consumer applied: recorded, apply the event.
    Applied,
    /// Older: the consumer is already at a later version.
    Stale(i64),
    /// Another in-flight batch of this consumer holds the aggregate: try the row later.
    Busy,
}

/// Records that `consumer` applies `version` of an aggregate, unless it applied a later one
/// before. An equal version is applied: one change may emit several events (`ORDER_PLACED`
/// and `PAYMENT_REQUESTED`, both at the aggregate's version after it), and the same event
/// delivered again never gets this far (its inbox row is unique). Runs in the delivery's savepoint, so a failed handler leaves the version
/// where it was.
///
/// The aggregate is first locked with a non-blocking advisory lock held to the batch's end.
/// Without it two concurrent batches touching two aggregates in opposite orders deadlock
/// (each waits for the other's version row); with it the second batch defers the row instead.
pub(crate) async fn advance_version(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    aggregate_type: &str,
    aggregate_id: &str,
    version: i64,
) -> Result<Advance> {
    let r: AdvanceRow = Prepared(
        diesel::sql_query(
            "WITH l AS ( \
             SELECT pg_try_advisory_xact_lock( \
                 hashtextextended($1 || chr(31) || $2 || chr(31) || $3, 7)) AS ok \
         ), up AS ( \
             INSERT INTO aggregate_versions (consumer, aggregate_type, aggregate_id, version) \
             SELECT $1, $2, $3, $4 FROM l WHERE l.ok \
             ON CONFLICT (consumer, aggregate_type, aggregate_id) DO UPDATE \
                 SET version = EXCLUDED.version, updated_at = now() \
                 WHERE aggregate_versions.version <= EXCLUDED.version \
             RETURNING 1 \
         ) \
         SELECT (SELECT ok FROM l) AS locked, (SELECT count(*) FROM up) AS applied, \
                (SELECT version FROM aggregate_versions \
                 WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3) AS current",
        )
        .bind::<Text, _>(consumer)
        .bind::<Text, _>(aggregate_type)
        .bind::<Text, _>(aggregate_id)
        .bind::<BigInt, _>(version),
    )
    .get_result(conn)
    .await?;
    Ok(match (r.locked, r.applied) {
        (false, _) => Advance::Busy,
        (true, 1) => Advance::Applied,
        (true, _) => Advance::Stale(r.current.unwrap_or(version)),
    })
}
