//! The log lines an operator follows one event by (ARCHITECTURE §6): each of the nine names
//! appears on the in-process route and on an external route, with the event's ids, its
//! consumer and its attempt where they apply. The tracing output is captured as JSON lines
//! and read back; faults (a claim that fails, a handler that fails once, a publish that fails,
//! a crash after a publish) are injected so that every name has a reason to appear.

use crate::common;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use actix_outbox::testing::{ScriptedTransport, Step};
use actix_outbox::{transport::ExternalConfig, OutboxRuntime, RetryPolicy};
use common::*;
use diesel_async::SimpleAsyncConnection;
use serde_json::Value;

/// Every line the library logged at `debug` and above, as JSON, from any thread.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

struct Writer(Arc<Mutex<Vec<u8>>>);

impl Write for Writer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Capture {
    type Writer = Writer;
    fn make_writer(&'a self) -> Writer {
        Writer(self.0.clone())
    }
}

/// The process's subscriber, installed once (tests of this binary may share a process); each
/// test reads only the lines about its own events.
fn capture() -> Capture {
    static CAPTURE: OnceLock<Capture> = OnceLock::new();
    CAPTURE
        .get_or_init(|| {
            let capture = Capture::default();
            let subscriber = tracing_subscriber::fmt()
                .json()
                .flatten_event(true)
                .with_env_filter(tracing_subscriber::EnvFilter::new("actix_outbox=debug"))
                .with_writer(capture.clone())
                .finish();
            tracing::subscriber::set_global_default(subscriber).expect("one subscriber");
            capture
        })
        .clone()
}

impl Capture {
    fn lines(&self) -> Vec<Value> {
        let bytes = self.0.lock().unwrap().clone();
        String::from_utf8_lossy(&bytes)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The lines named `name` about event `id`.
    fn about(&self, name: &str, id: &str) -> Vec<Value> {
        self.lines()
            .into_iter()
            .filter(|l| l["message"] == name && l["event_id"] == id)
            .collect()
    }

    /// Waits until a line named `name` about `id` (with `consumer`, if given) is there.
    async fn wait(&self, name: &str, id: &str, consumer: Option<&str>) -> Vec<Value> {
        let found = || {
            self.about(name, id)
                .into_iter()
                .filter(|l| consumer.is_none_or(|c| l["consumer"] == c))
                .collect::<Vec<_>>()
        };
        within(WAIT, async {
            loop {
                let lines = found();
                if !lines.is_empty() {
                    return lines;
                }
                actix_rt::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
    }
}

/// Asserts the fields every line about an event carries, and `consumer` / `attempt` where
/// given.
fn assert_fields(line: &Value, id: &str, consumer: Option<&str>, attempt: Option<i64>) {
    let name = &line["message"];
    assert_eq!(line["event_id"], id, "{name}: {line}");
    assert_eq!(line["event_type"], "ORDER_STATUS_CHANGED", "{name}: {line}");
    assert!(
        line["correlation_id"]
            .as_str()
            .is_some_and(|c| !c.is_empty()),
        "{name} has no correlation id: {line}"
    );
    assert!(
        line["aggregate_id"].as_str().is_some_and(|a| !a.is_empty()),
        "{name} has no aggregate id: {line}"
    );
    if let Some(consumer) = consumer {
        assert_eq!(line["consumer"], consumer, "{name}: {line}");
    }
    if let Some(attempt) = attempt {
        assert_eq!(line["attempt"], attempt, "{name}: {line}");
    }
}

#[actix_rt::test]
async fn the_in_process_route_logs_each_name_with_the_events_ids() {
    let logs = capture();
    let db = TestDb::new().await;
    let failing_once = Behaviour {
        fail_attempts: 1,
        ..Behaviour::default()
    };
    let rt = start(
        &db,
        vec![
            (consumer("mail", 3), failing_once),
            (consumer("stats", 3), Behaviour::default()),
        ],
    )
    .await;
    // The claim fails while the event's inbox row cannot be written.
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN RAISE EXCEPTION 'injected: inbox refused'; END $$; \
         CREATE TRIGGER refuse BEFORE INSERT ON actix_outbox.inbox_events FOR EACH ROW \
             WHEN (NEW.aggregate_id = 'logged') EXECUTE FUNCTION refuse();",
    )
    .await
    .unwrap();
    let conn2 = db.pool.get().await.unwrap();
    let id = actix_outbox::enqueue(&conn2, &order_event("logged"))
        .await
        .unwrap()
        .to_string();
    drop(conn2);
    assert_fields(
        &logs.wait("outbox.enqueued", &id, None).await[0],
        &id,
        None,
        None,
    );
    let failed = within(WAIT, async {
        loop {
            let failed: Vec<Value> = logs
                .lines()
                .into_iter()
                .filter(|l| {
                    l["message"] == "outbox.publish.failed"
                        && l["error"]
                            .as_str()
                            .is_some_and(|e| e.contains("inbox refused"))
                })
                .collect();
            if !failed.is_empty() {
                return failed;
            }
            actix_rt::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(failed[0]["level"], "WARN");
    // Nothing about the event before its claim committed.
    assert!(logs.about("outbox.created", &id).is_empty());
    conn.batch_execute("DROP TRIGGER refuse ON actix_outbox.inbox_events")
        .await
        .unwrap();
    rt.handle().wake();

    for name in [
        "outbox.created",
        "outbox.publish.started",
        "outbox.published",
    ] {
        assert_fields(&logs.wait(name, &id, None).await[0], &id, None, Some(1));
    }
    for c in ["mail", "stats"] {
        let received = logs.wait("event.received", &id, Some(c)).await;
        assert_fields(&received[0], &id, Some(c), None);
        let completed = logs.wait("consumer.completed", &id, Some(c)).await;
        let attempt = if c == "mail" { 2 } else { 1 };
        assert_fields(&completed[0], &id, Some(c), Some(attempt));
    }
    let started = logs.about("consumer.started", &id);
    let mail: Vec<_> = started.iter().filter(|l| l["consumer"] == "mail").collect();
    assert_eq!(mail.len(), 2, "attempts 1 and 2: {mail:?}");
    assert_fields(mail[1], &id, Some("mail"), Some(2));
    let failed = logs.wait("consumer.failed", &id, Some("mail")).await;
    assert_fields(&failed[0], &id, Some("mail"), Some(1));
    assert_eq!(failed[0]["level"], "WARN");
    assert!(logs
        .about("consumer.failed", &id)
        .iter()
        .all(|l| l["consumer"] == "mail"));

    // Published again (a lost acknowledgement): both inboxes absorb it.
    conn.batch_execute(&format!(
        "UPDATE actix_outbox.outbox_events SET status = 'PENDING' WHERE id = '{id}'"
    ))
    .await
    .unwrap();
    rt.handle().wake();
    for c in ["mail", "stats"] {
        let duplicate = logs.wait("event.duplicate", &id, Some(c)).await;
        assert_fields(&duplicate[0], &id, Some(c), None);
        assert_eq!(duplicate[0]["level"], "INFO");
        assert_eq!(duplicate[0]["code"], "DUPLICATE_EVENT", "{}", duplicate[0]);
    }
    // A second publish is no creation: one `outbox.created`.
    assert_eq!(logs.about("outbox.created", &id).len(), 1);
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 2);
    drop(conn);
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn an_external_route_logs_each_name_with_the_events_ids() {
    let logs = capture();
    let db = TestDb::new().await;
    let transport = ScriptedTransport::new(db.pool.clone());
    // A failed publish, then one that delivers and crashes before its mark: the lease expires
    // and the event is published again, which the inbox absorbs.
    transport.script([Step::Fail, Step::CrashAfterPublish]);
    let cfg = ExternalConfig::default()
        .lease(Duration::from_millis(600))
        .publish_timeout(Duration::from_millis(200))
        .retry(RetryPolicy::fixed(5, Duration::from_millis(50)))
        .reap_interval(Duration::from_millis(50));
    let failing_once = Behaviour {
        fail_attempts: 1,
        ..Behaviour::default()
    };
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer(consumer("mail", 3), move || Recorder {
            name: "mail".into(),
            behaviour: failing_once.clone(),
        })
        .external_transport(transport.clone(), cfg)
        .start()
        .await
        .expect("start runtime");
    let id = db.produce(1, "ext").await[0].to_string();

    assert_fields(
        &logs.wait("outbox.enqueued", &id, None).await[0],
        &id,
        None,
        None,
    );
    assert_fields(
        &logs.wait("outbox.created", &id, None).await[0],
        &id,
        None,
        Some(1),
    );
    let failed = logs.wait("outbox.publish.failed", &id, None).await;
    assert_fields(&failed[0], &id, None, Some(1));
    assert_eq!(failed[0]["level"], "WARN");
    let received = logs.wait("event.received", &id, Some("mail")).await;
    assert_fields(&received[0], &id, Some("mail"), None);
    let duplicate = logs.wait("event.duplicate", &id, Some("mail")).await;
    assert_fields(&duplicate[0], &id, Some("mail"), None);
    assert_eq!(duplicate[0]["code"], "DUPLICATE_EVENT", "{}", duplicate[0]);
    let published = logs.wait("outbox.published", &id, None).await;
    assert_fields(&published[0], &id, None, Some(3));
    let started = logs.about("outbox.publish.started", &id);
    assert_eq!(started.len(), 3, "three publishes: {started:?}");
    assert_eq!(logs.about("outbox.created", &id).len(), 1);

    let failed = logs.wait("consumer.failed", &id, Some("mail")).await;
    assert_fields(&failed[0], &id, Some("mail"), Some(1));
    let completed = logs.wait("consumer.completed", &id, Some("mail")).await;
    assert_fields(&completed[0], &id, Some("mail"), Some(2));
    assert_fields(
        &logs.wait("consumer.started", &id, Some("mail")).await[0],
        &id,
        Some("mail"),
        Some(1),
    );
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 1);
    db.finish(&[&rt]).await;
}

/// An event caused by another carries its causation id, and its aggregate id, on every line
/// about it: its enqueue, its publish and its consumer's.
#[actix_rt::test]
async fn the_lines_of_a_caused_event_carry_its_causation_and_aggregate_ids() {
    let logs = capture();
    let db = TestDb::new().await;
    let rt = start(&db, vec![(consumer("mail", 3), Behaviour::default())]).await;
    let event = order_event("caused-1").causation_id("cause-7");
    let conn = db.pool.get().await.unwrap();
    let id = actix_outbox::enqueue(&conn, &event)
        .await
        .unwrap()
        .to_string();
    drop(conn);
    rt.handle().wake();
    for name in ["outbox.enqueued", "outbox.published", "consumer.completed"] {
        let consumer = (name == "consumer.completed").then_some("mail");
        let line = &logs.wait(name, &id, consumer).await[0];
        assert_fields(line, &id, consumer, None);
        assert_eq!(line["causation_id"], "cause-7", "{name}: {line}");
        assert_eq!(line["aggregate_id"], "caused-1", "{name}: {line}");
    }
    db.finish(&[&rt]).await;
}
