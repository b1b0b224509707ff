//! Inbox statements: consumer registration, the per-consumer lease (claim, settle, expired
//! leases) and the stale-event check. `RECEIVED|RETRY_PENDING` (named by a lease while in
//! flight) `→ PROCESSED | RETRY_PENDING | DEAD_LETTER`, or back unhandled; see the migrations
//! `inbox_lease` and `inbox_lease_table`.
//!
//! | file | owns |
//! |---|---|
//! | `claim.rs` | the claim of a batch (`inbox_claim.sql`) and reloading its rows |
//! | `settle.rs` | the marks that settle leased rows, fenced on their lease |
//! | `cursor.rs` | cursor delivery: a batch's lease of the events past a cursor, and its promotion to inbox rows |
//! | `reap.rs` | judging the leases of loops that died, expiring and extending leases |
//! | here | the row type, subscriptions, pause, the receiving side, aggregate versions |

mod claim;
pub(crate) mod cursor;
mod reap;
mod settle;

pub(crate) use claim::{claim, new_token, reload, Place};
pub(crate) use reap::{end_session, expire, extend, judge_dead, judged, ExpiredRow};
pub(crate) use settle::{settle_and_commit, settle_now, Failure, Outcome, Settle};

use chrono::{DateTime, Utc};
use diesel::sql_types::{
    Array, BigInt, Bool, Integer, Jsonb, Nullable, Text, Timestamptz, Uuid as SqlUuid,
};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};

use crate::error::Result;
use crate::event::redact::Redactor;
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
    /// Whether both rows are events of the same aggregate.
    pub(crate) fn same_aggregate(&self, other: &InboxRow) -> bool {
        self.aggregate_id == other.aggregate_id && self.aggregate_type == other.aggregate_type
    }
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

/// [`register_consumer`]'s statement: the consumer's state row, its subscriptions and, with
/// a cursor, its cursors (one per slot and lane); answers the subscriptions it no longer lists.
///   $1 consumer  $2 event types  $3 ordered  $4 replay_safe  $5, $6 delays  $7 cursor
///   $8 HIGH types  $9 turning its cursors off
const REGISTER: &str = "WITH c AS (INSERT INTO actix_outbox.consumer_states \
                (consumer, replay_safe, allowed_delay_ms, critical_delay_ms) \
            VALUES ($1, $4, $5, $6) \
            ON CONFLICT (consumer) DO UPDATE SET replay_safe = $4, allowed_delay_ms = $5, \
                critical_delay_ms = $6, \
                cursor_off_vxids = CASE WHEN $7 THEN NULL WHEN $9 THEN '{pending}' \
                                        ELSE consumer_states.cursor_off_vxids END \
            WHERE (consumer_states.replay_safe, consumer_states.allowed_delay_ms, \
                   consumer_states.critical_delay_ms) IS DISTINCT FROM ($4, $5, $6) \
               OR $7 OR $9), \
      s AS (INSERT INTO actix_outbox.consumer_subscriptions \
                (consumer, event_type, ordered, cursor, high, since) \
            SELECT $1, t, $3, $7, t = ANY ($8::text[]), 9223372036854775807 \
            FROM unnest($2::text[]) AS t \
            ON CONFLICT (consumer, event_type) DO UPDATE \
            SET ordered = $3, cursor = $7, high = excluded.high \
            WHERE (consumer_subscriptions.ordered, consumer_subscriptions.cursor, \
                   consumer_subscriptions.high) <> ($3, $7, excluded.high)), \
      on_ AS (INSERT INTO actix_outbox.consumer_cursors (consumer, part, stamp, idx, since) \
            SELECT $1, part, last, 9223372036854775807, last \
            FROM actix_outbox.log_head, generate_series(0, 15) AS part WHERE $7 \
            ON CONFLICT DO NOTHING) \
 SELECT event_type FROM actix_outbox.consumer_subscriptions \
 WHERE consumer = $1 AND event_type <> ALL ($2::text[]) ORDER BY event_type";

/// Whether `consumer` has cursors.
async fn has_cursors(conn: &mut AsyncPgConnection, consumer: &str) -> Result<bool> {
    #[derive(QueryableByName)]
    struct Found {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        exists: bool,
    }
    let found: Found = Prepared(
        crate::store::sql(
            "SELECT EXISTS (SELECT FROM actix_outbox.consumer_cursors WHERE consumer = $1) AS exists",
        )
        .bind::<Text, _>(consumer),
    )
    .get_result(conn)
    .await?;
    Ok(found.exists)
}

/// Records a consumer and its subscriptions. Idempotent; several instances may run it at once.
/// Subscriptions are only ever added here: removing one is an operator's decision
/// ([`unsubscribe`](crate::ops::unsubscribe)), since another instance may still run the older code.
/// Returns the subscriptions in the database that `event_types` no longer lists. `ordered`
/// is set on each subscription (the last instance to start decides, as during a rolling
/// deploy), and rows fanned out from then on carry it. `cursor`: the consumer reads through
/// its cursors (one per slot and lane, made here), with the types it subscribes to as HIGH.
/// Without, a consumer that still has cursors is turning them off: its subscriptions' flag
/// and a `{pending}` list are committed first, then the transactions open at that moment are
/// listed ([`cursor::turning_off`]); with, the list is cleared in the same statement as the
/// flag. Also returns whether it is turning them off.
pub(crate) async fn register_consumer(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    event_types: &[String],
    ordered: bool,
    replay_safe: bool,
    delays: Option<(i64, i64)>,
    cursor: Option<&[String]>,
) -> Result<(Vec<String>, bool)> {
    #[derive(QueryableByName)]
    struct Subscription {
        #[diesel(sql_type = Text)]
        event_type: String,
    }
    let (extra, retiring) = conn
        .transaction::<_, crate::Error, _>(async |c| {
            // Before anything of the consumer is read or written (PostgreSQL runs a
            // statement's writing CTEs in no set order): a drop of its cursors
            // (`cursor::retire`) holds this row from its check to its commit, so the two never
            // interleave.
            crate::store::sql(
                "SELECT FROM actix_outbox.consumer_states WHERE consumer = $1 FOR NO KEY UPDATE",
            )
            .bind::<Text, _>(consumer)
            .execute(c)
            .await?;
            let retiring = cursor.is_none() && has_cursors(c, consumer).await?;
            if retiring && ordered {
                // Its cursors' events are read in no aggregate's order, beside the ordered inbox.
                return Err(crate::Error::Config(format!(
                    "consumer {consumer} still reads through cursors it is turning off: ordered can \
                     be turned on once they are dropped"
                )));
            }
            let register = Prepared(
                crate::store::sql(REGISTER)
                    .bind::<Text, _>(consumer)
                    .bind::<Array<Text>, _>(event_types)
                    .bind::<Bool, _>(ordered)
                    .bind::<Bool, _>(replay_safe)
                    .bind::<Nullable<BigInt>, _>(delays.map(|d| d.0))
                    .bind::<Nullable<BigInt>, _>(delays.map(|d| d.1))
                    .bind::<Bool, _>(cursor.is_some())
                    .bind::<Array<Text>, _>(cursor.unwrap_or_default())
                    .bind::<Bool, _>(retiring),
            );
            let extra: Vec<Subscription> = register.load(c).await?;
            Ok((extra, retiring))
        })
        .await?;
    // A new subscription's `since`, pending (the largest stamp) until now: the last stamp once
    // it is committed. A cursor claim that passed an event of its type without seeing it read
    // a stamp committed before that, so no smaller than this one; a replay counts only events
    // of larger stamps (a few read just after the commit are left out, never one passed).
    crate::store::sql(
        "UPDATE actix_outbox.consumer_subscriptions \
         SET since = (SELECT last FROM actix_outbox.log_head) \
         WHERE consumer = $1 AND since = 9223372036854775807",
    )
    .bind::<Text, _>(consumer)
    .execute(conn)
    .await?;
    if retiring {
        cursor::turning_off(conn, consumer).await?;
    }
    Ok((extra.into_iter().map(|s| s.event_type).collect(), retiring))
}

/// For each type `consumer` subscribes to as HIGH, the cursor consumers that read it LOW and
/// so keep it in the LOW lane for all (`claim.sql`): (event type, consumer), in that order.
pub(crate) async fn high_overruled(
    conn: &mut AsyncPgConnection,
    consumer: &str,
) -> Result<Vec<(String, String)>> {
    #[derive(QueryableByName)]
    struct Low {
        #[diesel(sql_type = Text)]
        event_type: String,
        #[diesel(sql_type = Text)]
        consumer: String,
    }
    let low: Vec<Low> = crate::store::sql(
        "SELECT h.event_type, l.consumer FROM actix_outbox.consumer_subscriptions h \
         JOIN actix_outbox.consumer_subscriptions l \
             ON l.event_type = h.event_type AND l.cursor AND NOT l.high \
         WHERE h.consumer = $1 AND h.cursor AND h.high ORDER BY 1, 2",
    )
    .bind::<Text, _>(consumer)
    .load(conn)
    .await?;
    Ok(low
        .into_iter()
        .map(|l| (l.event_type, l.consumer))
        .collect())
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
        crate::store::sql(
            "WITH d AS (DELETE FROM actix_outbox.consumer_subscriptions WHERE consumer = $1 AND event_type = $2 \
                        RETURNING 1) \
             SELECT EXISTS (SELECT 1 FROM actix_outbox.consumer_states WHERE consumer = $1) AS known, \
                    (SELECT count(*) FROM d) AS removed",
        )
        .bind::<Text, _>(consumer)
        .bind::<Text, _>(event_type),
    )
    .get_result(conn)
    .await?;
    Ok(r.known.then_some(r.removed > 0))
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

/// The most characters of error text stored in a row.
pub(crate) const MAX_ERROR_CHARS: usize = 2000;

/// An error message as any table stores it (`last_error`, `reconcile_runs.error`): redacted
/// first, so that no secret is cut where the redaction would no longer see it, then
/// [`truncate`]d. Every write of a handler's or a transport's error text goes through here.
pub(crate) fn error_text(redact: &Redactor, message: &str) -> String {
    truncate(&redact.apply(message), MAX_ERROR_CHARS)
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

/// Pauses a consumer, until `until` if given, registered or not (a runtime that registers it
/// later keeps the switch as it finds it).
pub(crate) async fn pause(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    by: &str,
    reason: &str,
    until: Option<chrono::DateTime<chrono::Utc>>,
) -> Result<()> {
    Prepared(
        crate::store::sql(
            "INSERT INTO actix_outbox.consumer_states (consumer, paused, paused_by, reason, paused_until) \
         VALUES ($1, true, $2, $3, $4) \
         ON CONFLICT (consumer) DO UPDATE SET paused = true, paused_by = $2, reason = $3, \
             paused_until = $4, updated_at = now()",
        )
        .bind::<Text, _>(consumer)
        .bind::<Text, _>(by)
        .bind::<Text, _>(reason)
        .bind::<Nullable<diesel::sql_types::Timestamptz>, _>(until),
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Resumes a consumer. Returns false when no such consumer was ever registered or paused.
pub(crate) async fn resume(conn: &mut AsyncPgConnection, consumer: &str, by: &str) -> Result<bool> {
    let n = Prepared(
        crate::store::sql(
            "UPDATE actix_outbox.consumer_states SET paused = false, paused_by = $2, reason = NULL, \
             paused_until = NULL, updated_at = now() \
         WHERE consumer = $1",
        )
        .bind::<Text, _>(consumer)
        .bind::<Text, _>(by),
    )
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
/// event's type. Returns each subscribed consumer and whether its row is new. An event no
/// consumer here subscribes to is recorded in `unrouted_events`, as the in-process fan-out
/// records one, so that health says so (`EVENTS_UNROUTED`) instead of the event being
/// acknowledged and gone without a trace.
pub(crate) async fn receive(
    conn: &mut AsyncPgConnection,
    e: &crate::event::OutboxEvent,
) -> Result<Vec<ReceiveRow>> {
    let rows = Prepared(crate::store::sql(
        "WITH subs AS (SELECT consumer FROM actix_outbox.consumer_subscriptions WHERE event_type = $2), \
         unrouted AS ( \
             INSERT INTO actix_outbox.unrouted_events (event_id, event_type) \
             SELECT $1, $2 WHERE NOT EXISTS (SELECT FROM subs) ON CONFLICT DO NOTHING \
         ), \
         ins AS ( \
             INSERT INTO actix_outbox.inbox_events (event_id, consumer, event_type, event_version, aggregate_type, \
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
        crate::store::sql(
            "WITH l AS ( \
             SELECT pg_try_advisory_xact_lock( \
                 hashtextextended($1 || chr(31) || $2 || chr(31) || $3, 7)) AS ok \
         ), up AS ( \
             INSERT INTO actix_outbox.aggregate_versions (consumer, aggregate_type, aggregate_id, version) \
             SELECT $1, $2, $3, $4 FROM l WHERE l.ok \
             ON CONFLICT (consumer, aggregate_type, aggregate_id) DO UPDATE \
                 SET version = EXCLUDED.version, updated_at = now() \
                 WHERE aggregate_versions.version <= EXCLUDED.version \
             RETURNING 1 \
         ) \
         SELECT (SELECT ok FROM l) AS locked, (SELECT count(*) FROM up) AS applied, \
                (SELECT version FROM actix_outbox.aggregate_versions \
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
