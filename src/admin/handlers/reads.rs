//! The read-only routes: health, overview, metrics, lists, timeline, consumers, audit.

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpResponse};
use diesel_async::AsyncPgConnection;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::admin::auth::Operator;
use crate::admin::error::*;
use crate::admin::State;
use crate::event::ConsumerName;
use crate::maintenance::health::{self, human, HealthConfig, HealthReport, HealthState};
use crate::store::{self, admin as stmt};

use super::*;

pub(super) async fn health(_: Operator, st: web::Data<State>) -> Reply {
    let mut conn = st.pool.get().await?;
    Ok(ok_json(current_health(&mut conn).await?))
}

/// The newest sampler's report, flagged when it is too old to trust. Without any sample (no
/// runtime has run on this database yet), a report from the live gauges and the default
/// thresholds, flagged as such.
pub(super) async fn current_health(
    conn: &mut AsyncPgConnection,
) -> Result<HealthReport, AdminError> {
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
            let floor = HealthConfig::default().snapshot_warn_after;
            let sample = store::stats::snapshot(conn, floor).await?;
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
pub(super) async fn overview(_: Operator, st: web::Data<State>) -> Reply {
    let mut conn = st.pool.get().await?;
    let health = current_health(&mut conn).await?;
    let live =
        store::stats::snapshot(&mut conn, HealthConfig::default().snapshot_warn_after).await?;
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
                "paused_until": state.and_then(|s| s.paused_until).filter(|_| c.paused),
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

pub(super) async fn metrics_text(_: Operator, st: web::Data<State>) -> Reply {
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
pub(super) struct OutboxQuery {
    status: Option<String>,
    #[serde(rename = "type")]
    event_type: Option<String>,
    before: Option<String>,
    limit: Option<String>,
}

/// Query of `GET /inbox`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct InboxQuery {
    status: Option<String>,
    #[serde(rename = "type")]
    event_type: Option<String>,
    consumer: Option<String>,
    before: Option<String>,
    limit: Option<String>,
}

/// Empty parameters (`?status=`, as a form sends them) mean "no filter".
/// A `consumer` filter: absent, or a valid consumer name.
fn consumer_filter(v: Option<String>) -> Result<Option<String>, AdminError> {
    given(v)
        .map(|c| {
            ConsumerName::new(c.clone())
                .map(|_| c)
                .map_err(|e| AdminError::bad_request(INVALID_CONSUMER, e.to_string()))
        })
        .transpose()
}

pub(super) fn given(v: Option<String>) -> Option<String> {
    v.map(|s| s.trim().to_owned()).filter(|s| !s.is_empty())
}

pub(super) fn status_filter(
    v: Option<String>,
    allowed: &[&str],
) -> Result<Option<String>, AdminError> {
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

pub(super) fn page_size(v: Option<String>) -> Result<i64, AdminError> {
    whole_number(v, "limit", DEFAULT_LIMIT, MAX_LIMIT, INVALID_LIMIT)
}

/// The query parameter `name`: `default` when absent or blank, else a whole number within
/// `1..=max`, refused with `code` otherwise.
pub(super) fn whole_number(
    v: Option<String>,
    name: &str,
    default: i64,
    max: i64,
    code: crate::ErrorCode,
) -> Result<i64, AdminError> {
    match given(v) {
        None => Ok(default),
        Some(s) => s
            .parse::<i64>()
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| {
                AdminError::bad_request(
                    code,
                    format!("{name} {s:?} must be a whole number within 1..={max}"),
                )
            }),
    }
}

pub(super) fn type_filter(v: Option<String>) -> Result<Option<String>, AdminError> {
    match given(v) {
        Some(t) if t.len() > 200 => Err(AdminError::bad_request(
            INVALID_QUERY,
            "type must be at most 200 characters",
        )),
        t => Ok(t),
    }
}

pub(super) fn parse_inbox_id(s: &str) -> Result<i64, AdminError> {
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

pub(super) fn parse_event_id(s: &str) -> Result<uuid::Uuid, AdminError> {
    uuid::Uuid::parse_str(s.trim()).map_err(|_| {
        AdminError::bad_request(INVALID_ID, format!("{s:?} is not an event id (a UUID)"))
    })
}

pub(super) fn cursor<T>(
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

pub(super) async fn list_outbox(
    _: Operator,
    st: web::Data<State>,
    q: web::Query<OutboxQuery>,
) -> Reply {
    let q = q.into_inner();
    let filter = stmt::ListFilter {
        status: status_filter(q.status, &OutboxStatus::names())?,
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

/// The inbox list's status filters: the stored statuses and IN_FLIGHT.
fn inbox_statuses() -> Vec<&'static str> {
    let mut names = InboxStatus::names();
    names.push(stmt::IN_FLIGHT);
    names
}

pub(super) async fn list_inbox(
    _: Operator,
    st: web::Data<State>,
    q: web::Query<InboxQuery>,
) -> Reply {
    let q = q.into_inner();
    let consumer = consumer_filter(q.consumer)?;
    let filter = stmt::ListFilter {
        status: status_filter(q.status, &inbox_statuses())?,
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

/// One event across the consumers: its outbox row, and for each consumer whether it got the
/// event, its state, attempts, last error and when it was processed. An event whose type no
/// consumer was subscribed to when it was published has no consumer here (`reached` 0), which
/// the health report's `EVENTS_UNROUTED` also says.
pub(super) async fn event(_: Operator, st: web::Data<State>, path: web::Path<String>) -> Reply {
    let id = parse_event_id(&path.into_inner())?;
    let mut conn = st.pool.get().await?;
    let (mut outbox, consumers) = stmt::event_fanout(&mut conn, id, st.redact.is_some()).await?;
    if outbox.is_none() && consumers.iter().all(|c| !c.got) {
        return Err(AdminError::new(
            StatusCode::NOT_FOUND,
            EVENT_NOT_FOUND,
            format!("no outbox or inbox row has event id {id}"),
        ));
    }
    if let (Some(redact), Some(o)) = (&st.redact, outbox.as_mut()) {
        o.payload = o.payload.take().map(|v| redact(&o.event_type, &v));
    }
    let reached = consumers.iter().filter(|c| c.got).count();
    // Where it came from: this database's outbox, or a broker (`receive`).
    let source = if outbox.is_some() { "outbox" } else { "broker" };
    Ok(ok_json(json!({
        "event_id": id,
        "source": source,
        "outbox": outbox,
        "reached": reached,
        "consumers": consumers,
    })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct BlockedQuery {
    consumer: Option<String>,
    limit: Option<String>,
}

/// The aggregates ordered consumers are held up on: each one's failed head event and how
/// many events wait behind it.
pub(super) async fn blocked(
    _: Operator,
    st: web::Data<State>,
    q: web::Query<BlockedQuery>,
) -> Reply {
    let q = q.into_inner();
    let consumer = consumer_filter(q.consumer)?;
    let limit = page_size(q.limit)?;
    let mut conn = st.pool.get().await?;
    let items = stmt::blocked_aggregates(&mut conn, consumer.as_deref(), limit).await?;
    Ok(ok_json(json!({ "items": items })))
}

/// One page of a list: payloads redacted when the application enabled that view (otherwise
/// they were never selected), and the cursor of the next page when this one is full.
pub(super) fn list_page<T: Serialize>(
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

pub(super) async fn timeline(_: Operator, st: web::Data<State>, path: web::Path<String>) -> Reply {
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

pub(super) async fn consumers(_: Operator, st: web::Data<State>) -> Reply {
    let mut conn = st.pool.get().await?;
    let items = stmt::consumer_states(&mut conn).await?;
    Ok(ok_json(json!({ "items": items })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AuditQuery {
    before: Option<String>,
    limit: Option<String>,
}

pub(super) async fn audit(_: Operator, st: web::Data<State>, q: web::Query<AuditQuery>) -> Reply {
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
