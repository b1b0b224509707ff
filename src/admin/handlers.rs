//! Routes and handlers of the operator API. Every data handler takes [`Operator`] first (see
//! `auth`); every action validates its whole input before it opens a transaction, and inside
//! the transaction locks its rows, re-checks them, changes them and writes the audit row.

use std::collections::HashSet;
use std::time::Duration;

use actix_web::http::{header, StatusCode};
use actix_web::{web, FromRequest, Handler, HttpResponse, Resource, Responder, Scope};
use diesel_async::{AsyncConnection, AsyncPgConnection};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::auth::Operator;
use super::error::*;
use super::{State, DASHBOARD};
use crate::event::ConsumerName;
use crate::inbox::{pause_consumer, resume_consumer, unsubscribe};
use crate::maintenance::health::{self, human, HealthConfig, HealthReport, HealthState};
use crate::store::{self, admin as stmt};

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

const OUTBOX_STATUSES: &[&str] = &[
    "PENDING",
    "PROCESSING",
    "PUBLISHED",
    "RETRY_PENDING",
    "DEAD_LETTER",
    "IGNORED",
];
const INBOX_STATUSES: &[&str] = &[
    "RECEIVED",
    "PROCESSED",
    "RETRY_PENDING",
    "DEAD_LETTER",
    "IGNORED",
];

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
        .service(get("/metrics", metrics_text))
        .service(get("/outbox", list_outbox))
        .service(get("/inbox", list_inbox))
        .service(get("/consumers", consumers))
        .service(get("/audit", audit))
        .service(get("/timeline/{correlation_id}", timeline))
        // The fixed paths come before `/{id}/…` so that `retry` is never read as an id.
        .service(post("/inbox/retry", retry_inbox_set))
        .service(post("/outbox/retry", retry_outbox_set))
        .service(post("/inbox/{id}/retry", retry_inbox_one))
        .service(post("/outbox/{id}/retry", retry_outbox_one))
        .service(post("/inbox/{id}/ignore", ignore_inbox_one))
        .service(post("/outbox/{id}/ignore", ignore_outbox_one))
        .service(post("/consumers/{name}/pause", pause))
        .service(post("/consumers/{name}/resume", resume))
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

// ---------------------------------------------------------------------------------------------
// Health, overview, metrics

async fn health(_: Operator, st: web::Data<State>) -> Reply {
    let mut conn = st.pool.get().await?;
    Ok(ok_json(current_health(&mut conn).await?))
}

/// The newest sampler's report, flagged when it is too old to trust. Without any sample (no
/// runtime has run on this database yet), a report from the live gauges and the default
/// thresholds, flagged as such.
async fn current_health(conn: &mut AsyncPgConnection) -> Result<HealthReport, AdminError> {
    let latest = store::stats::latest_health(conn).await?;
    let parsed = latest.and_then(|l| {
        let report: HealthReport = serde_json::from_value(l.health).ok()?;
        Some((report, l.interval_ms, l.age_seconds))
    });
    match parsed {
        Some((mut report, interval_ms, age)) => {
            let stale_after = 3.0 * interval_ms as f64 / 1000.0 + 5.0;
            if age > stale_after {
                report.push(
                    HealthState::Warning,
                    "STATS_STALE",
                    None,
                    format!(
                        "the newest stats sample is {} old (expected every {}); is a runtime \
                         running on this database?",
                        human(age),
                        human(interval_ms as f64 / 1000.0)
                    ),
                );
            }
            Ok(report)
        }
        None => {
            let sample = store::stats::snapshot(conn).await?;
            let mut report = health::assess(&HealthConfig::default(), &sample, &[]);
            report.push(
                HealthState::Warning,
                "STATS_MISSING",
                None,
                "no stats sample has been stored yet; is a runtime running on this database?"
                    .into(),
            );
            Ok(report)
        }
    }
}

/// The dashboard's numbers. Counts are read live, unlike the Prometheus gauges (which come from
/// the sampler): an operator who just pressed "retry" expects to see it, and every count reads a
/// partial index, so a page refreshing every 5 s costs a handful of index probes. Health and the
/// last hour's failures and duplicates come from the stored samples.
async fn overview(_: Operator, st: web::Data<State>) -> Reply {
    let mut conn = st.pool.get().await?;
    let health = current_health(&mut conn).await?;
    let live = store::stats::snapshot(&mut conn).await?;
    let states = stmt::consumer_states(&mut conn).await?;
    let sums = store::stats::consumer_sums(&mut conn, RECENT).await?;
    let consumers: Vec<_> = live
        .consumers
        .iter()
        .map(|c| {
            let state = states.iter().find(|s| s.consumer == c.consumer);
            let (dup, failed, processed) = sums
                .iter()
                .find(|s| s.0 == c.consumer)
                .map(|s| (s.1, s.2, s.3))
                .unwrap_or_default();
            json!({
                "consumer": c.consumer,
                "paused": c.paused,
                "paused_by": state.and_then(|s| s.paused_by.clone()).filter(|_| c.paused),
                "pause_reason": state.and_then(|s| s.reason.clone()).filter(|_| c.paused),
                "backlog": c.backlog,
                "retrying": c.retrying,
                "due": c.due,
                "oldest_due_age_seconds": c.oldest_due_age_seconds,
                "dead_letter": c.dead_letter,
                "last_hour": {"processed": processed, "failed": failed, "duplicates": dup},
            })
        })
        .collect();
    let o = &live.outbox;
    Ok(ok_json(json!({
        "checked_at": live.at,
        "health": health,
        "outbox": {
            "pending": o.pending,
            "retrying": o.retrying,
            "processing": o.processing,
            "dead_letter": o.dead_letter,
            "oldest_pending_age_seconds": o.oldest_pending_age_seconds,
        },
        "consumers": consumers,
    })))
}

async fn metrics_text(_: Operator, st: web::Data<State>) -> Reply {
    let handle = st.metrics.as_ref().ok_or_else(|| {
        AdminError::new(
            StatusCode::NOT_FOUND,
            METRICS_NOT_CONFIGURED,
            "no metrics recorder was given to AdminConfig::metrics",
        )
    })?;
    Ok(HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .body(handle.render()))
}

// ---------------------------------------------------------------------------------------------
// Lists

/// Query of `GET /outbox`. Unknown parameters are refused, so a typo does not silently list
/// everything.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OutboxQuery {
    status: Option<String>,
    #[serde(rename = "type")]
    event_type: Option<String>,
    before: Option<String>,
    limit: Option<String>,
}

/// Query of `GET /inbox`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct InboxQuery {
    status: Option<String>,
    #[serde(rename = "type")]
    event_type: Option<String>,
    consumer: Option<String>,
    before: Option<String>,
    limit: Option<String>,
}

/// Empty parameters (`?status=`, as a form sends them) mean "no filter".
fn given(v: Option<String>) -> Option<String> {
    v.map(|s| s.trim().to_owned()).filter(|s| !s.is_empty())
}

fn status_filter(v: Option<String>, allowed: &[&str]) -> Result<Option<String>, AdminError> {
    match given(v) {
        None => Ok(None),
        Some(s) => {
            let upper = s.to_ascii_uppercase();
            if allowed.contains(&upper.as_str()) {
                Ok(Some(upper))
            } else {
                Err(AdminError::bad_request(
                    INVALID_STATUS,
                    format!("status {s:?} is not one of {}", allowed.join(", ")),
                ))
            }
        }
    }
}

fn page_size(v: Option<String>) -> Result<i64, AdminError> {
    match given(v) {
        None => Ok(DEFAULT_LIMIT),
        Some(s) => s
            .parse::<i64>()
            .ok()
            .filter(|n| (1..=MAX_LIMIT).contains(n))
            .ok_or_else(|| {
                AdminError::bad_request(
                    INVALID_LIMIT,
                    format!("limit {s:?} must be a whole number within 1..={MAX_LIMIT}"),
                )
            }),
    }
}

fn type_filter(v: Option<String>) -> Result<Option<String>, AdminError> {
    match given(v) {
        Some(t) if t.len() > 200 => Err(AdminError::bad_request(
            INVALID_QUERY,
            "type must be at most 200 characters",
        )),
        t => Ok(t),
    }
}

fn parse_inbox_id(s: &str) -> Result<i64, AdminError> {
    s.trim()
        .parse::<i64>()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| {
            AdminError::bad_request(
                INVALID_ID,
                format!("{s:?} is not an inbox row id (a positive integer)"),
            )
        })
}

fn parse_event_id(s: &str) -> Result<uuid::Uuid, AdminError> {
    uuid::Uuid::parse_str(s.trim()).map_err(|_| {
        AdminError::bad_request(INVALID_ID, format!("{s:?} is not an event id (a UUID)"))
    })
}

fn cursor<T>(
    v: Option<String>,
    parse: impl Fn(&str) -> Result<T, AdminError>,
) -> Result<Option<T>, AdminError> {
    given(v)
        .map(|s| {
            parse(&s).map_err(|e| {
                AdminError::bad_request(INVALID_CURSOR, format!("before: {}", e.message))
            })
        })
        .transpose()
}

async fn list_outbox(_: Operator, st: web::Data<State>, q: web::Query<OutboxQuery>) -> Reply {
    let q = q.into_inner();
    let filter = stmt::ListFilter {
        status: status_filter(q.status, OUTBOX_STATUSES)?,
        event_type: type_filter(q.event_type)?,
        consumer: None,
        limit: page_size(q.limit)?,
        with_payload: st.redact.is_some(),
    };
    let before = cursor(q.before, parse_event_id)?;
    let mut conn = st.pool.get().await?;
    let items = stmt::list_outbox(&mut conn, &filter, before).await?;
    Ok(list_page(
        items,
        filter.limit,
        &st,
        |i| (&i.event_type, &mut i.payload),
        |i| i.id.to_string(),
    ))
}

async fn list_inbox(_: Operator, st: web::Data<State>, q: web::Query<InboxQuery>) -> Reply {
    let q = q.into_inner();
    let consumer = given(q.consumer)
        .map(|c| {
            ConsumerName::new(c.clone())
                .map(|_| c)
                .map_err(|e| AdminError::bad_request(INVALID_CONSUMER, e.to_string()))
        })
        .transpose()?;
    let filter = stmt::ListFilter {
        status: status_filter(q.status, INBOX_STATUSES)?,
        event_type: type_filter(q.event_type)?,
        consumer,
        limit: page_size(q.limit)?,
        with_payload: st.redact.is_some(),
    };
    let before = cursor(q.before, parse_inbox_id)?;
    let mut conn = st.pool.get().await?;
    let items = stmt::list_inbox(&mut conn, &filter, before).await?;
    Ok(list_page(
        items,
        filter.limit,
        &st,
        |i| (&i.event_type, &mut i.payload),
        |i| i.id.to_string(),
    ))
}

/// One page of a list: payloads redacted when the application enabled that view (otherwise
/// they were never selected), and the cursor of the next page when this one is full.
fn list_page<T: Serialize>(
    mut items: Vec<T>,
    limit: i64,
    st: &State,
    payload: impl Fn(&mut T) -> (&String, &mut Option<serde_json::Value>),
    id: impl Fn(&T) -> String,
) -> HttpResponse {
    if let Some(redact) = &st.redact {
        for item in &mut items {
            let (event_type, p) = payload(item);
            *p = p.take().map(|v| redact(event_type, &v));
        }
    }
    let next = (items.len() as i64 == limit)
        .then(|| items.last().map(&id))
        .flatten();
    ok_json(json!({"items": items, "next_before": next}))
}

async fn timeline(_: Operator, st: web::Data<State>, path: web::Path<String>) -> Reply {
    let correlation_id = path.into_inner();
    if correlation_id.is_empty() || correlation_id.len() > 200 {
        return Err(AdminError::bad_request(
            INVALID_ID,
            "a correlation id is 1-200 characters",
        ));
    }
    let mut conn = st.pool.get().await?;
    let mut entries = crate::outbox::timeline(&mut conn, &correlation_id).await?;
    // The library's timeline stops at its own bound; reaching it means there may be more.
    let truncated = entries.len() >= TIMELINE_LIMIT;
    entries.truncate(TIMELINE_LIMIT);
    if entries.is_empty() {
        return Err(AdminError::new(
            StatusCode::NOT_FOUND,
            CORRELATION_NOT_FOUND,
            format!("no outbox or inbox row has correlation id {correlation_id:?}"),
        ));
    }
    Ok(ok_json(json!({
        "correlation_id": correlation_id,
        "entries": entries,
        "truncated": truncated,
    })))
}

async fn consumers(_: Operator, st: web::Data<State>) -> Reply {
    let mut conn = st.pool.get().await?;
    let items = stmt::consumer_states(&mut conn).await?;
    Ok(ok_json(json!({ "items": items })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AuditQuery {
    before: Option<String>,
    limit: Option<String>,
}

async fn audit(_: Operator, st: web::Data<State>, q: web::Query<AuditQuery>) -> Reply {
    let q = q.into_inner();
    let limit = page_size(q.limit)?;
    let before = cursor(q.before, parse_inbox_id)?;
    let mut conn = st.pool.get().await?;
    let items = stmt::list_audit(&mut conn, before, limit).await?;
    let next = (items.len() as i64 == limit)
        .then(|| items.last().map(|i| i.id.to_string()))
        .flatten();
    Ok(ok_json(json!({"items": items, "next_before": next})))
}

// ---------------------------------------------------------------------------------------------
// Actions

/// An action's body, read up to [`MAX_BODY`] bytes. Past that, a JSON 413 `BODY_TOO_LARGE`
/// (actix's own limit would answer in plain text, without a code).
struct Body(web::Bytes);

impl FromRequest for Body {
    type Error = AdminError;
    type Future = futures_util::future::LocalBoxFuture<'static, Result<Self, AdminError>>;

    fn from_request(
        _: &actix_web::HttpRequest,
        payload: &mut actix_web::dev::Payload,
    ) -> Self::Future {
        use futures_util::StreamExt;
        let mut payload = payload.take();
        Box::pin(async move {
            let mut buf = web::BytesMut::new();
            while let Some(chunk) = payload.next().await {
                let chunk = chunk.map_err(|e| {
                    AdminError::bad_request(
                        INVALID_BODY,
                        format!("the body could not be read: {e}"),
                    )
                })?;
                if buf.len() + chunk.len() > MAX_BODY {
                    return Err(AdminError::new(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        BODY_TOO_LARGE,
                        format!("a body is at most {MAX_BODY} bytes"),
                    ));
                }
                buf.extend_from_slice(&chunk);
            }
            Ok(Body(buf.freeze()))
        })
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReasonBody {
    reason: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct BulkBody<T> {
    #[serde(default = "Vec::new")]
    ids: Vec<T>,
    confirm: Option<String>,
    reason: Option<String>,
}

/// Parses an optional JSON body: an empty body is the default (no reason, no ids).
fn parse_body<T: DeserializeOwned + Default>(body: &[u8]) -> Result<T, AdminError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| {
        AdminError::bad_request(
            INVALID_BODY,
            format!("the body is not valid for this action: {e}"),
        )
    })
}

fn reason(v: Option<String>, required: bool) -> Result<Option<String>, AdminError> {
    match given(v) {
        None if required => Err(AdminError::bad_request(
            REASON_REQUIRED,
            "this action needs a non-empty \"reason\", kept in the audit trail",
        )),
        Some(r) if r.chars().count() > MAX_REASON_CHARS => Err(AdminError::bad_request(
            REASON_TOO_LONG,
            format!("a reason is at most {MAX_REASON_CHARS} characters"),
        )),
        Some(r) if r.contains('\0') => Err(AdminError::bad_request(
            INVALID_BODY,
            "a reason must not hold a NUL character",
        )),
        r => Ok(r),
    }
}

/// Checks a bulk action's ids and confirmation before anything is read.
fn check_bulk(ids: &[String], confirm: Option<&str>) -> Result<(), AdminError> {
    let n = ids.len();
    if n == 0 {
        return Err(AdminError::bad_request(
            NO_IDS,
            "\"ids\" must name at least one row",
        ));
    }
    if n > MAX_BULK {
        return Err(AdminError::bad_request(
            TOO_MANY_IDS,
            format!("at most {MAX_BULK} rows per action, got {n}"),
        ));
    }
    if ids.iter().collect::<HashSet<_>>().len() != n {
        return Err(AdminError::bad_request(
            DUPLICATE_IDS,
            "\"ids\" names a row twice",
        ));
    }
    let want = format!("RETRY {n}");
    if confirm.map(str::trim) != Some(want.as_str()) {
        return Err(AdminError::bad_request(
            CONFIRMATION_MISMATCH,
            format!("set \"confirm\" to \"{want}\" to retry these {n} rows"),
        ));
    }
    Ok(())
}

/// The rows an action is about.
enum Ids {
    Inbox(Vec<i64>),
    Outbox(Vec<uuid::Uuid>),
}

impl Ids {
    fn table(&self) -> &'static str {
        match self {
            Ids::Inbox(_) => "inbox",
            Ids::Outbox(_) => "outbox",
        }
    }
    fn as_strings(&self) -> Vec<String> {
        match self {
            Ids::Inbox(v) => v.iter().map(i64::to_string).collect(),
            Ids::Outbox(v) => v.iter().map(uuid::Uuid::to_string).collect(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    Retry,
    Ignore,
}

/// What an action did: returned to the caller and, as `details`, kept in the audit row.
#[derive(Debug, Serialize)]
struct Outcome {
    action: String,
    target: String,
    changed: usize,
    audit_id: i64,
    /// The rows (or the consumer) as they were before the change.
    before: serde_json::Value,
}

/// Retry or ignore, in one transaction: lock the rows, refuse the whole action if any row is
/// missing or in the wrong state, change them, write the audit row.
async fn apply(
    st: &State,
    who: &str,
    ids: Ids,
    change: Change,
    reason: Option<String>,
    bulk: bool,
) -> Result<Outcome, AdminError> {
    let table = ids.table();
    let (name, allowed, wrong_code, verb) = match change {
        Change::Retry => ("retry", &["DEAD_LETTER"][..], NOT_A_DEAD_LETTER, "retried"),
        Change::Ignore => ("ignore", stmt::IGNORABLE, NOT_IGNORABLE, "ignored"),
    };
    // e.g. inbox.retry, outbox.retry_set, inbox.ignore
    let action = format!("{table}.{name}{}", if bulk { "_set" } else { "" });
    let wanted = ids.as_strings();
    let target = if bulk {
        format!("{table}:[{} rows]", wanted.len())
    } else {
        format!("{table}:{}", wanted.join(","))
    };
    let mut conn = st.pool.get().await?;
    let outcome = conn
        .transaction::<_, AdminError, _>(async |conn| {
            let rows = lock_rows(conn, &ids).await?;
            let missing: Vec<&str> = wanted
                .iter()
                .filter(|w| !rows.iter().any(|r| &r.id == *w))
                .map(String::as_str)
                .collect();
            if !missing.is_empty() {
                return Err(AdminError::new(
                    StatusCode::NOT_FOUND,
                    ROW_NOT_FOUND,
                    format!(
                        "no {table} row with id {}; nothing was changed",
                        missing.join(", ")
                    ),
                ));
            }
            let wrong: Vec<String> = rows
                .iter()
                .filter(|r| !allowed.contains(&r.status.as_str()))
                .map(|r| format!("{} is {}", r.id, r.status))
                .collect();
            if !wrong.is_empty() {
                return Err(AdminError::new(
                    StatusCode::CONFLICT,
                    wrong_code.clone(),
                    format!(
                        "only {} rows can be {verb} ({}); nothing was changed",
                        allowed.join(" or "),
                        wrong.join(", ")
                    ),
                ));
            }
            let changed = match (&ids, change) {
                (Ids::Inbox(v), Change::Retry) => stmt::retry_inbox(conn, v).await?,
                (Ids::Outbox(v), Change::Retry) => stmt::retry_outbox(conn, v).await?,
                (Ids::Inbox(v), Change::Ignore) => stmt::ignore_inbox(conn, v[0]).await?,
                (Ids::Outbox(v), Change::Ignore) => stmt::ignore_outbox(conn, v[0]).await?,
            };
            let before = json!({ "rows": rows });
            let audit_id =
                stmt::insert_audit(conn, who, &action, &target, reason.as_deref(), &before).await?;
            Ok(Outcome {
                action: action.clone(),
                target: target.clone(),
                changed,
                audit_id,
                before,
            })
        })
        .await?;
    log_action(who, &outcome, reason.as_deref());
    Ok(outcome)
}

/// How long an action waits for rows that a batch in progress holds.
const ROW_WAIT: Duration = Duration::from_secs(2);

/// Locks the action's rows, waiting up to [`ROW_WAIT`] for those a consumer batch or a
/// publisher holds (normally milliseconds). Past that — a handler hanging past its timeout
/// keeps its rows for as long as it hangs — the action is refused with `ROW_BUSY` rather than
/// left waiting with a connection taken from the pool.
async fn lock_rows(
    conn: &mut AsyncPgConnection,
    ids: &Ids,
) -> Result<Vec<stmt::LockedRow>, AdminError> {
    let deadline = std::time::Instant::now() + ROW_WAIT;
    loop {
        let (rows, existing) = match ids {
            Ids::Inbox(v) => stmt::lock_inbox(conn, v).await?,
            Ids::Outbox(v) => stmt::lock_outbox(conn, v).await?,
        };
        if rows.len() as i64 >= existing {
            return Ok(rows);
        }
        if std::time::Instant::now() >= deadline {
            return Err(AdminError::new(
                StatusCode::CONFLICT,
                ROW_BUSY,
                "a row is held by a batch in progress (a handler may be running past its \
                 timeout); nothing was changed, try again later",
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn log_action(who: &str, o: &Outcome, reason: Option<&str>) {
    tracing::info!(
        name: "admin.action",
        who, action = %o.action, target = %o.target, changed = o.changed, audit_id = o.audit_id,
        reason,
        "admin.action"
    );
}

/// One row, retried or ignored; ignoring needs a reason.
async fn act_on_one(
    op: Operator,
    st: web::Data<State>,
    ids: Ids,
    body: &web::Bytes,
    change: Change,
) -> Reply {
    let body: ReasonBody = parse_body(body)?;
    let reason = reason(body.reason, matches!(change, Change::Ignore))?;
    let out = apply(&st, &op.0, ids, change, reason, false).await?;
    Ok(ok_json(out))
}

async fn retry_inbox_one(
    op: Operator,
    st: web::Data<State>,
    path: web::Path<String>,
    Body(body): Body,
) -> Reply {
    let ids = Ids::Inbox(vec![parse_inbox_id(&path)?]);
    act_on_one(op, st, ids, &body, Change::Retry).await
}

async fn retry_outbox_one(
    op: Operator,
    st: web::Data<State>,
    path: web::Path<String>,
    Body(body): Body,
) -> Reply {
    let ids = Ids::Outbox(vec![parse_event_id(&path)?]);
    act_on_one(op, st, ids, &body, Change::Retry).await
}

async fn retry_inbox_set(op: Operator, st: web::Data<State>, Body(body): Body) -> Reply {
    let body: BulkBody<i64> = parse_body(&body)?;
    let strings: Vec<String> = body.ids.iter().map(i64::to_string).collect();
    check_bulk(&strings, body.confirm.as_deref())?;
    if let Some(bad) = body.ids.iter().find(|id| **id <= 0) {
        return Err(AdminError::bad_request(
            INVALID_ID,
            format!("{bad} is not an inbox row id (a positive integer)"),
        ));
    }
    let reason = reason(body.reason, false)?;
    let out = apply(
        &st,
        &op.0,
        Ids::Inbox(body.ids),
        Change::Retry,
        reason,
        true,
    )
    .await?;
    Ok(ok_json(out))
}

async fn retry_outbox_set(op: Operator, st: web::Data<State>, Body(body): Body) -> Reply {
    let body: BulkBody<uuid::Uuid> = parse_body(&body)?;
    let strings: Vec<String> = body.ids.iter().map(uuid::Uuid::to_string).collect();
    check_bulk(&strings, body.confirm.as_deref())?;
    let reason = reason(body.reason, false)?;
    let out = apply(
        &st,
        &op.0,
        Ids::Outbox(body.ids),
        Change::Retry,
        reason,
        true,
    )
    .await?;
    Ok(ok_json(out))
}

async fn ignore_inbox_one(
    op: Operator,
    st: web::Data<State>,
    path: web::Path<String>,
    Body(body): Body,
) -> Reply {
    let ids = Ids::Inbox(vec![parse_inbox_id(&path)?]);
    act_on_one(op, st, ids, &body, Change::Ignore).await
}

async fn ignore_outbox_one(
    op: Operator,
    st: web::Data<State>,
    path: web::Path<String>,
    Body(body): Body,
) -> Reply {
    let ids = Ids::Outbox(vec![parse_event_id(&path)?]);
    act_on_one(op, st, ids, &body, Change::Ignore).await
}

async fn pause(
    op: Operator,
    st: web::Data<State>,
    path: web::Path<String>,
    Body(body): Body,
) -> Reply {
    set_pause(op, st, path, body, true).await
}

async fn resume(
    op: Operator,
    st: web::Data<State>,
    path: web::Path<String>,
    Body(body): Body,
) -> Reply {
    set_pause(op, st, path, body, false).await
}

/// The pause switch through the library's own [`pause_consumer`] / [`resume_consumer`].
async fn set_pause(
    op: Operator,
    st: web::Data<State>,
    path: web::Path<String>,
    body: web::Bytes,
    paused: bool,
) -> Reply {
    let name = consumer_name(path.into_inner())?;
    let body: ReasonBody = parse_body(&body)?;
    let reason = reason(body.reason, paused)?;
    let change = if paused {
        ConsumerChange::Pause
    } else {
        ConsumerChange::Resume
    };
    consumer_action(&op, &st, &name, change, reason).await
}

/// Removes a consumer's subscription through the library's own [`unsubscribe`]. Needs a
/// reason: events of that type stop reaching the consumer, which is only right once no
/// instance runs code that handles them.
async fn remove_subscription(
    op: Operator,
    st: web::Data<State>,
    path: web::Path<(String, String)>,
    Body(body): Body,
) -> Reply {
    let (name, event_type) = path.into_inner();
    let name = consumer_name(name)?;
    let body: ReasonBody = parse_body(&body)?;
    let reason = reason(body.reason, true)?;
    consumer_action(
        &op,
        &st,
        &name,
        ConsumerChange::Unsubscribe(event_type),
        reason,
    )
    .await
}

fn consumer_name(name: String) -> Result<ConsumerName, AdminError> {
    ConsumerName::new(name).map_err(|e| AdminError::bad_request(INVALID_CONSUMER, e.to_string()))
}

/// What an action does to a consumer.
enum ConsumerChange {
    Pause,
    Resume,
    Unsubscribe(String),
}

/// An action on a consumer, in one transaction with its audit row: lock the consumer's state
/// row (404 for a consumer never registered), make the change, write the audit row.
async fn consumer_action(
    op: &Operator,
    st: &State,
    name: &ConsumerName,
    change: ConsumerChange,
    reason: Option<String>,
) -> Reply {
    let who = op.0.as_str();
    let action = match change {
        ConsumerChange::Pause => "consumer.pause",
        ConsumerChange::Resume => "consumer.resume",
        ConsumerChange::Unsubscribe(_) => "consumer.unsubscribe",
    };
    let target = format!("consumer:{name}");
    let mut conn = st.pool.get().await?;
    let outcome = conn
        .transaction::<_, AdminError, _>(async |conn| {
            let was_paused = stmt::lock_consumer(conn, name.as_str())
                .await?
                .ok_or_else(|| {
                    AdminError::new(
                        StatusCode::NOT_FOUND,
                        crate::ErrorCode::CONSUMER_UNKNOWN,
                        format!("no consumer {name} was ever registered"),
                    )
                })?;
            let before = match &change {
                ConsumerChange::Pause => {
                    let why = reason.as_deref().unwrap_or_default();
                    pause_consumer(conn, name, who, why).await?;
                    json!({ "paused": was_paused })
                }
                ConsumerChange::Resume => {
                    resume_consumer(conn, name, who).await?;
                    json!({ "paused": was_paused })
                }
                ConsumerChange::Unsubscribe(event_type) => {
                    if !unsubscribe(conn, name, event_type).await? {
                        return Err(AdminError::new(
                            StatusCode::NOT_FOUND,
                            SUBSCRIPTION_NOT_FOUND,
                            format!("consumer {name} is not subscribed to {event_type}"),
                        ));
                    }
                    json!({ "event_type": event_type, "subscribed": true })
                }
            };
            let audit_id =
                stmt::insert_audit(conn, who, action, &target, reason.as_deref(), &before).await?;
            Ok(Outcome {
                action: action.to_owned(),
                target: target.clone(),
                changed: 1,
                audit_id,
                before,
            })
        })
        .await?;
    log_action(who, &outcome, reason.as_deref());
    Ok(ok_json(outcome))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bulk_input_is_checked_in_a_stable_order() {
        let ids = |n: usize| (1..=n).map(|i| i.to_string()).collect::<Vec<_>>();
        let code = |r: Result<(), AdminError>| r.unwrap_err().code.as_str().to_owned();
        assert_eq!(code(check_bulk(&[], Some("RETRY 0"))), "NO_IDS");
        assert_eq!(
            code(check_bulk(&ids(101), Some("RETRY 101"))),
            "TOO_MANY_IDS"
        );
        let twice = vec!["1".to_owned(), "1".to_owned()];
        assert_eq!(code(check_bulk(&twice, Some("RETRY 2"))), "DUPLICATE_IDS");
        assert_eq!(
            code(check_bulk(&ids(3), Some("RETRY 2"))),
            "CONFIRMATION_MISMATCH"
        );
        assert_eq!(code(check_bulk(&ids(3), None)), "CONFIRMATION_MISMATCH");
        assert!(check_bulk(&ids(3), Some("RETRY 3")).is_ok());
        assert!(check_bulk(&ids(100), Some(" RETRY 100 ")).is_ok());
    }

    #[test]
    fn filters_are_validated() {
        assert_eq!(
            status_filter(Some("dead_letter".into()), INBOX_STATUSES)
                .unwrap()
                .as_deref(),
            Some("DEAD_LETTER")
        );
        assert_eq!(
            status_filter(Some("".into()), INBOX_STATUSES).unwrap(),
            None
        );
        let e = status_filter(Some("PUBLISHED".into()), INBOX_STATUSES).unwrap_err();
        assert_eq!(e.code.as_str(), "INVALID_STATUS");
        assert_eq!(page_size(None).unwrap(), 50);
        assert_eq!(page_size(Some("200".into())).unwrap(), 200);
        for bad in ["0", "201", "-1", "ten"] {
            assert_eq!(
                page_size(Some(bad.into())).unwrap_err().code.as_str(),
                "INVALID_LIMIT"
            );
        }
        assert_eq!(parse_inbox_id("0").unwrap_err().code.as_str(), "INVALID_ID");
        assert_eq!(
            parse_event_id("nope").unwrap_err().code.as_str(),
            "INVALID_ID"
        );
    }

    #[test]
    fn reasons_are_trimmed_and_bounded() {
        assert_eq!(reason(Some("  ".into()), false).unwrap(), None);
        assert_eq!(
            reason(None, true).unwrap_err().code.as_str(),
            "REASON_REQUIRED"
        );
        assert_eq!(
            reason(Some(" x ".into()), true).unwrap().as_deref(),
            Some("x")
        );
        let long = "x".repeat(1001);
        assert_eq!(
            reason(Some(long), false).unwrap_err().code.as_str(),
            "REASON_TOO_LONG"
        );
    }

    #[test]
    fn an_empty_body_is_the_default_and_junk_is_refused() {
        let b: ReasonBody = parse_body(b"").unwrap();
        assert!(b.reason.is_none());
        let e = parse_body::<ReasonBody>(b"{\"reason\": 3}").unwrap_err();
        assert_eq!(e.code.as_str(), "INVALID_BODY");
        let e = parse_body::<ReasonBody>(b"{\"reasn\": \"x\"}").unwrap_err();
        assert_eq!(e.code.as_str(), "INVALID_BODY");
    }
}
