//! The HTTP surface. Every write is one transaction holding the business change, its audit
//! row and its event; the outbox is woken only after the commit.

use std::fmt;

use actix_outbox::{enqueue, NewEvent, OutboxHandle, PgPool};
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse, ResponseError};
use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Nullable, Text, Timestamptz};
use diesel::{OptionalExtension, QueryableByName};
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use serde::{Deserialize, Serialize};

use crate::ORDER_STATUS_CHANGED;

pub struct AppState {
    pub pool: PgPool,
    pub outbox: OutboxHandle,
}

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/health", web::get().to(health))
        .route("/stats", web::get().to(crate::stats::stats))
        .route("/orders", web::post().to(create_order))
        .route("/orders/{id}", web::get().to(get_order))
        .route("/orders/{id}/status", web::post().to(change_status));
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderStatus {
    Waiting,
    Paid,
    Completed,
    Cancelled,
}

impl OrderStatus {
    pub fn parse(s: &str) -> Option<OrderStatus> {
        Some(match s {
            "WAITING" => OrderStatus::Waiting,
            "PAID" => OrderStatus::Paid,
            "COMPLETED" => OrderStatus::Completed,
            "CANCELLED" => OrderStatus::Cancelled,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            OrderStatus::Waiting => "WAITING",
            OrderStatus::Paid => "PAID",
            OrderStatus::Completed => "COMPLETED",
            OrderStatus::Cancelled => "CANCELLED",
        }
    }

    /// The state machine. COMPLETED and CANCELLED are terminal, and a status never moves to
    /// itself, so a repeated request is refused instead of writing a second event.
    pub fn can_move_to(self, to: OrderStatus) -> bool {
        use OrderStatus::*;
        matches!(
            (self, to),
            (Waiting, Paid | Completed | Cancelled) | (Paid, Completed | Cancelled)
        )
    }
}

/// An error as the API shows it: `{"error": {"code", "message"}}`.
#[derive(Debug)]
pub enum ApiError {
    Unprocessable { code: &'static str, message: String },
    NotFound(String),
    Unavailable(String),
    Internal(String),
}

impl ApiError {
    fn unprocessable(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::Unprocessable {
            code,
            message: message.into(),
        }
    }

    fn code(&self) -> &'static str {
        match self {
            ApiError::Unprocessable { code, .. } => code,
            ApiError::NotFound(_) => "ORDER_NOT_FOUND",
            ApiError::Unavailable(_) => "SERVICE_UNAVAILABLE",
            ApiError::Internal(_) => "INTERNAL_ERROR",
        }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApiError::Unprocessable { message, .. }
            | ApiError::NotFound(message)
            | ApiError::Unavailable(message)
            | ApiError::Internal(message) => f.write_str(message),
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::Unprocessable { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn error_response(&self) -> HttpResponse {
        // Internal details go to the log, not to the client.
        let message = match self {
            ApiError::Internal(_) => "internal error".to_owned(),
            other => other.to_string(),
        };
        HttpResponse::build(self.status_code())
            .json(serde_json::json!({"error": {"code": self.code(), "message": message}}))
    }
}

impl From<diesel::result::Error> for ApiError {
    fn from(e: diesel::result::Error) -> Self {
        tracing::error!(error = %e, "database error");
        ApiError::Internal(e.to_string())
    }
}

impl From<actix_outbox::Error> for ApiError {
    fn from(e: actix_outbox::Error) -> Self {
        match e {
            actix_outbox::Error::Pool(m) => {
                tracing::warn!(error = %m, "no database connection");
                ApiError::Unavailable("the database is unavailable; try again".into())
            }
            other => {
                tracing::error!(error = %other, code = %other.code(), "request failed");
                ApiError::Internal(other.to_string())
            }
        }
    }
}

type Conn<'a> = bb8::PooledConnection<'a, AsyncDieselConnectionManager<AsyncPgConnection>>;

pub async fn conn(pool: &PgPool) -> Result<Conn<'_>, ApiError> {
    pool.get()
        .await
        .map_err(|e| ApiError::from(actix_outbox::Error::from(e)))
}

fn parse_body<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::unprocessable("INVALID_BODY", e.to_string()))
}

/// A header value usable as an id: short, visible ASCII. Anything else is ignored rather than
/// refused, since these headers are optional.
fn id_header(req: &HttpRequest, name: &str) -> Option<String> {
    let v = req.headers().get(name)?.to_str().ok()?.trim();
    let ok = !v.is_empty() && v.len() <= 200 && v.bytes().all(|b| b.is_ascii_graphic());
    ok.then(|| v.to_owned())
}

/// The Idempotency-Key, if the client sent one. Unlike a request id it is refused when it is
/// not usable: ignoring it would make the create silently not idempotent, and the client's
/// retry would create a second order.
fn idempotency_key(req: &HttpRequest) -> Result<Option<String>, ApiError> {
    match (
        req.headers().contains_key("Idempotency-Key"),
        id_header(req, "Idempotency-Key"),
    ) {
        (true, None) => Err(ApiError::unprocessable(
            "INVALID_IDEMPOTENCY_KEY",
            "Idempotency-Key must be 1-200 visible ASCII characters",
        )),
        (_, key) => Ok(key),
    }
}

#[derive(Debug, Serialize, QueryableByName)]
pub struct Order {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Text)]
    customer_id: String,
    #[diesel(sql_type = BigInt)]
    total_cents: i64,
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = BigInt)]
    version: i64,
    #[diesel(sql_type = Text)]
    source: String,
    #[diesel(sql_type = Timestamptz)]
    created_at: DateTime<Utc>,
    #[diesel(sql_type = Timestamptz)]
    updated_at: DateTime<Utc>,
}

const ORDER_COLUMNS: &str =
    "id, customer_id, total_cents, status, version, source, created_at, updated_at";

#[derive(Serialize)]
struct OrderState<'a> {
    id: &'a str,
    status: &'a str,
    version: i64,
}

/// The event of one status change. Ids and states only: consumers read anything else from
/// the database, so no personal data is copied into the outbox and the inboxes.
fn status_changed(
    order_id: &str,
    status: OrderStatus,
    version: i64,
    correlation: Option<&String>,
) -> NewEvent {
    let event = NewEvent::new(
        ORDER_STATUS_CHANGED,
        "order",
        order_id,
        serde_json::json!({"order_id": order_id, "status": status.as_str(), "version": version}),
    )
    .aggregate_version(version);
    match correlation {
        Some(c) => event.correlation_id(c.clone()),
        None => event,
    }
}

async fn audit(
    mut conn: &AsyncPgConnection,
    order_id: &str,
    action: &str,
    from: Option<OrderStatus>,
    to: OrderStatus,
    version: i64,
    correlation: Option<&String>,
) -> Result<(), diesel::result::Error> {
    diesel::sql_query(
        "INSERT INTO audit_logs (order_id, action, from_status, to_status, version, correlation_id) \
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind::<Text, _>(order_id)
    .bind::<Text, _>(action)
    .bind::<Nullable<Text>, _>(from.map(OrderStatus::as_str))
    .bind::<Text, _>(to.as_str())
    .bind::<BigInt, _>(version)
    .bind::<Nullable<Text>, _>(correlation)
    .execute(&mut conn)
    .await?;
    Ok(())
}

async fn health(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let mut conn = conn(&state.pool).await?;
    diesel::sql_query("SELECT 1").execute(&mut conn).await?;
    Ok(HttpResponse::Ok().json(serde_json::json!({"status": "ok"})))
}

#[derive(Deserialize)]
struct CreateOrder {
    customer_id: String,
    total_cents: i64,
}

enum Created {
    New(Order),
    Replayed(Order),
}

/// `POST /orders`. With an `Idempotency-Key` header a retried request (the client never saw
/// the first answer) returns the order the first one made instead of making another.
async fn create_order(
    state: web::Data<AppState>,
    req: HttpRequest,
    body: web::Bytes,
) -> Result<HttpResponse, ApiError> {
    let input: CreateOrder = parse_body(&body)?;
    let customer_id = input.customer_id.trim().to_owned();
    if customer_id.is_empty() || customer_id.len() > 100 {
        return Err(ApiError::unprocessable(
            "VALIDATION_FAILED",
            "customer_id must be 1-100 characters",
        ));
    }
    if input.total_cents < 0 {
        return Err(ApiError::unprocessable(
            "VALIDATION_FAILED",
            "total_cents must not be negative",
        ));
    }
    let idempotency_key = idempotency_key(&req)?;
    let correlation = id_header(&req, "X-Request-Id");
    let id = uuid::Uuid::now_v7().to_string();

    let mut conn = conn(&state.pool).await?;
    let created = conn
        .transaction::<_, ApiError, _>(async |conn| {
            let inserted: Option<Order> = diesel::sql_query(format!(
                "INSERT INTO orders (id, customer_id, total_cents, status, version, idempotency_key) \
                 VALUES ($1, $2, $3, 'WAITING', 1, $4) \
                 ON CONFLICT (idempotency_key) DO NOTHING RETURNING {ORDER_COLUMNS}"
            ))
            .bind::<Text, _>(&id)
            .bind::<Text, _>(&customer_id)
            .bind::<BigInt, _>(input.total_cents)
            .bind::<Nullable<Text>, _>(&idempotency_key)
            .get_result(conn)
            .await
            .optional()?;
            let Some(order) = inserted else {
                // Only a key can conflict; a concurrent first request with it has committed by
                // now (the insert waited for it), so the order is visible.
                let existing: Order = diesel::sql_query(format!(
                    "SELECT {ORDER_COLUMNS} FROM orders WHERE idempotency_key = $1"
                ))
                .bind::<Nullable<Text>, _>(&idempotency_key)
                .get_result(conn)
                .await?;
                if existing.customer_id != customer_id || existing.total_cents != input.total_cents
                {
                    return Err(ApiError::unprocessable(
                        "IDEMPOTENCY_KEY_REUSED",
                        "this Idempotency-Key was used for a different order",
                    ));
                }
                return Ok(Created::Replayed(existing));
            };
            let waiting = OrderStatus::Waiting;
            // The audit row and the event go to the server together: one round trip.
            let conn: &AsyncPgConnection = conn;
            futures_util::try_join!(
                async { Ok::<_, ApiError>(audit(conn, &id, "CREATED", None, waiting, 1, correlation.as_ref()).await?) },
                async { Ok(enqueue(conn, &status_changed(&id, waiting, 1, correlation.as_ref())).await?) },
            )?;
            Ok(Created::New(order))
        })
        .await?;

    let (order, replayed) = match created {
        Created::New(order) => {
            state.outbox.wake();
            (order, false)
        }
        Created::Replayed(order) => (order, true),
    };
    let mut resp = HttpResponse::Created();
    if replayed {
        resp.insert_header(("Idempotent-Replayed", "true"));
    }
    Ok(resp.json(OrderState {
        id: &order.id,
        status: &order.status,
        version: order.version,
    }))
}

async fn get_order(
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = path.into_inner();
    let mut conn = conn(&state.pool).await?;
    let order: Option<Order> =
        diesel::sql_query(format!("SELECT {ORDER_COLUMNS} FROM orders WHERE id = $1"))
            .bind::<Text, _>(&id)
            .get_result(&mut conn)
            .await
            .optional()?;
    match order {
        Some(order) => Ok(HttpResponse::Ok().json(order)),
        None => Err(ApiError::NotFound(format!("order {id} does not exist"))),
    }
}

#[derive(Deserialize)]
struct ChangeStatus {
    status: String,
}

#[derive(QueryableByName)]
struct Current {
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = BigInt)]
    version: i64,
}

/// `POST /orders/{id}/status`: the order row, an audit row and the event in one transaction.
/// Refusals (404, 422) are returned from inside it, so nothing they touched is kept.
async fn change_status(
    state: web::Data<AppState>,
    req: HttpRequest,
    path: web::Path<String>,
    body: web::Bytes,
) -> Result<HttpResponse, ApiError> {
    let order_id = path.into_inner();
    let input: ChangeStatus = parse_body(&body)?;
    let to = OrderStatus::parse(&input.status).ok_or_else(|| {
        ApiError::unprocessable(
            "INVALID_STATUS",
            format!(
                "unknown status {:?}; expected WAITING, PAID, COMPLETED or CANCELLED",
                input.status
            ),
        )
    })?;
    let correlation = id_header(&req, "X-Request-Id");

    let mut conn = conn(&state.pool).await?;
    let version = conn
        .transaction::<_, ApiError, _>(async |conn| {
            // The row lock orders concurrent changes of one order, so versions never repeat.
            let current: Current =
                diesel::sql_query("SELECT status, version FROM orders WHERE id = $1 FOR UPDATE")
                    .bind::<Text, _>(&order_id)
                    .get_result(conn)
                    .await
                    .optional()?
                    .ok_or_else(|| {
                        ApiError::NotFound(format!("order {order_id} does not exist"))
                    })?;
            let from = OrderStatus::parse(&current.status).ok_or_else(|| {
                ApiError::Internal(format!("order {order_id} has status {}", current.status))
            })?;
            if !from.can_move_to(to) {
                return Err(ApiError::unprocessable(
                    "INVALID_TRANSITION",
                    format!(
                        "order {order_id} is {} and cannot become {}",
                        from.as_str(),
                        to.as_str()
                    ),
                ));
            }
            let version = current.version + 1;
            // The change, its audit row and its event are sent together (pipelined): one
            // round trip, still one transaction.
            let conn: &AsyncPgConnection = conn;
            let update = diesel::sql_query(
                "UPDATE orders SET status = $2, version = $3, updated_at = now() WHERE id = $1",
            )
            .bind::<Text, _>(&order_id)
            .bind::<Text, _>(to.as_str())
            .bind::<BigInt, _>(version);
            let event = status_changed(&order_id, to, version, correlation.as_ref());
            futures_util::try_join!(
                async { Ok::<_, ApiError>(update.execute(&mut &*conn).await?) },
                async {
                    let (from, correlation) = (Some(from), correlation.as_ref());
                    Ok(audit(
                        conn,
                        &order_id,
                        "STATUS_CHANGED",
                        from,
                        to,
                        version,
                        correlation,
                    )
                    .await?)
                },
                async { Ok(enqueue(conn, &event).await?) },
            )?;
            Ok(version)
        })
        .await?;
    state.outbox.wake();
    Ok(HttpResponse::Ok().json(OrderState {
        id: &order_id,
        status: to.as_str(),
        version,
    }))
}
