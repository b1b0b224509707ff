//! A shipping service: the second service of the NATS topology (`scripts/demo --nats`).
//!
//! It has a database of its own and hears about orders only through NATS JetStream: a
//! `NatsReceiver` (a durable pull consumer, `shipping`, shared by every instance) records each
//! `ORDER_STATUS_CHANGED` event in this database's inbox, and the `shipment` consumer writes
//! one row in `shipments` for each order that became COMPLETED, in the inbox's transaction.
//! `shipments.order_id` is unique and the insert has no `ON CONFLICT`: a second effect for one
//! order would fail loudly (and end as a dead letter) rather than hide.
//!
//! - `GET /health`: 200 when the receiver is bound to its consumer, else 503, with its state.
//! - `GET /stats`: shipments, inbox rows by status, dead letters, the receiver's counters.
//! - With `ADMIN_TOKEN` set (16 characters or more): the library's operator API under `/admin`.
//!
//! Configuration (environment): `DATABASE_URL` (required), `NATS_URL` (required), `BIND`
//! (default `127.0.0.1:8081`), `ADMIN_TOKEN`, `NATS_STREAM` (default `ORDERS`; the order
//! service publishes to the same one), `RUST_LOG`.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/shipping NATS_URL=nats://127.0.0.1:4222 \
//!     cargo run --features nats --example shipping_service
//! ```

use std::process::ExitCode;
use std::time::Duration;

use actix_outbox::admin::{admin_scope, AdminConfig};
use actix_outbox::nats::{NatsHealth, NatsReceiver, NatsReceiverConfig, NatsStream};
use actix_outbox::{
    ConsumerConfig, Delivery, HandlerError, OutboxRuntime, RetryPolicy, RuntimeConfig,
};
use actix_web::{web, App, HttpResponse, HttpServer};
use diesel::sql_types::Text;
use diesel::QueryableByName;
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS shipments (
    id         bigserial   PRIMARY KEY,
    order_id   text        NOT NULL UNIQUE,
    event_id   uuid        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);";

#[path = "../common/logging.rs"]
mod logging;

/// Serialises the schema script between instances starting at once.
const SCHEMA_LOCK_KEY: i64 = 0x7368_6970_7069_6e67; // "shipping"

#[actix_web::main]
async fn main() -> ExitCode {
    logging::init();
    logging::exit(run().await, "shipping service")
}

/// The stream both services use: `NATS_STREAM`, or `ORDERS`.
pub fn stream() -> NatsStream {
    NatsStream::new(std::env::var("NATS_STREAM").unwrap_or_else(|_| "ORDERS".into()))
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let database_url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL must be set")?;
    let nats_url = std::env::var("NATS_URL").map_err(|_| "NATS_URL must be set")?;
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:8081".into());
    let admin_token = std::env::var("ADMIN_TOKEN").ok().filter(|t| !t.is_empty());

    actix_outbox::migrate(&database_url).await?;
    let outbox_pool = actix_outbox::connect(&database_url, 10).await?;
    let http_pool = actix_outbox::connect(&database_url, 4).await?;
    // Under an advisory lock: instances starting at once would race on `CREATE TABLE IF NOT
    // EXISTS`, which is not safe against a concurrent create of the same table.
    outbox_pool
        .get()
        .await?
        .batch_execute(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock({SCHEMA_LOCK_KEY}); {SCHEMA} COMMIT;"
        ))
        .await?;

    let receiver = NatsReceiver::new(
        actix_outbox::nats::connect(&nats_url).await?,
        NatsReceiverConfig::new(stream(), "shipping")
            .ack_wait(Duration::from_secs(10))
            .max_backoff(Duration::from_secs(2)),
    )?;
    let health = receiver.health();
    let shipment = ConsumerConfig::new("shipment")
        .subscribe("ORDER_STATUS_CHANGED")
        .retry(
            RetryPolicy::default()
                .max_attempts(10)
                .base(Duration::from_millis(100))
                .cap(Duration::from_secs(5)),
        )
        .batch_size(50);
    let runtime = OutboxRuntime::builder(outbox_pool.clone())
        .config(RuntimeConfig::default().shutdown_timeout(Duration::from_secs(10)))
        .consumer_fn(shipment, ship)
        .nats_receiver(receiver)
        .start()
        .await?;

    let admin = match admin_token.as_deref() {
        Some(token) => Some(AdminConfig::new(outbox_pool.clone()).bearer_token("ops", token)?),
        None => None,
    };
    let state = web::Data::new(State {
        pool: http_pool,
        health,
    });
    tracing::info!(%bind, "shipping service listening");
    let served = HttpServer::new(move || {
        let admin = admin.clone();
        App::new()
            .app_data(state.clone())
            .route("/health", web::get().to(health_route))
            .route("/stats", web::get().to(stats_route))
            .configure(move |c| {
                if let Some(admin) = admin {
                    c.service(admin_scope("/admin", admin));
                }
            })
    })
    .bind(&bind)?
    .shutdown_timeout(10)
    .run()
    .await;
    let finished = runtime.shutdown().await;
    tracing::info!(finished, "shipping service stopped");
    served?;
    Ok(())
}

/// One shipment per order that became COMPLETED, in the inbox's transaction.
async fn ship(d: Delivery) -> Result<(), HandlerError> {
    if d.payload().get("status").and_then(|s| s.as_str()) != Some("COMPLETED") {
        return Ok(());
    }
    let mut conn = d.conn().await?;
    diesel::sql_query("INSERT INTO shipments (order_id, event_id) VALUES ($1, $2)")
        .bind::<Text, _>(d.aggregate_id())
        .bind::<diesel::sql_types::Uuid, _>(d.event_id().as_uuid())
        .execute(&mut *conn)
        .await?;
    Ok(())
}

struct State {
    pool: actix_outbox::PgPool,
    health: NatsHealth,
}

fn nats_json(h: &NatsHealth) -> serde_json::Value {
    let s = h.status();
    serde_json::json!({
        "bound": s.bound,
        "last_error": s.last_error,
        "failing_for_ms": s.failing_since.map(|t| t.elapsed().as_millis() as u64),
        "acked": s.acked,
        "duplicates": s.duplicates,
        "refused": s.refused,
    })
}

async fn health_route(state: web::Data<State>) -> HttpResponse {
    let body = serde_json::json!({ "nats": nats_json(&state.health) });
    if state.health.is_healthy() {
        HttpResponse::Ok().json(body)
    } else {
        HttpResponse::ServiceUnavailable().json(body)
    }
}

#[derive(QueryableByName)]
struct Stats {
    #[diesel(sql_type = Text)]
    stats: String,
}

async fn stats_route(state: web::Data<State>) -> HttpResponse {
    let sql = "SELECT json_build_object(
        'shipments', (SELECT count(*) FROM shipments),
        'inbox', (SELECT coalesce(json_object_agg(status, n), '{}') FROM
            (SELECT status, count(*) AS n FROM actix_outbox.inbox_events GROUP BY status) s),
        'inbox_open', (SELECT count(*) FROM actix_outbox.inbox_events
            WHERE status IN ('RECEIVED', 'RETRY_PENDING', 'PROCESSING')),
        'dead_letters', (SELECT count(*) FROM actix_outbox.inbox_events WHERE status = 'DEAD_LETTER'))::text AS stats";
    let stats = match state.pool.get().await {
        Ok(mut conn) => diesel::sql_query(sql).get_result::<Stats>(&mut *conn).await,
        Err(e) => return HttpResponse::ServiceUnavailable().body(e.to_string()),
    };
    match stats {
        Ok(s) => {
            let mut v: serde_json::Value = serde_json::from_str(&s.stats).unwrap_or_default();
            v["nats"] = nats_json(&state.health);
            HttpResponse::Ok().json(v)
        }
        Err(e) => HttpResponse::ServiceUnavailable().body(e.to_string()),
    }
}
