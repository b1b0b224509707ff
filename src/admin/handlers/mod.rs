//! Routes and handlers of the operator API. Every data handler takes [`Operator`] first (see
//! `auth`); every action validates its whole input before it opens a transaction, and inside
//! the transaction locks its rows, re-checks them, changes them and writes the audit row.
//!
//! Here: the routes and what they share. `reads.rs`: health, overview, metrics, lists,
//! timeline, audit. `charts.rs`: each consumer's throughput and lag over the last hour.
//! `actions.rs`: retry, ignore, pause, resume, unsubscribe. `replays.rs`: ask for, list and
//! cancel replays. `effects.rs`: side effects' list, retry and ignore.

use std::time::Duration;

use actix_web::http::{header, StatusCode};
use actix_web::{web, FromRequest, Handler, HttpResponse, Resource, Responder, Scope};
use serde::Serialize;

use crate::admin::auth::Operator;
use crate::admin::error::*;
use crate::admin::{State, DASHBOARD};
use crate::store::status::{InboxStatus, OutboxStatus};

mod actions;
mod charts;
mod effects;
mod input;
mod reads;
mod replays;

use actions::*;
use reads::*;

/// Rows per page unless `limit` says otherwise.
const DEFAULT_LIMIT: i64 = 50;
/// Largest page: an operator's list, not an export.
const MAX_LIMIT: i64 = 200;
/// Most rows one bulk action may change.
const MAX_BULK: usize = 100;
/// Most entries a correlation timeline shows (the library's `timeline` returns at most 1000).
const TIMELINE_LIMIT: usize = 1000;
/// Largest request body accepted (a bulk action of 100 UUIDs is ~4 KiB).
const MAX_BODY: usize = 64 * 1024;
/// Longest reason kept in the audit trail.
const MAX_REASON_CHARS: usize = 1000;
/// The window of the dashboard's "last hour" sums.
const RECENT: Duration = Duration::from_secs(3600);

type Reply = Result<HttpResponse, AdminError>;

pub(crate) fn scope(path: &str, state: State) -> Scope {
    web::scope(path)
        .app_data(web::Data::new(state))
        .app_data(web::QueryConfig::default().error_handler(|e, _| {
            AdminError::bad_request(INVALID_QUERY, format!("invalid query: {e}")).into()
        }))
        .app_data(web::PathConfig::default().error_handler(|e, _| {
            AdminError::bad_request(INVALID_ID, format!("invalid path: {e}")).into()
        }))
        .service(
            web::resource(["", "/"])
                .route(web::get().to(page))
                .default_service(web::to(method_not_allowed)),
        )
        .service(get("/health", health))
        .service(get("/overview", overview))
        .service(get("/charts", charts::charts))
        .service(get("/metrics", metrics_text))
        .service(get("/outbox", list_outbox))
        .service(get("/inbox", list_inbox))
        .service(get("/consumers", consumers))
        .service(get("/blocked", blocked))
        .service(get("/events/{event_id}", event))
        .service(get("/audit", audit))
        .service(get("/timeline/{correlation_id}", timeline))
        .service(get("/replays", replays::list))
        .service(get("/effects", effects::list))
        // The fixed paths come before `/{id}/…` so that `retry` is never read as an id.
        .service(post("/inbox/retry", retry_inbox_set))
        .service(post("/outbox/retry", retry_outbox_set))
        .service(post("/inbox/{id}/retry", retry_inbox_one))
        .service(post("/outbox/{id}/retry", retry_outbox_one))
        .service(post("/inbox/{id}/ignore", ignore_inbox_one))
        .service(post("/outbox/{id}/ignore", ignore_outbox_one))
        .service(post("/consumers/{name}/pause", pause))
        .service(post("/consumers/{name}/resume", resume))
        .service(post("/consumers/{name}/replay", replays::replay))
        .service(post("/replays/{id}/cancel", replays::cancel))
        .service(post("/effects/retry", effects::retry_set))
        .service(post("/effects/{id}/retry", effects::retry_one))
        .service(post("/effects/{id}/ignore", effects::ignore_one))
        .service(post(
            "/consumers/{name}/subscriptions/{event_type}/remove",
            remove_subscription,
        ))
        .default_service(web::to(not_found))
}

fn get<F, Args>(path: &str, handler: F) -> Resource
where
    F: Handler<Args>,
    Args: FromRequest + 'static,
    F::Output: Responder + 'static,
{
    web::resource(path)
        .route(web::get().to(handler))
        .default_service(web::to(method_not_allowed))
}

fn post<F, Args>(path: &str, handler: F) -> Resource
where
    F: Handler<Args>,
    Args: FromRequest + 'static,
    F::Output: Responder + 'static,
{
    web::resource(path)
        .route(web::post().to(handler))
        .default_service(web::to(method_not_allowed))
}

async fn not_found(_: Operator) -> Reply {
    Err(AdminError::new(
        StatusCode::NOT_FOUND,
        NOT_FOUND,
        "no such endpoint",
    ))
}

async fn method_not_allowed(_: Operator) -> Reply {
    Err(AdminError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        METHOD_NOT_ALLOWED,
        "this endpoint does not take that method",
    ))
}

fn ok_json(body: impl Serialize) -> HttpResponse {
    HttpResponse::Ok()
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .json(body)
}

/// The page holds no data (everything comes from the API with the operator's token), so it is
/// the one response served without credentials: the token is typed into it.
async fn page() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/html; charset=utf-8")
        .insert_header((
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
             connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; \
             frame-ancestors 'none'",
        ))
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .insert_header((header::REFERRER_POLICY, "no-referrer"))
        .body(DASHBOARD)
}
