//! An order service built on actix-outbox: the system under load in `scripts/demo`.
//!
//! - `POST /orders`, `POST /orders/{id}/status`, `GET /orders/{id}`: each change writes the
//!   order, an audit row and an `ORDER_STATUS_CHANGED` event in one transaction.
//! - Consumers: `notification` turns each status change into a `notification_jobs` row, guarded
//!   by the business key `notification:{order}:{status}`; `analytics`, a batch consumer,
//!   counts changes per status with one upsert per batch.
//! - Each job's sending is a side effect: the library's worker calls a fake provider with the
//!   notification's key, outside any inbox transaction (`worker.rs`).
//! - A reconcile rule gives COMPLETED orders that have no COMPLETED notification one, through
//!   the same business key.
//! - `GET /stats` reports what the demo needs; `GET /health` says the service is up.
//! - Bodies are JSON (`Content-Type: application/json`, at most 16 KiB). Every refusal is a
//!   JSON 4xx `{"error": {"code", "message"}}` with a stable code, and writes nothing; the
//!   bodies, headers and codes are in `wire.rs`, which the demo's load driver
//!   (`examples/demo_load`) shares.
//! - With `ADMIN_TOKEN` set: the library's operator API, dashboard (`/admin/`), lag health and
//!   Prometheus metrics under `/admin`.
//! - With `NATS_URL` set (built with `--features nats`): events are published to the JetStream
//!   stream `NATS_STREAM` (default `ORDERS`) through `NatsTransport`, for other services
//!   (`examples/shipping_service`). This service's own consumers then receive them back through
//!   a `NatsReceiver` of their own (durable consumer `order_service`), into this database's
//!   inbox: one route for every consumer, so they keep working as before, and wait with
//!   everyone else while NATS is down.
//!
//! - With `CURSOR=1`: both consumers read through their cursors (`ConsumerConfig::cursor`,
//!   storage v2's first step, experimental), with inbox rows only for exceptions. The
//!   in-process route only: events received through NATS still get inbox rows.
//!
//! Configuration (environment): `DATABASE_URL` (required), `BIND` (default `127.0.0.1:8080`),
//! `ADMIN_TOKEN`, `PROVIDER_FAIL_RATE` and `CONSUMER_FAIL_RATE` (0.0–1.0, default 0),
//! `RECONCILE_WINDOW_MS` (default 5000), `CURSOR`, `NATS_URL`, `NATS_STREAM`, `RUST_LOG`.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/orders cargo run --example order_service
//! ```
//!
//! It creates what it needs at start-up and may be killed at any moment: everything it knows
//! is in PostgreSQL.

mod api;
mod consumers;
#[path = "../common/logging.rs"]
mod logging;
mod reconcile;
mod rng;
mod stats;
mod wire;
mod worker;

use std::process::ExitCode;
use std::time::Duration;

use actix_outbox::{
    admin::admin_scope, admin::AdminConfig, ConsumerConfig, OutboxRuntime, PgPool, RetryPolicy,
    RuntimeConfig,
};
use actix_web::{web, App, HttpServer};
use diesel::sql_types::BigInt;
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};

const SCHEMA: &str = include_str!("schema.sql");

/// Serialises the schema script between instances starting at once: `CREATE TABLE IF NOT
/// EXISTS` is not safe against a concurrent create of the same table.
const SCHEMA_LOCK_KEY: i64 = 0x6f72_6465_7273_7663; // "ordersvc"

/// The event every status change (including creation) writes.
pub const ORDER_STATUS_CHANGED: &str = "ORDER_STATUS_CHANGED";

struct Config {
    database_url: String,
    bind: String,
    admin_token: Option<String>,
    provider_fail_rate: f64,
    consumer_fail_rate: f64,
    reconcile_window: Duration,
    cursor: bool,
}

impl Config {
    fn from_env() -> Result<Config, String> {
        let database_url = std::env::var("DATABASE_URL")
            .map_err(|_| "DATABASE_URL must be set (postgres://user@host:port/db)".to_owned())?;
        let reconcile_window_ms = match std::env::var("RECONCILE_WINDOW_MS") {
            Ok(v) => v
                .parse::<u64>()
                .map_err(|_| format!("RECONCILE_WINDOW_MS={v:?} is not a number of ms"))?,
            Err(_) => 5000,
        };
        Ok(Config {
            database_url,
            bind: std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:8080".into()),
            admin_token: std::env::var("ADMIN_TOKEN").ok().filter(|t| !t.is_empty()),
            provider_fail_rate: rate("PROVIDER_FAIL_RATE")?,
            consumer_fail_rate: rate("CONSUMER_FAIL_RATE")?,
            reconcile_window: Duration::from_millis(reconcile_window_ms),
            cursor: std::env::var("CURSOR").is_ok_and(|v| v == "1"),
        })
    }
}

fn rate(name: &str) -> Result<f64, String> {
    match std::env::var(name) {
        Err(_) => Ok(0.0),
        Ok(v) => match v.parse::<f64>() {
            Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
            _ => Err(format!("{name}={v:?} must be a number within 0.0..=1.0")),
        },
    }
}

#[actix_web::main]
async fn main() -> ExitCode {
    logging::init();
    logging::exit(run().await, "order service")
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let cfg = Config::from_env()?;
    rng::seed();

    actix_outbox::migrate(&cfg.database_url).await?;
    // Two pools on purpose. A pooled connection's I/O task lives on the runtime that opened it,
    // and every actix-web worker is a runtime of its own that stops with the HTTP server, before
    // the outbox runtime drains. The outbox's actors therefore get a pool only they (on this,
    // the main runtime) ever open connections from.
    let outbox_pool = actix_outbox::connect(&cfg.database_url, 12).await?;
    let http_pool = actix_outbox::connect(&cfg.database_url, 16).await?;
    // The consumers' handler-call counter changes a session setting; see consumers.rs.
    let metrics_pool = actix_outbox::connect(&cfg.database_url, 4).await?;
    apply_schema(&outbox_pool).await?;

    let runtime_cfg = RuntimeConfig::default()
        .shutdown_timeout(Duration::from_secs(10))
        .reconcile_interval(Duration::from_secs(10))
        .consistency_window(Duration::from_secs(30));

    let (fail_rate, provider_fail_rate) = (cfg.consumer_fail_rate, cfg.provider_fail_rate);
    let notification = ConsumerConfig::new("notification")
        .subscribe(ORDER_STATUS_CHANGED)
        // A job insert is cheap and independent per order: retry soon, many times.
        .retry(
            RetryPolicy::default()
                .max_attempts(10)
                .base(Duration::from_millis(100))
                .factor(2.0)
                .cap(Duration::from_secs(5))
                .jitter(0.2),
        )
        .batch_size(50)
        .concurrency(2)
        .cursor(cfg.cursor);
    // Analytics is one hot row per status: a batch consumer (one upsert per status per batch),
    // a single batch at a time, retried at a steady pace.
    let analytics = ConsumerConfig::new("analytics")
        .subscribe(ORDER_STATUS_CHANGED)
        .retry(RetryPolicy::fixed(10, Duration::from_millis(250)))
        .batch_size(200)
        .cursor(cfg.cursor);

    // The operator API, dashboard, health and Prometheus metrics under /admin, when a token is
    // configured (at least 16 characters). Its queries use the HTTP handlers' pool, not the
    // runtime's, which is sized for the runtime's loops (docs/operations.md). Checked before
    // anything starts, so that a bad token stops the service before it runs.
    let prometheus = actix_outbox::admin::install_prometheus_recorder()?;
    let admin = match cfg.admin_token.as_deref() {
        Some(token) => Some(
            AdminConfig::new(http_pool.clone())
                .bearer_token("ops", token)?
                .metrics(prometheus),
        ),
        None => None,
    };

    let builder = OutboxRuntime::builder(outbox_pool.clone()).config(runtime_cfg);
    let builder = match std::env::var("NATS_URL").ok().filter(|u| !u.is_empty()) {
        Some(url) => through_nats(builder, &url).await?,
        None => builder,
    };
    let runtime = builder
        .consumer(notification, {
            let metrics_pool = metrics_pool.clone();
            move || consumers::NotificationConsumer::new(metrics_pool.clone(), fail_rate)
        })
        .batch_consumer(analytics, move || {
            consumers::AnalyticsConsumer::new(metrics_pool.clone(), fail_rate)
        })
        .reconcile(reconcile::CompletedWithoutNotification::new(
            cfg.reconcile_window,
        ))
        .effect(worker::config(), move |effect| {
            worker::send(effect, provider_fail_rate)
        })
        .start()
        .await?;

    let state = web::Data::new(api::AppState {
        pool: http_pool,
        outbox: runtime.handle(),
    });
    tracing::info!(
        bind = %cfg.bind,
        admin_token = cfg.admin_token.is_some(),
        provider_fail_rate = cfg.provider_fail_rate,
        consumer_fail_rate = cfg.consumer_fail_rate,
        reconcile_window_ms = cfg.reconcile_window.as_millis() as u64,
        "order service listening"
    );
    // actix-web stops on SIGTERM / SIGINT by itself, finishing requests in flight. Whatever
    // ends it (a stop, or a bind that fails), the runtime (and its notification worker) is
    // drained after.
    let served = async {
        HttpServer::new(move || {
            let admin = admin.clone();
            App::new()
                .app_data(state.clone())
                .configure(api::routes)
                .configure(move |c| {
                    if let Some(admin) = admin {
                        c.service(admin_scope("/admin", admin));
                    }
                })
        })
        .bind(&cfg.bind)?
        .shutdown_timeout(10)
        .run()
        .await
    }
    .await;

    tracing::info!("HTTP stopped; draining the outbox runtime");
    let finished = runtime.shutdown().await;
    tracing::info!(finished, "order service stopped");
    served?;
    Ok(())
}

/// Publishes through JetStream, and receives this service's own events back from it.
#[cfg(feature = "nats")]
async fn through_nats(
    builder: actix_outbox::OutboxBuilder,
    url: &str,
) -> Result<actix_outbox::OutboxBuilder, Box<dyn std::error::Error>> {
    use actix_outbox::nats::{
        connect, NatsReceiver, NatsReceiverConfig, NatsStream, NatsTransport, NatsTransportConfig,
    };
    use actix_outbox::transport::ExternalConfig;
    let stream = NatsStream::new(std::env::var("NATS_STREAM").unwrap_or_else(|_| "ORDERS".into()));
    let client = connect(url).await?;
    let transport =
        NatsTransport::new(client.clone(), NatsTransportConfig::new(stream.clone())).await?;
    // A NATS outage must not dead-letter events: retried for as long as it lasts, at most 2 s
    // apart.
    let publishing = ExternalConfig::default()
        .lease(Duration::from_secs(30))
        .retry(
            RetryPolicy::default()
                .max_attempts(100_000)
                .base(Duration::from_millis(100))
                .cap(Duration::from_secs(2)),
        );
    let receiver = NatsReceiver::new(
        client,
        NatsReceiverConfig::new(stream, "order_service")
            .ack_wait(Duration::from_secs(10))
            .max_backoff(Duration::from_secs(2)),
    )?;
    tracing::info!(url, "publishing through NATS JetStream");
    Ok(builder
        .external_transport(transport, publishing)
        .nats_receiver(receiver))
}

#[cfg(not(feature = "nats"))]
async fn through_nats(
    _: actix_outbox::OutboxBuilder,
    _: &str,
) -> Result<actix_outbox::OutboxBuilder, Box<dyn std::error::Error>> {
    Err("NATS_URL is set but this build has no NATS support (build with --features nats)".into())
}

async fn apply_schema(pool: &PgPool) -> actix_outbox::Result<()> {
    let mut conn = pool.get().await?;
    conn.transaction::<_, actix_outbox::Error, _>(async |conn| {
        diesel::sql_query("SELECT pg_advisory_xact_lock($1)")
            .bind::<BigInt, _>(SCHEMA_LOCK_KEY)
            .execute(conn)
            .await?;
        conn.batch_execute(SCHEMA).await?;
        Ok(())
    })
    .await
}
