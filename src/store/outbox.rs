//! Outbox statements: the insert made in the caller's transaction, and the in-process claim.

use diesel::sql_types::{Array, BigInt, Integer, Jsonb, Nullable, Text, Uuid as SqlUuid};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::Result;
use crate::event::NewEvent;
use crate::store::{self, Prepared};

/// Inserts all `events` with one statement (`unnest` of column arrays), so a producer that
/// writes 500 events in one business transaction pays for one round trip, not 500.
pub(crate) async fn insert_events(mut conn: &AsyncPgConnection, events: &[NewEvent]) -> Result<()> {
    if events.is_empty() {
        return Ok(());
    }
    let n = events.len();
    let (mut ids, mut types, mut versions) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let (mut agg_types, mut agg_ids, mut agg_versions) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let (mut payloads, mut metadata) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let (mut correlations, mut causations) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for e in events {
        ids.push(e.id.as_uuid());
        types.push(e.event_type.as_str());
        versions.push(e.event_version);
        agg_types.push(e.aggregate_type.as_str());
        agg_ids.push(e.aggregate_id.as_str());
        agg_versions.push(e.aggregate_version);
        payloads.push(&e.payload);
        metadata.push(&e.metadata);
        // An event that starts a chain is its own correlation root.
        correlations.push(e.correlation_id.clone().unwrap_or_else(|| e.id.to_string()));
        causations.push(e.causation_id.as_deref());
    }
    Prepared(diesel::sql_query(
        "INSERT INTO outbox_events (id, event_type, event_version, aggregate_type, aggregate_id, \
             aggregate_version, payload, metadata, correlation_id, causation_id) \
         SELECT * FROM unnest($1::uuid[], $2::text[], $3::int4[], $4::text[], $5::text[], \
             $6::int8[], $7::jsonb[], $8::jsonb[], $9::text[], $10::text[])",
    )
    .bind::<Array<SqlUuid>, _>(ids)
    .bind::<Array<Text>, _>(types)
    .bind::<Array<Integer>, _>(versions)
    .bind::<Array<Text>, _>(agg_types)
    .bind::<Array<Text>, _>(agg_ids)
    .bind::<Array<Nullable<BigInt>>, _>(agg_versions)
    .bind::<Array<Jsonb>, _>(payloads)
    .bind::<Array<Jsonb>, _>(metadata)
    .bind::<Array<Text>, _>(correlations)
    .bind::<Array<Nullable<Text>>, _>(causations))
    .execute(&mut conn)
    .await?;
    Ok(())
}

#[derive(QueryableByName)]
struct FanOutRow {
    #[diesel(sql_type = Nullable<Text>)]
    consumer: Option<String>,
    #[diesel(sql_type = BigInt)]
    wanted: i64,
    #[diesel(sql_type = BigInt)]
    rows: i64,
}

/// What one claim published and which consumers got new inbox rows.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct FanOut {
    /// Outbox rows moved to PUBLISHED.
    pub published: usize,
    /// New inbox rows per consumer.
    pub delivered: Vec<(String, usize)>,
    /// Inbox rows that already existed (the event had been fanned out before), per consumer.
    pub duplicates: Vec<(String, usize)>,
}

/// Sent before the claim in its transaction: the [`PLAN_GUARD`](store::PLAN_GUARD)'s settings
/// and `synchronous_commit = off` (see the comment in [`claim_and_fan_out`] for why that is
/// safe there and nowhere else).
const CLAIM_SETTINGS: &str = concat!(
    include_str!("plan_guard.sql"),
    ", set_config('synchronous_commit', 'off', true)"
);

/// The statement of [`claim_and_fan_out`], kept in `claim.sql` so that `tests/plan.rs` and the
/// benchmark include exactly the text that runs.
pub(crate) const CLAIM_SQL: &str = include_str!("claim.sql");

/// The in-process transport in one statement: claim up to `limit` due outbox rows in `seq`
/// order (`FOR UPDATE SKIP LOCKED`, so concurrent publishers take disjoint rows), insert one
/// inbox row per subscribed consumer, and mark the outbox rows PUBLISHED.
///
/// One statement in a transaction of its own: there is no moment at which a row is claimed but
/// not yet fanned out, so nothing can be stuck half-way, and no lease is needed. `ON CONFLICT DO
/// NOTHING` makes a repeated fan-out of the same event harmless.
///
/// Expected plan: a `LockRows` over an `Index Scan using outbox_events_due` (never a bitmap
/// scan that reads and sorts every due row), and the update finding the claimed rows through
/// `outbox_events_pkey` (never a `Seq Scan`), whatever the statistics say. Two shapes ensure
/// it. The limit is a subquery: with a limit it cannot read at plan time, PostgreSQL plans to
/// fetch 10% of the due rows, so the index that yields them in `seq` order wins even when a
/// fresh or stale table makes it think there are fewer due rows than the limit (with `LIMIT $1`
/// it then sorts the whole backlog for each batch). And the update looks the ids up with
/// `= ANY (ARRAY(...))`, so those 10% of a large analyzed backlog do not make it hash-join the
/// whole table. Neither shape helps a plan made while the table was empty (a cached generic
/// plan then scans the table); the [`PLAN_GUARD`](store::PLAN_GUARD) sent before it does.
/// `tests/plan.rs` asserts the plan on an empty, a fresh, a large and a backlogged table.
///
/// With `notify = Some((channel, sender))` the same statement sends one notification,
/// `sender|consumer,…`, for other instances; it goes out with the commit that makes the rows
/// visible, so it cannot be lost between the two and costs no round trip of its own.
pub(crate) async fn claim_and_fan_out(
    conn: &mut AsyncPgConnection,
    limit: i64,
    notify: Option<(&str, &str)>,
) -> Result<FanOut> {
    // BEGIN, the plan guard and no wait for the WAL flush, the claim and COMMIT, in one round
    // trip. The transaction manager counts the transaction until the COMMIT is known to have
    // run, so a failure or a drop half-way leaves a connection the pool closes rather than one
    // still inside it.
    //
    // Why the claim need not wait for its commit to reach disk: WAL is flushed in order, so no
    // later synchronous commit (a consumer's batch, holding the effect of one of these inbox
    // rows) can be durable unless this one is. A crash can only lose a claim nobody's effect
    // depends on, and it loses it whole: the outbox rows are PENDING again and are claimed
    // again. Not waiting takes a disk flush out of every event's path to its consumer.
    store::entered_transaction(conn)?;
    let (begun, guarded, rows, committed) = {
        let mut c: &AsyncPgConnection = conn;
        let claim = Prepared(
            diesel::sql_query(CLAIM_SQL)
                .bind::<BigInt, _>(limit)
                .bind::<Nullable<Text>, _>(notify.map(|n| n.0))
                .bind::<Nullable<Text>, _>(notify.map(|n| n.1)),
        )
        .load::<FanOutRow>(&mut c);
        futures_util::future::join4(
            store::run(c, "BEGIN"),
            store::run(c, CLAIM_SETTINGS),
            claim,
            store::run(c, "COMMIT"),
        )
        .await
    };
    begun?;
    guarded?;
    let rows = rows?;
    committed?;
    store::left_transaction(conn)?;
    let mut out = FanOut::default();
    for row in rows {
        match row.consumer {
            Some(consumer) => {
                if row.wanted > row.rows {
                    out.duplicates
                        .push((consumer.clone(), (row.wanted - row.rows) as usize));
                }
                if row.rows > 0 {
                    out.delivered.push((consumer, row.rows as usize));
                }
            }
            None => out.published = row.rows as usize,
        }
    }
    Ok(out)
}

/// Sends one notification on `channel` (autocommit, or at the caller's commit when inside a
/// transaction; PostgreSQL folds identical notifications of one transaction into one).
pub(crate) async fn notify(
    conn: &mut AsyncPgConnection,
    channel: &str,
    payload: &str,
) -> Result<()> {
    Prepared(
        diesel::sql_query("SELECT pg_notify($1, $2)")
            .bind::<Text, _>(channel)
            .bind::<Text, _>(payload),
    )
    .execute(conn)
    .await?;
    Ok(())
}
