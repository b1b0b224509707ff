//! `actix-outbox`: the operator's tool for hosts without the HTTP scope.
//!
//! Every command but `migrate` is one request to the operator API (`admin_scope`), served
//! inside this process against the database: no server, no token. So a retry, an ignore or a
//! pause is validated, locked, changed and audited by the same code as through HTTP, answers
//! with the same stable codes, and its audit row names the operator (`--operator`).
//!
//! Exit codes, for scripts: 0 done (health OK); 1 health WARNING; 2 health CRITICAL;
//! 64 the command line is wrong; 65 refused (bad input, a row in the wrong state, no reason);
//! 66 not found; 69 the database could not be reached or failed.

mod render;

use actix_outbox::admin::{admin_scope, AdminConfig};
use actix_web::body::MessageBody;
use actix_web::dev::{Service, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::test::{self, TestRequest};
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::{json, Value};

/// The command's exit codes (see the crate's docs and `--help`).
pub const OK: i32 = 0;
pub const WARNING: i32 = 1;
pub const CRITICAL: i32 = 2;
pub const USAGE: i32 = 64;
pub const REFUSED: i32 = 65;
pub const NOT_FOUND: i32 = 66;
pub const UNAVAILABLE: i32 = 69;

const EXIT_CODES: &str = "Exit codes: 0 done (health OK), 1 health WARNING, 2 health CRITICAL, \
64 wrong command line, 65 refused (bad input, a row in the wrong state, no reason), \
66 not found, 69 the database could not be reached or failed.";

/// Operate an actix-outbox database: health, dead letters, retries, pauses, replays.
///
/// Each action is validated, applied and audited exactly as by the operator API.
#[derive(Debug, Parser)]
#[command(name = "actix-outbox", version, after_help = EXIT_CODES)]
struct Cli {
    /// The database, e.g. postgres://ops@db/app.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// The library's schema, when the application moved it (default actix_outbox).
    #[arg(long, env = "ACTIX_OUTBOX_SCHEMA", global = true)]
    schema: Option<String>,
    /// Who acts, as kept in the audit trail (default cli:$USER).
    #[arg(long, env = "ACTIX_OUTBOX_OPERATOR", global = true)]
    operator: Option<String>,
    /// Print the API's JSON answer instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply the library's migrations (safe on live tables; several may run at once).
    Migrate,
    /// The health report; the exit code is its state (0 OK, 1 WARNING, 2 CRITICAL).
    Health,
    /// Counts of the outbox and of each consumer's inbox.
    Stats,
    /// Dead letters: list them, or show one event with its fan-out.
    #[command(name = "dead-letters", subcommand)]
    DeadLetters(DeadLetters),
    /// One event across the consumers (its fan-out), dead-lettered or not.
    Show(EventArg),
    /// Make dead-lettered rows due again (several ids: paced, `--rate` a second).
    Retry(RetryArgs),
    /// Set a failed row aside for good (IGNORED).
    Ignore(IgnoreArgs),
    /// Stop a consumer taking its events, until resumed or until `--until`.
    Pause(PauseArgs),
    /// Let a paused consumer take its events again.
    Resume(ConsumerReason),
    /// Re-deliver a consumer's processed events to it, in order.
    Replay(ReplayArgs),
    /// The newest replays and their progress.
    Replays {
        /// Only this consumer's.
        #[arg(long)]
        consumer: Option<String>,
    },
    /// Cancel a running replay (what it re-applied stays).
    Cancel {
        /// The replay's id.
        id: i64,
    },
    /// Every outbox and inbox row of one correlation id, in time order.
    Timeline {
        /// The correlation id.
        correlation_id: String,
    },
}

#[derive(Debug, Subcommand)]
enum DeadLetters {
    /// Dead-lettered rows, newest first.
    List {
        /// The outbox's dead letters (publishing failed) instead of the inbox's.
        #[arg(long, conflicts_with = "effects")]
        outbox: bool,
        /// Side effects' dead letters (their calls failed) instead of the inbox's.
        #[arg(long)]
        effects: bool,
        /// Only this consumer's (inbox).
        #[arg(long, conflicts_with_all = ["outbox", "effects"])]
        consumer: Option<String>,
        /// Only this kind of side effect (with --effects).
        #[arg(long, requires = "effects")]
        kind: Option<String>,
        /// Only this event type.
        #[arg(long = "type")]
        event_type: Option<String>,
        /// At most this many rows (default 50).
        #[arg(long)]
        limit: Option<u32>,
    },
    /// One event with its fan-out: each consumer's row, state, attempts and last error.
    Show(EventArg),
}

#[derive(Debug, Args)]
struct EventArg {
    /// The event's id (a UUID).
    event_id: String,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Table {
    Inbox,
    Outbox,
    /// Side effects (`side_effects`).
    Effect,
}

impl Table {
    fn path(self) -> &'static str {
        match self {
            Table::Inbox => "inbox",
            Table::Outbox => "outbox",
            Table::Effect => "effects",
        }
    }
}

#[derive(Debug, Args)]
struct RetryArgs {
    /// The rows' table: inbox (a consumer's row), outbox (publishing) or effect (a call).
    table: Table,
    /// The rows: inbox row or side effect ids, or event ids for the outbox.
    #[arg(required = true)]
    ids: Vec<String>,
    /// Why, kept in the audit trail. Required.
    #[arg(long)]
    reason: Option<String>,
    /// Several rows are made due one after another, this many a second (default 10).
    #[arg(long)]
    rate: Option<u32>,
}

#[derive(Debug, Args)]
struct IgnoreArgs {
    /// The row's table: inbox, outbox or effect.
    table: Table,
    /// The row: an inbox row or side effect id, or an event id for the outbox.
    id: String,
    /// Why, kept in the audit trail. Required.
    #[arg(long)]
    reason: Option<String>,
}

#[derive(Debug, Args)]
struct ConsumerReason {
    /// The consumer's name.
    consumer: String,
    /// Why, kept in the audit trail. Required.
    #[arg(long)]
    reason: Option<String>,
}

#[derive(Debug, Args)]
struct PauseArgs {
    #[command(flatten)]
    target: ConsumerReason,
    /// When the pause lifts itself (RFC 3339, e.g. 2026-12-04T06:00:00Z).
    #[arg(long)]
    until: Option<String>,
}

#[derive(Debug, Args)]
struct ReplayArgs {
    #[command(flatten)]
    target: ConsumerReason,
    /// Only events of this type (repeatable).
    #[arg(long = "type")]
    event_types: Vec<String>,
    /// Events written at or after (RFC 3339).
    #[arg(long)]
    from: Option<String>,
    /// Events written before (RFC 3339).
    #[arg(long)]
    until: Option<String>,
    /// Only events of this correlation id.
    #[arg(long)]
    correlation_id: Option<String>,
    /// Events per second.
    #[arg(long)]
    rate: Option<f64>,
}

/// One request to the operator API, and how to show its answer.
struct Request {
    post: bool,
    path: String,
    body: Option<Value>,
    shape: render::Shape,
}

impl Request {
    fn get(path: String, shape: render::Shape) -> Self {
        Request {
            post: false,
            path,
            body: None,
            shape,
        }
    }
    fn post(path: String, body: Value) -> Self {
        Request {
            post: true,
            path,
            body: Some(body),
            shape: render::Shape::Action,
        }
    }
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            std::process::exit(if e.use_stderr() { USAGE } else { OK });
        }
    };
    let code = actix_rt::System::new().block_on(run(cli));
    std::process::exit(code);
}

/// Prints a refusal the CLI makes itself, in the API's shape, and returns its exit code.
fn refuse(json_out: bool, code: &str, message: &str) -> i32 {
    render::error(
        json_out,
        &json!({"error": {"code": code, "message": message}}),
    );
    REFUSED
}

async fn run(cli: Cli) -> i32 {
    let Some(url) = cli.database_url.clone() else {
        eprintln!("no database: pass --database-url or set DATABASE_URL");
        return USAGE;
    };
    if let Some(schema) = &cli.schema {
        if let Err(e) = actix_outbox::db::use_schema(schema) {
            return refuse(cli.json, e.code().as_str(), &e.to_string());
        }
    }
    if let Command::Migrate = cli.command {
        return migrate(&url, cli.json).await;
    }
    let request = match plan(&cli.command) {
        Ok(r) => r,
        Err((code, message)) => return refuse(cli.json, code, message),
    };
    // One connection first, for its own error: the pool would only say it waited in vain.
    let settings = actix_outbox::db::ConnectionConfig::default();
    if let Err(e) = check_connection(&settings.url(&url)).await {
        let message = format!("cannot connect to the database: {e}");
        render::error(
            cli.json,
            &json!({"error": {"code": "POOL_CONNECT_FAILED", "message": message}}),
        );
        return UNAVAILABLE;
    }
    let pool = match actix_outbox::db::connect_with(&url, 2, &settings).await {
        Ok(p) => p,
        Err(e) => {
            render::error(
                cli.json,
                &json!({"error": {"code": e.code().as_str(), "message": e.to_string()}}),
            );
            return UNAVAILABLE;
        }
    };
    let operator = cli.operator.clone().unwrap_or_else(|| {
        format!(
            "cli:{}",
            std::env::var("USER").unwrap_or_else(|_| "unknown".into())
        )
    });
    if operator.trim().is_empty() || operator.contains('\0') {
        return refuse(cli.json, "CONFIG_INVALID", "--operator must name someone");
    }
    let config = AdminConfig::new(pool).guard(move |_| Some(operator.clone()));
    let app = test::init_service(actix_web::App::new().service(admin_scope("/ops", config))).await;
    let mut req = if request.post {
        TestRequest::post()
    } else {
        TestRequest::get()
    }
    .uri(&format!("/ops{}", request.path));
    if let Some(body) = &request.body {
        req = req.set_json(body);
    }
    let (status, answer) = call(&app, req.to_request()).await;
    exit_code(status, &answer, request.shape, cli.json)
}

async fn check_connection(url: &str) -> Result<(), String> {
    use diesel_async::{AsyncConnection, AsyncPgConnection};
    match AsyncPgConnection::establish(url).await {
        Ok(_) => Ok(()),
        Err(e) => Err(e.to_string()),
    }
}

/// Calls the in-process API and reads its JSON answer.
async fn call<S, R, B>(app: &S, req: R) -> (StatusCode, Value)
where
    S: Service<R, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: MessageBody,
{
    match app.call(req).await {
        Ok(resp) => {
            let status = resp.status();
            let bytes = test::read_body(resp).await;
            let v = serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
            (status, v)
        }
        Err(e) => {
            let resp = e.error_response();
            let v = json!({"error": {"code": "INTERNAL", "message": e.to_string()}});
            (resp.status(), v)
        }
    }
}

/// Shows the answer and turns it into the exit code.
fn exit_code(status: StatusCode, answer: &Value, shape: render::Shape, json_out: bool) -> i32 {
    if !status.is_success() {
        render::error(json_out, answer);
        return match status {
            StatusCode::NOT_FOUND => NOT_FOUND,
            s if s.is_client_error() => REFUSED,
            _ => UNAVAILABLE,
        };
    }
    render::answer(json_out, answer, shape);
    match (shape, answer["state"].as_str()) {
        (render::Shape::Health, Some("WARNING")) => WARNING,
        (render::Shape::Health, Some("CRITICAL")) => CRITICAL,
        _ => OK,
    }
}

/// A reason the CLI insists on for every action, before anything is sent.
fn reason(r: &Option<String>) -> Result<String, (&'static str, &'static str)> {
    match r.as_deref().map(str::trim) {
        Some(r) if !r.is_empty() => Ok(r.to_owned()),
        _ => Err((
            "REASON_REQUIRED",
            "every action needs --reason, kept in the audit trail; nothing was changed",
        )),
    }
}

/// Percent-encodes one path segment or query value.
fn enc(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The query string of the given pairs that have a value.
fn query(pairs: &[(&str, Option<String>)]) -> String {
    let set: Vec<String> = pairs
        .iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={}", enc(v))))
        .collect();
    if set.is_empty() {
        String::new()
    } else {
        format!("?{}", set.join("&"))
    }
}

fn plan(command: &Command) -> Result<Request, (&'static str, &'static str)> {
    use render::Shape;
    Ok(match command {
        Command::Migrate => unreachable!("handled before"),
        Command::Health => Request::get("/health".into(), Shape::Health),
        Command::Stats => Request::get("/overview".into(), Shape::Stats),
        Command::DeadLetters(DeadLetters::List {
            outbox,
            effects,
            consumer,
            kind,
            event_type,
            limit,
        }) => {
            let (table, shape) = match (*outbox, *effects) {
                (true, _) => ("outbox", Shape::Outbox),
                (_, true) => ("effects", Shape::Effects),
                _ => ("inbox", Shape::Inbox),
            };
            let q = query(&[
                ("status", Some("DEAD_LETTER".into())),
                ("consumer", consumer.clone()),
                ("kind", kind.clone()),
                ("type", event_type.clone()),
                ("limit", limit.map(|l| l.to_string())),
            ]);
            Request::get(format!("/{table}{q}"), shape)
        }
        Command::DeadLetters(DeadLetters::Show(e)) | Command::Show(e) => {
            Request::get(format!("/events/{}", enc(&e.event_id)), Shape::Event)
        }
        Command::Retry(a) => {
            let why = reason(&a.reason)?;
            let table = a.table.path();
            if let [id] = a.ids.as_slice() {
                if a.rate.is_none() {
                    let body = json!({"reason": why});
                    return Ok(Request::post(format!("/{table}/{}/retry", enc(id)), body));
                }
            }
            // Several rows: the API's bulk retry, whose confirmation this command gives.
            let ids: Vec<Value> = match a.table {
                Table::Inbox | Table::Effect => a
                    .ids
                    .iter()
                    .map(|i| i.trim().parse::<i64>().map(Value::from))
                    .collect::<Result<_, _>>()
                    .map_err(|_| {
                        (
                            "INVALID_ID",
                            "an inbox row or side effect id is a positive integer",
                        )
                    })?,
                Table::Outbox => a.ids.iter().map(|i| Value::from(i.as_str())).collect(),
            };
            let body = json!({
                "ids": ids,
                "confirm": format!("RETRY {}", a.ids.len()),
                "reason": why,
                "rate": a.rate,
            });
            Request::post(format!("/{table}/retry"), body)
        }
        Command::Ignore(a) => {
            let body = json!({"reason": reason(&a.reason)?});
            Request::post(format!("/{}/{}/ignore", a.table.path(), enc(&a.id)), body)
        }
        Command::Pause(a) => {
            let body = json!({"reason": reason(&a.target.reason)?, "until": a.until});
            Request::post(
                format!("/consumers/{}/pause", enc(&a.target.consumer)),
                body,
            )
        }
        Command::Resume(a) => {
            let body = json!({"reason": reason(&a.reason)?});
            Request::post(format!("/consumers/{}/resume", enc(&a.consumer)), body)
        }
        Command::Replay(a) => {
            let body = json!({
                "reason": reason(&a.target.reason)?,
                "event_types": a.event_types,
                "from": a.from,
                "until": a.until,
                "correlation_id": a.correlation_id,
                "rate": a.rate,
            });
            Request::post(
                format!("/consumers/{}/replay", enc(&a.target.consumer)),
                body,
            )
        }
        Command::Replays { consumer } => Request::get(
            format!("/replays{}", query(&[("consumer", consumer.clone())])),
            Shape::List,
        ),
        Command::Cancel { id } => Request::post(format!("/replays/{id}/cancel"), json!({})),
        Command::Timeline { correlation_id } => Request::get(
            format!("/timeline/{}", enc(correlation_id)),
            Shape::Timeline,
        ),
    })
}

/// `migrate`: the library's migrations, and what they did.
async fn migrate(url: &str, json_out: bool) -> i32 {
    let config = actix_outbox::db::MigrateConfig::default();
    match actix_outbox::db::migrate_with(url, &config).await {
        Ok(report) => {
            let answer = json!({
                "schema": actix_outbox::db::schema(),
                "applied": report.applied,
                "moved_from_public": report.moved_from_public,
                "lock_retries": report.lock_retries,
            });
            render::answer(json_out, &answer, render::Shape::Action);
            OK
        }
        Err(e) => {
            let answer = json!({"error": {"code": e.code().as_str(), "message": e.to_string()}});
            render::error(json_out, &answer);
            UNAVAILABLE
        }
    }
}
