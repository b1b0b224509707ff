//! Shared test setup: a fresh database per test, business tables, a configurable consumer
//! actor, and polling helpers with deadlines (never a bare sleep).

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use actix_outbox::event::ConsumerName;
use actix_outbox::ops::{pause_consumer, resume_consumer};
use actix_outbox::{
    enqueue, ConsumerConfig, Delivery, DeliveryBatch, HandlerError, NewEvent, OutboxRuntime,
    PgPool, RetryPolicy, RuntimeConfig,
};
use diesel::sql_types::{Array, BigInt, Text, Uuid as SqlUuid};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

pub fn base_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

mod template;
mod url;
pub use url::with_database;

pub struct TestDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

impl TestDb {
    /// Creates `ao_test_<random>`, a clone of the template (see `template`): the library's
    /// migrations and the test's business tables. `effects` has no unique constraint on
    /// purpose: a duplicate effect must show.
    pub async fn new() -> TestDb {
        TestDb::new_on(&base_url()).await
    }

    /// The same on the server at `server_url` (a test's own cluster).
    pub async fn new_on(server_url: &str) -> TestDb {
        let name = format!("ao_test_{}", uuid::Uuid::new_v4().simple());
        template::create(server_url, &name).await;
        let url = with_database(server_url, &name);
        let pool = actix_outbox::connect(&url, 30).await.expect("pool");
        TestDb { name, url, pool }
    }

    /// `ao_test_<random>` with nothing in it: no migration, no business table.
    pub async fn empty() -> TestDb {
        let name = format!("ao_test_{}", uuid::Uuid::new_v4().simple());
        let mut admin = AsyncPgConnection::establish(&base_url()).await.unwrap();
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        let url = with_database(&base_url(), &name);
        let pool = actix_outbox::connect(&url, 30).await.expect("pool");
        TestDb { name, url, pool }
    }

    pub async fn count(&self, sql: &str) -> i64 {
        let mut conn = self.pool.get().await.unwrap();
        let c: Count = diesel::sql_query(sql)
            .get_result(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        c.n
    }

    /// Polls `sql` (a `SELECT count(*) AS n …`) until it returns `want` or `timeout` passes;
    /// returns the last value so the caller's assertion shows what was seen.
    pub async fn wait_for(&self, sql: &str, want: i64, timeout: Duration) -> i64 {
        let deadline = Instant::now() + timeout;
        loop {
            let n = self.count(sql).await;
            if n == want || Instant::now() > deadline {
                return n;
            }
            actix_rt::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sessions of this database left idle inside a transaction: idle there for over a second,
    /// so a batch caught between its BEGIN and its first statement does not count.
    pub async fn idle_in_transaction(&self) -> i64 {
        self.count(&format!(
            "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = '{}' \
             AND state LIKE 'idle in transaction%' AND state_change < now() - interval '1 second'",
            self.name
        ))
        .await
    }

    /// Asserts no session is idle in transaction, stops the runtimes, asserts again, and drops
    /// the database.
    pub async fn finish(self, runtimes: &[&OutboxRuntime]) {
        assert_eq!(
            self.idle_in_transaction().await,
            0,
            "idle in transaction while running"
        );
        for rt in runtimes {
            rt.shutdown().await;
        }
        assert_eq!(
            self.idle_in_transaction().await,
            0,
            "idle in transaction after shutdown"
        );
        let listening = format!(
            "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = '{}' \
             AND query LIKE 'LISTEN%'",
            self.name
        );
        assert_eq!(
            self.wait_for(&listening, 0, Duration::from_secs(5)).await,
            0,
            "a LISTEN connection outlived its runtime"
        );
        let TestDb { name, pool, .. } = self;
        drop(pool);
        let mut admin = AsyncPgConnection::establish(&base_url()).await.unwrap();
        admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .await
            .unwrap();
    }

    /// Enqueues one ORDER_STATUS_CHANGED event of `aggregate`, with no business row.
    pub async fn enqueue_one(&self, aggregate: &str) {
        let conn = self.pool.get().await.unwrap();
        enqueue(&conn, &order_event(aggregate)).await.unwrap();
    }

    /// Enqueues `n` events in business transactions of `per_tx` events each.
    pub async fn produce_batched(&self, n: usize, per_tx: usize, prefix: &str) {
        let mut conn = self.pool.get().await.unwrap();
        for start in (0..n).step_by(per_tx) {
            let events: Vec<_> = (start..(start + per_tx).min(n))
                .map(|i| order_event(&format!("{prefix}-{i}")))
                .collect();
            conn.transaction::<_, actix_outbox::Error, _>(async |conn| {
                actix_outbox::enqueue_many(conn, &events).await?;
                Ok(())
            })
            .await
            .unwrap();
        }
    }

    /// Enqueues `n` ORDER_STATUS_CHANGED events, one business transaction each (order row,
    /// audit row, event), and returns their ids.
    pub async fn produce(&self, n: usize, prefix: &str) -> Vec<uuid::Uuid> {
        let mut ids = Vec::with_capacity(n);
        let mut conn = self.pool.get().await.unwrap();
        for i in 0..n {
            let order = format!("{prefix}-{i}");
            let id = conn
                .transaction::<_, actix_outbox::Error, _>(async |conn| {
                    insert_order(conn, &order).await?;
                    enqueue(conn, &order_event(&order)).await
                })
                .await
                .unwrap();
            ids.push(id.as_uuid());
        }
        ids
    }
}

pub fn order_event(order: &str) -> NewEvent {
    NewEvent::new(
        "ORDER_STATUS_CHANGED",
        "order",
        order,
        serde_json::json!({"order_id": order, "status": "COMPLETED"}),
    )
    .aggregate_version(2)
}

/// An `ORDER_STATUS_CHANGED` event of aggregate `order` `aggregate`, with no version.
pub fn order(aggregate: &str) -> NewEvent {
    NewEvent::new(
        "ORDER_STATUS_CHANGED",
        "order",
        aggregate,
        serde_json::json!({"order_id": aggregate}),
    )
}

/// Enqueues `events` in one transaction of their own.
pub async fn enqueue_events(db: &TestDb, events: &[NewEvent]) {
    let mut conn = db.pool.get().await.unwrap();
    conn.transaction::<_, actix_outbox::Error, _>(async |c| {
        actix_outbox::enqueue_many(c, events).await?;
        Ok(())
    })
    .await
    .unwrap();
}

/// Pauses `consumer` as an operator would.
pub async fn pause(db: &TestDb, consumer: &str) {
    let mut conn = db.pool.get().await.unwrap();
    let name = ConsumerName::new(consumer).unwrap();
    pause_consumer(&mut conn, &name, "test", "set-up", None)
        .await
        .unwrap();
}

/// Whether `consumer` reads through its cursors (one per slot and lane) and stamps were made:
/// a cursor variant of a test asserts it, so that it cannot pass on the inbox's path.
pub async fn read_through_cursors(db: &TestDb, consumer: &str) -> bool {
    let cursors = format!(
        "SELECT count(*) AS n FROM actix_outbox.consumer_cursors WHERE consumer = '{consumer}'"
    );
    let stamped = "SELECT last AS n FROM actix_outbox.log_head";
    db.count(&cursors).await == 16 && db.count(stamped).await > 0
}

/// Resumes `consumer` as an operator would.
pub async fn resume(db: &TestDb, consumer: &str) {
    let mut conn = db.pool.get().await.unwrap();
    let name = ConsumerName::new(consumer).unwrap();
    resume_consumer(&mut conn, &name, "test").await.unwrap();
}

/// `producers` connections that each commit `each` one-event transactions (aggregates
/// `p{producer}-{i}`) and wake the runtime after each commit, as the README says; every other
/// producer stalls mid-commit, up to 60 ms, varied so that commits interleave.
pub async fn stalled_producers(
    url: &str,
    handle: &actix_outbox::OutboxHandle,
    producers: usize,
    each: usize,
) {
    let producers = (0..producers).map(|p| {
        let (url, handle) = (url.to_owned(), handle.clone());
        async move {
            let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
            for i in 0..each {
                conn.batch_execute("BEGIN").await.unwrap();
                actix_outbox::enqueue_many(&conn, &[order(&format!("p{p}-{i}"))])
                    .await
                    .unwrap();
                if p % 2 == 1 {
                    let ms = ((i * 7 + p * 13) % 61) as u64;
                    actix_rt::time::sleep(Duration::from_millis(ms)).await;
                }
                conn.batch_execute("COMMIT").await.unwrap();
                handle.wake();
            }
        }
    });
    futures_util::future::join_all(producers).await;
}

/// Produces `total` events (`produce_batched`, 50 per transaction, aggregates `o-…`) from a
/// connection of its own while the child process `spawn` starts runs; SIGKILLs the child and
/// starts another each time `progress` (a count query) has climbed `first` rows past the last
/// kill, 97 more rows each time so that the kills land at different points, at most 8 times
/// or for 240 s. Returns the kills, and the child left running once the producer is done.
pub async fn kill_while_producing(
    db: &TestDb,
    spawn: impl Fn() -> std::process::Child,
    progress: &str,
    total: i64,
    first: i64,
) -> (i64, std::process::Child) {
    let mut child = spawn();
    let producer = {
        let db_url = db.url.clone();
        actix_rt::spawn(async move {
            let pool = actix_outbox::connect(&db_url, 2).await.unwrap();
            let db = TestDb {
                name: String::new(),
                url: db_url,
                pool,
            };
            db.produce_batched(total as usize, 50, "o").await;
        })
    };
    let deadline = Instant::now() + Duration::from_secs(240);
    let (mut kills, mut last) = (0, 0);
    while kills < 8 && Instant::now() < deadline {
        let now = db.count(progress).await;
        if now >= total {
            break;
        }
        if now >= last + first + kills * 97 {
            child.kill().expect("SIGKILL"); // Child::kill sends SIGKILL on Unix
            child.wait().unwrap();
            kills += 1;
            last = now;
            child = spawn();
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    producer.await.unwrap();
    (kills, child)
}

pub async fn insert_order(
    conn: &mut AsyncPgConnection,
    order: &str,
) -> Result<(), actix_outbox::Error> {
    diesel::sql_query("INSERT INTO orders (id, status, version) VALUES ($1, 'COMPLETED', 2)")
        .bind::<Text, _>(order)
        .execute(conn)
        .await?;
    diesel::sql_query("INSERT INTO audit_logs (order_id, action) VALUES ($1, 'COMPLETED')")
        .bind::<Text, _>(order)
        .execute(conn)
        .await?;
    Ok(())
}

/// What a [`Recorder`] does on each attempt. It always writes its effect row first, so a
/// failure that is not rolled back shows up as an extra row.
#[derive(Clone, Default)]
pub struct Behaviour {
    /// Attempts 1..=n return a retryable error.
    pub fail_attempts: u32,
    /// Attempts 1..=n panic inside the returned future (the actor survives).
    pub panic_attempts: u32,
    /// Attempts 1..=n panic in `handle` itself, which kills the handler actor.
    pub kill_attempts: u32,
    /// Events of this aggregate id fail on every attempt, as `poison` says.
    pub poison_aggregate: Option<String>,
    /// How the poison event fails.
    pub poison: Poison,
    /// The most events one call got (a [`BatchRecorder`] records it).
    pub largest_call: Arc<AtomicUsize>,
    /// Work time per delivery, to keep deliveries in flight (not a wait for an effect).
    pub work: Duration,
    /// Write the effect inside the handler's own `conn.transaction(…)`, nested in the
    /// delivery's transaction.
    pub nested: bool,
    /// Set by the first [`Poison::LongHang`].
    pub hung: Arc<std::sync::atomic::AtomicBool>,
    /// Calls that got the poison event, counted outside any transaction.
    pub poison_calls: Arc<AtomicUsize>,
    /// The handler makes an error of its own (`INBOX_CONSUMER_FAILED`) of a failed effect
    /// statement, as one using `map_err` does, instead of passing it on with `?`.
    pub own_errors: bool,
}

/// How a poison event fails.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub enum Poison {
    /// The handler returns a retryable error after writing its effect.
    #[default]
    Fail,
    /// The handler panics in `handle`, killing its actor.
    Kill,
    /// The handler writes its effect and keeps the connection for two seconds, past any test's
    /// handler timeout.
    Hang,
    /// The handler writes its effect and aborts the whole process.
    Abort,
    /// The handler writes its effect, lets go of the connection, runs on for [`LATE`], past
    /// its handler timeout in the test that uses it, and then aborts the whole process.
    LateAbort,
    /// The handler returns a retryable error whose message holds a NUL, which PostgreSQL's
    /// `text` refuses.
    NulMessage,
    /// The handler asks to be retried after `Duration::MAX`, more than PostgreSQL's interval
    /// arithmetic can add to a timestamp.
    RetryNever,
    /// The handler writes its effect, runs a statement that fails, ignores the error and
    /// returns Ok: its transaction is aborted and cannot commit.
    SwallowError,
    /// On the poison event's first delivery, the handler writes its effect and keeps the
    /// connection for [`LONG_HANG`]; later deliveries fail as [`Poison::Fail`].
    LongHang,
}

/// How long a [`Poison::LongHang`] handler holds on: longer than the test that uses it waits
/// for the other events.
pub const LONG_HANG: Duration = Duration::from_secs(20);

/// How long a [`Poison::Hang`] handler holds on.
pub const HANG: Duration = Duration::from_secs(2);
/// How long a [`Poison::LateAbort`] handler runs on before it aborts.
pub const LATE: Duration = Duration::from_millis(600);

impl Behaviour {
    /// What a poisoned delivery does once its effect is written, for the poisons that act
    /// then; `Some` is what the handler returns at once.
    async fn after_effect(&self, conn: &mut AsyncPgConnection) -> Option<Result<(), HandlerError>> {
        match self.poison {
            Poison::Hang => actix_rt::time::sleep(HANG).await,
            Poison::LongHang if !self.hung.swap(true, Ordering::Relaxed) => {
                actix_rt::time::sleep(LONG_HANG).await
            }
            Poison::SwallowError => {
                let _ = diesel::sql_query("SELECT 1 / 0").execute(conn).await;
                return Some(Ok(()));
            }
            Poison::NulMessage => {
                return Some(Err(HandlerError::retry("upstream said: \u{0}binary\u{0}")));
            }
            Poison::RetryNever => {
                return Some(Err(HandlerError::retry_after(
                    Duration::MAX,
                    "not before the end of time",
                )));
            }
            _ => {}
        }
        None
    }

    /// `poison_aggregate` `*` poisons every event.
    fn poisoned<'a>(&self, mut aggregates: impl Iterator<Item = &'a str>) -> bool {
        aggregates
            .any(|a| matches!(self.poison_aggregate.as_deref(), Some(p) if p == a || p == "*"))
    }
}

/// Writes `d`'s `effects` row for `consumer` (with its attempt) through `conn`, the delivery's.
pub async fn write_effect(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    d: &Delivery,
) -> Result<(), diesel::result::Error> {
    diesel::sql_query("INSERT INTO effects (consumer, event_id, attempt) VALUES ($1, $2, $3)")
        .bind::<Text, _>(consumer)
        .bind::<SqlUuid, _>(d.event_id().as_uuid())
        .bind::<diesel::sql_types::Integer, _>(d.attempt() as i32)
        .execute(conn)
        .await
        .map(drop)
}

/// A consumer actor that records one `effects` row per successful handling.
#[derive(Clone)]
pub struct Recorder {
    pub name: String,
    pub behaviour: Behaviour,
}

impl Actor for Recorder {
    type Context = Context<Self>;
}

impl Handler<Delivery> for Recorder {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
        let poisoned = self.behaviour.poisoned(std::iter::once(d.aggregate_id()));
        if poisoned {
            self.behaviour.poison_calls.fetch_add(1, Ordering::Relaxed);
        }
        if d.attempt() <= self.behaviour.kill_attempts
            || (poisoned && self.behaviour.poison == Poison::Kill)
        {
            panic!(
                "injected panic in handle of {} for {}",
                self.name,
                d.event_id()
            );
        }
        let me = self.clone();
        Box::pin(async move {
            let mut conn = d.conn().await?;
            let effect = diesel::sql_query(
                "INSERT INTO effects (consumer, event_id, attempt) VALUES ($1, $2, $3)",
            )
            .bind::<Text, _>(&me.name)
            .bind::<SqlUuid, _>(d.event_id().as_uuid())
            .bind::<diesel::sql_types::Integer, _>(d.attempt() as i32);
            if me.behaviour.nested {
                conn.transaction::<_, diesel::result::Error, _>(async |c| {
                    effect.execute(c).await.map(drop)
                })
                .await?;
            } else if me.behaviour.own_errors {
                effect
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| HandlerError::retry(format!("could not record: {e}")))?;
            } else {
                effect.execute(&mut *conn).await?;
            }
            if !me.behaviour.work.is_zero() {
                actix_rt::time::sleep(me.behaviour.work).await;
            }
            if d.attempt() <= me.behaviour.panic_attempts {
                panic!("injected panic in {} for {}", me.name, d.event_id());
            }
            if poisoned {
                if let Some(done) = me.behaviour.after_effect(&mut conn).await {
                    return done;
                }
            }
            if poisoned && me.behaviour.poison == Poison::Abort {
                std::process::abort();
            }
            if poisoned && me.behaviour.poison == Poison::LateAbort {
                drop(conn);
                actix_rt::time::sleep(LATE).await;
                std::process::abort();
            }
            if d.attempt() <= me.behaviour.fail_attempts || poisoned {
                return Err(HandlerError::retry("injected failure"));
            }
            Ok(())
        })
    }
}

/// A batch consumer actor: writes the effect rows of a whole [`DeliveryBatch`] in one
/// statement, then fails as its [`Behaviour`] says if the batch holds the poison event.
#[derive(Clone)]
pub struct BatchRecorder {
    pub name: String,
    pub behaviour: Behaviour,
}

impl Actor for BatchRecorder {
    type Context = Context<Self>;
}

impl Handler<DeliveryBatch> for BatchRecorder {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, b: DeliveryBatch, _: &mut Context<Self>) -> Self::Result {
        let me = self.clone();
        let poisoned = me
            .behaviour
            .poisoned(b.deliveries().iter().map(|d| d.aggregate_id()));
        if poisoned {
            me.behaviour.poison_calls.fetch_add(1, Ordering::Relaxed);
        }
        if poisoned && me.behaviour.poison == Poison::Kill {
            panic!("injected panic in handle of {}", me.name);
        }
        me.behaviour
            .largest_call
            .fetch_max(b.len(), Ordering::Relaxed);
        Box::pin(async move {
            let ids: Vec<uuid::Uuid> = b
                .deliveries()
                .iter()
                .map(|d| d.event_id().as_uuid())
                .collect();
            let attempts: Vec<i32> = b.deliveries().iter().map(|d| d.attempt() as i32).collect();
            let mut conn = b.conn().await?;
            diesel::sql_query(
                "INSERT INTO effects (consumer, event_id, attempt) \
                 SELECT $1, e, a FROM unnest($2::uuid[], $3::int4[]) AS t(e, a)",
            )
            .bind::<Text, _>(&me.name)
            .bind::<Array<SqlUuid>, _>(&ids)
            .bind::<Array<diesel::sql_types::Integer>, _>(&attempts)
            .execute(&mut *conn)
            .await?;
            if poisoned {
                if let Some(done) = me.behaviour.after_effect(&mut conn).await {
                    return done;
                }
            }
            if poisoned && me.behaviour.poison == Poison::Abort {
                std::process::abort();
            }
            drop(conn);
            if poisoned {
                return Err(HandlerError::retry("injected failure"));
            }
            Ok(())
        })
    }
}

/// Takes `n` of `pool`'s connections at once and gives them back, asserting that the pool
/// opened new ones meanwhile: opened while the calling thread asked, not lying idle before.
pub async fn make_pool_open(pool: &actix_outbox::PgPool, n: usize) {
    let opened = pool.state().statistics.connections_created;
    let taken = futures_util::future::join_all((0..n).map(|_| pool.get_owned()));
    let taken: Vec<_> = taken.await.into_iter().map(|c| c.unwrap()).collect();
    drop(taken);
    assert!(
        pool.state().statistics.connections_created > opened,
        "the pool opened no connection while the thread asked"
    );
}

/// A consumer config for tests: fast polls and millisecond retries.
pub fn consumer(name: &str, max_attempts: u32) -> ConsumerConfig {
    ConsumerConfig::new(name)
        .subscribe("ORDER_STATUS_CHANGED")
        .retry(RetryPolicy::fixed(max_attempts, Duration::from_millis(20)))
        .poll_interval(Duration::from_millis(100))
}

pub fn fast_runtime() -> RuntimeConfig {
    RuntimeConfig::default()
        .poll_interval(Duration::from_millis(100))
        .supervise_interval(Duration::from_millis(20))
        .shutdown_timeout(Duration::from_secs(10))
}

pub async fn start(db: &TestDb, consumers: Vec<(ConsumerConfig, Behaviour)>) -> OutboxRuntime {
    start_on(db.pool.clone(), consumers).await
}

/// Starts a runtime whose consumers are [`BatchRecorder`]s.
pub async fn start_batch(
    db: &TestDb,
    consumers: Vec<(ConsumerConfig, Behaviour)>,
) -> OutboxRuntime {
    start_batch_on(db.pool.clone(), consumers).await
}

pub async fn start_batch_on(
    pool: PgPool,
    consumers: Vec<(ConsumerConfig, Behaviour)>,
) -> OutboxRuntime {
    let mut b = OutboxRuntime::builder(pool).config(fast_runtime());
    for (cfg, behaviour) in consumers {
        let name = cfg.name().to_string();
        b = b.batch_consumer(cfg, move || BatchRecorder {
            name: name.clone(),
            behaviour: behaviour.clone(),
        });
    }
    b.start().await.expect("start runtime")
}

pub async fn start_on(pool: PgPool, consumers: Vec<(ConsumerConfig, Behaviour)>) -> OutboxRuntime {
    start_with(pool, fast_runtime(), consumers).await
}

/// [`start_on`] with a runtime configuration of the test's own.
pub async fn start_with(
    pool: PgPool,
    config: RuntimeConfig,
    consumers: Vec<(ConsumerConfig, Behaviour)>,
) -> OutboxRuntime {
    let mut b = OutboxRuntime::builder(pool).config(config);
    for (cfg, behaviour) in consumers {
        let name = cfg.name().to_string();
        b = b.consumer(cfg, move || Recorder {
            name: name.clone(),
            behaviour: behaviour.clone(),
        });
    }
    b.start().await.expect("start runtime")
}

pub const WAIT: Duration = Duration::from_secs(60);

/// Runs `f` with a deadline so a hung test fails instead of hanging CI.
pub async fn within<F: Future>(limit: Duration, f: F) -> F::Output {
    actix_rt::time::timeout(limit, f)
        .await
        .expect("test step timed out")
}

#[derive(QueryableByName)]
struct InboxStateRow {
    #[diesel(sql_type = SqlUuid)]
    event_id: uuid::Uuid,
    #[diesel(sql_type = Text)]
    consumer: String,
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = diesel::sql_types::Integer)]
    attempt_count: i32,
    #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
    error_code: Option<String>,
}

/// One inbox row's outcome: status, attempt count, error code.
pub type InboxState = (String, u32, Option<String>);

/// Every inbox row's outcome, keyed by (event id, consumer), for comparing a run against the
/// in-memory harness.
pub async fn inbox_states(
    db: &TestDb,
) -> std::collections::BTreeMap<(uuid::Uuid, String), InboxState> {
    let mut conn = db.pool.get().await.unwrap();
    let rows: Vec<InboxStateRow> = diesel::sql_query(
        "SELECT event_id, consumer, status, attempt_count, error_code FROM actix_outbox.inbox_events",
    )
    .load(&mut conn)
    .await
    .unwrap();
    rows.into_iter()
        .map(|r| {
            (
                (r.event_id, r.consumer),
                (r.status, r.attempt_count as u32, r.error_code),
            )
        })
        .collect()
}

/// The Prometheus recorder of this test process, installed by the first test that asks. A
/// process has one recorder, and `cargo test` runs every integration test in one process
/// (nextest runs each in its own): tests that read it use consumer names of their own.
pub fn prometheus() -> metrics_exporter_prometheus::PrometheusHandle {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            actix_outbox::admin::install_prometheus_recorder()
                .expect("no other recorder in this test process")
        })
        .clone()
}

/// Runs the `#[ignore]`d test `entry` of the current test binary as a child process, with the
/// database URL in `AO_CHILD_DB` and `env`: a runtime in a process of its own, for tests that
/// kill it. `entry` is the test's full name in the one integration test crate, module path
/// included (`failure::child_process_entry`): the child runs exactly that test, so a name
/// without its module would match nothing and the child would exit at once.
pub fn spawn_entry(url: &str, entry: &str, env: &[(&str, &str)]) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", entry, "--ignored", "--nocapture"])
        .envs(env.iter().copied())
        .env("AO_CHILD_DB", url)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn child runtime")
}

/// Calls an actix-web test service and returns (status, body as text).
macro_rules! call {
    ($app:expr, $req:expr) => {{
        let res = actix_web::test::call_service(&$app, $req.to_request()).await;
        let status = res.status().as_u16();
        let body = actix_web::test::read_body(res).await;
        (status, String::from_utf8(body.to_vec()).unwrap())
    }};
}
pub(crate) use call;
