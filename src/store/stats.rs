//! Statements of the maintenance services: the stats sampler's live gauges and
//! `outbox_stats_samples` rows, and retention's bounded deletes.
//!
//! Every count reads a partial index (due rows, PROCESSING rows, dead letters) or the small
//! `inbox_leases`, never the PUBLISHED/PROCESSED history, so a sample costs the same with a
//! million delivered events as with none.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Bool, Double, Jsonb, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::store;

/// Outbox numbers of one sample. Gauges come from the database; `published` and
/// `publish_failed` are the increments since the sampling process's previous sample.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct OutboxGauges {
    pub pending: i64,
    pub retrying: i64,
    pub processing: i64,
    pub dead_letter: i64,
    pub oldest_pending_age_seconds: f64,
    /// `seq` of the oldest row due for publishing: if it stays the same, nothing was published.
    pub head_seq: Option<i64>,
    pub published: u64,
    pub publish_failed: u64,
    /// Events published over the last hour to no consumer, and (a few of) their types.
    pub unrouted: i64,
    pub unrouted_types: Vec<String>,
}

/// One consumer's numbers of one sample; the counts after `dead_letter` are increments.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct ConsumerGauges {
    pub consumer: String,
    pub paused: bool,
    pub backlog: i64,
    pub retrying: i64,
    pub due: i64,
    pub oldest_due_age_seconds: f64,
    /// How long the oldest lease of the consumer has been held: long only while a handler
    /// hangs past its timeout, keeping it.
    pub oldest_in_flight_age_seconds: f64,
    /// How long the oldest event the consumer has not processed yet (due, waiting for a retry
    /// or in flight) has existed.
    pub oldest_waiting_age_seconds: f64,
    /// The consumer's allowed delay and its critical level, as its runtime registered them.
    pub allowed_delay_seconds: Option<f64>,
    pub critical_delay_seconds: Option<f64>,
    pub dead_letter: i64,
    pub received: u64,
    pub processed: u64,
    pub duplicates: u64,
    pub failed: u64,
    pub dead_lettered: u64,
    /// Hung handlers' database sessions the engine ended.
    pub sessions_ended: u64,
    /// A cursor consumer's: how long the oldest event past its cursors has waited. Retention
    /// keeps the outbox, for every consumer, from that event on.
    #[serde(default)]
    pub log_held_age_seconds: f64,
}

/// What the stats sampler saw at one moment.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Sample {
    pub at: DateTime<Utc>,
    pub outbox: OutboxGauges,
    pub consumers: Vec<ConsumerGauges>,
    /// The runtime instance that took it (absent in samples stored by older versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// The boot-time contract check's standing findings.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub contract: Vec<crate::store::contract::Finding>,
    /// Sessions of this database holding a snapshot open past the floor, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub snapshots: Vec<super::snapshots::HeldSnapshot>,
    /// Side effects waiting or dead-lettered, per kind (none when every call is made).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub effects: Vec<super::effects::EffectGauges>,
}

#[derive(QueryableByName)]
struct OutboxRow {
    #[diesel(sql_type = Timestamptz)]
    at: DateTime<Utc>,
    #[diesel(sql_type = BigInt)]
    pending: i64,
    #[diesel(sql_type = BigInt)]
    retrying: i64,
    #[diesel(sql_type = BigInt)]
    processing: i64,
    #[diesel(sql_type = BigInt)]
    dead_letter: i64,
    #[diesel(sql_type = Double)]
    oldest_age: f64,
    #[diesel(sql_type = Nullable<BigInt>)]
    head_seq: Option<i64>,
    #[diesel(sql_type = BigInt)]
    unrouted: i64,
    #[diesel(sql_type = diesel::sql_types::Array<Text>)]
    unrouted_types: Vec<String>,
}

/// The gauges of the outbox and of every consumer ever registered, at the database's `now()`.
/// The increments (`published`, `received`, …) are left at zero for the caller to fill in.
pub(crate) async fn snapshot(conn: &mut AsyncPgConnection, hold_floor: Duration) -> Result<Sample> {
    let (at, outbox) = outbox_gauges(conn).await?;
    let consumers = consumer_gauges(conn).await?;
    let contract = crate::store::contract::all(conn).await?;
    let snapshots = super::snapshots::held(conn, hold_floor).await?;
    let effects = super::effects::gauges(conn).await?;
    Ok(Sample {
        at,
        outbox,
        consumers,
        instance: None,
        contract,
        snapshots,
        effects,
    })
}

async fn outbox_gauges(conn: &mut AsyncPgConnection) -> Result<(DateTime<Utc>, OutboxGauges)> {
    let row: OutboxRow = crate::store::sql(
        "SELECT now() AS at, \
           (SELECT count(*) FROM actix_outbox.outbox_events WHERE status IN ('PENDING', 'RETRY_PENDING')) AS pending, \
           (SELECT count(*) FROM actix_outbox.outbox_events WHERE status = 'RETRY_PENDING') AS retrying, \
           (SELECT count(*) FROM actix_outbox.outbox_events WHERE status = 'PROCESSING') AS processing, \
           (SELECT count(*) FROM actix_outbox.outbox_events WHERE status = 'DEAD_LETTER') AS dead_letter, \
           coalesce((SELECT extract(epoch FROM now() - created_at)::float8 FROM actix_outbox.outbox_events \
               WHERE status IN ('PENDING', 'RETRY_PENDING') ORDER BY seq LIMIT 1), 0) AS oldest_age, \
           (SELECT seq FROM actix_outbox.outbox_events WHERE status IN ('PENDING', 'RETRY_PENDING') \
               AND next_attempt_at <= now() ORDER BY seq LIMIT 1) AS head_seq, \
           (SELECT count(*) FROM actix_outbox.unrouted_events \
               WHERE published_at > now() - interval '1 hour') AS unrouted, \
           coalesce((SELECT array_agg(t) FROM (SELECT DISTINCT event_type AS t FROM actix_outbox.unrouted_events \
               WHERE published_at > now() - interval '1 hour' ORDER BY 1 LIMIT 5) x), '{}') \
               AS unrouted_types",
    )
    .get_result(conn)
    .await?;
    let gauges = OutboxGauges {
        pending: row.pending,
        retrying: row.retrying,
        processing: row.processing,
        dead_letter: row.dead_letter,
        oldest_pending_age_seconds: row.oldest_age.max(0.0),
        head_seq: row.head_seq,
        unrouted: row.unrouted,
        unrouted_types: row.unrouted_types,
        ..Default::default()
    };
    Ok((row.at, gauges))
}

#[derive(QueryableByName)]
struct ConsumerRow {
    #[diesel(sql_type = Text)]
    consumer: String,
    #[diesel(sql_type = Bool)]
    paused: bool,
    #[diesel(sql_type = BigInt)]
    backlog: i64,
    #[diesel(sql_type = BigInt)]
    retrying: i64,
    #[diesel(sql_type = BigInt)]
    due: i64,
    #[diesel(sql_type = Double)]
    oldest_due_age: f64,
    #[diesel(sql_type = Double)]
    oldest_in_flight_age: f64,
    #[diesel(sql_type = Double)]
    oldest_waiting_age: f64,
    #[diesel(sql_type = Nullable<BigInt>)]
    allowed_delay_ms: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    critical_delay_ms: Option<i64>,
    #[diesel(sql_type = BigInt)]
    dead_letter: i64,
    #[diesel(sql_type = BigInt)]
    unread: i64,
    #[diesel(sql_type = Double)]
    unread_age: f64,
}

/// The gauges of every consumer ever registered, in name order.
async fn consumer_gauges(conn: &mut AsyncPgConnection) -> Result<Vec<ConsumerGauges>> {
    let rows: Vec<ConsumerRow> = crate::store::sql(
        "SELECT s.consumer, s.paused AND (s.paused_until IS NULL OR s.paused_until > now()) \
             AS paused, \
           (SELECT count(*) FROM actix_outbox.inbox_events i WHERE i.consumer = s.consumer \
               AND i.status IN ('RECEIVED', 'RETRY_PENDING')) AS backlog, \
           (SELECT count(*) FROM actix_outbox.inbox_events i WHERE i.consumer = s.consumer \
               AND i.status = 'RETRY_PENDING') AS retrying, \
           (SELECT count(*) FROM actix_outbox.inbox_events i WHERE i.consumer = s.consumer \
               AND i.status IN ('RECEIVED', 'RETRY_PENDING') AND i.next_attempt_at <= now() \
               AND i.id NOT IN (SELECT unnest(l.ids) FROM actix_outbox.inbox_leases l \
                                WHERE l.consumer = s.consumer)) AS due, \
           coalesce((SELECT extract(epoch FROM now() - min(i.next_attempt_at))::float8 \
               FROM actix_outbox.inbox_events i WHERE i.consumer = s.consumer \
               AND i.status IN ('RECEIVED', 'RETRY_PENDING') AND i.next_attempt_at <= now() \
               AND i.id NOT IN (SELECT unnest(l.ids) FROM actix_outbox.inbox_leases l \
                                WHERE l.consumer = s.consumer)), 0) AS oldest_due_age, \
           coalesce((SELECT extract(epoch FROM now() - min(l.claimed_at))::float8 \
               FROM actix_outbox.inbox_leases l WHERE l.consumer = s.consumer), 0) AS oldest_in_flight_age, \
           coalesce((SELECT extract(epoch FROM now() - min(i.event_created_at))::float8 \
               FROM actix_outbox.inbox_events i WHERE i.consumer = s.consumer \
               AND i.status IN ('RECEIVED', 'RETRY_PENDING')), 0) AS oldest_waiting_age, \
           s.allowed_delay_ms, s.critical_delay_ms, \
           (SELECT count(*) FROM actix_outbox.inbox_events i WHERE i.consumer = s.consumer \
               AND i.status = 'DEAD_LETTER') AS dead_letter, \
           (SELECT coalesce(sum(cardinality(t.events) - CASE WHEN t.stamp = u.stamp \
                   THEN least(u.idx, cardinality(t.events)) ELSE 0 END), 0)::int8 \
               FROM actix_outbox.consumer_cursors k \
               CROSS JOIN LATERAL (SELECT coalesce(k.upto_stamp, k.stamp) AS stamp, \
                   coalesce(k.upto_idx, k.idx) AS idx) u \
               JOIN actix_outbox.log_stamps t ON t.part = k.part AND t.stamp >= u.stamp \
               WHERE k.consumer = s.consumer) AS unread, \
           coalesce((SELECT extract(epoch FROM now() - min(t.stamped_at))::float8 \
               FROM actix_outbox.consumer_cursors k \
               CROSS JOIN LATERAL (SELECT coalesce(k.upto_stamp, k.stamp) AS stamp, \
                   coalesce(k.upto_idx, k.idx) AS idx) u \
               JOIN actix_outbox.log_stamps t ON t.part = k.part AND t.stamp >= u.stamp \
               WHERE k.consumer = s.consumer \
                 AND (t.stamp, cardinality(t.events)) > (u.stamp, u.idx)), 0) AS unread_age \
         FROM actix_outbox.consumer_states s ORDER BY s.consumer",
    )
    .load(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| ConsumerGauges {
            consumer: r.consumer,
            paused: r.paused,
            // A cursor consumer's entries past its cursors (not held by a batch) are due:
            // counted from their stamps, whatever their type (an upper bound when several
            // cursor consumers subscribe to different types), since their publish.
            backlog: r.backlog + r.unread,
            retrying: r.retrying,
            due: r.due + r.unread,
            oldest_due_age_seconds: r.oldest_due_age.max(r.unread_age).max(0.0),
            oldest_in_flight_age_seconds: r.oldest_in_flight_age.max(0.0),
            oldest_waiting_age_seconds: r.oldest_waiting_age.max(r.unread_age).max(0.0),
            allowed_delay_seconds: r.allowed_delay_ms.map(|ms| ms as f64 / 1000.0),
            critical_delay_seconds: r.critical_delay_ms.map(|ms| ms as f64 / 1000.0),
            dead_letter: r.dead_letter,
            log_held_age_seconds: r.unread_age.max(0.0),
            ..Default::default()
        })
        .collect())
}

/// Records one sample with the health report made from it; returns its `sampled_at`
/// (the database clock, which every instance shares).
pub(crate) async fn insert_sample(
    conn: &mut AsyncPgConnection,
    instance: &str,
    interval: Duration,
    sample: &serde_json::Value,
    health: &serde_json::Value,
) -> Result<DateTime<Utc>> {
    #[derive(QueryableByName)]
    struct At {
        #[diesel(sql_type = Timestamptz)]
        sampled_at: DateTime<Utc>,
    }
    let at: At = crate::store::sql(
        "INSERT INTO actix_outbox.outbox_stats_samples (instance, interval_ms, sample, health) \
         VALUES ($1, $2, $3, $4) RETURNING sampled_at",
    )
    .bind::<Text, _>(instance)
    .bind::<BigInt, _>(store::millis(interval))
    .bind::<Jsonb, _>(sample)
    .bind::<Jsonb, _>(health)
    .get_result(conn)
    .await?;
    Ok(at.sampled_at)
}

#[derive(QueryableByName)]
struct SampleRow {
    #[diesel(sql_type = Jsonb)]
    sample: serde_json::Value,
}

/// The samples of the last `since`, at most `limit` of them, oldest first.
pub(crate) async fn recent_samples(
    conn: &mut AsyncPgConnection,
    since: Duration,
    limit: i64,
) -> Result<Vec<serde_json::Value>> {
    let mut rows: Vec<SampleRow> = crate::store::sql(
        "SELECT sample FROM actix_outbox.outbox_stats_samples \
         WHERE sampled_at > now() - $1 * interval '1 millisecond' \
         ORDER BY sampled_at DESC, id DESC LIMIT $2",
    )
    .bind::<BigInt, _>(store::millis(since))
    .bind::<BigInt, _>(limit)
    .load(conn)
    .await?;
    rows.reverse();
    Ok(rows.into_iter().map(|r| r.sample).collect())
}

/// The newest health report, with when it was made and how often its sampler runs.
#[cfg(feature = "admin")]
#[derive(Debug, QueryableByName)]
pub(crate) struct LatestHealth {
    #[diesel(sql_type = Jsonb)]
    pub health: serde_json::Value,
    #[diesel(sql_type = BigInt)]
    pub interval_ms: i64,
    /// Seconds since the sample was taken, by the database clock.
    #[diesel(sql_type = Double)]
    pub age_seconds: f64,
}

#[cfg(feature = "admin")]
pub(crate) async fn latest_health(conn: &mut AsyncPgConnection) -> Result<Option<LatestHealth>> {
    let rows: Vec<LatestHealth> = crate::store::sql(
        "SELECT health, interval_ms, \
             extract(epoch FROM now() - sampled_at)::float8 AS age_seconds \
         FROM actix_outbox.outbox_stats_samples ORDER BY sampled_at DESC, id DESC LIMIT 1",
    )
    .load(conn)
    .await?;
    Ok(rows.into_iter().next())
}

#[cfg(feature = "admin")]
#[derive(QueryableByName)]
struct ConsumerSums {
    #[diesel(sql_type = Text)]
    consumer: String,
    #[diesel(sql_type = BigInt)]
    duplicates: i64,
    #[diesel(sql_type = BigInt)]
    failed: i64,
    #[diesel(sql_type = BigInt)]
    processed: i64,
}

/// Duplicates, failed attempts and processed rows per consumer over the last `since`, summed
/// over every instance's samples: (consumer, duplicates, failed, processed).
#[cfg(feature = "admin")]
pub(crate) async fn consumer_sums(
    conn: &mut AsyncPgConnection,
    since: Duration,
) -> Result<Vec<(String, i64, i64, i64)>> {
    let rows: Vec<ConsumerSums> = crate::store::sql(
        "SELECT c->>'consumer' AS consumer, \
             coalesce(sum((c->>'duplicates')::int8), 0)::int8 AS duplicates, \
             coalesce(sum((c->>'failed')::int8), 0)::int8 AS failed, \
             coalesce(sum((c->>'processed')::int8), 0)::int8 AS processed \
         FROM actix_outbox.outbox_stats_samples s, jsonb_array_elements(s.sample->'consumers') c \
         WHERE s.sampled_at > now() - $1 * interval '1 millisecond' \
         GROUP BY 1 ORDER BY 1",
    )
    .bind::<BigInt, _>(store::millis(since))
    .load(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| (r.consumer, r.duplicates, r.failed, r.processed))
        .collect())
}

/// One point of a consumer's chart: a time bucket of the stats samples, over every instance.
#[cfg(feature = "admin")]
#[derive(Debug, Clone, PartialEq, QueryableByName)]
pub(crate) struct ChartPoint {
    #[diesel(sql_type = Text)]
    pub consumer: String,
    /// The bucket's start.
    #[diesel(sql_type = Timestamptz)]
    pub at: DateTime<Utc>,
    /// Events processed in the bucket, every instance's.
    #[diesel(sql_type = BigInt)]
    pub processed: i64,
    /// Each instance's processed count over the intervals its samples cover, summed over
    /// the instances.
    #[diesel(sql_type = Double)]
    pub per_second: f64,
    /// The largest backlog sampled in the bucket (a database-wide gauge: a maximum, not a sum).
    #[diesel(sql_type = BigInt)]
    pub backlog: i64,
    /// The largest age of the oldest due row sampled in the bucket.
    #[diesel(sql_type = Double)]
    pub oldest_due_age: f64,
    /// Instances with a sample in the bucket.
    #[diesel(sql_type = BigInt)]
    pub instances: i64,
    /// Samples read for the whole window, the same on every row.
    #[diesel(sql_type = BigInt)]
    samples: i64,
}

/// The charts' statement; `tests/it/ops.rs` asserts its plan.
#[cfg(feature = "admin")]
const CHART_SERIES: &str = include_str!("chart_series.sql");

/// Per-consumer chart series over the stats samples of the `window` up to the database's now.
#[cfg(feature = "admin")]
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ChartSeries {
    /// The window's end, the database's now: the x axis ends there.
    pub until: DateTime<Utc>,
    /// Samples read: at `limit`, the oldest part of the window was left out.
    pub samples: i64,
    /// Ordered by consumer, then time.
    pub points: Vec<ChartPoint>,
}

/// The charts of the last `window`, in buckets of `bucket` (whole seconds, at least one),
/// from at most `limit` samples, the newest; of one `consumer` or of all. See
/// `chart_series.sql` for how instances' samples combine.
#[cfg(feature = "admin")]
pub(crate) async fn chart_series(
    conn: &mut AsyncPgConnection,
    window: Duration,
    bucket: Duration,
    limit: i64,
    consumer: Option<&str>,
) -> Result<ChartSeries> {
    #[derive(QueryableByName)]
    struct Now {
        #[diesel(sql_type = Timestamptz)]
        now: DateTime<Utc>,
    }
    let Now { now } = crate::store::sql("SELECT now() AS now")
        .get_result(conn)
        .await?;
    let points: Vec<ChartPoint> = crate::store::sql(CHART_SERIES)
        .bind::<Timestamptz, _>(now)
        .bind::<BigInt, _>(store::millis(window))
        .bind::<BigInt, _>(bucket.as_secs().clamp(1, i64::MAX as u64) as i64)
        .bind::<BigInt, _>(limit)
        .bind::<Nullable<Text>, _>(consumer)
        .load(conn)
        .await?;
    Ok(ChartSeries {
        until: now,
        samples: points.as_slice().first().map_or(0, |p| p.samples),
        points,
    })
}

/// Deletes at most `batch` samples older than `older_than`.
pub(crate) async fn prune_samples(
    conn: &mut AsyncPgConnection,
    older_than: Duration,
    batch: i64,
) -> Result<usize> {
    let n = crate::store::sql(
        "DELETE FROM actix_outbox.outbox_stats_samples WHERE id IN ( \
             SELECT id FROM actix_outbox.outbox_stats_samples \
             WHERE sampled_at < now() - $1 * interval '1 millisecond' \
             ORDER BY sampled_at LIMIT $2)",
    )
    .bind::<BigInt, _>(store::millis(older_than))
    .bind::<BigInt, _>(batch)
    .execute(conn)
    .await?;
    Ok(n)
}
