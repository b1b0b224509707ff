//! The runtime's lifecycle as an application lives it: a start-up that fails part-way, the
//! actix system dropped afterwards, and a shutdown while one part of the runtime is stuck.
//!
//! These tests drive `actix_rt::System` by hand (`block_on`, then drop it), as
//! `#[actix_web::main]` does, because the panics they guard against happen when the system is
//! dropped, after the application's own code has returned.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use actix::prelude::*;
use actix_outbox::testing::{ScriptedTransport, Step};
use actix_outbox::{
    admin::AdminConfig, transport::ExternalConfig, Delivery, Error, HandlerError, OutboxRuntime,
    RuntimeConfig,
};
use common::{consumer, fast_runtime, Behaviour, Recorder, TestDb};
use diesel::sql_types::{Integer, Text, Uuid as SqlUuid};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};

/// Every panic of this process, with the thread it happened on. The hook is installed once and
/// never removed: a panic in any actor, or while a system is dropped, lands here. Each test's
/// system runs on the test's own thread, which tells the tests' panics apart when `cargo test`
/// runs them side by side in one process.
fn panics() -> &'static Mutex<Vec<(std::thread::ThreadId, String)>> {
    static PANICS: OnceLock<Mutex<Vec<(std::thread::ThreadId, String)>>> = OnceLock::new();
    PANICS.get_or_init(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if let Some(p) = PANICS.get() {
                p.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((std::thread::current().id(), info.to_string()));
            }
            default(info);
        }));
        Mutex::new(Vec::new())
    })
}

/// Runs `app` as `#[actix_web::main]` would: in a fresh actix system that is dropped as soon as
/// `app` returns, with whatever is still alive in it. Returns `app`'s output and the panics seen
/// on this thread while it ran and while the system was dropped.
fn run_app<T>(app: impl std::future::Future<Output = T>) -> (T, Vec<String>) {
    let recorded = panics();
    let me = std::thread::current().id();
    let system = actix_rt::System::new();
    let out = system.block_on(app);
    // A panic in the drop would unwind out of here; the hook has recorded it either way.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(system)));
    let seen = recorded
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|(thread, _)| *thread == me)
        .map(|(_, panic)| panic.clone())
        .collect();
    (out, seen)
}

/// Drops a test database from a system of its own (the test's system is gone by now).
fn drop_database(name: &str) {
    actix_rt::System::new().block_on(async {
        let mut admin = AsyncPgConnection::establish(&common::base_url())
            .await
            .unwrap();
        admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .await
            .unwrap();
    });
}

/// The builder of a runtime with one recording consumer, on `db`.
fn builder(pool: actix_outbox::PgPool, name: &str) -> actix_outbox::OutboxBuilder {
    let owner = name.to_owned();
    OutboxRuntime::builder(pool)
        .config(fast_runtime())
        .consumer(consumer(name, 3), move || Recorder {
            name: owner.clone(),
            behaviour: Behaviour::default(),
        })
}

/// An application with two databases starts the outbox of the first; the second one's
/// configuration is invalid. `start` says so, and nothing panics: not the failed start, and not
/// the first runtime's actors when the application returns the error and its system is
/// dropped without a shutdown.
#[test]
fn a_start_that_fails_after_another_runtime_started_returns_the_error_and_panics_nowhere() {
    let ((result, names), panicked) = run_app(async {
        let orders = TestDb::new().await;
        let billing = TestDb::new().await;
        let names = vec![orders.name.clone(), billing.name.clone()];
        let app = async {
            let _orders = builder(orders.pool.clone(), "orders").start().await?;
            // A publish gap as long as the poll interval.
            let gap = Duration::from_millis(100);
            let invalid = fast_runtime().poll_interval(gap).publish_gap(gap);
            let _billing = builder(billing.pool.clone(), "billing")
                .config(invalid)
                .start()
                .await?;
            Ok::<(), Error>(())
        };
        (app.await, names)
    });
    for name in &names {
        drop_database(name);
    }
    assert!(
        matches!(result, Err(Error::Config(_))),
        "start returns the configuration error, got {result:?}"
    );
    assert_eq!(panicked, Vec::<String>::new(), "nothing panics");
}

/// The same when the failing step is the subscription write: the second database refuses
/// every write of a consumer's state (a trigger), so `start` cannot record its consumers.
#[test]
fn a_start_that_cannot_register_its_consumers_returns_the_error_and_panics_nowhere() {
    let ((result, names), panicked) = run_app(async {
        let orders = TestDb::new().await;
        let (bare, url) = bare_database().await;
        actix_outbox::migrate(&url).await.unwrap();
        let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
        conn.batch_execute(
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS \
                 $$ BEGIN RAISE EXCEPTION 'no consumer may register here'; END $$; \
             CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON actix_outbox.consumer_states \
                 FOR EACH ROW EXECUTE FUNCTION refuse();",
        )
        .await
        .unwrap();
        drop(conn);
        let names = vec![orders.name.clone(), bare.clone()];
        let app = async {
            let _orders = builder(orders.pool.clone(), "orders").start().await?;
            let pool = actix_outbox::connect(&common::with_database(&common::base_url(), &bare), 4)
                .await?;
            let _billing = builder(pool, "billing").start().await?;
            Ok::<(), Error>(())
        };
        (app.await, names)
    });
    for name in &names {
        drop_database(name);
    }
    assert!(
        matches!(result, Err(Error::Database(_))),
        "start returns the database error, got {result:?}"
    );
    assert_eq!(panicked, Vec::<String>::new(), "nothing panics");
}

/// A start on a database that was never migrated is refused before anything runs, with the
/// error that says so.
#[test]
fn a_start_on_a_database_never_migrated_says_so_and_panics_nowhere() {
    let ((result, name), panicked) = run_app(async {
        let (bare, url) = bare_database().await;
        let app = async {
            let pool = actix_outbox::connect(&url, 4).await?;
            let _billing = builder(pool, "billing").start().await?;
            Ok::<(), Error>(())
        };
        (app.await, bare)
    });
    drop_database(&name);
    assert_eq!(
        result.map_err(|e| e.code().as_str().to_owned()),
        Err("SCHEMA_NOT_MIGRATED".to_owned())
    );
    assert_eq!(panicked, Vec::<String>::new(), "nothing panics");
}

/// The example's start-up: the runtime has started, then the next step (the admin API's token,
/// too short) fails and the application returns the error without a shutdown. The runtime's
/// actors are alive when the system is dropped; nothing panics.
#[test]
fn an_application_error_after_start_panics_nowhere_when_the_system_is_dropped() {
    let ((result, name), panicked) = run_app(async {
        let db = TestDb::new().await;
        let name = db.name.clone();
        let app = async {
            let _runtime = builder(db.pool.clone(), "orders").start().await?;
            let _admin = AdminConfig::new(db.pool.clone()).bearer_token("ops", "short")?;
            Ok::<(), Error>(())
        };
        (app.await, name)
    });
    drop_database(&name);
    assert!(matches!(result, Err(Error::Config(_))), "got {result:?}");
    assert_eq!(panicked, Vec::<String>::new(), "nothing panics");
}

/// The same with many consumers, and the application doing a little more asynchronous work
/// before its next step fails: the system gets to run some of the runtime's actors but not
/// necessarily all. `start` returned only once all of them had started, so none is left for
/// the system's drop to start.
#[test]
fn an_application_error_after_starting_many_consumers_panics_nowhere() {
    let ((result, name), panicked) = run_app(async {
        let db = TestDb::new().await;
        let name = db.name.clone();
        let app = async {
            let mut b = OutboxRuntime::builder(db.pool.clone()).config(fast_runtime());
            for i in 0..100 {
                let name = format!("consumer{i}");
                b = b.consumer(consumer(&name, 3), move || Recorder {
                    name: name.clone(),
                    behaviour: Behaviour::default(),
                });
            }
            let _runtime = b.start().await?;
            tokio::task::yield_now().await;
            let _admin = AdminConfig::new(db.pool.clone()).bearer_token("ops", "short")?;
            Ok::<(), Error>(())
        };
        (app.await, name)
    });
    drop_database(&name);
    assert!(matches!(result, Err(Error::Config(_))), "got {result:?}");
    assert_eq!(panicked, Vec::<String>::new(), "nothing panics");
}

/// The application gives up on a start half-way (a start-up deadline ran out): the future of
/// `start` is dropped after it started the supervisor and before the actors ran. That stops
/// them; nothing panics, then or when the system is dropped.
#[test]
fn an_abandoned_start_panics_nowhere_when_the_system_is_dropped() {
    let ((result, name), panicked) = run_app(async {
        let db = TestDb::new().await;
        // No consumer: nothing to register, so the start gets as far as the actors at once.
        let start = OutboxRuntime::builder(db.pool.clone())
            .config(fast_runtime())
            .start();
        // Polled once (it starts the supervisor and waits for its actors), then given up.
        let result = tokio::select! {
            biased;
            started = start => started.map(drop).map_err(|e| e.to_string()),
            () = std::future::ready(()) => Err("start-up deadline".to_owned()),
        };
        (result, db.name.clone())
    });
    drop_database(&name);
    assert_eq!(result, Err("start-up deadline".to_owned()));
    assert_eq!(panicked, Vec::<String>::new(), "nothing panics");
}

/// A runtime that was shut down leaves nothing behind that panics when the system is dropped.
#[test]
fn a_shut_down_runtime_panics_nowhere_when_the_system_is_dropped() {
    let (name, panicked) = run_app(async {
        let db = TestDb::new().await;
        let runtime = builder(db.pool.clone(), "orders").start().await.unwrap();
        db.produce(5, "o").await;
        db.wait_for(
            "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'",
            5,
            common::WAIT,
        )
        .await;
        assert!(runtime.shutdown().await, "nothing was left in flight");
        db.name.clone()
    });
    drop_database(&name);
    assert_eq!(panicked, Vec::<String>::new(), "nothing panics");
}

/// A handler that counts the deliveries it started and finished, and works for [`WORK`] inside
/// each delivery's transaction in between.
#[derive(Clone, Default)]
struct SlowHandler {
    started: Arc<AtomicUsize>,
    finished: Arc<AtomicUsize>,
}

/// How long a [`SlowHandler`] delivery stays in flight.
const WORK: Duration = Duration::from_secs(2);

impl Actor for SlowHandler {
    type Context = Context<Self>;
}

impl Handler<Delivery> for SlowHandler {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
        // Here only: its `load` would shadow the counters' `AtomicUsize::load`.
        use diesel_async::RunQueryDsl;
        let me = self.clone();
        Box::pin(async move {
            let mut conn = d.conn().await?;
            diesel::sql_query(
                "INSERT INTO effects (consumer, event_id, attempt) VALUES ($1, $2, $3)",
            )
            .bind::<Text, _>("slow")
            .bind::<SqlUuid, _>(d.event_id().as_uuid())
            .bind::<Integer, _>(d.attempt() as i32)
            .execute(&mut *conn)
            .await?;
            me.started.fetch_add(1, Ordering::SeqCst);
            actix_rt::time::sleep(WORK).await;
            me.finished.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    }
}

/// Polls `done` until it holds or `limit` passes.
async fn until(limit: Duration, done: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while !done() {
        if Instant::now() > deadline {
            return false;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

/// The broker hangs on a publish (its timeout is a minute away) while a consumer is in the
/// middle of a delivery, with another event waiting in its inbox. Shutdown stops both the
/// publisher and the consumer from claiming at once, then drains them side by side: the
/// delivery in flight commits, the waiting event is left for the next start, and shutdown
/// returns at its deadline, reporting the publisher it could not wait for. (Draining the
/// publisher first left the consumer claiming new work for the whole deadline, and work it
/// started late was cut off at the deadline.)
#[test]
fn shutdown_drains_the_consumers_while_the_publisher_hangs_on_its_broker() {
    let (name, panicked) = run_app(async {
        let db = TestDb::new().await;
        let transport = ScriptedTransport::new(db.pool.clone());
        // Two events are published; the third hangs for longer than any deadline here.
        transport.script([Step::Ok, Step::Ok, Step::Hang(Duration::from_secs(3600))]);
        let external = ExternalConfig::default()
            .publish_timeout(Duration::from_secs(60))
            .lease(Duration::from_secs(120));
        let deadline = Duration::from_secs(5);
        let config: RuntimeConfig = fast_runtime().shutdown_timeout(deadline);
        let handler = SlowHandler::default();
        let runtime = OutboxRuntime::builder(db.pool.clone())
            .config(config.clone())
            .external_transport(transport.clone(), external)
            .consumer(consumer("slow", 3).batch_size(1).concurrency(1), {
                let handler = handler.clone();
                move || handler.clone()
            })
            .start()
            .await
            .unwrap();

        db.enqueue_one("in-flight").await;
        assert!(
            until(common::WAIT, || handler.started.load(Ordering::SeqCst) == 1).await,
            "the consumer started its delivery"
        );
        db.enqueue_one("waiting").await;
        assert_eq!(
            db.wait_for(
                "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'slow'",
                2,
                WORK
            )
            .await,
            2,
            "the second event waits in the inbox"
        );
        db.enqueue_one("hung").await;
        assert!(
            until(WORK, || transport.calls().iter().any(|c| !c.finished)).await,
            "the publisher is stuck in its broker"
        );
        assert_eq!(
            handler.finished.load(Ordering::SeqCst),
            0,
            "the first delivery is still in flight when shutdown begins"
        );

        let began = Instant::now();
        let finished = runtime.shutdown().await;
        let took = began.elapsed();
        assert!(!finished, "the hung publish did not finish");
        assert!(
            took < deadline + Duration::from_secs(1),
            "shutdown returned within its deadline (took {took:?})"
        );
        assert_eq!(
            db.count(
                "SELECT count(*) AS n FROM actix_outbox.inbox_events e JOIN actix_outbox.outbox_events o ON o.id = e.event_id \
                 WHERE e.consumer = 'slow' AND e.status = 'PROCESSED' AND o.aggregate_id = 'in-flight'"
            )
            .await,
            1,
            "the delivery in flight at shutdown committed"
        );
        assert_eq!(
            db.count(
                "SELECT count(*) AS n FROM actix_outbox.inbox_events e JOIN actix_outbox.outbox_events o ON o.id = e.event_id \
                 WHERE e.consumer = 'slow' AND e.status = 'RECEIVED' AND e.attempt_count = 0 \
                 AND o.aggregate_id = 'waiting'"
            )
            .await,
            1,
            "the waiting event was not claimed after shutdown began"
        );
        assert_eq!(
            db.count("SELECT count(*) AS n FROM effects").await,
            1,
            "one effect: the delivery that was in flight"
        );
        db.name.clone()
    });
    drop_database(&name);
    assert_eq!(panicked, Vec::<String>::new(), "nothing panics");
}

/// `ao_test_<random>` with nothing in it, and its URL.
async fn bare_database() -> (String, String) {
    let bare = format!("ao_test_{}", uuid::Uuid::new_v4().simple());
    let mut admin = AsyncPgConnection::establish(&common::base_url())
        .await
        .unwrap();
    admin
        .batch_execute(&format!("CREATE DATABASE {bare}"))
        .await
        .unwrap();
    let url = common::with_database(&common::base_url(), &bare);
    (bare, url)
}
