//! The delivery benchmark (issue 7): the peer harness's scenarios (`../shared/peers/node/
//! bench-common.mjs`) run against this library, plus fan-out and claim latency with history.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
//!     cargo bench --bench delivery -- [--scenario NAME[,NAME…]] [--json FILE] [--quick]
//! ```
//!
//! Scenarios: `drain`, `single`, `batched`, `paced`, `fanout`, `history`, `noisy-neighbour`
//! (all, in that order, by default). `--quick` puts 500,000 rows instead of 5,000,000 under
//! `history`. Tuning flags for experiments: `--events N`, `--consumer-batch N`, `--concurrency
//! N`, `--pipeline N`, `--threads N`, `--ordered`, `--cursor`, `--publish-batch N`, `--listen on|off`, `--publish-gap-us N`.
//! `--beside-blocking` adds, to every scenario's runtime, a consumer of the same events that
//! blocks its thread 200 ms per event. `--hold-snapshot` has another session hold a `REPEATABLE READ` snapshot open for the whole
//! of `drain` (issue 30: a held snapshot stops vacuum, and each claim walks the dead entries of
//! what was already delivered). `--handler batch`
//! registers the consumers as batch consumers (`OutboxBuilder::batch_consumer`), which write a
//! whole batch's effect rows in one statement; the default, `--handler each`, writes one
//! effect row per handler call.
//! `--producer statement` (the default) writes each one-event business transaction as one
//! `enqueue_with` statement; `--producer transaction` as `BEGIN`, the business insert
//! pipelined with `enqueue`, and `COMMIT`.
//!
//! How it measures:
//! - The benchmark creates its own database `ao_bench_<random>` on the server of
//!   `DATABASE_URL`, migrates it, adds a business table and an effects table, and drops it at
//!   the end. Tables are truncated between scenarios, so every scenario starts on fresh tables.
//! - The producer runs on its own arbiter thread with its own connection, like an actix-web
//!   worker next to the runtime's system; the runtime and its actors run on the main system.
//! - Latency is in-process: the producer stores the instant each business transaction's
//!   COMMIT returned, the handler stores the instant it started, both against one monotonic
//!   clock, in a slot per event (the event's number travels in its payload). A latency can be
//!   slightly negative when the publisher sees the commit before the producer does.
//! - "Done" is the peers' rule: every handler has started (seen in-process) and no inbox row
//!   is left RECEIVED, RETRY_PENDING or PROCESSING (leased to a batch whose handlers run or
//!   whose marks have not committed yet; polled every 5 ms). An effect commits with its inbox
//!   row's PROCESSED mark, so that is "last effect committed".
//! - WAL bytes are the server-wide `pg_current_wal_lsn()` difference over the scenario divided
//!   by the events, as the peers measure it: anything else the server writes meanwhile counts
//!   too. "this db" is the share of this benchmark's database, read with `pg_walinspect` when
//!   the extension is available (n/a otherwise).
//! - The handler writes its effect with a `diesel::sql_query` wrapped in `actix_outbox::db::Prepared`
//!   (prepared once per connection), as the crate's quick start does; the batch handler writes
//!   its batch's effects with one such `INSERT … SELECT … FROM unnest(…)`.
//! - `history` times the claim statement itself: `src/store/claim.sql`, the file the library
//!   includes, run alone in autocommit (the publisher pipelines it with BEGIN, its plan
//!   settings and COMMIT in one round trip) — 1,000 polls with nothing due, and 1,000 claims of
//!   one just-committed event that fan it out to one consumer —
//!   first on an empty table, then with N PUBLISHED rows (one `INSERT … SELECT
//!   generate_series`, then `VACUUM ANALYZE` and `CHECKPOINT`, so that writing out the bulk
//!   insert's dirty pages does not land in the claims' p99). Then the same claims again in
//!   turns, 100 on an empty twin database and 100 on the one with history, ten times: on a
//!   noisy machine a slow spell can last a whole phase, and taking turns puts it on both
//!   sides (the line's `interleaved` ratio). Timing an idle runtime's publish cycles would
//!   add the actor hops and the pool check-out to the figure and hide what the table size does.
//! - `noisy-neighbour` asks what an always-failing consumer costs a healthy one beside it: a
//!   backlog of `--events` (written as `drain` writes it, runtime stopped) is drained by the
//!   healthy consumer alone, then again with a second consumer subscribed to the same event
//!   type whose handler always returns `HandlerError::retry` (`RetryPolicy::fixed(1000,
//!   200 ms)`: it is still failing when the drain ends) and writes nothing. Both on one runtime,
//!   then on two `OutboxRuntime`s on the same database in this process, each with its own pool
//!   and running every consumer (as two instances would). The healthy consumer's drain time
//!   (from the runtimes' start to its "done") is timed; the ratio is with the neighbour / alone
//!   (1.0 = no cost). A third drain, beside a quiet neighbour (subscribed alike, succeeding at
//!   once, writing nothing), gives the cost of a second subscription alone: the publisher fans
//!   every event out twice, which a batch handler's drain feels most. The ratio "over the quiet
//!   neighbour" is the cost of failing. A fourth drain is beside a neighbour whose handler
//!   blocks its thread for 200 ms per event (`std::thread::sleep`, as a synchronous client
//!   would): handlers run on threads of their own, so its ratio should stay near the quiet
//!   neighbour's. Each of the eight drains starts on fresh tables.
//! - Peak RSS is this process's `VmHWM`, reset through `/proc/self/clear_refs` before each
//!   scenario (if the kernel refuses, it is the peak since the start and says so).

#[path = "../tests/common/url.rs"]
mod url;
use url::with_database;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use actix_outbox::{
    db::Prepared, enqueue, enqueue_many, enqueue_with, ConsumerConfig, Delivery, DeliveryBatch,
    HandlerError, NewEvent, OutboxBuilder, OutboxHandle, OutboxRuntime, PgPool, RetryPolicy,
    RuntimeConfig,
};
use diesel::sql_types::{Array, BigInt, Double, Nullable, Text, Uuid as SqlUuid};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use serde_json::{json, Value};

type BoxError = Box<dyn std::error::Error>;
type Res<T> = Result<T, BoxError>;

const EVENT_TYPE: &str = "ORDER_PLACED";
/// Longest wait for one scenario's deliveries before it is reported incomplete.
const SCENARIO_LIMIT: Duration = Duration::from_secs(300);
/// `RuntimeConfig::default()`'s `publish_batch_size`, the claim size `history` times unless
/// `--publish-batch` says otherwise.
const DEFAULT_PUBLISH_BATCH: u32 = 1000;
const ALL: &[&str] = &[
    "drain",
    "single",
    "batched",
    "paced",
    "fanout",
    "history",
    "noisy-neighbour",
];

// ------------------------------------------------------------------------------- options

#[derive(Debug, Clone)]
struct Opts {
    scenarios: Vec<String>,
    json: Option<String>,
    quick: bool,
    events: usize,
    paced_events: usize,
    paced_rate: f64,
    batch_per_tx: usize,
    history_rows: u64,
    /// `--publish-batch`; the library's default unless given.
    publish_batch: Option<u32>,
    consumer_batch: u32,
    concurrency: u32,
    listen: Option<bool>,
    /// `RuntimeConfig::publish_gap` (`--publish-gap-us`), the default unless given.
    publish_gap: Option<Duration>,
    /// Batch consumers (`--handler batch`) instead of one event per handler call.
    batch_handler: bool,
    /// `ConsumerConfig::pipeline` (`--pipeline N`): deliveries a one-event handler gets at once.
    pipeline: u32,
    /// `--threads N`: the consumers' handler threads (default: theirs, `concurrency`).
    threads: Option<u32>,
    /// `ConsumerConfig::ordered` (`--ordered`): each aggregate's events in enqueue order.
    ordered: bool,
    /// `ConsumerConfig::cursor` (`--cursor`): storage v2's first step, no inbox row per event.
    cursor: bool,
    /// `--hold-snapshot`: during `drain`, another session holds a `REPEATABLE READ` snapshot
    /// open from before the runtime starts until the drain is done, as a long report or
    /// `pg_dump` would: vacuum can then remove nothing the drain leaves dead.
    hold_snapshot: bool,
    /// `--beside-blocking`: every scenario's runtime also runs a consumer of the same events
    /// whose handler blocks its thread 200 ms per event (the `noisy-neighbour`'s `Blocking`),
    /// to see what it costs the others' latency.
    beside_blocking: bool,
    /// One-event business transactions as one `enqueue_with` statement (`--producer
    /// statement`, the default) or as `BEGIN`, the pipelined insert and `enqueue`, `COMMIT`.
    one_statement: bool,
    /// `--payload-bytes N`: each event's payload padded with a string of N bytes (0: none), for
    /// what a payload's size does to the WAL.
    payload_bytes: usize,
}

impl Opts {
    fn parse() -> Res<Opts> {
        let mut o = Opts {
            scenarios: Vec::new(),
            json: None,
            quick: false,
            events: 20_000,
            paced_events: 2_000,
            paced_rate: 200.0,
            batch_per_tx: 500,
            history_rows: 5_000_000,
            publish_batch: None,
            // Set after the arguments, by handler kind, unless given.
            consumer_batch: 0,
            concurrency: 0,
            listen: None,
            publish_gap: None,
            batch_handler: false,
            pipeline: 1,
            threads: None,
            ordered: false,
            cursor: false,
            hold_snapshot: false,
            beside_blocking: false,
            one_statement: true,
            payload_bytes: 0,
        };
        let mut args = std::env::args().skip(1);
        while let Some(a) = args.next() {
            let (key, inline) = match a.split_once('=') {
                Some((k, v)) => (k.to_owned(), Some(v.to_owned())),
                None => (a.clone(), None),
            };
            let mut value = || -> Res<String> {
                inline
                    .clone()
                    .or_else(|| args.next())
                    .ok_or_else(|| format!("{key} needs a value").into())
            };
            match key.as_str() {
                // `cargo bench` passes `--bench` to every bench binary.
                "--bench" => {}
                "--quick" => o.quick = true,
                "--scenario" | "--scenarios" => o.scenarios.extend(
                    value()?
                        .split(',')
                        .filter(|s| !s.is_empty())
                        .map(str::to_owned),
                ),
                "--json" => o.json = Some(value()?),
                "--events" => o.events = value()?.parse()?,
                "--payload-bytes" => o.payload_bytes = value()?.parse()?,
                "--publish-batch" => o.publish_batch = Some(value()?.parse()?),
                "--consumer-batch" => o.consumer_batch = value()?.parse()?,
                "--concurrency" => o.concurrency = value()?.parse()?,
                "--pipeline" => o.pipeline = value()?.parse()?,
                "--threads" => o.threads = Some(value()?.parse()?),
                "--ordered" => o.ordered = true,
                "--cursor" => o.cursor = true,
                "--hold-snapshot" => o.hold_snapshot = true,
                "--beside-blocking" => o.beside_blocking = true,
                "--listen" => o.listen = Some(value()? != "off"),
                "--publish-gap-us" => {
                    o.publish_gap = Some(Duration::from_micros(value()?.parse()?))
                }
                "--handler" => {
                    o.batch_handler = match value()?.as_str() {
                        "each" => false,
                        "batch" => true,
                        other => return Err(format!("--handler each|batch, not {other}").into()),
                    }
                }
                "--producer" => {
                    o.one_statement = match value()?.as_str() {
                        "statement" => true,
                        "transaction" => false,
                        other => {
                            return Err(
                                format!("--producer statement|transaction, not {other}").into()
                            )
                        }
                    }
                }
                other => return Err(format!("unknown argument {other}").into()),
            }
        }
        if o.scenarios.is_empty() {
            o.scenarios = ALL.iter().map(|s| s.to_string()).collect();
        }
        if let Some(bad) = o.scenarios.iter().find(|s| !ALL.contains(&s.as_str())) {
            return Err(format!("unknown scenario {bad}; known: {}", ALL.join(", ")).into());
        }
        if o.quick {
            o.history_rows = 500_000;
        }
        // Measured here (2 cores): one event per call is bound by its round trips per row, so
        // four loops of 250 rows (more connections in flight) drained fastest. A batch handler
        // has one round trip per batch; then more loops only contend for the two cores, and
        // one loop of 2,000 rows drained fastest (~10 % above 1,000: fewer commits, each
        // waiting for its WAL flush).
        let (batch, concurrency) = if o.batch_handler { (2000, 1) } else { (250, 4) };
        if o.consumer_batch == 0 {
            o.consumer_batch = batch;
        }
        if o.concurrency == 0 {
            o.concurrency = concurrency;
        }
        Ok(o)
    }

    fn runtime_config(&self) -> RuntimeConfig {
        let mut c = RuntimeConfig::default();
        if let Some(n) = self.publish_batch {
            c = c.publish_batch_size(n);
        }
        if let Some(gap) = self.publish_gap {
            c = c.publish_gap(gap);
        }
        // Wake-ups carry the load; the poll is only the backstop.
        c = c.poll_interval(Duration::from_millis(100));
        // Nothing to reconcile here; keep its queries out of the figures.
        c = c.reconcile_interval(Duration::from_secs(3600));
        c = c.shutdown_timeout(Duration::from_secs(10));
        // On by default: several instances are the normal case. Off, a single instance saves
        // the NOTIFY the publisher sends after each fan-out.
        if let Some(listen) = self.listen {
            c = c.listen(listen);
        }
        c
    }

    fn consumer_config(&self, name: &str) -> ConsumerConfig {
        let cfg = ConsumerConfig::new(name)
            .subscribe(EVENT_TYPE)
            .batch_size(self.consumer_batch)
            .concurrency(self.concurrency)
            .pipeline(self.pipeline)
            .ordered(self.ordered)
            .cursor(self.cursor)
            .mailbox_capacity(64)
            .poll_interval(Duration::from_millis(100));
        match self.threads {
            Some(n) => cfg.threads(n),
            None => cfg,
        }
    }

    /// Room for every runtime connection of the largest scenario (fan-out: three consumers),
    /// as `OutboxRuntime::builder` asks: publisher, listener, stats, reconciler, the
    /// consumers' batches, and the benchmark's own monitor. The producer has its own.
    fn pool_size(&self) -> u32 {
        6 + 3 * self.concurrency
    }

    fn describe(&self) -> String {
        let rc = self.runtime_config();
        format!(
            "config | pool {} | runtime: {rc:?} | consumer: batch_size {} concurrency \
             {} pipeline {} ordered {} cursor {} poll 100ms mailbox 64 handler {} | producer: own thread + connection, {} events ({} per tx \
             batched; one-event tx as {}; payload padding {} B), paced {} at {}/s | history {} rows",
            self.pool_size(),
            self.consumer_batch,
            self.concurrency,
            self.pipeline,
            self.ordered,
            self.cursor,
            if self.batch_handler { "batch" } else { "each" },
            self.events,
            self.batch_per_tx,
            if self.one_statement { "one statement" } else { "BEGIN…COMMIT" },
            self.payload_bytes,
            self.paced_events,
            self.paced_rate,
            self.history_rows
        )
    }
}

// ----------------------------------------------------------------------------- tracking

/// In its own module: `RunQueryDsl::load` would shadow the atomics' `load` where it is in scope.
mod tracking {
    use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    const UNSET: i64 = i64::MIN;

    /// Commit and handler-start instants, in nanoseconds since `origin`, one slot per event (and
    /// per consumer for the starts).
    pub struct Track {
        origin: Instant,
        commits: Vec<AtomicI64>,
        starts: Vec<Vec<AtomicI64>>,
        started: Vec<AtomicUsize>,
        duplicates: AtomicUsize,
    }

    impl Track {
        pub fn new(events: usize, consumers: usize) -> Arc<Track> {
            let slots = |n: usize| (0..n).map(|_| AtomicI64::new(UNSET)).collect::<Vec<_>>();
            Arc::new(Track {
                origin: Instant::now(),
                commits: slots(events),
                starts: (0..consumers).map(|_| slots(events)).collect(),
                started: (0..consumers).map(|_| AtomicUsize::new(0)).collect(),
                duplicates: AtomicUsize::new(0),
            })
        }

        pub fn now(&self) -> i64 {
            self.origin.elapsed().as_nanos() as i64
        }

        pub fn committed(&self, event: usize, at: i64) {
            self.commits[event].store(at, Ordering::Relaxed);
        }

        pub fn handler_started(&self, consumer: usize, event: usize, at: i64) {
            let Some(slot) = self.starts[consumer].get(event) else {
                return;
            };
            if slot
                .compare_exchange(UNSET, at, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                self.started[consumer].fetch_add(1, Ordering::Relaxed);
            } else {
                self.duplicates.fetch_add(1, Ordering::Relaxed);
            }
        }

        pub fn all_started(&self, consumer: usize) -> bool {
            self.started[consumer].load(Ordering::Relaxed) == self.commits.len()
        }

        /// Commit → handler start, in ms, for every (consumer, event) seen on both sides.
        pub fn latencies(&self) -> (Vec<f64>, usize) {
            let mut out = Vec::with_capacity(self.commits.len() * self.starts.len());
            let mut missing = 0;
            for starts in &self.starts {
                for (c, s) in self.commits.iter().zip(starts) {
                    let (c, s) = (c.load(Ordering::Relaxed), s.load(Ordering::Relaxed));
                    if c == UNSET || s == UNSET {
                        missing += 1;
                    } else {
                        out.push((s - c) as f64 / 1e6);
                    }
                }
            }
            out.sort_by(f64::total_cmp);
            (out, missing)
        }

        pub fn duplicates(&self) -> usize {
            self.duplicates.load(Ordering::Relaxed)
        }
    }
}

use tracking::Track;

/// The consumer: records its start, then writes one effect row in the delivery's transaction.
struct Sink {
    track: Arc<Track>,
    index: usize,
    name: Arc<str>,
}

impl Actor for Sink {
    type Context = Context<Self>;
}

impl Handler<Delivery> for Sink {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
        let at = self.track.now();
        if let Some(n) = d.payload().get("n").and_then(Value::as_u64) {
            self.track.handler_started(self.index, n as usize, at);
        }
        let name = self.name.clone();
        Box::pin(async move {
            // Shared: with `--pipeline N`, the N deliveries handed over at once pipeline their
            // inserts; with 1 (the default) it is the connection alone, as `conn()` gives it.
            let conn = d.shared_conn().await?;
            Prepared(
                diesel::sql_query(
                    "INSERT INTO bench_effects (consumer, event_id, order_id) VALUES ($1, $2, $3)",
                )
                .bind::<Text, _>(&*name)
                .bind::<SqlUuid, _>(d.event_id().as_uuid())
                .bind::<Text, _>(d.aggregate_id()),
            )
            .execute(&mut &*conn)
            .await?;
            Ok(())
        })
    }
}

/// The batch consumer: records each event's start, then writes the batch's effect rows in one
/// statement in the batch's transaction.
impl Handler<DeliveryBatch> for Sink {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, b: DeliveryBatch, _: &mut Context<Self>) -> Self::Result {
        let at = self.track.now();
        let mut ids = Vec::with_capacity(b.len());
        let mut orders = Vec::with_capacity(b.len());
        for d in b.deliveries() {
            if let Some(n) = d.payload().get("n").and_then(Value::as_u64) {
                self.track.handler_started(self.index, n as usize, at);
            }
            ids.push(d.event_id().as_uuid());
            orders.push(d.aggregate_id().to_owned());
        }
        let name = self.name.clone();
        Box::pin(async move {
            let mut conn = b.conn().await?;
            Prepared(
                diesel::sql_query(
                    "INSERT INTO bench_effects (consumer, event_id, order_id) \
                     SELECT $1, e, o FROM unnest($2::uuid[], $3::text[]) AS t(e, o)",
                )
                .bind::<Text, _>(&*name)
                .bind::<Array<SqlUuid>, _>(&ids)
                .bind::<Array<Text>, _>(&orders),
            )
            .execute(&mut *conn)
            .await?;
            Ok(())
        })
    }
}

// ------------------------------------------------------------------------------ database

const SCHEMA: &str = "
    CREATE TABLE bench_orders (
        id           text        PRIMARY KEY,
        status       text        NOT NULL,
        amount_cents bigint      NOT NULL,
        created_at   timestamptz NOT NULL DEFAULT now()
    );
    CREATE TABLE bench_effects (
        id         bigserial   PRIMARY KEY,
        consumer   text        NOT NULL,
        event_id   uuid        NOT NULL,
        order_id   text        NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now()
    );";

/// Every table a scenario writes, emptied so the next one starts on fresh tables.
const RESET: &str =
    "TRUNCATE actix_outbox.outbox_events, actix_outbox.inbox_events, actix_outbox.consumer_subscriptions, actix_outbox.consumer_states, \
     actix_outbox.outbox_stats_samples, actix_outbox.log_stamps, actix_outbox.consumer_cursors, \
     actix_outbox.inbox_leases, bench_orders, bench_effects RESTART IDENTITY CASCADE";

#[derive(QueryableByName)]
struct Lsn {
    #[diesel(sql_type = Text)]
    lsn: String,
}

#[derive(QueryableByName)]
struct Num {
    #[diesel(sql_type = Double)]
    n: f64,
}

#[derive(QueryableByName)]
struct PerConsumer {
    #[diesel(sql_type = Text)]
    consumer: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
}

async fn wal_lsn(conn: &mut AsyncPgConnection) -> Res<String> {
    let r: Lsn = diesel::sql_query("SELECT pg_current_wal_lsn()::text AS lsn")
        .get_result(conn)
        .await?;
    Ok(r.lsn)
}

async fn wal_since(conn: &mut AsyncPgConnection, from: &str) -> Res<f64> {
    let r: Num =
        diesel::sql_query("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::float8 AS n")
            .bind::<Text, _>(from)
            .get_result(conn)
            .await?;
    Ok(r.n)
}

/// The WAL written over one measurement. A temporary replication slot (dropped at the end, or
/// with the session) keeps the server from recycling those segments at a checkpoint before
/// `pg_walinspect` has read them: on a busy server a checkpoint comes every few seconds.
struct WalWindow {
    from: String,
    slot: Option<String>,
}

impl WalWindow {
    async fn open(conn: &mut AsyncPgConnection) -> Res<WalWindow> {
        let slot = format!("ao_bench_{}", uuid::Uuid::new_v4().simple());
        let held = diesel::sql_query("SELECT pg_create_physical_replication_slot($1, true, true)")
            .bind::<Text, _>(&slot)
            .execute(conn)
            .await
            .is_ok();
        Ok(WalWindow {
            from: wal_lsn(conn).await?,
            slot: held.then_some(slot),
        })
    }

    /// (bytes written by the whole server, bytes of this database's records).
    async fn close(self, conn: &mut AsyncPgConnection) -> Res<(f64, Option<f64>)> {
        let server = wal_since(conn, &self.from).await;
        let db = wal_of_this_db(conn, &self.from).await;
        if let Some(slot) = &self.slot {
            diesel::sql_query("SELECT pg_drop_replication_slot($1)")
                .bind::<Text, _>(slot)
                .execute(conn)
                .await?;
        }
        Ok((server?, db))
    }
}

/// This database's share of the WAL written since `from`: every record of a transaction that
/// touched one of its blocks (its commit record included), plus the records without a
/// transaction on its blocks (pruning, hint-bit page images). The server-wide figure also
/// counts whatever else the server runs meanwhile (another test suite's `CREATE DATABASE`
/// alone writes megabytes). `None` without `pg_walinspect` or once the WAL is recycled.
async fn wal_of_this_db(conn: &mut AsyncPgConnection, from: &str) -> Option<f64> {
    let r: Result<Num, _> = diesel::sql_query(
        "WITH me AS (SELECT '%/' || oid || '/%' AS blocks FROM pg_database \
                     WHERE datname = current_database()), \
              r AS (SELECT xid, record_length, block_ref \
                    FROM pg_get_wal_records_info($1::pg_lsn, pg_current_wal_flush_lsn())), \
              mine AS (SELECT DISTINCT xid FROM r, me \
                       WHERE xid <> 0 AND block_ref LIKE me.blocks) \
         SELECT coalesce(sum(record_length), 0)::float8 AS n FROM r, me \
         WHERE xid IN (SELECT xid FROM mine) OR (xid = 0 AND block_ref LIKE me.blocks)",
    )
    .bind::<Text, _>(from)
    .get_result(conn)
    .await;
    r.map_err(|e| tracing::warn!(error = %e, "no per-database WAL figure"))
        .ok()
        .map(|r| r.n)
}

async fn number(conn: &mut AsyncPgConnection, sql: &str) -> Res<f64> {
    let r: Num = diesel::sql_query(sql).get_result(conn).await?;
    Ok(r.n)
}

// ------------------------------------------------------------------------------ process

/// Forgets the peak RSS so far, so the next reading is this scenario's. False if the kernel
/// does not allow it.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// `VmHWM` in MiB.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}

/// Runs `f` on a new arbiter thread (an actix-web worker's position) and returns its output.
async fn on_own_thread<F, Fut, T>(f: F) -> T
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = T> + 'static,
    T: Send + 'static,
{
    let arbiter = Arbiter::new();
    let (tx, rx) = tokio::sync::oneshot::channel();
    arbiter.spawn_fn(move || {
        actix_rt::spawn(async move {
            let _ = tx.send(f().await);
        });
    });
    let out = rx
        .await
        .expect("the producer thread ended without a result");
    arbiter.stop();
    out
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[idx.clamp(1, sorted.len()) - 1]
}

fn lat_json(sorted: &[f64], missing: usize) -> Value {
    json!({
        "p50_ms": percentile(sorted, 50.0),
        "p90_ms": percentile(sorted, 90.0),
        "p99_ms": percentile(sorted, 99.0),
        "max_ms": sorted.last().copied().unwrap_or(f64::NAN),
        "min_ms": sorted.first().copied().unwrap_or(f64::NAN),
        "missing": missing,
    })
}

fn lat_text(sorted: &[f64], with_max: bool) -> String {
    let mut s = format!(
        "lat p50 {:.1} ms p90 {:.1} ms p99 {:.1} ms",
        percentile(sorted, 50.0),
        percentile(sorted, 90.0),
        percentile(sorted, 99.0)
    );
    if with_max {
        s.push_str(&format!(
            " max {:.1} ms",
            sorted.last().copied().unwrap_or(f64::NAN)
        ));
    }
    s
}

// ----------------------------------------------------------------------------- producer

#[derive(Clone, Copy)]
struct Produce {
    events: usize,
    per_tx: usize,
    /// Events per second, one per transaction; `None` for as fast as possible.
    rate: Option<f64>,
    /// One-event transactions as one statement (see `Opts::one_statement`).
    one_statement: bool,
    /// See `Opts::payload_bytes`.
    payload_bytes: usize,
}

/// One business transaction: `BEGIN`, the business rows pipelined with their events, `COMMIT`.
async fn transaction(
    conn: &mut AsyncPgConnection,
    ids: &[String],
    events: &[NewEvent],
    first: usize,
    last: usize,
) -> Result<(), String> {
    conn.transaction::<_, actix_outbox::Error, _>(async |conn| {
        let conn: &AsyncPgConnection = conn;
        if events.len() == 1 {
            let order = Prepared(
                diesel::sql_query(
                    "INSERT INTO bench_orders (id, status, amount_cents) VALUES ($1, 'PLACED', $2)",
                )
                .bind::<Text, _>(&ids[0])
                .bind::<BigInt, _>(first as i64 * 100),
            );
            futures_util::try_join!(
                async { Ok(order.execute(&mut &*conn).await?) },
                enqueue(conn, &events[0])
            )?;
        } else {
            let amounts: Vec<i64> = (first..last).map(|n| n as i64 * 100).collect();
            let orders = diesel::sql_query(
                "INSERT INTO bench_orders (id, status, amount_cents) \
                 SELECT id, 'PLACED', amount FROM unnest($1::text[], $2::int8[]) AS t(id, amount)",
            )
            .bind::<Array<Text>, _>(ids)
            .bind::<Array<BigInt>, _>(&amounts);
            futures_util::try_join!(
                async { Ok(orders.execute(&mut &*conn).await?) },
                enqueue_many(conn, events)
            )?;
        }
        Ok(())
    })
    .await
    .map_err(|e| e.to_string())
}

/// Writes `p.events` business rows and their events, `p.per_tx` per transaction, recording
/// each commit in `track` and waking the runtime after it. Returns (first BEGIN, last COMMIT)
/// in the track's clock and the number of transactions.
async fn produce(
    url: String,
    track: Arc<Track>,
    p: Produce,
    wake: Option<OutboxHandle>,
) -> Result<(i64, i64, usize), String> {
    let mut conn = AsyncPgConnection::establish(&url)
        .await
        .map_err(|e| e.to_string())?;
    let start = track.now();
    let mut txs = 0;
    for first in (0..p.events).step_by(p.per_tx) {
        let last = (first + p.per_tx).min(p.events);
        if let Some(rate) = p.rate {
            let due = start + (first as f64 * 1e9 / rate) as i64;
            let wait = due - track.now();
            if wait > 0 {
                actix_rt::time::sleep(Duration::from_nanos(wait as u64)).await;
            }
        }
        let ids: Vec<String> = (first..last).map(|i| format!("o-{i}")).collect();
        let events: Vec<NewEvent> = ids
            .iter()
            .zip(first..last)
            .map(|(id, n)| {
                let mut payload = json!({"n": n, "order_id": id, "amount_cents": n * 100});
                if p.payload_bytes > 0 {
                    payload["pad"] = json!("x".repeat(p.payload_bytes));
                }
                NewEvent::new(EVENT_TYPE, "order", id.as_str(), payload)
            })
            .collect();
        if events.len() == 1 && p.one_statement {
            // The business row and its event in one statement: the whole transaction in one
            // round trip.
            let order = Prepared(
                diesel::sql_query(
                    "INSERT INTO bench_orders (id, status, amount_cents) VALUES ($1, 'PLACED', $2) \
                     RETURNING id",
                )
                .bind::<Text, _>(&ids[0])
                .bind::<BigInt, _>(first as i64 * 100),
            );
            let written = enqueue_with(&conn, order, &events)
                .await
                .map_err(|e| e.to_string())?;
            if !written {
                return Err(format!("order {} was not written", ids[0]));
            }
        } else {
            // The business rows and their events are pipelined: one round trip between BEGIN
            // and COMMIT.
            transaction(&mut conn, &ids, &events, first, last).await?;
        }
        let at = track.now();
        for n in first..last {
            track.committed(n, at);
        }
        txs += 1;
        if let Some(h) = &wake {
            h.wake();
        }
    }
    Ok((start, track.now(), txs))
}

struct Ctx {
    url: String,
    pool: PgPool,
    opts: Opts,
    rss_resets: bool,
}

/// Registers `make`'s actors as consumer `cfg`, in the handler shape `--handler` chose.
fn with_handler<A, F>(b: OutboxBuilder, batch: bool, cfg: ConsumerConfig, make: F) -> OutboxBuilder
where
    A: Actor<Context = Context<A>> + Handler<Delivery> + Handler<DeliveryBatch>,
    F: Fn() -> A + Send + Sync + 'static,
{
    if batch {
        b.batch_consumer(cfg, make)
    } else {
        b.consumer(cfg, make)
    }
}

// One file per scenario (or family of them).
#[path = "delivery/events.rs"]
mod events;
#[path = "delivery/history.rs"]
mod history;
#[path = "delivery/noisy.rs"]
mod noisy;
use events::*;
use history::*;
use noisy::*;

// --------------------------------------------------------------------------------- main

async fn run_all(ctx: &Ctx) -> Vec<Value> {
    let mut results = Vec::new();
    for name in &ctx.opts.scenarios {
        let reset = async {
            let mut conn = ctx.pool.get().await?;
            conn.batch_execute(RESET).await?;
            Ok::<_, BoxError>(())
        };
        let outcome = match reset.await {
            Err(e) => Err(e),
            Ok(()) => {
                reset_peak_rss();
                match name.as_str() {
                    "single" => run_events(ctx, Kind::Single).await,
                    "batched" => run_events(ctx, Kind::Batched).await,
                    "drain" => run_events(ctx, Kind::Drain).await,
                    "paced" => run_events(ctx, Kind::Paced).await,
                    "fanout" => run_events(ctx, Kind::Fanout).await,
                    "noisy-neighbour" => run_noisy(ctx).await,
                    _ => run_history(ctx).await,
                }
            }
        };
        match outcome {
            Ok((line, value)) => {
                println!("{line}");
                results.push(value);
            }
            Err(e) => {
                println!("{name:<8}| ERROR {e}");
                results.push(json!({"scenario": name, "error": e.to_string()}));
            }
        }
        // Let the server settle between scenarios, as the peer harness does.
        actix_rt::time::sleep(Duration::from_millis(200)).await;
    }
    results
}

#[actix_rt::main]
async fn main() -> Res<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let opts = Opts::parse()?;
    let server = std::env::var("DATABASE_URL")
        .map_err(|_| "set DATABASE_URL to a PostgreSQL server URL (its database is not used)")?;
    let db = format!("ao_bench_{}", uuid::Uuid::new_v4().simple());
    let mut admin = AsyncPgConnection::establish(&server).await?;
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await?;
    let url = with_database(&server, &db);
    println!("{}", opts.describe());

    let started = Instant::now();
    let setup = async {
        actix_outbox::migrate(&url).await?;
        let pool = actix_outbox::connect(&url, opts.pool_size()).await?;
        let mut conn = pool.get().await?;
        conn.batch_execute(SCHEMA).await?;
        // Optional: attributes WAL to this database (needs a superuser; the figure is then
        // reported as n/a).
        let _ = conn
            .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            .await;
        drop(conn);
        Ok::<_, BoxError>(pool)
    };
    let outcome = match setup.await {
        Ok(pool) => {
            let ctx = Ctx {
                url: url.clone(),
                pool,
                opts: opts.clone(),
                rss_resets: reset_peak_rss(),
            };
            let results = run_all(&ctx).await;
            drop(ctx);
            Ok(results)
        }
        Err(e) => Err(e),
    };
    // The database goes whatever happened; FORCE ends connections a runtime may still hold.
    let dropped = admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await;
    let results = outcome?;
    dropped?;
    if let Some(path) = &opts.json {
        let report = json!({
            "library": "actix-outbox",
            "config": opts.describe(),
            "results": results,
            "wall_seconds": started.elapsed().as_secs_f64(),
            "at_unix": std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}
