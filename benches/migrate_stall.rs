//! The migration-stall benchmark: the longest enqueue stall while `migrate()` applies the
//! latest migrations to a large install under enqueue load. Goal: ≤ 1 s. Figures only; it
//! asserts nothing.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
//!     cargo bench --bench migrate_stall -- [--rows N] [--tasks K] [--gap-ms N] \
//!     [--round quiet,reader,snapshot,late]
//! ```
//!
//! How it measures:
//! - It creates a database `ao_bench_stall_<random>` on the server of `DATABASE_URL`
//!   (default `postgres://postgres@127.0.0.1:5432/postgres`), migrates it up to
//!   `20261202000016` with `migrate_with(…, until)`, and fills it with `--rows` (1,000,000)
//!   PUBLISHED outbox rows and as many PROCESSED inbox rows of one consumer (with its
//!   `consumer_states` and `consumer_subscriptions` rows), each table in one
//!   `INSERT … SELECT … generate_series`, then `VACUUM ANALYZE` and `CHECKPOINT`.
//! - Each round runs on a fresh copy of that database (`CREATE DATABASE … TEMPLATE …
//!   STRATEGY FILE_COPY`, dropped after the round), so every round starts from the same
//!   filled install at 16. All of them are dropped at the end, whatever happened.
//! - The load: `--tasks` (4) loops, each `enqueue` of one event in a transaction of its own on
//!   a pooled connection (`actix_outbox::connect`, one connection per loop), then a pause of
//!   `--gap-ms` (10 ms), so the load stays modest (~300 commits/s on a 2-core machine) while
//!   a call is nearly always in flight. Each call's latency runs from before the pool
//!   check-out to the commit's return, stored with its start instant.
//! - After 3 s of load, `migrate_with(…, MigrateConfig::default())` applies 17, 18 and 19,
//!   timed; the load runs on until 2 s after it returns. A call is "during the migration" if
//!   it overlaps the migration's interval at all; the others are the baseline.
//! - A monitor polls `pg_stat_activity` (and `pg_stat_progress_create_index`) every 100 ms for
//!   what the migration's session is doing (it connects with `application_name =
//!   ao_bench_stall_migrate`), and for how many other sessions of the database wait on a lock:
//!   a timeline of the migration, and whether an enqueue ever queued behind it.
//! - Rounds: `quiet` (the load only); `reader`: another session runs `BEGIN; SELECT count(*)
//!   FROM actix_outbox.outbox_events WHERE status = 'PUBLISHED'` just before the migration and
//!   keeps the transaction open 5 s (READ COMMITTED, as an application's report would);
//!   `snapshot`: the same in `REPEATABLE READ`, which keeps its snapshot open as `pg_dump` does,
//!   so that `CREATE INDEX CONCURRENTLY` must wait for it; `late`: a `REPEATABLE READ`
//!   transaction that reads one outbox row, opened once the migration has begun building the
//!   outbox's index and kept open 5 s: the build then fails on its lock timeout, and the
//!   invalid index it leaves must be dropped while the reader still holds its lock on the
//!   table.

#[path = "../tests/common/url.rs"]
mod url;
use url::with_database;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_outbox::db::{migrate_with, MigrateConfig, MigrateReport};
use actix_outbox::{enqueue, NewEvent, PgPool};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use serde_json::json;
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

type BoxError = Box<dyn std::error::Error>;
type Res<T> = Result<T, BoxError>;

const DEFAULT_SERVER: &str = "postgres://postgres@127.0.0.1:5432/postgres";
/// The install the benchmark upgrades: every migration up to this one.
const BEFORE: &str = "20261202000016";
const GOAL: Duration = Duration::from_secs(1);
const WARM: Duration = Duration::from_secs(3);
const TAIL: Duration = Duration::from_secs(2);
const READER_HOLD: Duration = Duration::from_secs(5);
const MONITOR_EVERY: Duration = Duration::from_millis(100);
const MIGRATE_APP: &str = "ao_bench_stall_migrate";
const CONSUMER: &str = "bench-consumer";
const EVENT_TYPE: &str = "ORDER_PLACED";
const ROUNDS: &[&str] = &["quiet", "reader", "snapshot", "late"];

// ------------------------------------------------------------------------------- options

struct Opts {
    rows: u64,
    tasks: usize,
    gap: Duration,
    rounds: Vec<String>,
}

impl Opts {
    fn parse() -> Res<Opts> {
        let mut o = Opts {
            rows: 1_000_000,
            tasks: 4,
            gap: Duration::from_millis(10),
            rounds: Vec::new(),
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
                "--rows" => o.rows = value()?.parse()?,
                "--tasks" => o.tasks = value()?.parse()?,
                "--gap-ms" => o.gap = Duration::from_millis(value()?.parse()?),
                "--round" | "--rounds" => o.rounds.extend(
                    value()?
                        .split(',')
                        .filter(|s| !s.is_empty())
                        .map(str::to_owned),
                ),
                other => return Err(format!("unknown argument {other}").into()),
            }
        }
        if o.rounds.is_empty() {
            o.rounds = ROUNDS.iter().map(|s| s.to_string()).collect();
        }
        if let Some(bad) = o.rounds.iter().find(|r| !ROUNDS.contains(&r.as_str())) {
            return Err(format!("unknown round {bad}; known: {}", ROUNDS.join(", ")).into());
        }
        if o.tasks == 0 {
            return Err("--tasks must be at least 1".into());
        }
        Ok(o)
    }
}

// -------------------------------------------------------------------------------- helpers

/// `url` with `application_name` set, so that the monitor can find the session.
fn with_application_name(url: &str, name: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={name}")
}

/// A plain client for the benchmark's own statements, its connection driven in the
/// background.
async fn client(url: &str) -> Res<Client> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    actix_rt::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// The first column of the first row of `sql`, as text ("" for NULL or no row).
async fn scalar(client: &Client, sql: &str) -> Res<String> {
    for m in client.simple_query(sql).await? {
        if let SimpleQueryMessage::Row(r) = m {
            return Ok(r.get(0).unwrap_or("").to_owned());
        }
    }
    Ok(String::new())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The `q` quantile of sorted `v` (nearest rank), in ms.
fn quantile(v: &[Duration], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    ms(v[rank - 1])
}

// ------------------------------------------------------------------------------------ fill

/// Migrates `url` up to [`BEFORE`] and writes the history; returns how long the fill took.
async fn build_install(url: &str, rows: u64) -> Res<Duration> {
    let report = migrate_with(
        url,
        &MigrateConfig {
            until: Some(BEFORE.into()),
            ..Default::default()
        },
    )
    .await?;
    println!(
        "install | migrated to {BEFORE}: {} migrations applied",
        report.applied.len()
    );
    let started = Instant::now();
    let mut conn = AsyncPgConnection::establish(url).await?;
    // Ids as the library makes them (time-ordered, uuid v7 layout), a second apart, the
    // newest now; the inbox row of each event as one consumer processed it.
    conn.batch_execute(&format!(
        "INSERT INTO actix_outbox.consumer_states (consumer) VALUES ('{CONSUMER}');
         INSERT INTO actix_outbox.consumer_subscriptions (consumer, event_type)
             VALUES ('{CONSUMER}', '{EVENT_TYPE}');
         INSERT INTO actix_outbox.outbox_events (id, event_type, aggregate_type, aggregate_id,
             payload, correlation_id, status, attempt_count, next_attempt_at, published_at,
             created_at, updated_at)
         SELECT (lpad(to_hex(1700000000000 + g), 12, '0') || '70008000'
                 || lpad(to_hex(g), 12, '0'))::uuid,
             '{EVENT_TYPE}', 'order', 'o-' || g,
             jsonb_build_object('order_id', 'o-' || g, 'status', 'PLACED'), 'c-' || g,
             'PUBLISHED', 1, t, t, t, t
         FROM generate_series(1, {rows}) AS g,
             LATERAL (SELECT now() - ({rows} - g) * interval '1 second' AS t) AS at;
         INSERT INTO actix_outbox.inbox_events (event_id, consumer, event_type, event_version,
             aggregate_type, aggregate_id, payload, correlation_id, event_created_at, status,
             attempt_count, next_attempt_at, received_at, processed_at, updated_at, event_seq)
         SELECT id, '{CONSUMER}', event_type, 1, aggregate_type, aggregate_id, payload,
             correlation_id, created_at, 'PROCESSED', 1, created_at, created_at, created_at,
             created_at, seq
         FROM actix_outbox.outbox_events ORDER BY seq;"
    ))
    .await?;
    // One statement each: VACUUM runs outside a transaction block.
    for st in [
        "VACUUM ANALYZE actix_outbox.outbox_events",
        "VACUUM ANALYZE actix_outbox.inbox_events",
        "ANALYZE actix_outbox.consumer_states",
        "ANALYZE actix_outbox.consumer_subscriptions",
        "CHECKPOINT",
    ] {
        conn.batch_execute(st).await?;
    }
    Ok(started.elapsed())
}

// ------------------------------------------------------------------------------------ load

/// One enqueue: when it started (from the round's origin) and how long it took.
#[derive(Clone, Copy)]
struct Call {
    start: Duration,
    took: Duration,
}

struct LoadResult {
    calls: Vec<Call>,
    errors: usize,
    first_error: Option<String>,
}

async fn enqueue_loop(
    pool: PgPool,
    task: usize,
    gap: Duration,
    origin: Instant,
    stop: Arc<AtomicBool>,
) -> LoadResult {
    let mut out = LoadResult {
        calls: Vec::with_capacity(16_384),
        errors: 0,
        first_error: None,
    };
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let aggregate = format!("bench-{task}-{i}");
        let event = NewEvent::new(
            EVENT_TYPE,
            "order",
            aggregate.as_str(),
            json!({ "order_id": aggregate, "status": "PLACED" }),
        );
        let t0 = Instant::now();
        let result = async {
            let mut conn = pool.get().await.map_err(|e| e.to_string())?;
            conn.transaction::<_, actix_outbox::Error, _>(async |c| {
                enqueue(c, &event).await?;
                Ok(())
            })
            .await
            .map_err(|e| e.to_string())
        }
        .await;
        let took = t0.elapsed();
        match result {
            Ok(()) => out.calls.push(Call {
                start: t0 - origin,
                took,
            }),
            Err(e) => {
                out.errors += 1;
                out.first_error.get_or_insert(e);
            }
        }
        actix_rt::time::sleep(gap).await;
    }
    out
}

// --------------------------------------------------------------------------------- monitor

struct Monitor {
    /// (offset from the round's origin, what the migration's session did) at each change.
    timeline: Vec<(Duration, String)>,
    /// The most other sessions of the database seen waiting on a lock at once, and when.
    max_lock_waiters: (i64, Duration),
}

async fn monitor(url: String, origin: Instant, stop: Arc<AtomicBool>) -> Res<Monitor> {
    let c = client(&url).await?;
    let sql = format!(
        "SELECT (SELECT CASE WHEN a.wait_event_type = 'Lock' \
                     THEN 'waits for a lock (' || a.wait_event || ')' ELSE 'runs' END \
                 || coalesce(' [' || p.phase || ']', '') || ': ' \
                 || left(regexp_replace(regexp_replace(a.query, '^(\\s*--[^\\n]*\\n)*\\s*', ''), \
                     '\\s+', ' ', 'g'), 110) \
             FROM pg_stat_activity a LEFT JOIN pg_stat_progress_create_index p ON p.pid = a.pid \
             WHERE a.application_name = '{MIGRATE_APP}' AND a.state = 'active' LIMIT 1), \
         (SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND wait_event_type = 'Lock' AND application_name <> '{MIGRATE_APP}')"
    );
    let mut m = Monitor {
        timeline: Vec::new(),
        max_lock_waiters: (0, Duration::ZERO),
    };
    let mut last = String::from("(none)");
    while !stop.load(Ordering::Relaxed) {
        let at = origin.elapsed();
        for msg in c.simple_query(&sql).await? {
            if let SimpleQueryMessage::Row(r) = msg {
                let doing = r.get(0).unwrap_or("idle").to_owned();
                let waiters: i64 = r.get(1).unwrap_or("0").parse().unwrap_or(0);
                if waiters > m.max_lock_waiters.0 {
                    m.max_lock_waiters = (waiters, at);
                }
                if doing != last {
                    m.timeline.push((at, doing.clone()));
                    last = doing;
                }
            }
        }
        actix_rt::time::sleep(MONITOR_EVERY).await;
    }
    Ok(m)
}

// ----------------------------------------------------------------------------------- round

struct RoundResult {
    name: String,
    took: Duration,
    report: Result<MigrateReport, String>,
    during: Window,
    baseline: Window,
    longest_gap_during: Duration,
    worst_at: Option<Duration>,
    errors: usize,
    first_error: Option<String>,
    lock_waiters: (i64, Duration),
    /// When the reader's transaction opened and closed, in seconds from the migration's start.
    reader: Option<(f64, f64)>,
    invalid_left: String,
    versions: String,
}

struct Window {
    n: usize,
    seconds: f64,
    max: f64,
    p50: f64,
    p99: f64,
}

impl Window {
    fn of(mut took: Vec<Duration>, seconds: f64) -> Window {
        took.sort();
        Window {
            n: took.len(),
            seconds,
            max: took.last().map_or(f64::NAN, |d| ms(*d)),
            p50: quantile(&took, 0.50),
            p99: quantile(&took, 0.99),
        }
    }

    fn line(&self) -> String {
        format!(
            "{} enqueues in {:.1} s ({:.0}/s), p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            self.n,
            self.seconds,
            self.n as f64 / self.seconds.max(1e-9),
            self.p50,
            self.p99,
            self.max
        )
    }
}

async fn run_round(
    name: &str,
    server: &mut AsyncPgConnection,
    server_url: &str,
    template: &str,
    opts: &Opts,
) -> Res<RoundResult> {
    let db = format!("{template}_{name}");
    let copied = Instant::now();
    server
        .batch_execute(&format!(
            "CREATE DATABASE {db} TEMPLATE {template} STRATEGY FILE_COPY"
        ))
        .await?;
    println!(
        "{name} | fresh copy of the install: {db} ({:.1} s)",
        copied.elapsed().as_secs_f64()
    );
    let url = with_database(server_url, &db);
    let result = measure(name, &url, opts).await;
    server
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await?;
    result
}

async fn measure(name: &str, url: &str, opts: &Opts) -> Res<RoundResult> {
    let pool = actix_outbox::connect(url, opts.tasks as u32).await?;
    // Open every connection before the clock starts.
    {
        let mut held = Vec::new();
        for _ in 0..opts.tasks {
            held.push(pool.get().await.map_err(|e| e.to_string())?);
        }
    }
    let origin = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let loads: Vec<_> = (0..opts.tasks)
        .map(|task| {
            actix_rt::spawn(enqueue_loop(
                pool.clone(),
                task,
                opts.gap,
                origin,
                stop.clone(),
            ))
        })
        .collect();
    let watcher = actix_rt::spawn(monitor(url.to_owned(), origin, stop.clone()));
    actix_rt::time::sleep(WARM).await;

    // The long reader, if any. `reader` and `snapshot`: its read done and its transaction
    // open when the migration starts; `late`: opened once the migration builds the outbox's
    // index. Committed READER_HOLD after it began.
    let migrated = Arc::new(AtomicBool::new(false));
    let reader = match name {
        "reader" | "snapshot" => {
            let c = client(url).await?;
            let begin = if name == "snapshot" {
                "BEGIN ISOLATION LEVEL REPEATABLE READ"
            } else {
                "BEGIN"
            };
            let opened = origin.elapsed();
            c.batch_execute(begin).await?;
            let n = scalar(
                &c,
                "SELECT count(*) FROM actix_outbox.outbox_events WHERE status = 'PUBLISHED'",
            )
            .await?;
            println!(
                "{name} | reader: {begin}; counted {n} PUBLISHED rows in {:.0} ms; open for {} s",
                ms(origin.elapsed() - opened),
                READER_HOLD.as_secs()
            );
            Some(actix_rt::spawn(async move {
                let left = READER_HOLD.saturating_sub(origin.elapsed() - opened);
                actix_rt::time::sleep(left).await;
                let _ = c.batch_execute("COMMIT").await;
                Ok::<_, String>(Some((opened, origin.elapsed())))
            }))
        }
        "late" => {
            let c = client(url).await?;
            let migrated = migrated.clone();
            Some(actix_rt::spawn(async move {
                let e = |e: tokio_postgres::Error| e.to_string();
                let building = "SELECT count(*) FROM pg_stat_progress_create_index \
                     WHERE relid = 'actix_outbox.outbox_events'::regclass";
                while scalar(&c, building).await.map_err(|e| e.to_string())? == "0" {
                    if migrated.load(Ordering::Relaxed) {
                        return Ok(None);
                    }
                    actix_rt::time::sleep(Duration::from_millis(20)).await;
                }
                let opened = origin.elapsed();
                c.batch_execute(
                    "BEGIN ISOLATION LEVEL REPEATABLE READ; \
                     SELECT 1 FROM actix_outbox.outbox_events LIMIT 1",
                )
                .await
                .map_err(e)?;
                actix_rt::time::sleep(READER_HOLD).await;
                c.batch_execute("COMMIT").await.map_err(e)?;
                Ok(Some((opened, origin.elapsed())))
            }))
        }
        _ => None,
    };

    let migrate_url = with_application_name(url, MIGRATE_APP);
    let mig_start = origin.elapsed();
    let report = migrate_with(&migrate_url, &MigrateConfig::default())
        .await
        .map_err(|e| e.to_string());
    let mig_end = origin.elapsed();
    migrated.store(true, Ordering::Relaxed);
    let reader_span = match reader {
        Some(r) => r.await?.map_err(|e| format!("the reader failed: {e}"))?,
        None => None,
    };
    let rest = (mig_end + TAIL).saturating_sub(origin.elapsed());
    actix_rt::time::sleep(rest).await;
    stop.store(true, Ordering::Relaxed);

    let mut calls = Vec::new();
    let (mut errors, mut first_error) = (0, None);
    for l in loads {
        let r = l.await?;
        calls.extend(r.calls);
        errors += r.errors;
        if first_error.is_none() {
            first_error = r.first_error;
        }
    }
    let seen = watcher.await??;
    let end = origin.elapsed();

    let check = client(url).await?;
    let invalid_left = scalar(
        &check,
        "SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
         JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = 'actix_outbox' AND NOT i.indisvalid",
    )
    .await?;
    let versions = scalar(
        &check,
        "SELECT count(*) || ', last ' || max(version) FROM actix_outbox.schema_migrations",
    )
    .await?;
    drop(check);
    drop(pool);

    let overlaps = |c: &Call| c.start < mig_end && c.start + c.took > mig_start;
    let (inside, outside): (Vec<Call>, Vec<Call>) = calls.iter().partition(|c| overlaps(c));
    let worst_at = inside
        .iter()
        .max_by_key(|c| c.took)
        .map(|c| c.start.saturating_sub(mig_start));
    // The longest time without any commit returning, during the migration.
    let mut ends: Vec<Duration> = calls.iter().map(|c| c.start + c.took).collect();
    ends.push(mig_start);
    ends.push(mig_end);
    ends.sort();
    let longest_gap_during = ends
        .windows(2)
        .filter(|w| w[0] >= mig_start && w[1] <= mig_end)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();

    let mut timeline = seen.timeline;
    timeline.retain(|(at, _)| *at + MONITOR_EVERY >= mig_start && *at <= mig_end);
    println!("{name} | the migration as the monitor saw it (every 100 ms, from its start):");
    let shown = 40;
    for (at, doing) in timeline.iter().take(shown) {
        println!(
            "{name} |   {:>7.1} s  {doing}",
            at.as_secs_f64() - mig_start.as_secs_f64()
        );
    }
    if timeline.len() > shown {
        println!("{name} |   … {} more changes", timeline.len() - shown);
    }

    Ok(RoundResult {
        name: name.to_owned(),
        took: mig_end - mig_start,
        report,
        during: Window::of(
            inside.iter().map(|c| c.took).collect(),
            (mig_end - mig_start).as_secs_f64(),
        ),
        baseline: Window::of(
            outside.iter().map(|c| c.took).collect(),
            (end - (mig_end - mig_start)).as_secs_f64(),
        ),
        longest_gap_during,
        worst_at,
        errors,
        first_error,
        lock_waiters: (
            seen.max_lock_waiters.0,
            seen.max_lock_waiters.1.saturating_sub(mig_start),
        ),
        reader: reader_span.map(|(a, b): (Duration, Duration)| {
            let from = |d: Duration| d.as_secs_f64() - mig_start.as_secs_f64();
            (from(a), from(b))
        }),
        invalid_left,
        versions,
    })
}

fn print(r: &RoundResult) {
    let n = &r.name;
    match &r.report {
        Ok(rep) => println!(
            "{n} | migration: {:.2} s, applied {:?}, lock_retries {}, moved_from_public {}",
            r.took.as_secs_f64(),
            rep.applied,
            rep.lock_retries,
            rep.moved_from_public
        ),
        Err(e) => println!(
            "{n} | migration FAILED after {:.2} s: {e}",
            r.took.as_secs_f64()
        ),
    }
    println!(
        "{n} | afterwards: schema_migrations {}, invalid indexes left {}",
        r.versions, r.invalid_left
    );
    if let Some((from, to)) = r.reader {
        println!(
            "{n} | reader's transaction open from {from:+.2} s to {to:+.2} s of the migration's start"
        );
    }
    println!("{n} | during the migration: {}", r.during.line());
    println!("{n} | baseline (outside it): {}", r.baseline.line());
    println!(
        "{n} | longest stall during the migration: {:.1} ms (call started {:.2} s into it); \
         longest span without a commit returning: {:.1} ms; sessions waiting on a lock at once: \
         {} (max, at {:.1} s); enqueue errors: {}{}",
        r.during.max,
        r.worst_at.unwrap_or_default().as_secs_f64(),
        ms(r.longest_gap_during),
        r.lock_waiters.0,
        r.lock_waiters.1.as_secs_f64(),
        r.errors,
        r.first_error
            .as_deref()
            .map_or(String::new(), |e| format!(" (first: {e})"))
    );
    let pass = r.report.is_ok() && r.errors == 0 && r.during.max <= ms(GOAL);
    println!(
        "{n} | goal: longest enqueue stall ≤ {:.0} ms: {} ({:.1} ms)",
        ms(GOAL),
        if pass { "PASS" } else { "MISS" },
        r.during.max
    );
}

// ------------------------------------------------------------------------------------ main

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
    let server_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_SERVER.to_owned());
    let template = format!("ao_bench_stall_{}", uuid::Uuid::new_v4().simple());
    let mut server = AsyncPgConnection::establish(&server_url).await?;
    let started = Instant::now();
    println!(
        "config | {} outbox + {} inbox rows | load: {} enqueue loops, one event per \
         transaction, {} ms pause between calls | warm {} s, tail {} s | goal: stall ≤ {} s | \
         rounds: {}",
        opts.rows,
        opts.rows,
        opts.tasks,
        opts.gap.as_millis(),
        WARM.as_secs(),
        TAIL.as_secs(),
        GOAL.as_secs(),
        opts.rounds.join(", ")
    );
    server
        .batch_execute(&format!("CREATE DATABASE {template}"))
        .await?;

    let outcome = async {
        let url = with_database(&server_url, &template);
        let fill = build_install(&url, opts.rows).await?;
        let size = scalar(
            &client(&url).await?,
            "SELECT pg_size_pretty(pg_total_relation_size('actix_outbox.outbox_events')) || ' + ' \
             || pg_size_pretty(pg_total_relation_size('actix_outbox.inbox_events'))",
        )
        .await?;
        println!(
            "install | filled in {:.1} s (with VACUUM ANALYZE, CHECKPOINT); outbox + inbox: {size}",
            fill.as_secs_f64()
        );
        let mut results = Vec::new();
        for name in &opts.rounds {
            let r = run_round(name, &mut server, &server_url, &template, &opts).await?;
            print(&r);
            results.push(r);
        }
        Ok::<_, BoxError>(results)
    }
    .await;
    // The install goes whatever happened (a round's copy is dropped by its round).
    let dropped = server
        .batch_execute(&format!("DROP DATABASE IF EXISTS {template} WITH (FORCE)"))
        .await;
    let results = outcome?;
    dropped?;
    println!("summary | round | migration s | lock_retries | stall max ms | p50 / p99 ms during | p50 / p99 ms baseline | goal");
    for r in &results {
        println!(
            "summary | {} | {:.2} | {} | {:.1} | {:.1} / {:.1} | {:.1} / {:.1} | {}",
            r.name,
            r.took.as_secs_f64(),
            r.report
                .as_ref()
                .map_or("failed".to_owned(), |rep| rep.lock_retries.to_string()),
            r.during.max,
            r.during.p50,
            r.during.p99,
            r.baseline.p50,
            r.baseline.p99,
            if r.report.is_ok() && r.errors == 0 && r.during.max <= ms(GOAL) {
                "PASS"
            } else {
                "MISS"
            }
        );
    }
    println!("total | {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}
