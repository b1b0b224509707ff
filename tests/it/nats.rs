//! The NATS JetStream bridge against real PostgreSQL and a real nats-server: a producing
//! database publishes through `NatsTransport`, a receiving database records through
//! `NatsReceiver`, and the effects are counted in the receiving database.
//!
//! The server is `NATS_URL` (default `nats://127.0.0.1:4222`, which `scripts/test` provides);
//! a test that stops NATS runs a `nats-server` of its own. Every test makes streams of its own
//! (`AO_TEST_<random>`) and deletes them at its end, so tests run in parallel and never touch
//! another's stream.

use crate::common;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_outbox::nats::{
    NatsReceiver, NatsReceiverConfig, NatsStream, NatsTransport, NatsTransportConfig,
};
use actix_outbox::transport::{BoxFuture, ExternalConfig, OutboxEvent, Transport, TransportError};
use actix_outbox::{ConsumerConfig, ErrorCode, HandlerError, OutboxRuntime, RetryPolicy};
use async_nats::jetstream::stream::StorageType;
use common::*;
use diesel::sql_types::{Text, Uuid as SqlUuid};
use diesel_async::RunQueryDsl;

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A stream of this test's own, in memory unless the test restarts NATS.
fn stream(storage: StorageType) -> NatsStream {
    let name = format!("AO_TEST_{}", uuid::Uuid::new_v4().simple());
    NatsStream::new(name).storage(storage)
}

async fn client(url: &str) -> async_nats::Client {
    actix_outbox::nats::connect(url).await.expect("NATS client")
}

/// A transport publishing to stream `s`, with the default subjects.
async fn transport(url: &str, s: &NatsStream) -> NatsTransport {
    NatsTransport::new(client(url).await, NatsTransportConfig::new(s.clone()))
        .await
        .unwrap()
}

fn external(lease_ms: u64) -> ExternalConfig {
    ExternalConfig::default()
        .lease(Duration::from_millis(lease_ms))
        .publish_timeout(Duration::from_millis(lease_ms / 2))
        .retry(RetryPolicy::fixed(100, Duration::from_millis(100)))
        .reap_interval(Duration::from_millis(50))
}

/// The producing service: no consumers, an external route through `transport`.
async fn producer(db: &TestDb, transport: impl Transport, cfg: ExternalConfig) -> OutboxRuntime {
    OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .external_transport(transport, cfg)
        .start()
        .await
        .expect("start the producer")
}

fn receiver_cfg(s: &NatsStream, durable: &str) -> NatsReceiverConfig {
    NatsReceiverConfig::new(s.clone(), durable).ack_wait(Duration::from_secs(2))
}

/// The receiving service: a `Recorder` consumer `c1` and a receiver.
async fn receiving(db: &TestDb, receiver: NatsReceiver, behaviour: Behaviour) -> OutboxRuntime {
    OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer(consumer("c1", 3), move || Recorder {
            name: "c1".into(),
            behaviour: behaviour.clone(),
        })
        .nats_receiver(receiver)
        .start()
        .await
        .expect("start the receiving service")
}

async fn stream_messages(url: &str, s: &NatsStream) -> u64 {
    let js = async_nats::jetstream::new(client(url).await);
    let mut st = js.get_stream(s.name()).await.expect("the stream exists");
    st.info().await.expect("stream info").state.messages
}

/// Creates stream `s` in memory before any service does, as another producer might have, so
/// that raw messages can be published to it first.
async fn create_stream(js: &async_nats::jetstream::Context, s: &NatsStream) {
    js.create_stream(async_nats::jetstream::stream::Config {
        name: s.name().to_owned(),
        subjects: vec![format!("{}.>", s.name().to_lowercase())],
        duplicate_window: Duration::from_secs(120),
        storage: StorageType::Memory,
        ..Default::default()
    })
    .await
    .unwrap();
}

async fn delete_stream(url: &str, s: &NatsStream) {
    let js = async_nats::jetstream::new(client(url).await);
    let _ = js.delete_stream(s.name()).await;
}

const PROCESSED: &str =
    "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
const EFFECTS: &str = "SELECT count(*) AS n FROM effects";

/// Publishes through NATS, then panics before the publisher can mark the row (once): the
/// crash between the publish and the mark.
#[derive(Clone)]
struct CrashAfterPublish {
    inner: NatsTransport,
    crashed: Arc<AtomicBool>,
    publishes: Arc<std::sync::atomic::AtomicUsize>,
}

impl Transport for CrashAfterPublish {
    fn publish<'a>(&'a self, event: &'a OutboxEvent) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            self.inner.publish(event).await?;
            self.publishes.fetch_add(1, Ordering::Relaxed);
            if !self.crashed.swap(true, Ordering::Relaxed) {
                panic!("fault injection: crash after publishing {}", event.id);
            }
            Ok(())
        })
    }
}

async fn crash_between_publish_and_mark(window: Duration, lease_ms: u64) -> (u64, i64, i64) {
    let url = nats_url();
    let (src, dst) = (TestDb::new().await, TestDb::new().await);
    let s = stream(StorageType::Memory).duplicate_window(window);
    let inner = transport(&url, &s).await;
    let transport = CrashAfterPublish {
        inner,
        crashed: Arc::default(),
        publishes: Arc::default(),
    };
    let publishes = transport.publishes.clone();
    let receiver = NatsReceiver::new(client(&url).await, receiver_cfg(&s, "shipping")).unwrap();
    let health = receiver.health();
    let rx = receiving(&dst, receiver, Behaviour::default()).await;
    let tx = producer(&src, transport, external(lease_ms)).await;
    src.produce(1, "o").await;

    let published =
        "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'PUBLISHED' AND attempt_count = 2";
    assert_eq!(
        src.wait_for(published, 1, WAIT).await,
        1,
        "published again after the lease"
    );
    assert_eq!(
        std::sync::atomic::AtomicUsize::load(&publishes, Ordering::Relaxed),
        2,
        "two publishes of one event"
    );
    assert_eq!(dst.wait_for(PROCESSED, 1, WAIT).await, 1);
    assert_eq!(
        tx.status().await.unwrap().restarts.get("publisher"),
        Some(&1),
        "the publisher died between its publish and its mark"
    );
    let messages = stream_messages(&url, &s).await;
    // The second message, if any, must have reached the receiver before the counts below.
    let deadline = std::time::Instant::now() + WAIT;
    while health.status().acked < messages && std::time::Instant::now() < deadline {
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        health.status().acked,
        messages,
        "every stream message was received"
    );
    let inbox = dst
        .count("SELECT count(*) AS n FROM actix_outbox.inbox_events")
        .await;
    let effects = dst.count(EFFECTS).await;
    src.finish(&[&tx]).await;
    dst.finish(&[&rx]).await;
    delete_stream(&url, &s).await;
    (messages, inbox, effects)
}

#[actix_rt::test]
async fn a_crash_between_publish_and_mark_leaves_one_stream_message_and_one_effect() {
    let (messages, inbox, effects) =
        crash_between_publish_and_mark(Duration::from_secs(120), 600).await;
    assert_eq!(
        messages, 1,
        "JetStream dropped the re-publish inside its duplicate window"
    );
    assert_eq!((inbox, effects), (1, 1));
}

#[actix_rt::test]
async fn past_the_duplicate_window_the_receiving_inbox_absorbs_the_re_publish() {
    // A window far shorter than the lease: the re-publish comes after it.
    let (messages, inbox, effects) =
        crash_between_publish_and_mark(Duration::from_millis(100), 1_500).await;
    assert_eq!(messages, 2, "past its window JetStream kept both publishes");
    assert_eq!(
        (inbox, effects),
        (1, 1),
        "the receiving inbox absorbed the second"
    );
}

#[actix_rt::test]
async fn a_receiver_killed_after_its_commit_and_before_its_ack_causes_one_effect() {
    let url = nats_url();
    let (src, dst) = (TestDb::new().await, TestDb::new().await);
    let s = stream(StorageType::Memory);
    let transport = transport(&url, &s).await;
    let cfg = receiver_cfg(&s, "shipping")
        .ack_wait(Duration::from_secs(1))
        .crash_before_ack(1);
    let receiver = NatsReceiver::new(client(&url).await, cfg).unwrap();
    let (name, health) = (receiver.name(), receiver.health());
    let rx = receiving(&dst, receiver, Behaviour::default()).await;
    let tx = producer(&src, transport, external(4_000)).await;
    src.produce(5, "o").await;

    assert_eq!(dst.wait_for(PROCESSED, 5, WAIT).await, 5);
    // The crashed batch's messages come back after ack_wait and are found in the inbox.
    let deadline = std::time::Instant::now() + WAIT;
    while (health.status().acked < 5 || health.status().duplicates < 1)
        && std::time::Instant::now() < deadline
    {
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
    let status = health.status();
    assert!(
        status.duplicates >= 1,
        "a redelivery was absorbed: {status:?}"
    );
    assert_eq!(
        rx.status().await.unwrap().restarts.get(&name),
        Some(&1),
        "the receiver died once and was restarted"
    );
    assert_eq!(
        dst.count("SELECT count(*) AS n FROM actix_outbox.inbox_events")
            .await,
        5
    );
    assert_eq!(dst.count(EFFECTS).await, 5, "one effect per event");
    src.finish(&[&tx]).await;
    dst.finish(&[&rx]).await;
    delete_stream(&url, &s).await;
}

#[actix_rt::test]
async fn a_permanently_failing_event_is_dead_lettered_where_it_is_received_and_the_rest_are_processed(
) {
    let url = nats_url();
    let (src, dst) = (TestDb::new().await, TestDb::new().await);
    let s = stream(StorageType::Memory);
    let transport = transport(&url, &s).await;
    let receiver = NatsReceiver::new(client(&url).await, receiver_cfg(&s, "shipping")).unwrap();
    let rx = OutboxRuntime::builder(dst.pool.clone())
        .config(fast_runtime())
        .consumer_fn(
            ConsumerConfig::new("c1")
                .subscribe("ORDER_STATUS_CHANGED")
                .retry(RetryPolicy::fixed(5, Duration::from_millis(20)))
                .poll_interval(Duration::from_millis(100)),
            |d| async move {
                if d.aggregate_id() == "o-0" {
                    return Err(HandlerError::permanent(
                        ErrorCode::new("ORDER_UNKNOWN"),
                        "no such order here",
                    ));
                }
                let mut conn = d.conn().await?;
                diesel::sql_query(
                    "INSERT INTO effects (consumer, event_id, attempt) VALUES ($1, $2, 1)",
                )
                .bind::<Text, _>("c1")
                .bind::<SqlUuid, _>(d.event_id().as_uuid())
                .execute(&mut *conn)
                .await?;
                Ok(())
            },
        )
        .nats_receiver(receiver)
        .start()
        .await
        .unwrap();
    let tx = producer(&src, transport, external(4_000)).await;
    src.produce(10, "o").await;

    assert_eq!(dst.wait_for(PROCESSED, 9, WAIT).await, 9);
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'DEAD_LETTER' \
                AND aggregate_id = 'o-0' AND error_code = 'ORDER_UNKNOWN' AND attempt_count = 1";
    assert_eq!(dst.wait_for(dead, 1, WAIT).await, 1);
    assert_eq!(dst.count(EFFECTS).await, 9);
    assert_eq!(
        src.count(
            "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'PUBLISHED'"
        )
        .await,
        10,
        "the producer's side is done with all ten"
    );
    src.finish(&[&tx]).await;
    dst.finish(&[&rx]).await;
    delete_stream(&url, &s).await;
}

#[actix_rt::test]
async fn two_receivers_on_one_durable_consumer_apply_each_of_5000_events_once() {
    let url = nats_url();
    let (src, dst) = (TestDb::new().await, TestDb::new().await);
    let s = stream(StorageType::Memory);
    let transport = transport(&url, &s).await;
    let receivers: Vec<NatsReceiver> = vec![
        NatsReceiver::new(client(&url).await, receiver_cfg(&s, "shipping")).unwrap(),
        NatsReceiver::new(client(&url).await, receiver_cfg(&s, "shipping")).unwrap(),
    ];
    let healths: Vec<_> = receivers.iter().map(|r| r.health()).collect();
    let mut rxs = Vec::new();
    for r in receivers {
        // Two instances of the receiving service on one database.
        rxs.push(receiving(&dst, r, Behaviour::default()).await);
    }
    let tx = producer(&src, transport, external(10_000).batch_size(200)).await;
    within(
        Duration::from_secs(120),
        src.produce_batched(5_000, 100, "o"),
    )
    .await;

    let long = Duration::from_secs(180);
    assert_eq!(dst.wait_for(PROCESSED, 5_000, long).await, 5_000);
    assert_eq!(dst.count(EFFECTS).await, 5_000, "each effect exactly once");
    assert_eq!(
        dst.count("SELECT count(DISTINCT event_id) AS n FROM effects")
            .await,
        5_000
    );
    let acked: Vec<u64> = healths.iter().map(|h| h.status().acked).collect();
    assert!(
        acked.iter().all(|a| *a > 0),
        "both receivers took part: {acked:?}"
    );
    assert_eq!(stream_messages(&url, &s).await, 5_000);
    src.finish(&[&tx]).await;
    dst.finish(&[&rxs[0], &rxs[1]]).await;
    delete_stream(&url, &s).await;
}

/// A `nats-server -js` of the test's own, on a free port, with its store in the test's
/// temporary folder: stopped and started again to make NATS unavailable.
struct OwnNats {
    port: u16,
    dir: std::path::PathBuf,
    child: Option<Child>,
}

impl OwnNats {
    fn new() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("nats-{}", uuid::Uuid::new_v4().simple()));
        OwnNats {
            port,
            dir,
            child: None,
        }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    async fn start(&mut self) {
        let bin = std::env::var("NATS_SERVER_BIN").unwrap_or_else(|_| "nats-server".into());
        let child = Command::new(bin)
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-sd",
            ])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server (Debian package nats-server) must be installed");
        self.child = Some(child);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "nats-server did not start"
            );
            actix_rt::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL: no clean shutdown.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for OwnNats {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[actix_rt::test]
async fn events_wait_while_nats_is_down_at_start_and_mid_run_and_drain_when_it_returns() {
    let mut nats = OwnNats::new();
    let url = nats.url();
    let (src, dst) = (TestDb::new().await, TestDb::new().await);
    let s = stream(StorageType::File);
    let cfg = NatsTransportConfig::new(s.clone())
        .ack_timeout(Duration::from_millis(500))
        .start_timeout(Duration::from_millis(300));
    // NATS is down: both services start anyway.
    let transport = NatsTransport::new(client(&url).await, cfg).await.unwrap();
    let receiver = NatsReceiver::new(client(&url).await, receiver_cfg(&s, "shipping")).unwrap();
    let health = receiver.health();
    let rx = receiving(&dst, receiver, Behaviour::default()).await;
    let tx = producer(&src, transport, external(3_000)).await;
    src.produce(20, "a").await;

    let waiting = "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'RETRY_PENDING' \
                   AND attempt_count >= 2 AND error_code IN ('OUTBOX_PUBLISH_FAILED', 'OUTBOX_PUBLISH_TIMEOUT')";
    assert_eq!(
        src.wait_for(waiting, 20, WAIT).await,
        20,
        "waiting, attempts counted"
    );
    assert!(
        !health.is_healthy(),
        "the receiver reports NATS unavailable"
    );

    nats.start().await;
    let published =
        "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'PUBLISHED'";
    assert_eq!(src.wait_for(published, 20, WAIT).await, 20);
    assert_eq!(dst.wait_for(PROCESSED, 20, WAIT).await, 20);

    // Down mid-run.
    nats.kill();
    src.produce(20, "b").await;
    let b_waiting =
        "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE aggregate_id LIKE 'b-%' \
                     AND status = 'RETRY_PENDING' AND attempt_count >= 1";
    assert_eq!(src.wait_for(b_waiting, 20, WAIT).await, 20);
    assert_eq!(dst.count(PROCESSED).await, 20);

    nats.start().await;
    assert_eq!(src.wait_for(published, 40, WAIT).await, 40);
    assert_eq!(dst.wait_for(PROCESSED, 40, WAIT).await, 40, "nothing lost");
    assert_eq!(dst.count(EFFECTS).await, 40, "nothing doubled");
    assert!(health.is_healthy(), "{:?}", health.status());
    src.finish(&[&tx]).await;
    dst.finish(&[&rx]).await;
}

/// A message as another producer (not `NatsTransport`) might publish it.
async fn publish_raw(url: &str, s: &NatsStream, id: uuid::Uuid, body: Vec<u8>) {
    let js = async_nats::jetstream::new(client(url).await);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", id.to_string().as_str());
    let subject = format!("{}.ORDER_STATUS_CHANGED", s.name().to_lowercase());
    js.publish_with_headers(subject, headers, body.into())
        .await
        .unwrap()
        .await
        .unwrap();
}

fn raw_event(id: uuid::Uuid, aggregate: &str, payload: serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "id": id, "event_type": "ORDER_STATUS_CHANGED", "event_version": 1,
        "aggregate_type": "order", "aggregate_id": aggregate, "aggregate_version": null,
        "payload": payload, "metadata": {}, "correlation_id": "raw", "causation_id": null,
        "created_at": "2026-12-01T00:00:00Z", "attempt": 1,
    }))
    .unwrap()
}

/// Messages the receiving database refuses do not hold up the ones around them: a body that
/// is no outbox event is terminated (nothing to record it under), an event PostgreSQL refuses
/// is left unacknowledged (redelivered, never dropped), and the others are recorded.
#[actix_rt::test]
async fn messages_that_cannot_be_recorded_do_not_hold_up_the_others() {
    let url = nats_url();
    let dst = TestDb::new().await;
    let s = stream(StorageType::Memory);
    let js = async_nats::jetstream::new(client(&url).await);
    create_stream(&js, &s).await;
    let ids: Vec<uuid::Uuid> = (0..3).map(|_| uuid::Uuid::now_v7()).collect();
    publish_raw(
        &url,
        &s,
        ids[0],
        raw_event(ids[0], "good-1", serde_json::json!({})),
    )
    .await;
    // PostgreSQL's jsonb refuses a NUL.
    let nul = serde_json::json!({"note": "a\u{0}b"});
    publish_raw(&url, &s, ids[1], raw_event(ids[1], "refused", nul)).await;
    publish_raw(&url, &s, uuid::Uuid::now_v7(), b"not json".to_vec()).await;
    publish_raw(
        &url,
        &s,
        ids[2],
        raw_event(ids[2], "good-2", serde_json::json!({})),
    )
    .await;

    // All four are waiting when the receiver starts, so they come in one batch.
    let receiver = NatsReceiver::new(client(&url).await, receiver_cfg(&s, "shipping")).unwrap();
    let health = receiver.health();
    let rx = receiving(&dst, receiver, Behaviour::default()).await;
    assert_eq!(dst.wait_for(PROCESSED, 2, WAIT).await, 2);
    assert_eq!(dst.count(EFFECTS).await, 2);
    assert_eq!(
        dst.count(
            "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE aggregate_id = 'refused'"
        )
        .await,
        0
    );
    let status = health.status();
    assert_eq!(status.refused, 1, "{status:?}");
    assert!(
        status.last_error.is_some(),
        "the refused event is reported: {status:?}"
    );
    let mut consumer: async_nats::jetstream::consumer::PullConsumer = js
        .get_stream(s.name())
        .await
        .unwrap()
        .get_consumer("shipping")
        .await
        .unwrap();
    let info = consumer.info().await.unwrap();
    assert_eq!(
        info.num_ack_pending + info.num_pending as usize,
        1,
        "only the refused event is still in the stream's hands: {info:?}"
    );
    dst.finish(&[&rx]).await;
    delete_stream(&url, &s).await;
}

/// Item 10 of issue 30. An event the receiving service has no consumer for is recorded as
/// unrouted, as the in-process route records one, and health raises the same alarm
/// (`EVENTS_UNROUTED`, naming the type). Before, the receiver acknowledged it and it was gone
/// without a trace.
#[actix_rt::test]
async fn an_event_no_consumer_here_subscribes_to_is_recorded_and_raises_the_alarm() {
    use actix_outbox::health::{StatsConfig, StatsSampler};
    let url = nats_url();
    let dst = TestDb::new().await;
    let s = stream(StorageType::Memory);
    let js = async_nats::jetstream::new(client(&url).await);
    create_stream(&js, &s).await;
    let routed = uuid::Uuid::now_v7();
    publish_raw(
        &url,
        &s,
        routed,
        raw_event(routed, "o-1", serde_json::json!({})),
    )
    .await;
    let unrouted = uuid::Uuid::now_v7();
    let mut body: serde_json::Value =
        serde_json::from_slice(&raw_event(unrouted, "o-2", serde_json::json!({}))).unwrap();
    body["event_type"] = "INVOICE_ISSUED".into();
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", unrouted.to_string().as_str());
    js.publish_with_headers(
        format!("{}.INVOICE_ISSUED", s.name().to_lowercase()),
        headers,
        serde_json::to_vec(&body).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();

    let receiver = NatsReceiver::new(client(&url).await, receiver_cfg(&s, "shipping")).unwrap();
    let health = receiver.health();
    let rx = receiving(&dst, receiver, Behaviour::default()).await;
    assert_eq!(dst.wait_for(PROCESSED, 1, WAIT).await, 1);
    let recorded = format!(
        "SELECT count(*) AS n FROM actix_outbox.unrouted_events \
         WHERE event_id = '{unrouted}' AND event_type = 'INVOICE_ISSUED'"
    );
    assert_eq!(
        dst.wait_for(&recorded, 1, WAIT).await,
        1,
        "the unrouted event left no trace"
    );
    assert_eq!(health.status().acked, 2);
    let sampler = StatsSampler::new(dst.pool.clone(), StatsConfig::default()).unwrap();
    let report = sampler.run_once().await.unwrap();
    let alarm: Vec<_> = report
        .reasons
        .iter()
        .filter(|r| r.code == "EVENTS_UNROUTED")
        .collect();
    assert_eq!(alarm.len(), 1, "{report:?}");
    assert!(alarm[0].message.contains("INVOICE_ISSUED"), "{report:?}");
    rx.shutdown().await;
    delete_stream(&url, &s).await;
}

/// Item 10 of issue 30. A durable consumer this database bound before and that is gone is not
/// recreated from the stream's start, which would deliver every event again into an inbox
/// whose processed rows retention may have deleted: the receiver refuses
/// (`NATS_CONSUMER_LOST`), records nothing, and binds again once an operator recreated it.
#[actix_rt::test]
async fn a_lost_durable_consumer_is_not_recreated_from_the_streams_start() {
    let url = nats_url();
    let dst = TestDb::new().await;
    let s = stream(StorageType::Memory);
    let js = async_nats::jetstream::new(client(&url).await);
    create_stream(&js, &s).await;
    let first = uuid::Uuid::now_v7();
    publish_raw(
        &url,
        &s,
        first,
        raw_event(first, "o-1", serde_json::json!({})),
    )
    .await;
    let receiver = NatsReceiver::new(client(&url).await, receiver_cfg(&s, "lost")).unwrap();
    let rx = receiving(&dst, receiver, Behaviour::default()).await;
    assert_eq!(dst.wait_for(PROCESSED, 1, WAIT).await, 1);
    rx.shutdown().await;

    // The durable consumer is lost, and the processed row is gone too (retention).
    js.get_stream(s.name())
        .await
        .unwrap()
        .delete_consumer("lost")
        .await
        .unwrap();
    let mut conn = dst.pool.get().await.unwrap();
    diesel::sql_query("DELETE FROM actix_outbox.inbox_events")
        .execute(&mut conn)
        .await
        .unwrap();
    drop(conn);

    let receiver = NatsReceiver::new(client(&url).await, receiver_cfg(&s, "lost")).unwrap();
    let health = receiver.health();
    let rx = receiving(&dst, receiver, Behaviour::default()).await;
    let deadline = std::time::Instant::now() + WAIT;
    while health.status().last_error.is_none() && std::time::Instant::now() < deadline {
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
    let status = health.status();
    assert!(!status.bound, "{status:?}");
    let error = status.last_error.clone().unwrap_or_default();
    assert!(error.contains("first bound at"), "{error}");
    // Nothing was delivered again, and the consumer was not recreated.
    actix_rt::time::sleep(Duration::from_millis(500)).await;
    let rows = "SELECT count(*) AS n FROM actix_outbox.inbox_events";
    assert_eq!(dst.count(rows).await, 0, "the stream was delivered again");
    let stream_ = js.get_stream(s.name()).await.unwrap();
    assert!(
        stream_
            .get_consumer::<async_nats::jetstream::consumer::pull::Config>("lost")
            .await
            .is_err(),
        "the durable consumer was recreated"
    );
    rx.shutdown().await;
    delete_stream(&url, &s).await;
}

/// Item 10 of issue 30. A receiver whose stream keeps messages longer than retention keeps
/// processed inbox rows is refused at start (`CONFIG_INVALID`), before anything runs.
#[actix_rt::test]
async fn a_stream_outliving_the_inbox_retention_is_refused_at_start() {
    let url = nats_url();
    let dst = TestDb::new().await;
    let retention = actix_outbox::retention::RetentionConfig::default()
        .processed_inbox_after(Duration::from_secs(3600))
        .idempotency_keys_after(Duration::from_secs(3600));
    for (max_age, refused) in [
        (Duration::ZERO, true),
        (Duration::from_secs(7200), true),
        (Duration::from_secs(1800), false),
    ] {
        let s = stream(StorageType::Memory).max_age(max_age);
        let receiver = NatsReceiver::new(client(&url).await, receiver_cfg(&s, "kept")).unwrap();
        let started = OutboxRuntime::builder(dst.pool.clone())
            .config(fast_runtime().retention(retention.clone()))
            .consumer(consumer("c1", 3), || Recorder {
                name: "c1".into(),
                behaviour: Behaviour::default(),
            })
            .nats_receiver(receiver)
            .start()
            .await;
        match started {
            Err(e) => {
                assert!(refused, "{max_age:?} refused: {e}");
                assert_eq!(e.code(), ErrorCode::CONFIG_INVALID);
                assert!(e.to_string().contains("max_age"), "{e}");
            }
            Ok(rt) => {
                assert!(
                    !refused,
                    "a stream keeping messages {max_age:?} was accepted"
                );
                rt.shutdown().await;
            }
        }
        delete_stream(&url, &s).await;
    }
}
