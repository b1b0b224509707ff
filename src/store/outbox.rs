//! Outbox statements: the insert made in the caller's transaction, and the in-process claim.

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::sql_types::{Array, BigInt, Integer, Jsonb, Nullable, Text, Uuid as SqlUuid};
use diesel::{QueryResult, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::Result;
use crate::event::NewEvent;
use crate::store::{self, Prepared};

/// Inserts all `events` with one statement (`unnest` of column arrays), so a producer that
/// writes 500 events in one business transaction pays for one round trip, not 500.
pub(crate) async fn insert_events(mut conn: &AsyncPgConnection, events: &[NewEvent]) -> Result<()> {
    super::schema::check()?;
    if events.is_empty() {
        return Ok(());
    }
    InsertEvents::<()>::new(None, events)
        .execute(&mut conn)
        .await?;
    Ok(())
}

/// Runs `business` and inserts `events` (at least one) in one statement, `WITH business AS
/// (…) INSERT …`, writing the events only when `business` returned a row. Returns whether it
/// did.
///
/// One statement is atomic on its own, so outside a transaction this is a whole business
/// transaction in one round trip: no `BEGIN`, no `COMMIT`, and no moment at which the one is
/// committed without the other.
pub(crate) async fn insert_events_with<B>(
    mut conn: &AsyncPgConnection,
    business: B,
    events: &[NewEvent],
) -> Result<bool>
where
    B: QueryFragment<Pg> + Send,
{
    super::schema::check()?;
    let written = InsertEvents::new(Some(business), events)
        .execute(&mut conn)
        .await?;
    Ok(written > 0)
}

/// The outbox insert as a query fragment, so that a business statement can precede it in the
/// same statement. Its text depends only on the business statement, never on the number of
/// events, so it is prepared once per connection.
struct InsertEvents<'a, B> {
    business: Option<B>,
    ids: Vec<uuid::Uuid>,
    types: Vec<&'a str>,
    versions: Vec<i32>,
    agg_types: Vec<&'a str>,
    agg_ids: Vec<&'a str>,
    agg_versions: Vec<Option<i64>>,
    payloads: Vec<&'a serde_json::Value>,
    metadata: Vec<std::borrow::Cow<'a, serde_json::Value>>,
    correlations: Vec<String>,
    causations: Vec<Option<&'a str>>,
}

impl<'a, B> InsertEvents<'a, B> {
    fn new(business: Option<B>, events: &'a [NewEvent]) -> Self {
        Self {
            business,
            ids: events.iter().map(|e| e.id.as_uuid()).collect(),
            types: events.iter().map(|e| e.event_type.as_str()).collect(),
            versions: events.iter().map(|e| e.event_version).collect(),
            agg_types: events.iter().map(|e| e.aggregate_type.as_str()).collect(),
            agg_ids: events.iter().map(|e| e.aggregate_id.as_str()).collect(),
            agg_versions: events.iter().map(|e| e.aggregate_version).collect(),
            payloads: events.iter().map(|e| &e.payload).collect(),
            // With the feature `otel`, the current span's trace context goes in too.
            #[cfg(feature = "otel")]
            metadata: events
                .iter()
                .map(|e| crate::telemetry::otel::with_current(&e.metadata))
                .collect(),
            #[cfg(not(feature = "otel"))]
            metadata: events
                .iter()
                .map(|e| std::borrow::Cow::Borrowed(&e.metadata))
                .collect(),
            // An event that starts a chain is its own correlation root.
            correlations: events
                .iter()
                .map(|e| e.correlation_id.clone().unwrap_or_else(|| e.id.to_string()))
                .collect(),
            causations: events.iter().map(|e| e.causation_id.as_deref()).collect(),
        }
    }
}

impl<B: QueryFragment<Pg>> QueryFragment<Pg> for InsertEvents<'_, B> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        if let Some(business) = &self.business {
            out.push_sql("WITH business AS (");
            business.walk_ast(out.reborrow())?;
            out.push_sql(") ");
        }
        out.push_sql(&super::schema::qualify(
            "INSERT INTO actix_outbox.outbox_events (id, event_type, event_version, aggregate_type, \
             aggregate_id, aggregate_version, payload, metadata, correlation_id, causation_id) \
             SELECT * FROM unnest(",
        ));
        out.push_bind_param::<Array<SqlUuid>, _>(&self.ids)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<Text>, _>(&self.types)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<Integer>, _>(&self.versions)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<Text>, _>(&self.agg_types)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<Text>, _>(&self.agg_ids)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<Nullable<BigInt>>, _>(&self.agg_versions)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<Jsonb>, _>(&self.payloads)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<Jsonb>, _>(&self.metadata)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<Text>, _>(&self.correlations)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<Nullable<Text>>, _>(&self.causations)?;
        out.push_sql(")");
        if self.business.is_some() {
            out.push_sql(" WHERE EXISTS (SELECT FROM business)");
        }
        Ok(())
    }

    fn is_safe_to_cache_prepared(&self, backend: &Pg) -> QueryResult<bool> {
        self.business
            .as_ref()
            .map_or(Ok(true), |b| b.is_safe_to_cache_prepared(backend))
    }
}

impl<B> QueryId for InsertEvents<'_, B> {
    type QueryId = ();
    // Cached by SQL text, which the business statement decides.
    const HAS_STATIC_QUERY_ID: bool = false;
}

#[derive(QueryableByName)]
struct FanOutRow {
    #[diesel(sql_type = Text)]
    kind: String,
    #[diesel(sql_type = Nullable<Text>)]
    consumer: Option<String>,
    #[diesel(sql_type = Nullable<diesel::sql_types::Uuid>)]
    event_id: Option<uuid::Uuid>,
    #[diesel(sql_type = BigInt)]
    wanted: i64,
    #[diesel(sql_type = BigInt)]
    rows: i64,
    #[diesel(sql_type = Nullable<Text>)]
    event_type: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    aggregate_id: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    correlation_id: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    causation_id: Option<String>,
    #[diesel(sql_type = Nullable<BigInt>)]
    last_seq: Option<i64>,
}

/// One event a claim published, for its log lines.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct Published {
    pub event_id: uuid::Uuid,
    pub event_type: String,
    pub aggregate_id: String,
    pub correlation_id: String,
    pub causation_id: Option<String>,
    /// This publish attempt, from 1.
    pub attempt: i64,
}

impl<'a> From<&'a Published> for crate::telemetry::EventFields<'a> {
    fn from(p: &'a Published) -> Self {
        crate::telemetry::EventFields {
            consumer: None,
            event_id: p.event_id,
            event_type: &p.event_type,
            aggregate_id: &p.aggregate_id,
            correlation_id: Some(&p.correlation_id),
            causation_id: p.causation_id.as_deref(),
            attempt: Some(p.attempt),
        }
    }
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
    /// Each (event, consumer) whose inbox row already existed.
    pub duplicate_events: Vec<(String, Published)>,
    /// With `detail`: each event published, and each (event, consumer) inbox row written.
    pub events: Vec<Published>,
    pub received: Vec<(String, uuid::Uuid)>,
    /// The highest seq published, where the next claim may start (`store::scan`).
    pub last_seq: Option<i64>,
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
/// With `after_seq`, the claim reads the due index past that seq ([`scan`](store::scan) says
/// when); without, from the start.
///
/// With `detail`, the answer also names each event published and each inbox row written, for
/// the per-event log lines; without, those parts of the statement do not run.
///
/// With `notify = Some((channel, sender))` the same statement sends one notification,
/// `sender|consumer,…`, for other instances; it goes out with the commit that makes the rows
/// visible, so it cannot be lost between the two and costs no round trip of its own.
pub(crate) async fn claim_and_fan_out(
    conn: &mut AsyncPgConnection,
    limit: i64,
    after_seq: Option<i64>,
    notify: Option<(&str, &str)>,
    detail: bool,
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
            crate::store::sql(CLAIM_SQL)
                .bind::<BigInt, _>(limit)
                .bind::<Nullable<Text>, _>(notify.map(|n| n.0))
                .bind::<Nullable<Text>, _>(notify.map(|n| n.1))
                .bind::<diesel::sql_types::Bool, _>(detail)
                .bind::<BigInt, _>(after_seq.unwrap_or(i64::MIN)),
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
        let published = |row: FanOutRow| Published {
            event_id: row.event_id.unwrap_or_default(),
            event_type: row.event_type.unwrap_or_default(),
            aggregate_id: row.aggregate_id.unwrap_or_default(),
            correlation_id: row.correlation_id.unwrap_or_default(),
            causation_id: row.causation_id,
            attempt: row.wanted,
        };
        match (row.kind.as_str(), row.consumer.clone()) {
            ("count", Some(consumer)) => {
                if row.wanted > row.rows {
                    out.duplicates
                        .push((consumer.clone(), (row.wanted - row.rows) as usize));
                }
                if row.rows > 0 {
                    out.delivered.push((consumer, row.rows as usize));
                }
            }
            ("total", _) => {
                out.published = row.rows as usize;
                out.last_seq = row.last_seq;
            }
            ("duplicate", Some(consumer)) => out.duplicate_events.push((consumer, published(row))),
            ("event", _) => out.events.push(published(row)),
            ("received", Some(consumer)) => out
                .received
                .push((consumer, row.event_id.unwrap_or_default())),
            _ => {}
        }
    }
    Ok(out)
}

/// Sends one notification on `channel` (autocommit, or at the caller's commit when inside a
/// transaction; PostgreSQL folds identical notifications of one transaction into one).
pub(crate) async fn notify(
    mut conn: &AsyncPgConnection,
    channel: &str,
    payload: &str,
) -> Result<()> {
    Prepared(
        crate::store::sql("SELECT pg_notify($1, $2)")
            .bind::<Text, _>(super::schema::channel(channel))
            .bind::<Text, _>(payload),
    )
    .execute(&mut conn)
    .await?;
    Ok(())
}
