//! PostgreSQL itself crashes mid-run: an immediate shutdown (no checkpoint; WAL not yet
//! written is lost, as on a power cut for anything not flushed) while events are produced and
//! consumed, twice. The runtime must get through on new connections, lose no committed event
//! and repeat no effect.
//!
//! This is the fault behind the publisher's claim committing without waiting for its WAL flush
//! (`synchronous_commit = off` for that transaction only): a crash may lose recent claims, and
//! then their outbox rows are PENDING again and claimed again; every consumer commit still
//! waits for its flush, which covers all WAL before it, so no effect can outlive the claim it
//! came from.
//!
//! The test runs its own throwaway cluster (crashing the shared server would break every other
//! test), from the system's PostgreSQL binaries.

use crate::common;

use std::net::TcpListener;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use actix_outbox::{Delivery, HandlerError, OutboxRuntime};
use common::*;
use diesel::sql_types::{BigInt, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};

/// Events produced; the crashes come after a third and after two thirds of them.
const EVENTS: usize = 1_500;

/// A throwaway cluster, managed by the same shell functions `scripts/test` uses for its
/// private cluster (`scripts/lib/pg.sh`: binaries, the `postgres` OS user when we are root,
/// initdb, pg_ctl).
struct Cluster {
    dir: String,
    port: u16,
}

/// Runs `script` with `scripts/lib/pg.sh` loaded and PG_BIN set; `$1…` are `args`.
fn pg_sh_output(script: &str, args: &[&str]) -> std::process::Output {
    Command::new("bash")
        .arg("-c")
        .arg(format!(". scripts/lib/pg.sh && pg_ensure_bin && {script}"))
        .arg("pg_sh")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run bash")
}

/// [`pg_sh_output`] that must succeed; returns its standard output.
fn pg_sh(script: &str, args: &[&str]) -> String {
    let out = pg_sh_output(script, args);
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

impl Cluster {
    fn start() -> Cluster {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let tmp = std::env::temp_dir().display().to_string();
        let dir = pg_sh(r#"pg_owned_dir "$1" ao-crash"#, &[&tmp]);
        let c = Cluster { dir, port };
        c.run_server();
        c
    }

    fn run_server(&self) {
        pg_sh(
            r#"pg_cluster_start "$1" "$2" "-c fsync=on -c synchronous_commit=on""#,
            &[&self.dir, &self.port.to_string()],
        );
    }

    /// Immediate shutdown: every backend is killed, nothing is checkpointed; the next start
    /// replays the WAL that reached the disk.
    fn crash(&self) {
        pg_sh(r#"pg_cluster_stop "$1" immediate"#, &[&self.dir]);
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = pg_sh_output(r#"pg_cluster_stop "$1" immediate"#, &[&self.dir]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[derive(QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// A count on a fresh connection, retried while the server is down or recovering.
async fn count(url: &str, sql: &str) -> i64 {
    let deadline = Instant::now() + WAIT;
    loop {
        let attempt = async {
            let mut conn = AsyncPgConnection::establish(url).await.ok()?;
            let r: N = diesel::sql_query(sql).get_result(&mut conn).await.ok()?;
            Some(r.n)
        };
        if let Some(n) = attempt.await {
            return n;
        }
        assert!(Instant::now() < deadline, "the server did not come back");
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One business transaction: the order and its event, unless the order already exists (a
/// retried transaction whose COMMIT went through before the crash cut the answer off).
async fn place(url: &str, order: &str) -> Result<(), actix_outbox::Error> {
    let mut conn = AsyncPgConnection::establish(url)
        .await
        .map_err(actix_outbox::Error::from)?;
    conn.transaction(async |conn| {
        let new = diesel::sql_query(
            "INSERT INTO orders (id, status, version) VALUES ($1, 'COMPLETED', 2) \
             ON CONFLICT DO NOTHING",
        )
        .bind::<Text, _>(order)
        .execute(conn)
        .await?;
        if new == 1 {
            actix_outbox::enqueue(conn, &order_event(order)).await?;
        }
        Ok(())
    })
    .await
}

#[actix_rt::test]
async fn a_server_crash_mid_run_loses_nothing_and_duplicates_nothing() {
    server_crash_mid_run(false).await;
}

/// The same with the consumer reading through its cursors (storage v2): leases, cursor moves
/// and stamps in flight when the server dies.
#[actix_rt::test]
async fn a_server_crash_mid_run_loses_nothing_and_duplicates_nothing_on_cursors() {
    server_crash_mid_run(true).await;
}

async fn server_crash_mid_run(cursor: bool) {
    let cluster = Cluster::start();
    let db = TestDb::new_on(&cluster.url()).await;
    let runtime = start(
        &db,
        vec![(
            consumer("c1", 50)
                .batch_size(16)
                .concurrency(2)
                .cursor(cursor),
            Behaviour::default(),
        )],
    )
    .await;

    // The producer reconnects per transaction and retries one until it commits.
    let url = db.url.clone();
    let producer = actix_rt::spawn(async move {
        for i in 0..EVENTS {
            let order = format!("o-{i}");
            while place(&url, &order).await.is_err() {
                actix_rt::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });

    for third in [1, 2] {
        let at = (EVENTS * third / 3) as i64;
        while count(&db.url, "SELECT count(*) AS n FROM orders").await < at {
            actix_rt::time::sleep(Duration::from_millis(20)).await;
        }
        // Consumers are behind the producer, so batches and claims are in flight here.
        cluster.crash();
        actix_rt::time::sleep(Duration::from_millis(300)).await;
        cluster.run_server();
    }
    within(WAIT, producer).await.unwrap();

    let n = EVENTS as i64;
    let deadline = Instant::now() + WAIT;
    let effects = loop {
        let effects = count(&db.url, "SELECT count(*) AS n FROM effects").await;
        if effects >= n || Instant::now() > deadline {
            break effects;
        }
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    };
    let orders = count(&db.url, "SELECT count(*) AS n FROM orders").await;
    let events = count(
        &db.url,
        "SELECT count(*) AS n FROM actix_outbox.outbox_events",
    )
    .await;
    let distinct = count(&db.url, "SELECT count(DISTINCT event_id) AS n FROM effects").await;
    let open = count(
        &db.url,
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status <> 'PROCESSED'",
    )
    .await;
    let unpublished = count(
        &db.url,
        "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status <> 'PUBLISHED'",
    )
    .await;
    if cursor {
        // Counted on a fresh connection: the pool's went down with the server.
        let cursors = "SELECT count(*) AS n FROM actix_outbox.consumer_cursors \
                       WHERE consumer = 'c1' AND (SELECT last FROM actix_outbox.log_head) > 0";
        assert_eq!(count(&db.url, cursors).await, 16, "not on cursors");
    }
    assert_eq!(orders, n, "every order committed once");
    assert_eq!(events, n, "one event per committed order");
    assert_eq!(distinct, n, "an event's effect was lost");
    assert_eq!(effects, n, "an effect was repeated");
    assert_eq!(open, 0, "inbox rows left unprocessed");
    assert_eq!(unpublished, 0, "outbox rows left unpublished");
    runtime.shutdown().await;
    drop(cluster);
}

/// The backend's process id, as PostgreSQL reports it.
#[derive(QueryableByName)]
struct Backend {
    #[diesel(sql_type = diesel::sql_types::Integer)]
    pid: i32,
}

/// A consumer actor that records its effect like [`Recorder`], and on the event of the
/// aggregate `poison` then sends SIGKILL to its own database backend: the postmaster takes
/// that for a crash and restarts every session of the cluster. Its kills are counted here, in
/// the process's memory (anything it wrote in the database rolled back with the backend).
#[derive(Clone)]
struct BackendKiller {
    kills: Arc<AtomicUsize>,
}

impl Actor for BackendKiller {
    type Context = Context<Self>;
}

impl Handler<Delivery> for BackendKiller {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
        let kills = self.kills.clone();
        Box::pin(async move {
            let mut conn = d.conn().await?;
            diesel::sql_query(
                "INSERT INTO effects (consumer, event_id, attempt) VALUES ('c1', $1, $2)",
            )
            .bind::<diesel::sql_types::Uuid, _>(d.event_id().as_uuid())
            .bind::<diesel::sql_types::Integer, _>(d.attempt() as i32)
            .execute(&mut *conn)
            .await?;
            if d.aggregate_id() != "poison" {
                return Ok(());
            }
            let backend: Backend = diesel::sql_query("SELECT pg_backend_pid() AS pid")
                .get_result(&mut *conn)
                .await?;
            // The server runs on this machine, as this user or (when the tests run as root)
            // as `postgres`, which root may signal.
            let killed = Command::new("kill")
                .args(["-9", &backend.pid.to_string()])
                .status()
                .expect("run kill");
            assert!(killed.success(), "kill -9 {}", backend.pid);
            kills.fetch_add(1, Ordering::SeqCst);
            // Its session is gone: the next statement fails, and the handler passes the error
            // on, as one using `?` would.
            for _ in 0..100 {
                diesel::sql_query("SELECT 1").execute(&mut *conn).await?;
                actix_rt::time::sleep(Duration::from_millis(20)).await;
            }
            Err(HandlerError::retry(format!(
                "the backend {} outlived its SIGKILL",
                backend.pid
            )))
        })
    }
}

/// An event whose handler crashes its database backend — here by SIGKILL, after which the
/// postmaster restarts every session, as after a crash in native code or an OOM kill — must
/// not crash the server for ever. First claimed in a batch with others, it dies once as a
/// suspect (nothing is charged), then alone, charged each time, and is dead-lettered
/// (`INBOX_ATTEMPT_INTERRUPTED`) after its attempts; every other event is processed exactly
/// once, on its first attempt. The crashes are at most `max_attempts` + 1.
#[actix_rt::test]
async fn a_handler_that_crashes_its_backend_is_dead_lettered_after_its_attempts() {
    const MAX_ATTEMPTS: u32 = 3;
    const HEALTHY: i64 = 30;
    let cluster = Cluster::start();
    let db = TestDb::new_on(&cluster.url()).await;
    // The poison event first, ahead of the healthy ones, so that they share its first batch.
    db.enqueue_one("poison").await;
    db.produce_batched(HEALTHY as usize, 10, "healthy").await;

    let kills = Arc::new(AtomicUsize::new(0));
    let killer = BackendKiller {
        kills: kills.clone(),
    };
    let cfg = consumer("c1", MAX_ATTEMPTS)
        .batch_size(16)
        .handler_timeout(Duration::from_secs(1))
        .lease(Duration::from_secs(2));
    let runtime = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer(cfg, move || killer.clone())
        .start()
        .await
        .expect("start runtime");

    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE aggregate_id = 'poison' \
                AND status = 'DEAD_LETTER' AND attempt_count = 3 \
                AND error_code = 'INBOX_ATTEMPT_INTERRUPTED'";
    let healthy =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE aggregate_id <> 'poison' \
                   AND status = 'PROCESSED'";
    let deadline = Instant::now() + WAIT;
    while (count(&db.url, dead).await, count(&db.url, healthy).await) != (1, HEALTHY)
        && Instant::now() < deadline
    {
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    }
    let crashes = AtomicUsize::load(&kills, Ordering::SeqCst);
    println!("the poison event's handler crashed the server {crashes} times (max_attempts {MAX_ATTEMPTS})");
    assert_eq!(
        count(&db.url, dead).await,
        1,
        "the poison event dead-lettered"
    );
    assert_eq!(
        count(&db.url, healthy).await,
        HEALTHY,
        "every other event processed"
    );
    let first =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE aggregate_id <> 'poison' \
                 AND status = 'PROCESSED' AND attempt_count = 1";
    assert_eq!(
        count(&db.url, first).await,
        HEALTHY,
        "an event was charged for a crash it did not cause"
    );
    // The first crash was in a batch with others, which were suspected, not charged, and then
    // handed over alone.
    let suspected =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE aggregate_id <> 'poison' AND alone";
    assert!(
        count(&db.url, suspected).await >= 1,
        "the poison event's first crash was not in a batch"
    );
    assert!(crashes >= 1, "the handler never crashed its backend");
    assert!(
        crashes <= MAX_ATTEMPTS as usize + 1,
        "{crashes} crashes for an event of {MAX_ATTEMPTS} attempts"
    );
    let effects = "SELECT count(*) AS n FROM effects";
    assert_eq!(count(&db.url, effects).await, HEALTHY, "effects");
    let most = "SELECT coalesce(max(c), 0) AS n FROM \
                (SELECT count(*) AS c FROM effects GROUP BY event_id) x";
    assert_eq!(count(&db.url, most).await, 1, "an effect was repeated");
    runtime.shutdown().await;
    drop(cluster);
}
