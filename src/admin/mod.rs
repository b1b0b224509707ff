//! The operator API: an actix-web scope the application mounts ([`admin_scope`]), with a
//! dashboard page, lag health, a Prometheus endpoint, bounded lists and the few actions an
//! operator needs. `auth` decides who may call it, `handlers` holds the routes, `error` the
//! JSON errors and their stable codes; `dashboard.html` is the page, embedded at build time.

#![cfg(feature = "admin")]

mod auth;
mod error;
mod handlers;

use std::sync::Arc;

use actix_web::{HttpRequest, Scope};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::error::{Error, Result};
use crate::store::PgPool;
use crate::telemetry::metrics as m;
use auth::{Auth, Guard, NamedToken};

/// Turns a payload into what operators may see of it: `(event_type, payload) → redacted`.
type Redact = Arc<dyn Fn(&str, &serde_json::Value) -> serde_json::Value + Send + Sync>;

/// Settings of the operator API. Cheap to clone: `HttpServer::new` calls its factory once per
/// worker.
#[derive(Clone)]
pub struct AdminConfig {
    pool: PgPool,
    tokens: Vec<NamedToken>,
    guard: Option<Guard>,
    redact: Option<Redact>,
    metrics: Option<PrometheusHandle>,
}

impl std::fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminConfig")
            .field("tokens", &self.tokens)
            .field("guard", &self.guard.is_some())
            .field("redacted_payloads", &self.redact.is_some())
            .field("metrics", &self.metrics.is_some())
            .finish_non_exhaustive()
    }
}

/// Shared by the handlers of one worker.
pub(crate) struct State {
    pub pool: PgPool,
    pub auth: Auth,
    pub redact: Option<Redact>,
    pub metrics: Option<PrometheusHandle>,
}

/// The shortest token accepted: anything shorter can be guessed.
const MIN_TOKEN_LEN: usize = 16;

impl AdminConfig {
    /// An operator API on `pool` that refuses everyone until a token or a guard is added.
    pub fn new(pool: PgPool) -> Self {
        AdminConfig {
            pool,
            tokens: Vec::new(),
            guard: None,
            redact: None,
            metrics: None,
        }
    }

    /// Accepts `Authorization: Bearer <token>` as the operator `operator` (the name written to
    /// the audit trail). Add one token per person or system to know who did what.
    ///
    /// # Errors
    /// [`Error::Config`] for an empty operator name or a token shorter than 16 characters.
    pub fn bearer_token(mut self, operator: &str, token: &str) -> Result<Self> {
        if operator.trim().is_empty() {
            return Err(Error::Config(
                "an admin operator name must not be empty".into(),
            ));
        }
        if token.trim().len() < MIN_TOKEN_LEN {
            return Err(Error::Config(format!(
                "the admin token for {operator} must be at least {MIN_TOKEN_LEN} characters"
            )));
        }
        self.tokens.push(NamedToken {
            operator: operator.trim().to_owned(),
            secret: token.trim().as_bytes().to_vec(),
        });
        Ok(self)
    }

    /// Replaces the bearer tokens by the application's own check (a session, a header set by
    /// an authenticating proxy, …): return the operator's name to allow the request, `None`
    /// to answer 401. It runs before anything else in every request but the page.
    pub fn guard<F>(mut self, guard: F) -> Self
    where
        F: Fn(&HttpRequest) -> Option<String> + Send + Sync + 'static,
    {
        self.guard = Some(Arc::new(guard));
        self
    }

    /// Serves `GET /metrics` from this Prometheus recorder (see [`install_prometheus_recorder`]).
    pub fn metrics(mut self, handle: PrometheusHandle) -> Self {
        self.metrics = Some(handle);
        self
    }

    /// Shows payloads in lists, after `redact(event_type, payload)`. Off by default: payloads
    /// carry ids, but an application that must show more decides here what operators see.
    pub fn redacted_payloads<F>(mut self, redact: F) -> Self
    where
        F: Fn(&str, &serde_json::Value) -> serde_json::Value + Send + Sync + 'static,
    {
        self.redact = Some(Arc::new(redact));
        self
    }

    fn state(self) -> State {
        let auth = match self.guard {
            Some(g) => Auth::Guard(g),
            None => Auth::Tokens(self.tokens),
        };
        if matches!(&auth, Auth::Tokens(t) if t.is_empty()) {
            tracing::warn!(
                "the operator API has no token and no guard: every request will be refused"
            );
        }
        State {
            pool: self.pool,
            auth,
            redact: self.redact,
            metrics: self.metrics,
        }
    }
}

/// The operator API as an actix-web scope mounted at `path`: a dashboard page, lag health, a
/// Prometheus endpoint, bounded lists and the few actions an operator needs.
///
/// ```no_run
/// # async fn run(pool: actix_outbox::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use actix_outbox::{admin::admin_scope, admin::install_prometheus_recorder, admin::AdminConfig};
/// use actix_web::{App, HttpServer};
///
/// let metrics = install_prometheus_recorder()?;
/// let token = std::env::var("OPS_TOKEN").unwrap_or_default();
/// let admin = AdminConfig::new(pool).bearer_token("ops", &token)?.metrics(metrics);
/// HttpServer::new(move || App::new().service(admin_scope("/ops", admin.clone())))
///     .bind(("127.0.0.1", 8080))?
///     .run()
///     .await?;
/// # Ok(()) }
/// ```
///
/// # Security
///
/// Every endpoint except the dashboard page itself (static HTML without data) requires an
/// operator: `Authorization: Bearer <token>` matching a configured token (compared in constant
/// time), or whatever the application's [`AdminConfig::guard`] accepts. Anything else gets
/// `401 ADMIN_UNAUTHORIZED` before the request body is read or the database is touched. A
/// config without tokens or a guard refuses everyone. The operator's name goes to the audit.
///
/// Lists show metadata — ids, types, aggregates, statuses, attempts, error codes and messages,
/// correlation ids, times — never payloads, unless the application supplies a redaction
/// function ([`AdminConfig::redacted_payloads`]).
///
/// # Endpoints (relative to the mount path)
///
/// | method & path | what |
/// |---|---|
/// | `GET /` | the dashboard page |
/// | `GET /health` | [`HealthReport`](crate::health::HealthReport) from the latest stats sample |
/// | `GET /overview` | live counts per consumer, last hour's failures and duplicates, health |
/// | `GET /charts?minutes=&consumer=` | per consumer and minute: throughput and lag, from the stats samples |
/// | `GET /metrics` | Prometheus text (needs [`AdminConfig::metrics`]) |
/// | `GET /outbox?status=&type=&before=&limit=` | outbox rows, newest first (limit ≤ 200) |
/// | `GET /inbox?status=&type=&consumer=&before=&limit=` | inbox rows, newest first |
/// | `GET /timeline/{correlation_id}` | every outbox and inbox row of a correlation, in order |
/// | `GET /consumers` | pause switches and subscriptions |
/// | `GET /audit?before=&limit=` | the audit trail, newest first |
/// | `POST /inbox/{id}/retry`, `POST /outbox/{event_id}/retry` | a dead letter back to work |
/// | `POST /inbox/retry`, `POST /outbox/retry` | ≤ 100 dead letters: `{"ids":[…],"confirm":"RETRY 3"}` |
/// | `POST /inbox/{id}/ignore`, `POST /outbox/{event_id}/ignore` | mark IGNORED: `{"reason":"…"}` |
/// | `POST /consumers/{name}/pause`, `…/resume` | the pause switch (pause needs a reason) |
/// | `POST /consumers/{name}/subscriptions/{event_type}/remove` | stop fanning that type out to it: `{"reason":"…"}` |
///
/// There is deliberately no "retry everything": a bulk retry names its rows and repeats their
/// count, so a mistake is bounded. Every action writes one `admin_audit` row in the same
/// transaction as its change. Errors are `{"error":{"code":"STABLE_CODE","message":"…"}}` with
/// a 4xx status for bad input (and nothing changed) and 503 when the database is unavailable.
///
/// A retried inbox dead letter becomes RETRY_PENDING, due now, with its attempt count kept: the
/// consumer gets one more attempt before its policy dead-letters it again. A retried outbox
/// dead letter becomes PENDING for the publisher. IGNORED rows stay for the record and are never
/// deleted by retention.
///
/// Codes: `ADMIN_UNAUTHORIZED` (401); `INVALID_BODY`, `INVALID_QUERY`, `INVALID_ID`,
/// `INVALID_CURSOR`, `INVALID_STATUS`, `INVALID_LIMIT`, `INVALID_CONSUMER`, `REASON_REQUIRED`,
/// `REASON_TOO_LONG`, `NO_IDS`, `TOO_MANY_IDS`, `DUPLICATE_IDS`, `CONFIRMATION_MISMATCH` (400);
/// `ROW_NOT_FOUND`, `CORRELATION_NOT_FOUND`, `CONSUMER_UNKNOWN`, `METRICS_NOT_CONFIGURED`,
/// `NOT_FOUND` (404); `METHOD_NOT_ALLOWED` (405); `NOT_A_DEAD_LETTER`, `NOT_IGNORABLE` (409);
/// `DATABASE_ERROR`, `POOL_TIMEOUT` (503).
pub fn admin_scope(path: &str, config: AdminConfig) -> Scope {
    handlers::scope(path, config.state())
}

/// Installs a Prometheus recorder as the process's `metrics` recorder, with latency buckets
/// for `inbox_delivery_latency_seconds`, and returns the handle to give
/// [`AdminConfig::metrics`]. Also starts a small thread that runs the recorder's upkeep every
/// 5 s, so histograms do not grow between scrapes.
///
/// An application with its own recorder skips this and exposes the library's metrics through
/// its recorder instead (names are prefixed `outbox_` and `inbox_`).
///
/// # Errors
/// [`Error::Config`] when a recorder is already installed.
pub fn install_prometheus_recorder() -> Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(m::INBOX_DELIVERY_LATENCY.to_owned()),
            m::LATENCY_BUCKETS,
        )
        .and_then(|b| b.install_recorder())
        .map_err(|e| Error::Config(format!("cannot install the Prometheus recorder: {e}")))?;
    m::describe();
    let upkeep = handle.clone();
    std::thread::Builder::new()
        .name("actix-outbox-metrics".into())
        .spawn(move || loop {
            std::thread::sleep(std::time::Duration::from_secs(5));
            upkeep.run_upkeep();
        })
        .map_err(|e| Error::Config(format!("cannot start the metrics upkeep thread: {e}")))?;
    Ok(handle)
}

/// The dashboard: one HTML file with inline CSS and JS, no build step.
const DASHBOARD: &str = include_str!("dashboard.html");
