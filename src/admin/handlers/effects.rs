//! Side effects for operators: list them, retry dead letters (one, or paced in bulk), set one
//! aside. The actions go through the same `apply` as the inbox's and the outbox's: validated,
//! locked, re-checked, changed and audited in one transaction.

use actix_web::web;
use serde::Deserialize;

use crate::admin::auth::Operator;
use crate::admin::State;
use crate::store::admin::effects;

use super::actions::{act_on_one, retry_numbered_set, Change, Ids};
use super::input::Body;
use super::reads::{cursor, page_size, parse_inbox_id, status_filter, type_filter};
use super::*;

/// Query of `GET /effects`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EffectsQuery {
    status: Option<String>,
    kind: Option<String>,
    before: Option<String>,
    limit: Option<String>,
}

/// Side effects, newest first, by status and kind; no payloads.
pub(super) async fn list(_: Operator, st: web::Data<State>, q: web::Query<EffectsQuery>) -> Reply {
    let q = q.into_inner();
    let status = status_filter(q.status, effects::STATUSES)?;
    let kind = type_filter(q.kind)?;
    let limit = page_size(q.limit)?;
    let before = cursor(q.before, parse_inbox_id)?;
    let mut conn = st.pool.get().await?;
    let items = effects::list(&mut conn, status.as_deref(), kind.as_deref(), before, limit).await?;
    let next = (items.len() as i64 == limit)
        .then(|| items.last().map(|i| i.id.to_string()))
        .flatten();
    Ok(ok_json(
        serde_json::json!({"items": items, "next_before": next}),
    ))
}

pub(super) async fn retry_one(
    op: Operator,
    st: web::Data<State>,
    path: web::Path<String>,
    Body(body): Body,
) -> Reply {
    let ids = Ids::Effect(vec![parse_inbox_id(&path)?]);
    act_on_one(op, st, ids, &body, Change::Retry { per_second: None }).await
}

pub(super) async fn ignore_one(
    op: Operator,
    st: web::Data<State>,
    path: web::Path<String>,
    Body(body): Body,
) -> Reply {
    let ids = Ids::Effect(vec![parse_inbox_id(&path)?]);
    act_on_one(op, st, ids, &body, Change::Ignore).await
}

/// Several dead letters, made due at the request's pace (default 10 a second).
pub(super) async fn retry_set(op: Operator, st: web::Data<State>, Body(body): Body) -> Reply {
    retry_numbered_set(op, st, &body, "a side effect's id", Ids::Effect).await
}
