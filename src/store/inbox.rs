//! Inbox statements: consumer registration, the per-consumer claim and the marks.

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
    #[diesel(sql_type = Integer)]
    pub attempt_count: i32,
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

/// Opens the batch's transaction and locks up to `limit` due rows of `consumer` in it, both in
/// one round trip (`BEGIN` and the claim are pipelined). Rows locked by another instance are
/// skipped, never waited for; a paused consumer claims nothing.
///
/// The connection's transaction manager counts the transaction from before `BEGIN` is sent,
/// so an error return hands back a connection that the pool will close (rolling the
/// transaction back) rather than reuse.
pub(crate) async fn begin_and_claim(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    limit: i64,
) -> Result<Vec<InboxRow>> {
    store::entered_transaction(conn)?;
    let c: &AsyncPgConnection = conn;
    let (begun, rows) =
        futures_util::future::join(store::run(c, "BEGIN"), claim_due(c, consumer, limit)).await;
    begun?;
    rows
}

async fn claim_due(
    mut conn: &AsyncPgConnection,
    consumer: &str,
    limit: i64,
) -> Result<Vec<InboxRow>> {
    let rows = Prepared(
        diesel::sql_query(include_str!("inbox_claim.sql"))
            .bind::<Text, _>(consumer)
            .bind::<BigInt, _>(limit),
    )
    .load(&mut conn)
    .await?;
    Ok(rows)
}

/// An entry of `inbox_in_flight` that may hold some of a batch's rows.
#[derive(Debug, QueryableByName)]
pub(crate) struct InFlightEntry {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = Array<BigInt>)]
    pub inbox_ids: Vec<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub alone: Option<i64>,
}

/// Enters a batch's rows `ids` in `inbox_in_flight` (autocommit, on the consumer's in-flight
/// connection), deletes the entries `done` (of this consumer's committed batches) and any
/// entry older than a day none of whose rows is still waiting (no batch lives that long; an
/// entry left behind has served its purpose once its rows were claimed again and decided, but
/// a consumer paused or stopped for over a day still needs it when it comes back), and returns the new entry's id with the other
/// entries whose id range meets the batch's. The caller holds the rows' locks, so no live
/// batch can own an entry holding one of them.
pub(crate) async fn enter_in_flight(
    mut conn: &AsyncPgConnection,
    consumer: &str,
    ids: &[i64],
    done: &[i64],
) -> Result<(i64, Vec<InFlightEntry>)> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = BigInt)]
        entry: i64,
        #[diesel(sql_type = Nullable<BigInt>)]
        id: Option<i64>,
        #[diesel(sql_type = Nullable<Array<BigInt>>)]
        inbox_ids: Option<Vec<i64>>,
        #[diesel(sql_type = Nullable<BigInt>)]
        alone: Option<i64>,
    }
    let lo = ids.iter().copied().min().unwrap_or_default();
    let hi = ids.iter().copied().max().unwrap_or_default();
    let rows: Vec<Row> = Prepared(
        diesel::sql_query(
            "WITH gone AS (DELETE FROM inbox_in_flight f \
                           WHERE id = ANY($3) OR (entered_at < now() - interval '1 day' \
                               AND NOT EXISTS (SELECT 1 FROM inbox_events i \
                                   WHERE i.id = ANY (f.inbox_ids) \
                                     AND i.status IN ('RECEIVED', 'RETRY_PENDING')))), \
                  entered AS (INSERT INTO inbox_in_flight (consumer, lo, hi, inbox_ids) \
                              VALUES ($1, $4, $5, $2) RETURNING id) \
             SELECT e.id AS entry, f.id, f.inbox_ids, f.alone FROM entered e \
             LEFT JOIN inbox_in_flight f ON f.consumer = $1 AND f.lo <= $5 AND f.hi >= $4 \
                 AND f.id <> ALL ($3)",
        )
        .bind::<Text, _>(consumer)
        .bind::<Array<BigInt>, _>(ids)
        .bind::<Array<BigInt>, _>(done)
        .bind::<BigInt, _>(lo)
        .bind::<BigInt, _>(hi),
    )
    .load(&mut conn)
    .await?;
    let entry = rows.as_slice().first().map(|r| r.entry).unwrap_or_default();
    let others = rows
        .into_iter()
        .filter_map(|r| {
            Some(InFlightEntry {
                id: r.id?,
                inbox_ids: r.inbox_ids?,
                alone: r.alone,
            })
        })
        .collect();
    Ok((entry, others))
}

/// Records the row the batch `entries` is handing over on its own now: `Some(row)` just before
/// its handler is called (should the process die then, that row alone is to blame: no other
/// handler runs in the process meanwhile), `None` as soon as the call returns.
pub(crate) async fn set_alone(
    mut conn: &AsyncPgConnection,
    entries: &[i64],
    row: Option<i64>,
) -> Result<()> {
    Prepared(
        diesel::sql_query("UPDATE inbox_in_flight SET alone = $2 WHERE id = ANY($1)")
            .bind::<Array<BigInt>, _>(entries)
            .bind::<Nullable<BigInt>, _>(row),
    )
    .execute(&mut conn)
    .await?;
    Ok(())
}

/// Removes `row` from the entry `entry`, or the entry if it held that row only: the row's
/// attempt is recorded, so the entry no longer needs to hold it, and the batch that claims the
/// entry's other rows again then finds them all and deletes it.
pub(crate) async fn forget_in_flight(
    mut conn: &AsyncPgConnection,
    entry: i64,
    row: i64,
) -> Result<()> {
    Prepared(
        diesel::sql_query(
            "WITH gone AS (DELETE FROM inbox_in_flight \
                           WHERE id = $1 AND inbox_ids <@ ARRAY[$2]::int8[] RETURNING id) \
             UPDATE inbox_in_flight SET inbox_ids = array_remove(inbox_ids, $2) \
             WHERE id = $1 AND NOT EXISTS (SELECT FROM gone)",
        )
        .bind::<BigInt, _>(entry)
        .bind::<BigInt, _>(row),
    )
    .execute(&mut conn)
    .await?;
    Ok(())
}

/// Deletes entries from `inbox_in_flight`.
pub(crate) async fn leave_in_flight(mut conn: &AsyncPgConnection, entries: &[i64]) -> Result<()> {
    Prepared(
        diesel::sql_query("DELETE FROM inbox_in_flight WHERE id = ANY($1)")
            .bind::<Array<BigInt>, _>(entries),
    )
    .execute(&mut conn)
    .await?;
    Ok(())
}

/// Marks the batch's outcomes and commits it, in one round trip: the marks and `COMMIT` are
/// pipelined, after the [`PLAN_GUARD`](store::PLAN_GUARD) (no handler code runs after it).
/// The transaction is only counted as closed when every mark and the commit succeeded;
/// otherwise the connection is left for the pool to close, and PostgreSQL rolls back whatever
/// the commit did not make durable.
pub(crate) async fn mark_and_commit(
    conn: &mut AsyncPgConnection,
    processed: &[i64],
    stale: &[(i64, i64)],
    failures: &[Failure],
    counted: &[i64],
) -> Result<()> {
    let ((g, p, s), (f, a, committed)) = {
        let c: &AsyncPgConnection = conn;
        futures_util::future::join(
            futures_util::future::join3(
                store::run(c, store::PLAN_GUARD),
                mark_processed(c, processed),
                mark_stale(c, stale),
            ),
            futures_util::future::join3(
                mark_failed(c, failures),
                forget_alone(c, counted),
                store::run(c, "COMMIT"),
            ),
        )
        .await
    };
    g?;
    p?;
    s?;
    f?;
    a?;
    committed?;
    store::left_transaction(conn)
}

/// Clears the `alone` row of the entries in flight `counted`, in the transaction that records
/// their interrupted attempts, so that each such attempt is counted exactly once: both commit,
/// or neither does.
async fn forget_alone(mut conn: &AsyncPgConnection, counted: &[i64]) -> Result<()> {
    if counted.is_empty() {
        return Ok(());
    }
    Prepared(
        diesel::sql_query("UPDATE inbox_in_flight SET alone = NULL WHERE id = ANY($1)")
            .bind::<Array<BigInt>, _>(counted),
    )
    .execute(&mut conn)
    .await?;
    Ok(())
}

/// Marks rows PROCESSED inside the transaction that holds the handlers' effects.
async fn mark_processed(mut conn: &AsyncPgConnection, ids: &[i64]) -> Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    Prepared(diesel::sql_query(
        "UPDATE inbox_events SET status = 'PROCESSED', attempt_count = attempt_count + 1, \
             processed_at = clock_timestamp(), updated_at = now(), last_error = NULL, error_code = NULL \
         WHERE id = ANY($1)",
    )
    .bind::<Array<BigInt>, _>(ids))
    .execute(&mut conn)
    .await?;
    Ok(())
}

/// A failed attempt of one row, as decided by the consumer's retry policy.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Failure {
    pub id: i64,
    /// `attempt_count` as claimed; the mark only applies if nobody moved the row since.
    pub attempts_before: i32,
    pub dead: bool,
    pub delay_ms: i64,
    pub code: String,
    pub message: String,
}

/// Records failed attempts: the counter goes up by one, and the row becomes RETRY_PENDING at
/// `clock_timestamp() + delay` (the database clock at the mark, not at the batch's start, so a
/// row failing late in a long batch still waits its full backoff) or DEAD_LETTER. Fenced on the attempt count seen at claim,
/// so a mark made outside the claiming transaction cannot overwrite a newer outcome.
pub(crate) async fn mark_failed(
    mut conn: &AsyncPgConnection,
    failures: &[Failure],
) -> Result<usize> {
    if failures.is_empty() {
        return Ok(0);
    }
    let ids: Vec<i64> = failures.iter().map(|f| f.id).collect();
    let attempts: Vec<i32> = failures.iter().map(|f| f.attempts_before).collect();
    let dead: Vec<bool> = failures.iter().map(|f| f.dead).collect();
    let delays: Vec<i64> = failures.iter().map(|f| f.delay_ms).collect();
    let codes: Vec<String> = failures.iter().map(|f| truncate(&f.code, 200)).collect();
    let messages: Vec<String> = failures
        .iter()
        .map(|f| truncate(&f.message, 2000))
        .collect();
    let n = Prepared(
        diesel::sql_query(
            "UPDATE inbox_events i \
         SET attempt_count = i.attempt_count + 1, \
             status = CASE WHEN f.dead THEN 'DEAD_LETTER' ELSE 'RETRY_PENDING' END, \
             next_attempt_at = clock_timestamp() + f.delay_ms * interval '1 millisecond', \
             error_code = f.code, last_error = f.message, updated_at = now() \
         FROM unnest($1::int8[], $2::int4[], $3::bool[], $4::int8[], $5::text[], $6::text[]) \
             AS f(id, attempts, dead, delay_ms, code, message) \
         WHERE i.id = f.id AND i.attempt_count = f.attempts \
           AND i.status IN ('RECEIVED', 'RETRY_PENDING')",
        )
        .bind::<Array<BigInt>, _>(ids)
        .bind::<Array<Integer>, _>(attempts)
        .bind::<Array<diesel::sql_types::Bool>, _>(dead)
        .bind::<Array<BigInt>, _>(delays)
        .bind::<Array<Text>, _>(codes)
        .bind::<Array<Text>, _>(messages),
    )
    .execute(&mut conn)
    .await?;
    Ok(n)
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
    e: &crate::publisher::OutboxEvent,
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

/// Marks stale rows: PROCESSED (nothing is left to do) but with `EVENT_STALE` and the version
/// the consumer was already at, so they stay visible and countable.
async fn mark_stale(mut conn: &AsyncPgConnection, stale: &[(i64, i64)]) -> Result<()> {
    if stale.is_empty() {
        return Ok(());
    }
    let ids: Vec<i64> = stale.iter().map(|s| s.0).collect();
    let current: Vec<i64> = stale.iter().map(|s| s.1).collect();
    Prepared(
        diesel::sql_query(
            "UPDATE inbox_events i SET status = 'PROCESSED', attempt_count = i.attempt_count + 1, \
             processed_at = clock_timestamp(), updated_at = now(), error_code = 'EVENT_STALE', \
             last_error = 'stale: the consumer already applied aggregate version ' || s.current \
         FROM unnest($1::int8[], $2::int8[]) AS s(id, current) WHERE i.id = s.id",
        )
        .bind::<Array<BigInt>, _>(ids)
        .bind::<Array<BigInt>, _>(current),
    )
    .execute(&mut conn)
    .await?;
    Ok(())
}
