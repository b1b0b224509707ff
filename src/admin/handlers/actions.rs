//! The actions: each validates its whole input, then locks, re-checks, changes and audits
//! its rows in one transaction.

use std::collections::HashSet;
use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::web;
use chrono::{DateTime, Utc};
use diesel_async::{AsyncConnection, AsyncPgConnection};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::admin::auth::Operator;
use crate::admin::error::*;
use crate::admin::State;
use crate::event::ConsumerName;
use crate::inbox::{pause_consumer, resume_consumer, unsubscribe};
use crate::store::admin as stmt;
use crate::store::admin::effects;

/// Side effects an operator may set aside: dead letters, and effects still waiting (one whose
/// call is running is held, `ROW_BUSY`).
const EFFECT_IGNORABLE: &[&str] = &["DEAD_LETTER", "PENDING"];

use super::input::{parse_body, reason, Body};
use super::*;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReasonBody {
    reason: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct BulkBody<T> {
    #[serde(default = "Vec::new")]
    ids: Vec<T>,
    confirm: Option<String>,
    reason: Option<String>,
    /// A bulk retry's pace, rows due per second (default [`BULK_RETRY_PER_SECOND`]).
    rate: Option<u32>,
}

/// A bulk retry's pace from its request: 1..=10000 rows per second.
fn pace(rate: Option<u32>) -> Result<Option<u32>, AdminError> {
    match rate.unwrap_or(BULK_RETRY_PER_SECOND) {
        r @ 1..=10_000 => Ok(Some(r)),
        _ => Err(AdminError::bad_request(
            INVALID_BODY,
            "\"rate\" is rows made due per second, 1 to 10000",
        )),
    }
}

/// Checks a bulk action's ids and confirmation before anything is read.
pub(super) fn check_bulk(ids: &[String], confirm: Option<&str>) -> Result<(), AdminError> {
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
pub(super) enum Ids {
    Inbox(Vec<i64>),
    Outbox(Vec<uuid::Uuid>),
    /// Side effects (`side_effects` ids).
    Effect(Vec<i64>),
}

impl Ids {
    fn table(&self) -> &'static str {
        match self {
            Ids::Inbox(_) => "inbox",
            Ids::Outbox(_) => "outbox",
            Ids::Effect(_) => "effect",
        }
    }
    fn as_strings(&self) -> Vec<String> {
        match self {
            Ids::Inbox(v) | Ids::Effect(v) => v.iter().map(i64::to_string).collect(),
            Ids::Outbox(v) => v.iter().map(uuid::Uuid::to_string).collect(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Change {
    /// Back to work; a bulk retry at most `per_second` rows due per second (the first now).
    Retry {
        per_second: Option<u32>,
    },
    Ignore,
}

/// How fast a bulk retry makes its rows due, unless the request says (`"rate"`): not all at
/// once, so that a hundred rows that failed together do not hit their dependency together.
pub(super) const BULK_RETRY_PER_SECOND: u32 = 10;

/// What an action did: returned to the caller and, as `details`, kept in the audit row.
#[derive(Debug, Serialize)]
pub(super) struct Outcome {
    action: String,
    target: String,
    changed: usize,
    audit_id: i64,
    /// The rows (or the consumer) as they were before the change.
    before: serde_json::Value,
    /// A bulk retry's pace: rows due per second, and in how many seconds the last is due.
    #[serde(skip_serializing_if = "Option::is_none")]
    pace: Option<serde_json::Value>,
}

/// Retry or ignore, in one transaction: lock the rows, refuse the whole action if any row is
/// missing or in the wrong state, change them, write the audit row.
pub(super) async fn apply(
    st: &State,
    who: &str,
    ids: Ids,
    change: Change,
    reason: Option<String>,
    bulk: bool,
) -> Result<Outcome, AdminError> {
    let table = ids.table();
    let (name, allowed, wrong_code, verb) = match change {
        Change::Retry { .. } => ("retry", stmt::RETRYABLE, NOT_A_DEAD_LETTER, "retried"),
        Change::Ignore if matches!(ids, Ids::Effect(_)) => {
            ("ignore", EFFECT_IGNORABLE, NOT_IGNORABLE, "ignored")
        }
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
            let rows = lock_rows(conn, &ids, matches!(change, Change::Ignore)).await?;
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
                (Ids::Inbox(v), Change::Retry { per_second }) => {
                    stmt::retry_inbox(conn, v, per_second).await?
                }
                (Ids::Outbox(v), Change::Retry { per_second }) => {
                    stmt::retry_outbox(conn, v, per_second).await?
                }
                (Ids::Inbox(v), Change::Ignore) => stmt::ignore_inbox(conn, v[0]).await?,
                (Ids::Outbox(v), Change::Ignore) => stmt::ignore_outbox(conn, v[0]).await?,
                (Ids::Effect(v), Change::Retry { per_second }) => {
                    effects::retry(conn, v, per_second).await?
                }
                (Ids::Effect(v), Change::Ignore) => effects::ignore(conn, v[0]).await?,
            };
            let pace = match change {
                Change::Retry {
                    per_second: Some(r),
                } => Some(json!({ "per_second": r,
                    "last_due_in_seconds": changed.saturating_sub(1) as f64 / f64::from(r) })),
                _ => None,
            };
            let mut before = json!({ "rows": rows });
            if let Some(p) = &pace {
                before["pace"] = p.clone();
            }
            let audit_id =
                stmt::insert_audit(conn, who, &action, &target, reason.as_deref(), &before).await?;
            Ok(Outcome {
                action: action.clone(),
                target: target.clone(),
                changed,
                audit_id,
                before,
                pace,
            })
        })
        .await?;
    log_action(who, &outcome, reason.as_deref());
    Ok(outcome)
}

/// How long an action waits for rows that a batch in progress holds.
pub(super) const ROW_WAIT: Duration = Duration::from_secs(2);

/// Locks the action's rows, waiting up to [`ROW_WAIT`] for those a consumer batch or a
/// publisher holds (normally milliseconds). Past that — a handler hanging past its timeout
/// keeps its rows for as long as it hangs — the action is refused with `ROW_BUSY` rather than
/// left waiting with a connection taken from the pool.
pub(super) async fn lock_rows(
    conn: &mut AsyncPgConnection,
    ids: &Ids,
    in_flight_matters: bool,
) -> Result<Vec<stmt::LockedRow>, AdminError> {
    let deadline = std::time::Instant::now() + ROW_WAIT;
    loop {
        let (rows, existing) = match ids {
            Ids::Inbox(v) => stmt::lock_inbox(conn, v, in_flight_matters).await?,
            Ids::Outbox(v) => stmt::lock_outbox(conn, v).await?,
            Ids::Effect(v) => effects::lock(conn, v).await?,
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

pub(super) fn log_action(who: &str, o: &Outcome, reason: Option<&str>) {
    tracing::info!(
        name: "admin.action",
        who, action = %o.action, target = %o.target, changed = o.changed, audit_id = o.audit_id,
        reason,
        "admin.action"
    );
}

/// One row, retried or ignored; ignoring needs a reason.
pub(super) async fn act_on_one(
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

pub(super) async fn retry_inbox_one(
    op: Operator,
    st: web::Data<State>,
    path: web::Path<String>,
    Body(body): Body,
) -> Reply {
    let ids = Ids::Inbox(vec![parse_inbox_id(&path)?]);
    act_on_one(op, st, ids, &body, Change::Retry { per_second: None }).await
}

pub(super) async fn retry_outbox_one(
    op: Operator,
    st: web::Data<State>,
    path: web::Path<String>,
    Body(body): Body,
) -> Reply {
    let ids = Ids::Outbox(vec![parse_event_id(&path)?]);
    act_on_one(op, st, ids, &body, Change::Retry { per_second: None }).await
}

pub(super) async fn retry_inbox_set(op: Operator, st: web::Data<State>, Body(body): Body) -> Reply {
    retry_numbered_set(op, st, &body, "an inbox row id", Ids::Inbox).await
}

/// A bulk retry of rows whose ids are positive integers (`what`, for the error): inbox rows,
/// side effects.
pub(super) async fn retry_numbered_set(
    op: Operator,
    st: web::Data<State>,
    body: &[u8],
    what: &str,
    ids: fn(Vec<i64>) -> Ids,
) -> Reply {
    let body: BulkBody<i64> = parse_body(body)?;
    let strings: Vec<String> = body.ids.iter().map(i64::to_string).collect();
    check_bulk(&strings, body.confirm.as_deref())?;
    if let Some(bad) = body.ids.iter().find(|id| **id <= 0) {
        return Err(AdminError::bad_request(
            INVALID_ID,
            format!("{bad} is not {what} (a positive integer)"),
        ));
    }
    let reason = reason(body.reason, false)?;
    let per_second = pace(body.rate)?;
    let change = Change::Retry { per_second };
    let out = apply(&st, &op.0, ids(body.ids), change, reason, true).await?;
    Ok(ok_json(out))
}

pub(super) async fn retry_outbox_set(
    op: Operator,
    st: web::Data<State>,
    Body(body): Body,
) -> Reply {
    let body: BulkBody<uuid::Uuid> = parse_body(&body)?;
    let strings: Vec<String> = body.ids.iter().map(uuid::Uuid::to_string).collect();
    check_bulk(&strings, body.confirm.as_deref())?;
    let reason = reason(body.reason, false)?;
    let per_second = pace(body.rate)?;
    let out = apply(
        &st,
        &op.0,
        Ids::Outbox(body.ids),
        Change::Retry { per_second },
        reason,
        true,
    )
    .await?;
    Ok(ok_json(out))
}

pub(super) async fn ignore_inbox_one(
    op: Operator,
    st: web::Data<State>,
    path: web::Path<String>,
    Body(body): Body,
) -> Reply {
    let ids = Ids::Inbox(vec![parse_inbox_id(&path)?]);
    act_on_one(op, st, ids, &body, Change::Ignore).await
}

pub(super) async fn ignore_outbox_one(
    op: Operator,
    st: web::Data<State>,
    path: web::Path<String>,
    Body(body): Body,
) -> Reply {
    let ids = Ids::Outbox(vec![parse_event_id(&path)?]);
    act_on_one(op, st, ids, &body, Change::Ignore).await
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PauseBody {
    reason: Option<String>,
    /// RFC 3339; the pause lifts itself then.
    until: Option<String>,
}

/// Pauses a consumer through the library's own [`pause_consumer`]: a reason is required, an
/// end (`until`, in the future) is optional. A consumer not registered yet may be paused, so
/// that a new consumer ships switched off.
pub(super) async fn pause(
    op: Operator,
    st: web::Data<State>,
    path: web::Path<String>,
    Body(body): Body,
) -> Reply {
    let name = consumer_name(path.into_inner())?;
    let body: PauseBody = parse_body(&body)?;
    let reason = reason(body.reason, true)?;
    let until = given(body.until)
        .map(|u| {
            let at = DateTime::parse_from_rfc3339(&u).map_err(|e| {
                AdminError::bad_request(INVALID_BODY, format!("until {u:?} is not RFC 3339: {e}"))
            })?;
            let at = at.with_timezone(&Utc);
            if at <= Utc::now() {
                return Err(AdminError::bad_request(
                    INVALID_BODY,
                    format!("until {u:?} has passed: the pause would end before it began"),
                ));
            }
            Ok(at)
        })
        .transpose()?;
    consumer_action(&op, &st, &name, ConsumerChange::Pause(until), reason).await
}

/// Resumes a consumer through the library's own [`resume_consumer`].
pub(super) async fn resume(
    op: Operator,
    st: web::Data<State>,
    path: web::Path<String>,
    Body(body): Body,
) -> Reply {
    let name = consumer_name(path.into_inner())?;
    let body: ReasonBody = parse_body(&body)?;
    let reason = reason(body.reason, false)?;
    consumer_action(&op, &st, &name, ConsumerChange::Resume, reason).await
}

/// Removes a consumer's subscription through the library's own [`unsubscribe`]. Needs a
/// reason: events of that type stop reaching the consumer, which is only right once no
/// instance runs code that handles them.
pub(super) async fn remove_subscription(
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

pub(super) fn consumer_name(name: String) -> Result<ConsumerName, AdminError> {
    ConsumerName::new(name).map_err(|e| AdminError::bad_request(INVALID_CONSUMER, e.to_string()))
}

/// What an action does to a consumer.
pub(super) enum ConsumerChange {
    /// Until the time given, if any.
    Pause(Option<DateTime<Utc>>),
    Resume,
    Unsubscribe(String),
}

/// An action on a consumer, in one transaction with its audit row: lock the consumer's state
/// row (404 for a consumer never registered), make the change, write the audit row.
pub(super) async fn consumer_action(
    op: &Operator,
    st: &State,
    name: &ConsumerName,
    change: ConsumerChange,
    reason: Option<String>,
) -> Reply {
    let who = op.0.as_str();
    let action = match change {
        ConsumerChange::Pause(_) => "consumer.pause",
        ConsumerChange::Resume => "consumer.resume",
        ConsumerChange::Unsubscribe(_) => "consumer.unsubscribe",
    };
    let target = format!("consumer:{name}");
    let mut conn = st.pool.get().await?;
    let outcome = conn
        .transaction::<_, AdminError, _>(async |conn| {
            let state = stmt::lock_consumer(conn, name.as_str()).await?;
            let unknown = || {
                AdminError::new(
                    StatusCode::NOT_FOUND,
                    crate::ErrorCode::CONSUMER_UNKNOWN,
                    format!("no consumer {name} was ever registered"),
                )
            };
            let before = match &change {
                ConsumerChange::Pause(until) => {
                    let why = reason.as_deref().unwrap_or_default();
                    pause_consumer(conn, name, who, why, *until).await?;
                    json!({ "paused": state.unwrap_or_default(), "registered": state.is_some() })
                }
                ConsumerChange::Resume => {
                    let was_paused = state.ok_or_else(unknown)?;
                    resume_consumer(conn, name, who).await?;
                    json!({ "paused": was_paused })
                }
                ConsumerChange::Unsubscribe(event_type) => {
                    state.ok_or_else(unknown)?;
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
                pace: None,
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
            status_filter(Some("dead_letter".into()), &InboxStatus::names())
                .unwrap()
                .as_deref(),
            Some("DEAD_LETTER")
        );
        assert_eq!(
            status_filter(Some("".into()), &InboxStatus::names()).unwrap(),
            None
        );
        let e = status_filter(Some("PUBLISHED".into()), &InboxStatus::names()).unwrap_err();
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
