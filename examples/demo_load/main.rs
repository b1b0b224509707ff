//! The load driver and reporter of `scripts/demo`, against the example order service.
//!
//! ```text
//! demo_load load     --url URL [--orders 2000] [--concurrency 16] [--op-deadline 120]
//!                    [--progress-file PATH] [--progress-every 2] [--summary PATH]
//! demo_load health   --url URL [--timeout 60] [--pid PID]
//! demo_load quiet    --url URL [--deadline 180] [--progress-every 3]
//! demo_load report   --url URL [--summary PATH]
//! demo_load admin-health --url URL      (bearer token from ADMIN_TOKEN)
//! demo_load free-port
//! ```
//!
//! - `load` creates orders and moves them WAITING -> COMPLETED, concurrently, surviving
//!   outages; it writes the count of completed orders to the progress file as it goes, and
//!   its counters to the summary (JSON) at the end.
//! - `health` waits until `GET /health` answers 200, giving up as soon as `--pid` has exited.
//! - `quiet` polls `GET /stats` until nothing is left in flight.
//! - `report` prints the delivery report from `GET /stats` and the load's summary.
//! - `admin-health` prints the lag health from `GET /admin/health` on one line.
//! - `free-port` prints a TCP port on 127.0.0.1 that was free a moment ago.
//!
//! The load is written to be correct across a crash of the service: every request that got no
//! answer is settled before it is repeated. A create carries an Idempotency-Key, so repeating it
//! returns the order the first attempt made. A status change is never repeated blindly: the
//! driver first reads the order back, since the change may have committed just before the
//! crash.
//!
//! The request and response bodies are the service's own types (`order_service/wire.rs`).

mod client;
mod report;
#[path = "../order_service/rng.rs"]
#[allow(dead_code)]
mod rng;
#[path = "../order_service/wire.rs"]
mod wire;

use std::collections::HashMap;
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use client::{Client, Response};
use wire::{
    code, ChangeStatus, CreateOrder, ErrorBody, Order, OrderState, OrderStatus, IDEMPOTENCY_KEY,
    IDEMPOTENT_REPLAYED, REQUEST_ID,
};

/// An answer the service must never give, or a deadline passed: the demo fails.
#[derive(Debug)]
pub struct Fatal(pub String);

const USAGE: &str =
    "usage: demo_load load|health|quiet|report|admin-health|free-port [--option value]... \
                     (see examples/demo_load/main.rs)";

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((cmd, rest)) = args.split_first() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let opts = match Opts::parse(rest) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("demo_load: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let result = match cmd.as_str() {
        "load" => cmd_load(&opts).await,
        "health" => cmd_health(&opts).await,
        "quiet" => cmd_quiet(&opts).await,
        "report" => report::cmd_report(&opts).await,
        "admin-health" => cmd_admin_health(&opts).await,
        "free-port" => cmd_free_port(),
        other => Err(Fatal(format!("unknown command {other:?}\n{USAGE}"))),
    };
    match result {
        Ok(code) => code,
        Err(Fatal(message)) => {
            eprintln!("[demo] {message}");
            ExitCode::FAILURE
        }
    }
}

/// `--name value` (or `--name=value`) options.
pub struct Opts(HashMap<String, String>);

impl Opts {
    fn parse(args: &[String]) -> Result<Opts, String> {
        let mut map = HashMap::new();
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let name = arg
                .strip_prefix("--")
                .ok_or_else(|| format!("unexpected argument {arg:?}"))?;
            let (name, value) = match name.split_once('=') {
                Some((n, v)) => (n.to_owned(), v.to_owned()),
                None => {
                    let v = it.next().ok_or_else(|| format!("--{name} needs a value"))?;
                    (name.to_owned(), v.clone())
                }
            };
            map.insert(name, value);
        }
        Ok(Opts(map))
    }

    pub fn str(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }

    pub fn url(&self) -> Result<&str, Fatal> {
        self.str("url")
            .ok_or_else(|| Fatal("--url is required".into()))
    }

    fn num<T: std::str::FromStr>(&self, name: &str, default: T) -> Result<T, Fatal> {
        match self.str(name) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|_| Fatal(format!("--{name} {v:?} is not a valid number"))),
        }
    }

    fn seconds(&self, name: &str, default: f64) -> Result<Duration, Fatal> {
        let s: f64 = self.num(name, default)?;
        Duration::try_from_secs_f64(s).map_err(|_| Fatal(format!("--{name} {s} is not a duration")))
    }
}

pub fn client(url: &str, timeout: Duration) -> Result<Client, Fatal> {
    Client::new(url, timeout).map_err(Fatal)
}

// ---------------------------------------------------------------------------------------------
// load

/// What the load did, written to `--summary` for `report`.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Summary {
    pub orders: u64,
    pub seconds: f64,
    pub failure: Option<String>,
    pub requests: u64,
    pub transport_errors: u64,
    pub server_errors: u64,
    pub created: u64,
    pub creates_repeated: u64,
    pub creates_replayed: u64,
    pub completed: u64,
    pub already_completed: u64,
    pub confirmed_by_read: u64,
    pub status_changes_repeated: u64,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    transport_errors: AtomicU64,
    server_errors: AtomicU64,
    created: AtomicU64,
    creates_repeated: AtomicU64,
    creates_replayed: AtomicU64,
    completed: AtomicU64,
    already_completed: AtomicU64,
    confirmed_by_read: AtomicU64,
    status_changes_repeated: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

fn get(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

impl Counters {
    fn snapshot(&self) -> Summary {
        Summary {
            requests: get(&self.requests),
            transport_errors: get(&self.transport_errors),
            server_errors: get(&self.server_errors),
            created: get(&self.created),
            creates_repeated: get(&self.creates_repeated),
            creates_replayed: get(&self.creates_replayed),
            completed: get(&self.completed),
            already_completed: get(&self.already_completed),
            confirmed_by_read: get(&self.confirmed_by_read),
            status_changes_repeated: get(&self.status_changes_repeated),
            ..Summary::default()
        }
    }
}

struct Driver {
    base: String,
    total: u64,
    /// How long one order may take, outages included.
    deadline: Duration,
    run_id: String,
    counters: Counters,
    /// The next order's index, and the first failure (which stops the workers).
    state: Mutex<(u64, Option<String>)>,
}

impl Driver {
    fn take_index(&self) -> Option<u64> {
        let mut state = self.state.lock().unwrap();
        if state.0 >= self.total || state.1.is_some() {
            return None;
        }
        state.0 += 1;
        Some(state.0 - 1)
    }

    fn fail(&self, message: String) {
        let mut state = self.state.lock().unwrap();
        state.1.get_or_insert(message);
    }

    fn failure(&self) -> Option<String> {
        self.state.lock().unwrap().1.clone()
    }

    /// One request; `None` when there was no answer (or a 5xx) and the outcome is unknown.
    async fn call(
        &self,
        client: &mut Client,
        path: &str,
        body: Option<&impl Serialize>,
        headers: &[(&str, &str)],
    ) -> Option<Response> {
        bump(&self.counters.requests);
        let method = if body.is_some() { "POST" } else { "GET" };
        match client.request(method, path, body, headers).await {
            Err(_) => {
                bump(&self.counters.transport_errors);
                None
            }
            Ok(resp) if resp.status >= 500 => {
                bump(&self.counters.server_errors);
                None
            }
            Ok(resp) => Some(resp),
        }
    }

    /// The order's status, waiting out an outage.
    async fn get_status(
        &self,
        client: &mut Client,
        order_id: &str,
        started: Instant,
    ) -> Result<String, Fatal> {
        let path = format!("/orders/{order_id}");
        let mut attempt = 0;
        while started.elapsed() < self.deadline {
            let Some(resp) = self.call(client, &path, None::<&()>, &[]).await else {
                pause(attempt).await;
                attempt += 1;
                continue;
            };
            if resp.status == 200 {
                let order: Order = resp
                    .json()
                    .map_err(|e| Fatal(format!("GET {path} -> 200, {e}")))?;
                return Ok(order.status);
            }
            return Err(Fatal(format!(
                "GET {path} -> {} {}",
                resp.status,
                resp.text()
            )));
        }
        Err(Fatal(format!(
            "order {order_id}: no answer within {}s",
            self.deadline.as_secs_f64()
        )))
    }

    async fn create(&self, client: &mut Client, i: u64) -> Result<String, Fatal> {
        let key = format!("demo-{}-{i}", self.run_id);
        let request_id = format!("{key}-create");
        let body = CreateOrder {
            customer_id: format!("c{}", rng::between(0, 999)),
            total_cents: rng::between(100, 99_999) as i64,
        };
        let headers = [(IDEMPOTENCY_KEY, key.as_str()), (REQUEST_ID, &request_id)];
        let (started, mut attempt) = (Instant::now(), 0);
        while started.elapsed() < self.deadline {
            let Some(resp) = self.call(client, "/orders", Some(&body), &headers).await else {
                // Safe to repeat as is: the key makes a second create return the first order.
                if attempt == 0 {
                    bump(&self.counters.creates_repeated);
                }
                pause(attempt).await;
                attempt += 1;
                continue;
            };
            if resp.status == 201 {
                if let Ok(order) = resp.json::<OrderState>() {
                    if order.status == OrderStatus::Waiting.as_str() {
                        if resp.header(IDEMPOTENT_REPLAYED) == Some("true") {
                            bump(&self.counters.creates_replayed);
                        }
                        bump(&self.counters.created);
                        return Ok(order.id);
                    }
                }
            }
            return Err(Fatal(format!(
                "POST /orders -> {} {}",
                resp.status,
                resp.text()
            )));
        }
        Err(Fatal(format!(
            "create {key}: no answer within {}s",
            self.deadline.as_secs_f64()
        )))
    }

    async fn complete(&self, client: &mut Client, order_id: &str, i: u64) -> Result<(), Fatal> {
        let request_id = format!("demo-{}-{i}-complete", self.run_id);
        let headers = [(REQUEST_ID, request_id.as_str())];
        let path = format!("/orders/{order_id}/status");
        let completed = OrderStatus::Completed.as_str();
        let body = ChangeStatus {
            status: completed.to_owned(),
        };
        let (started, mut attempt) = (Instant::now(), 0);
        while started.elapsed() < self.deadline {
            if let Some(resp) = self.call(client, &path, Some(&body), &headers).await {
                if resp.status == 200
                    && resp
                        .json::<OrderState>()
                        .is_ok_and(|o| o.status == completed)
                {
                    bump(&self.counters.completed);
                    return Ok(());
                }
                let refused = resp.json::<ErrorBody>().ok().map(|e| e.error.code);
                if resp.status == 422
                    && refused.as_deref() == Some(code::INVALID_TRANSITION)
                    && self.get_status(client, order_id, started).await? == completed
                {
                    bump(&self.counters.already_completed);
                    bump(&self.counters.completed);
                    return Ok(());
                }
                return Err(Fatal(format!(
                    "POST {path} -> {} {}",
                    resp.status,
                    resp.text()
                )));
            }
            // No answer: the change may have committed. Repeating it blindly would be refused
            // at best and a second transition at worst, so settle the first attempt first.
            pause(attempt).await;
            attempt += 1;
            if self.get_status(client, order_id, started).await? == completed {
                bump(&self.counters.confirmed_by_read);
                bump(&self.counters.completed);
                return Ok(());
            }
            bump(&self.counters.status_changes_repeated);
        }
        Err(Fatal(format!(
            "complete {order_id}: no answer within {}s",
            self.deadline.as_secs_f64()
        )))
    }

    async fn worker(self: Arc<Self>) {
        let mut client = match client(&self.base, Duration::from_secs(10)) {
            Ok(c) => c,
            Err(Fatal(e)) => return self.fail(e),
        };
        while let Some(i) = self.take_index() {
            let done = match self.create(&mut client, i).await {
                Ok(order_id) => self.complete(&mut client, &order_id, i).await,
                Err(e) => Err(e),
            };
            if let Err(Fatal(e)) = done {
                return self.fail(e);
            }
        }
    }
}

async fn pause(attempt: u32) {
    let seconds = (0.05 * 2f64.powi(attempt.min(10) as i32)).min(0.5);
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
}

/// Writes `text` to `path` through a temporary file, so a reader never sees half of it.
fn write_atomic(path: &str, text: &str) -> Result<(), Fatal> {
    let tmp = format!("{path}.tmp");
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| Fatal(format!("cannot write {path}: {e}")))
}

async fn cmd_load(opts: &Opts) -> Result<ExitCode, Fatal> {
    rng::seed();
    let driver = Arc::new(Driver {
        base: opts.url()?.to_owned(),
        total: opts.num("orders", 2000)?,
        deadline: opts.seconds("op-deadline", 120.0)?,
        run_id: format!("{:x}", rng::next_u64() >> 24),
        counters: Counters::default(),
        state: Mutex::new((0, None)),
    });
    let concurrency: usize = opts.num("concurrency", 16)?;
    let progress_every = opts.seconds("progress-every", 2.0)?;
    let progress_file = opts.str("progress-file");

    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency.max(1))
        .map(|_| tokio::spawn(driver.clone().worker()))
        .collect();
    let (mut last_print, mut last_requests) = (started, 0);
    while workers.iter().any(|w| !w.is_finished()) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let c = &driver.counters;
        if let Some(path) = progress_file {
            write_atomic(path, &format!("{}\n", get(&c.completed)))?;
        }
        let now = Instant::now();
        if now - last_print >= progress_every {
            let requests = get(&c.requests);
            let rate = (requests - last_requests) as f64 / (now - last_print).as_secs_f64();
            println!(
                "[load] {:5}/{} orders completed, {:5} created | {:5.0} req/s | {} requests without an answer",
                get(&c.completed),
                driver.total,
                get(&c.created),
                rate,
                get(&c.transport_errors) + get(&c.server_errors),
            );
            (last_print, last_requests) = (now, requests);
        }
    }
    for w in workers {
        // A panic is a driver bug: it must fail the demo, not hang it.
        if let Err(e) = w.await {
            driver.fail(format!("driver error: {e}"));
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let mut summary = driver.counters.snapshot();
    if let Some(path) = progress_file {
        write_atomic(path, &format!("{}\n", summary.completed))?;
    }
    summary.orders = driver.total;
    summary.seconds = (elapsed * 100.0).round() / 100.0;
    summary.failure = driver.failure();
    if let Some(path) = opts.str("summary") {
        let json = serde_json::to_string(&summary).expect("a summary serialises");
        write_atomic(path, &json)?;
    }
    println!(
        "[load] done: {}/{} orders completed in {elapsed:.1}s ({} requests, {:.0} req/s)",
        summary.completed,
        driver.total,
        summary.requests,
        summary.requests as f64 / elapsed.max(1e-9),
    );
    if summary.failure.is_some() || summary.completed != driver.total {
        eprintln!(
            "[load] FAILED: {}",
            summary
                .failure
                .as_deref()
                .unwrap_or("not every order was completed")
        );
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

// ---------------------------------------------------------------------------------------------
// health, quiet, admin-health, free-port

/// Whether process `pid` still exists (one we may not signal does).
fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 sends nothing; kill only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

async fn cmd_health(opts: &Opts) -> Result<ExitCode, Fatal> {
    let mut client = client(opts.url()?, Duration::from_secs(2))?;
    let timeout = opts.seconds("timeout", 60.0)?;
    let pid: Option<i32> = opts.str("pid").map(|_| opts.num("pid", 0)).transpose()?;
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Some(pid) = pid.filter(|&p| !alive(p)) {
            eprintln!("[demo] the service (pid {pid}) exited");
            return Ok(ExitCode::FAILURE);
        }
        if let Ok(resp) = client.get("/health", &[]).await {
            if resp.status == 200 {
                return Ok(ExitCode::SUCCESS);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "[demo] the service did not become healthy within {}s",
        timeout.as_secs_f64()
    );
    Ok(ExitCode::FAILURE)
}

async fn cmd_quiet(opts: &Opts) -> Result<ExitCode, Fatal> {
    let mut client = client(opts.url()?, Duration::from_secs(10))?;
    let deadline = opts.seconds("deadline", 180.0)?;
    let progress_every = opts.seconds("progress-every", 3.0)?;
    let started = Instant::now();
    let (mut quiet_polls, mut last_print, mut left) = (0, None::<Instant>, None);
    while started.elapsed() < deadline {
        let stats = match report::fetch_stats(&mut client).await? {
            Some(s) => s,
            None => {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let in_flight = stats.in_flight();
        // Twice in a row: a reconcile run or a job retry may be about to add work.
        quiet_polls = if in_flight.iter().all(|(_, n)| *n == 0) {
            quiet_polls + 1
        } else {
            0
        };
        if quiet_polls >= 2 {
            println!(
                "[quiet] quiet after {:.1}s",
                started.elapsed().as_secs_f64()
            );
            return Ok(ExitCode::SUCCESS);
        }
        let text = report::join(in_flight.iter().map(|(k, n)| format!("{k} {n}")), ", ");
        if last_print.is_none_or(|t| t.elapsed() >= progress_every) {
            println!("[quiet] {text}");
            last_print = Some(Instant::now());
        }
        left = Some(text);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "[quiet] still busy after {}s: {}",
        deadline.as_secs_f64(),
        left.as_deref().unwrap_or("no stats")
    );
    Ok(ExitCode::FAILURE)
}

/// `STATE - reasons`, or `STATE - no findings`.
async fn cmd_admin_health(opts: &Opts) -> Result<ExitCode, Fatal> {
    let token = std::env::var("ADMIN_TOKEN").map_err(|_| Fatal("ADMIN_TOKEN is not set".into()))?;
    let mut client = client(opts.url()?, Duration::from_secs(10))?;
    let auth = format!("Bearer {token}");
    let resp = client
        .get("/admin/health", &[("Authorization", &auth)])
        .await
        .map_err(|e| Fatal(format!("GET /admin/health: {e}")))?;
    if resp.status != 200 {
        return Err(Fatal(format!(
            "GET /admin/health -> {} {}",
            resp.status,
            resp.text()
        )));
    }
    let health: actix_outbox::health::HealthReport = resp.json().map_err(Fatal)?;
    let state = serde_json::to_value(health.state).expect("a state serialises");
    let reasons = report::join(health.reasons.iter().map(|r| r.message.clone()), "; ");
    println!(
        "{} - {}",
        state.as_str().unwrap_or("?"),
        if reasons.is_empty() {
            "no findings"
        } else {
            &reasons
        }
    );
    Ok(ExitCode::SUCCESS)
}

fn cmd_free_port() -> Result<ExitCode, Fatal> {
    let socket = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map_err(|e| Fatal(format!("no free port: {e}")))?;
    println!("{}", socket.port());
    Ok(ExitCode::SUCCESS)
}

/// Reads the load's summary, if there is one.
pub fn read_summary(path: Option<&str>) -> Result<Option<Summary>, Fatal> {
    let Some(path) = path.filter(|p| Path::new(p).exists()) else {
        return Ok(None);
    };
    let text =
        std::fs::read_to_string(path).map_err(|e| Fatal(format!("cannot read {path}: {e}")))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Fatal(format!("{path}: {e}")))
}
