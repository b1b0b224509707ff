//! The HTTP surface. Every write is one transaction holding the business change, its audit
//! row and its event; the outbox is woken only after the commit.
//!
//! Every refusal is a JSON error with a stable code ([`crate::wire::code`]) and writes nothing:
//! bodies are checked (type, size, shape, fields) before a connection is taken, and the
//! routes' unknown paths and methods answer in JSON too.

use std::fmt;

use actix_outbox::{enqueue, NewEvent, OutboxHandle, PgPool};
use actix_web::error::JsonPayloadError;
use actix_web::http::{header, StatusCode};
use actix_web::{
    web, FromRequest, Handler, HttpRequest, HttpResponse, Resource, Responder, ResponseError,
};
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel::{OptionalExtension, QueryableByName};
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};

use crate::wire::{
    code, ChangeStatus, CreateOrder, ErrorBody, ErrorDetail, Order, OrderState, OrderStatus,
    IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, MAX_BODY, REQUEST_ID,
};
use crate::ORDER_STATUS_CHANGED;

pub struct AppState {
    pub pool: PgPool,
    pub outbox: OutboxHandle,
}

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(get("/health", health))
        .service(get("/stats", crate::stats::stats))
        .service(post("/orders", create_order))
        .service(get("/orders/{id}", get_order))
        .service(post("/orders/{id}/status", change_status))
        .default_service(web::to(|| async {
            ApiError::refused(StatusCode::NOT_FOUND, code::NOT_FOUND, "no such endpoint")
                .error_response()
        }));
}

fn get<F, Args>(path: &str, handler: F) -> Resource
where
    F: Handler<Args>,
    Args: FromRequest + 'static,
    F::Output: Responder + 'static,
{
    resource(path, "GET").route(web::get().to(handler))
}

fn post<F, Args>(path: &str, handler: F) -> Resource
where
    F: Handler<Args>,
    Args: FromRequest + 'static,
    F::Output: Responder + 'static,
{
    resource(path, "POST").route(web::post().to(handler))
}

/// A resource whose extractors and wrong methods answer with JSON errors, never actix's
/// plain-text ones.
fn resource(path: &str, method: &'static str) -> Resource {
    web::resource(path)
        .app_data(
            web::JsonConfig::default()
                .limit(MAX_BODY)
                .error_handler(|e, _| ApiError::from(e).into()),
        )
        .app_data(web::PathConfig::default().error_handler(|e, _| {
            ApiError::refused(StatusCode::NOT_FOUND, code::NOT_FOUND, e.to_string()).into()
        }))
        .default_service(web::to(move || async move {
            let mut resp = ApiError::refused(
                StatusCode::METHOD_NOT_ALLOWED,
                code::METHOD_NOT_ALLOWED,
                format!("this endpoint takes {method} only"),
            )
            .error_response();
            resp.headers_mut()
                .insert(header::ALLOW, header::HeaderValue::from_static(method));
            resp
        }))
}

/// An error as the API shows it: [`ErrorBody`].
#[derive(Debug)]
pub enum ApiError {
    /// A client error: the request is refused as it is.
    Refused {
        status: StatusCode,
        code: &'static str,
        message: String,
    },
    NotFound(String),
    Unavailable(String),
    Internal(String),
}

impl ApiError {
    fn refused(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError::Refused {
            status,
            code,
            message: message.into(),
        }
    }

    fn unprocessable(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::refused(StatusCode::UNPROCESSABLE_ENTITY, code, message)
    }

    fn code(&self) -> &'static str {
        match self {
            ApiError::Refused { code, .. } => code,
            ApiError::NotFound(_) => code::ORDER_NOT_FOUND,
            ApiError::Unavailable(_) => code::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => code::INTERNAL_ERROR,
        }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApiError::Refused { message, .. }
            | ApiError::NotFound(message)
            | ApiError::Unavailable(message)
            | ApiError::Internal(message) => f.write_str(message),
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::Refused { status, .. } => *status,
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
        HttpResponse::build(self.status_code()).json(ErrorBody {
            error: ErrorDetail {
                code: self.code().to_owned(),
                message,
            },
        })
    }
}

/// A body the `Json` extractor refused.
impl From<JsonPayloadError> for ApiError {
    fn from(e: JsonPayloadError) -> Self {
        match e {
            JsonPayloadError::OverflowKnownLength { .. }
            | JsonPayloadError::Overflow { .. }
            | JsonPayloadError::Payload(actix_web::error::PayloadError::Overflow) => {
                ApiError::refused(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    code::BODY_TOO_LARGE,
                    format!("a body is at most {MAX_BODY} bytes"),
                )
            }
            JsonPayloadError::ContentType => ApiError::refused(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                code::UNSUPPORTED_MEDIA_TYPE,
                "the body must be JSON, sent as Content-Type: application/json",
            ),
            JsonPayloadError::Deserialize(e) => {
                ApiError::unprocessable(code::INVALID_BODY, e.to_string())
            }
            JsonPayloadError::Payload(e) => ApiError::refused(
                StatusCode::BAD_REQUEST,
                code::UNREADABLE_BODY,
                format!("the body could not be read: {e}"),
            ),
            // Only answers are serialised; a request never gets here.
            other => ApiError::unprocessable(code::INVALID_BODY, other.to_string()),
        }
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
            e @ actix_outbox::Error::Pool(_) => {
                tracing::warn!(error = %e, code = %e.code(), "no database connection");
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
        req.headers().contains_key(IDEMPOTENCY_KEY),
        id_header(req, IDEMPOTENCY_KEY),
    ) {
        (true, None) => Err(ApiError::unprocessable(
            code::INVALID_IDEMPOTENCY_KEY,
            "Idempotency-Key must be 1-200 visible ASCII characters",
        )),
        (_, key) => Ok(key),
    }
}

/// An order id from the path. One PostgreSQL cannot store (text holds no NUL) names no order,
/// and must not reach a query, which would fail with a server error.
fn order_id(path: web::Path<String>) -> Result<String, ApiError> {
    let id = path.into_inner();
    if id.contains('\0') {
        return Err(ApiError::NotFound(format!("order {id:?} does not exist")));
    }
    Ok(id)
}

const ORDER_COLUMNS: &str =
    "id, customer_id, total_cents, status, version, source, created_at, updated_at";

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

enum Created {
    New(Order),
    Replayed(Order),
}

/// `POST /orders`. With an `Idempotency-Key` header a retried request (the client never saw
/// the first answer) returns the order the first one made instead of making another.
async fn create_order(
    state: web::Data<AppState>,
    req: HttpRequest,
    body: web::Json<CreateOrder>,
) -> Result<HttpResponse, ApiError> {
    let input = body.into_inner();
    let customer_id = input.customer_id.trim().to_owned();
    // Control characters are refused with the rest: NUL, which a text column cannot hold,
    // would otherwise fail the insert with a server error.
    if customer_id.is_empty()
        || customer_id.chars().count() > 100
        || customer_id.chars().any(char::is_control)
    {
        return Err(ApiError::unprocessable(
            code::VALIDATION_FAILED,
            "customer_id must be 1-100 characters, none of them a control character",
        ));
    }
    if input.total_cents < 0 {
        return Err(ApiError::unprocessable(
            code::VALIDATION_FAILED,
            "total_cents must not be negative",
        ));
    }
    let idempotency_key = idempotency_key(&req)?;
    let correlation = id_header(&req, REQUEST_ID);
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
                        code::IDEMPOTENCY_KEY_REUSED,
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
        resp.insert_header((IDEMPOTENT_REPLAYED, "true"));
    }
    Ok(resp.json(OrderState {
        id: order.id,
        status: order.status,
        version: order.version,
    }))
}

async fn get_order(
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = order_id(path)?;
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
    body: web::Json<ChangeStatus>,
) -> Result<HttpResponse, ApiError> {
    let order_id = order_id(path)?;
    let input = body.into_inner();
    let to = OrderStatus::parse(&input.status).ok_or_else(|| {
        ApiError::unprocessable(
            code::INVALID_STATUS,
            format!(
                "unknown status {:?}; expected WAITING, PAID, COMPLETED or CANCELLED",
                input.status
            ),
        )
    })?;
    let correlation = id_header(&req, REQUEST_ID);

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
                    code::INVALID_TRANSITION,
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
        id: order_id,
        status: to.as_str().to_owned(),
        version,
    }))
}
