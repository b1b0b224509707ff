//! Replays: ask for one (`POST /consumers/{name}/replay`), list them with their progress
//! (`GET /replays`), cancel one (`POST /replays/{id}/cancel`). Each goes through the library's
//! own [`ops`](crate::ops) function, which checks the request and writes the audit row.

use actix_web::web;
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::json;

use crate::admin::auth::Operator;
use crate::admin::error::*;
use crate::admin::State;
use crate::inbox::{cancel_replay, replay as ask, replays, ReplayRange};

use super::actions::consumer_name;
use super::input::{parse_body, reason, Body};
use super::reads::given;
use super::*;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReplayBody {
    reason: Option<String>,
    #[serde(default)]
    event_types: Vec<String>,
    /// RFC 3339: events written at or after.
    from: Option<String>,
    /// RFC 3339: events written before.
    until: Option<String>,
    correlation_id: Option<String>,
    /// Events per second.
    rate: Option<f64>,
}

fn instant(field: &str, v: Option<String>) -> Result<Option<DateTime<Utc>>, AdminError> {
    given(v)
        .map(|v| {
            DateTime::parse_from_rfc3339(&v)
                .map(|t| t.with_timezone(&Utc))
                .map_err(|e| {
                    AdminError::bad_request(
                        INVALID_BODY,
                        format!("{field} {v:?} is not RFC 3339: {e}"),
                    )
                })
        })
        .transpose()
}

/// Asks for a replay of a consumer's processed events; a reason is required.
pub(super) async fn replay(
    op: Operator,
    st: web::Data<State>,
    path: web::Path<String>,
    Body(body): Body,
) -> Reply {
    let name = consumer_name(path.into_inner())?;
    let body: ReplayBody = parse_body(&body)?;
    let why = reason(body.reason, true)?.unwrap_or_default();
    let mut range = ReplayRange::all();
    for t in &body.event_types {
        range = range.event_type(t.trim());
    }
    if let Some(from) = instant("from", body.from)? {
        range = range.created_from(from);
    }
    if let Some(until) = instant("until", body.until)? {
        range = range.created_until(until);
    }
    if let Some(c) = given(body.correlation_id) {
        range = range.correlation_id(&c);
    }
    if let Some(rate) = body.rate {
        range = range.rate(rate);
    }
    let mut conn = st.pool.get().await?;
    let replay = ask(&mut conn, &name, &range, op.0.as_str(), &why).await?;
    Ok(ok_json(replay))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReplaysQuery {
    consumer: Option<String>,
}

/// The newest replays, with their progress (`done` of `total`).
pub(super) async fn list(_: Operator, st: web::Data<State>, q: web::Query<ReplaysQuery>) -> Reply {
    let consumer = given(q.into_inner().consumer)
        .map(consumer_name)
        .transpose()?;
    let mut conn = st.pool.get().await?;
    let items = replays(&mut conn, consumer.as_ref()).await?;
    Ok(ok_json(json!({ "items": items })))
}

/// Cancels a running replay; what it re-applied stays.
pub(super) async fn cancel(op: Operator, st: web::Data<State>, path: web::Path<i64>) -> Reply {
    let mut conn = st.pool.get().await?;
    let replay = cancel_replay(&mut conn, path.into_inner(), op.0.as_str()).await?;
    Ok(ok_json(replay))
}
