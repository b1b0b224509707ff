//! The `bridge` scenario (issue 19): outbox → NATS JetStream → receiving inbox, end to end.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres NATS_URL=nats://127.0.0.1:4222 \
//!     cargo bench --features nats --bench bridge -- [--events N] [--rate N] [--json FILE]
//! ```
//!
//! How it measures:
//! - Two databases of its own on the server of `DATABASE_URL` (`ao_bench_<random>_src` and
//!   `_dst`), migrated, dropped at the end; a stream of its own (`BENCH_<random>`, file
//!   storage, as a deployment would have it), deleted at the end.
//! - The producing runtime publishes through `NatsTransport` (external route, leases, a
//!   publish acknowledged by the stream per event); the receiving runtime runs a `NatsReceiver`
//!   and one consumer whose handler writes an effect row in the inbox transaction. Both run in
//!   this process, on the main actix system.
//! - The producer runs on a thread of its own with its own connection: one business
//!   transaction per event (a business row and the event), as fast as it can, or `--rate N`
//!   per second. Each commit's instant and each handler's start are stored against one
//!   monotonic clock, in a slot per event (the event's number travels in its payload).
//! - Rate: events over the time from the first commit to the last effect committed (every
//!   handler started and no inbox row left open in the receiving database, polled every 5 ms).
//!   Latency: commit → handler start, p50 / p99 / max.

#[path = "../tests/common/url.rs"]
mod url;
use url::with_database;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_outbox::nats::{
    NatsReceiver, NatsReceiverConfig, NatsStream, NatsTransport, NatsTransportConfig,
};
use actix_outbox::transport::ExternalConfig;
use actix_outbox::{enqueue, ConsumerConfig, NewEvent, OutboxRuntime, RetryPolicy, RuntimeConfig};
use diesel::sql_types::{BigInt, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

struct Opts {
    events: usize,
    rate: Option<f64>,
    json: Option<String>,
}

fn opts() -> Res<Opts> {
    let mut o = Opts {
        events: 5_000,
        rate: None,
        json: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--events" => o.events = args.next().ok_or("--events N")?.parse()?,
            "--rate" => o.rate = Some(args.next().ok_or("--rate N")?.parse()?),
            "--json" => o.json = Some(args.next().ok_or("--json FILE")?),
            "--bench" => {}
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    Ok(o)
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Nanoseconds since `t0` (0 = not yet), per event.
struct Clock {
    t0: Instant,
    commit: Vec<AtomicU64>,
    start: Vec<AtomicU64>,
}

impl Clock {
    fn now(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

#[actix_rt::main]
async fn main() -> Res<()> {
    let o = opts()?;
    let base = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let tag = uuid::Uuid::now_v7().simple().to_string();
    let tag = &tag[tag.len() - 10..];
    let (src_db, dst_db) = (format!("ao_bench_{tag}_src"), format!("ao_bench_{tag}_dst"));
    let mut admin = AsyncPgConnection::establish(&base).await?;
    for db in [&src_db, &dst_db] {
        admin
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .await?;
    }
    let result = run(&o, &base, &nats_url, &src_db, &dst_db, tag).await;
    for db in [&src_db, &dst_db] {
        let _ = admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
            .await;
    }
    result
}

async fn run(
    o: &Opts,
    base: &str,
    nats_url: &str,
    src_db: &str,
    dst_db: &str,
    tag: &str,
) -> Res<()> {
    let (src_url, dst_url) = (with_database(base, src_db), with_database(base, dst_db));
    for url in [&src_url, &dst_url] {
        actix_outbox::migrate(url).await?;
        let mut c = AsyncPgConnection::establish(url).await?;
        c.batch_execute(
            "CREATE TABLE orders (id text PRIMARY KEY, n bigint NOT NULL);
             CREATE TABLE effects (n bigint NOT NULL, event_id uuid NOT NULL);",
        )
        .await?;
    }
    let stream = NatsStream::new(format!("BENCH_{tag}"));
    let client = actix_outbox::nats::connect(nats_url).await?;
    let transport =
        NatsTransport::new(client.clone(), NatsTransportConfig::new(stream.clone())).await?;
    let receiver = NatsReceiver::new(
        client.clone(),
        NatsReceiverConfig::new(stream.clone(), "bench"),
    )?;
    let clock = Arc::new(Clock {
        t0: Instant::now(),
        commit: (0..o.events).map(|_| AtomicU64::new(0)).collect(),
        start: (0..o.events).map(|_| AtomicU64::new(0)).collect(),
    });

    let dst_pool = actix_outbox::connect(&dst_url, 12).await?;
    let handler_clock = clock.clone();
    let receiving = OutboxRuntime::builder(dst_pool.clone())
        .config(RuntimeConfig::default())
        .consumer_fn(
            ConsumerConfig::new("bench")
                .subscribe("BENCH_EVENT")
                .retry(RetryPolicy::fixed(10, Duration::from_millis(50))),
            move |d| {
                let clock = handler_clock.clone();
                async move {
                    let n = d.payload()["n"].as_u64().unwrap_or(0) as usize;
                    if let Some(slot) = clock.start.get(n) {
                        let _ = slot.compare_exchange(
                            0,
                            clock.now(),
                            Ordering::Relaxed,
                            Ordering::Relaxed,
                        );
                    }
                    let mut conn = d.conn().await?;
                    actix_outbox::db::Prepared(
                        diesel::sql_query("INSERT INTO effects (n, event_id) VALUES ($1, $2)")
                            .bind::<BigInt, _>(n as i64)
                            .bind::<diesel::sql_types::Uuid, _>(d.event_id().as_uuid()),
                    )
                    .execute(&mut *conn)
                    .await?;
                    Ok(())
                }
            },
        )
        .nats_receiver(receiver)
        .start()
        .await?;
    let src_pool = actix_outbox::connect(&src_url, 12).await?;
    let producing = OutboxRuntime::builder(src_pool)
        .config(RuntimeConfig::default())
        .external_transport(transport, ExternalConfig::default())
        .start()
        .await?;
    let wake = producing.handle();

    // The producer: a thread and a runtime of its own, one business transaction per event.
    let (events, rate) = (o.events, o.rate);
    let producer_clock = clock.clone();
    let producer_url = src_url.clone();
    let producer = std::thread::spawn(move || -> Result<(), String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        rt.block_on(async move {
            let mut conn = AsyncPgConnection::establish(&producer_url)
                .await
                .map_err(|e| e.to_string())?;
            let started = Instant::now();
            for n in 0..events {
                if let Some(r) = rate {
                    let due = started + Duration::from_secs_f64(n as f64 / r);
                    tokio::time::sleep_until(due.into()).await;
                }
                let order = format!("o-{n}");
                conn.transaction::<_, actix_outbox::Error, _>(async |c| {
                    diesel::sql_query("INSERT INTO orders (id, n) VALUES ($1, $2)")
                        .bind::<Text, _>(&order)
                        .bind::<BigInt, _>(n as i64)
                        .execute(c)
                        .await?;
                    enqueue(
                        c,
                        &NewEvent::new("BENCH_EVENT", "order", &order, serde_json::json!({"n": n})),
                    )
                    .await?;
                    Ok(())
                })
                .await
                .map_err(|e| e.to_string())?;
                producer_clock.commit[n].store(producer_clock.now(), Ordering::Relaxed);
                wake.wake();
            }
            Ok(())
        })
    });

    // Done: every handler started and nothing open in the receiving inbox.
    let mut conn = dst_pool.get().await?;
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let started = clock.start.iter().all(|s| s.load(Ordering::Relaxed) != 0);
        if started {
            let open: Count = diesel::sql_query(
                "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status IN ('RECEIVED', 'RETRY_PENDING', 'PROCESSING')",
            )
            .get_result(&mut *conn)
            .await?;
            if open.n == 0 {
                break;
            }
        }
        if Instant::now() > deadline {
            return Err("not done within 600 s".into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let done = clock.now();
    drop(conn);
    producer
        .join()
        .map_err(|_| "the producer panicked")?
        .map_err(|e| format!("producer: {e}"))?;
    let first = clock
        .commit
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .min()
        .unwrap_or(0);
    let secs = (done - first) as f64 / 1e9;
    let mut lat: Vec<f64> = clock
        .commit
        .iter()
        .zip(&clock.start)
        .map(|(c, s)| (s.load(Ordering::Relaxed) as f64 - c.load(Ordering::Relaxed) as f64) / 1e6)
        .collect();
    lat.sort_by(|a, b| a.total_cmp(b));
    let (p50, p99, max) = (
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        lat.last().copied().unwrap_or(f64::NAN),
    );
    let mut c = dst_pool.get().await?;
    let effects: Count = diesel::sql_query("SELECT count(*) AS n FROM effects")
        .get_result(&mut *c)
        .await?;
    drop(c);
    let rate_s = o.events as f64 / secs;
    println!(
        "bridge: {} events{} in {secs:.2} s: {rate_s:.0} events/s end to end; commit → handler start p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms; {} effects",
        o.events,
        o.rate.map(|r| format!(" paced at {r}/s")).unwrap_or_default(),
        effects.n
    );
    if effects.n != o.events as i64 {
        return Err(format!("{} effects for {} events", effects.n, o.events).into());
    }
    if let Some(path) = &o.json {
        let v = serde_json::json!({
            "scenario": "bridge", "events": o.events, "rate_limit": o.rate,
            "seconds": secs, "events_per_s": rate_s, "p50_ms": p50, "p99_ms": p99, "max_ms": max,
        });
        std::fs::write(path, serde_json::to_string_pretty(&v)?)?;
    }
    producing.shutdown().await;
    receiving.shutdown().await;
    let js = async_nats::jetstream::new(client);
    let _ = js.delete_stream(stream.name()).await;
    Ok(())
}
