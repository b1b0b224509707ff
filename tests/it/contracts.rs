//! Event contracts against real PostgreSQL: validation at enqueue, versions and upcasting,
//! stale events, business idempotency keys, correlation and causation.

use crate::common;

use std::time::Duration;

use actix::prelude::*;
use actix_outbox::{
    enqueue, keys::claim_key, keys::KeyClaim, ConsumerConfig, Delivery, Error, Event,
    EventRegistry, HandlerError, NewEvent, OutboxRuntime, RetryPolicy,
};
use common::*;
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// Version 2 of the event; version 1 called `status` `state`.
#[derive(Debug, Serialize, Deserialize)]
struct StatusChanged {
    order_id: String,
    status: String,
    version: i64,
}

impl Event for StatusChanged {
    const TYPE: &'static str = "ORDER_STATUS_CHANGED";
    const VERSION: i32 = 2;
    const AGGREGATE_TYPE: &'static str = "order";
    fn aggregate_id(&self) -> String {
        self.order_id.clone()
    }
    fn aggregate_version(&self) -> Option<i64> {
        Some(self.version)
    }
}

/// The follow-up a [`Projector`] may cause.
#[derive(Debug, Serialize, Deserialize)]
struct NotificationRequested {
    order_id: String,
}

impl Event for NotificationRequested {
    const TYPE: &'static str = "NOTIFICATION_REQUESTED";
    const VERSION: i32 = 1;
    const AGGREGATE_TYPE: &'static str = "order";
    fn aggregate_id(&self) -> String {
        self.order_id.clone()
    }
}

/// The projector's registry: it reads ORDER_STATUS_CHANGED; its follow-up type is not
/// registered (and so only the payload rules check it).
fn registry() -> EventRegistry {
    EventRegistry::new()
        .register::<StatusChanged>()
        .upcaster("ORDER_STATUS_CHANGED", 1, |mut v| {
            let state = v
                .get_mut("state")
                .map(serde_json::Value::take)
                .ok_or("v1 payload without state")?;
            v["status"] = state;
            Ok(v)
        })
}

/// Inserts order `id`, returning it: a business statement for `enqueue_with`.
fn placed(id: &str) -> impl diesel::query_builder::QueryFragment<diesel::pg::Pg> + Send {
    diesel::sql_query("INSERT INTO orders (id, status) VALUES ($1, 'PLACED') RETURNING id")
        .bind::<diesel::sql_types::Text, _>(id.to_owned())
}

fn changed(order: &str, status: &str, version: i64) -> NewEvent {
    NewEvent::typed(&StatusChanged {
        order_id: order.into(),
        status: status.into(),
        version,
    })
    .unwrap()
}

/// Projects the order's status; with `notify` it also creates a notification through the
/// business key `notification:{order}:{status}`, and with `follow_up` it causes a
/// NOTIFICATION_REQUESTED event (of version `follow_up_version`, if set).
#[derive(Clone, Default)]
struct Projector {
    notify: bool,
    follow_up: bool,
    follow_up_version: Option<i32>,
}

impl Actor for Projector {
    type Context = Context<Self>;
}

impl Handler<Delivery> for Projector {
    type Result = ResponseFuture<Result<(), HandlerError>>;
    fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
        let me = self.clone();
        Box::pin(async move {
            let e: StatusChanged = d.event()?;
            {
                let mut conn = d.conn().await?;
                diesel::sql_query(
                    "INSERT INTO projections (order_id, status, version) VALUES ($1, $2, $3) \
                     ON CONFLICT (order_id) DO UPDATE SET status = EXCLUDED.status, version = EXCLUDED.version",
                )
                .bind::<Text, _>(&e.order_id)
                .bind::<Text, _>(&e.status)
                .bind::<BigInt, _>(e.version)
                .execute(&mut *conn)
                .await?;
                if me.notify {
                    let key = format!("notification:{}:{}", e.order_id, e.status);
                    if claim_key(&mut conn, &key, "projector", Some(d.event_id())).await?
                        == KeyClaim::Claimed
                    {
                        diesel::sql_query(
                            "INSERT INTO notifications (order_id, status) VALUES ($1, $2)",
                        )
                        .bind::<Text, _>(&e.order_id)
                        .bind::<Text, _>(&e.status)
                        .execute(&mut *conn)
                        .await?;
                    }
                }
            }
            if me.follow_up {
                let event = NewEvent::new(
                    "NOTIFICATION_REQUESTED",
                    "order",
                    e.order_id.clone(),
                    json!({"order_id": e.order_id}),
                );
                let event = match me.follow_up_version {
                    Some(v) => event.version(v),
                    None => event,
                };
                d.enqueue(event).await?;
            }
            Ok(())
        })
    }
}

async fn setup(db: &TestDb) {
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(
        "CREATE TABLE projections (order_id text PRIMARY KEY, status text NOT NULL, version bigint NOT NULL);
         CREATE TABLE notifications (id bigserial PRIMARY KEY, order_id text NOT NULL, status text NOT NULL);",
    )
    .await
    .unwrap();
}

fn projector_config(name: &str) -> ConsumerConfig {
    ConsumerConfig::new(name)
        .subscribe("ORDER_STATUS_CHANGED")
        .retry(RetryPolicy::fixed(3, Duration::from_millis(20)))
        .poll_interval(Duration::from_millis(50))
}

async fn start_projector(db: &TestDb, cfg: ConsumerConfig, p: Projector) -> OutboxRuntime {
    OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .events(registry())
        .consumer(cfg, move || p.clone())
        .start()
        .await
        .unwrap()
}

#[actix_rt::test]
async fn invalid_events_fail_the_enqueue_and_roll_back_the_business_change() {
    let db = TestDb::new().await;
    let reg = registry();
    let mut conn = db.pool.get().await.unwrap();
    let cases = [
        ("bad-payload", NewEvent::new("ORDER_STATUS_CHANGED", "order", "x", json!({"order_id": 1})).version(2)),
        ("unknown-type", NewEvent::new("ORDER_TELEPORTED", "order", "x", json!({}))),
        ("old-version", changed("x", "PAID", 1).version(1)),
        ("secret", NewEvent::new("ORDER_STATUS_CHANGED", "order", "x",
            json!({"order_id": "x", "status": "PAID", "version": 1, "customer": {"email": "a@b.c"}})).version(2)),
        // Metadata is stored and shipped with the payload: it is checked the same way.
        ("secret-metadata", changed("x", "PAID", 2).metadata(json!({"X-Api-Key": "k"}))),
        // What PostgreSQL itself would refuse gets the same code, not DATABASE_ERROR.
        ("nul-payload", NewEvent::new("ORDER_STATUS_CHANGED", "order", "x",
            json!({"order_id": "x", "status": "PAID\u{0}", "version": 1})).version(2)),
        ("nul-metadata", changed("x", "PAID", 2).metadata(json!({"trace": ["a\u{0}"]}))),
        ("nul-id", changed("x\u{0}y", "PAID", 2)),
        ("nul-correlation", changed("x", "PAID", 2).correlation_id("c\u{0}")),
        ("long-correlation", changed("x", "PAID", 2).correlation_id("c".repeat(3000))),
    ];
    for (order, event) in cases {
        let res = conn
            .transaction::<_, Error, _>(async |conn| {
                insert_order(conn, order).await?;
                reg.enqueue(conn, &event).await
            })
            .await;
        assert_eq!(
            res.unwrap_err().code().as_str(),
            "EVENT_SCHEMA_INVALID",
            "{order}"
        );
        // The same check guards the one-statement form, before the statement is sent.
        let one = reg
            .enqueue_with(&conn, placed(&format!("{order}-one")), &[event])
            .await;
        assert_eq!(
            one.unwrap_err().code().as_str(),
            "EVENT_SCHEMA_INVALID",
            "{order}"
        );
    }
    // The plain enqueue rejects secrets too, without a registry.
    let res = conn
        .transaction::<_, Error, _>(async |conn| {
            insert_order(conn, "plain").await?;
            enqueue(
                conn,
                &NewEvent::new("X", "order", "plain", json!({"password": "hunter2"})),
            )
            .await
        })
        .await;
    assert_eq!(res.unwrap_err().code().as_str(), "EVENT_SCHEMA_INVALID");
    // A valid one goes through.
    conn.transaction::<_, Error, _>(async |conn| {
        insert_order(conn, "good").await?;
        reg.enqueue(conn, &changed("good", "PAID", 2)).await
    })
    .await
    .unwrap();
    let event = changed("good-one", "PAID", 2);
    let one = reg.enqueue_with(&conn, placed("good-one"), std::slice::from_ref(&event));
    assert!(one.await.unwrap());
    drop(conn);
    assert_eq!(db.count("SELECT count(*) AS n FROM orders").await, 2);
    assert_eq!(db.count("SELECT count(*) AS n FROM audit_logs").await, 1);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.outbox_events")
            .await,
        2
    );
    db.finish(&[]).await;
}

#[actix_rt::test]
async fn a_newer_version_is_retried_for_a_newer_build_and_v1_is_upcast() {
    let db = TestDb::new().await;
    setup(&db).await;
    let conn = db.pool.get().await.unwrap();
    // Rows already in the table: a v1 (readable through the upcaster) and a v9 (from a newer
    // build, unreadable here). The plain enqueue writes any version.
    let v1 = NewEvent::new(
        "ORDER_STATUS_CHANGED",
        "order",
        "o1",
        json!({"order_id": "o1", "state": "PAID", "version": 2}),
    )
    .version(1);
    let v9 = NewEvent::new(
        "ORDER_STATUS_CHANGED",
        "order",
        "o9",
        json!({"whatever": true}),
    )
    .version(9);
    enqueue(&conn, &v1).await.unwrap();
    enqueue(&conn, &v9).await.unwrap();
    drop(conn);
    let rt = start_projector(&db, projector_config("projector"), Projector::default()).await;

    // Retried, not dead-lettered at once: in a rolling deploy an instance of the newer build
    // may claim it next. No build here reads it, so it is dead-lettered after its 3 attempts.
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'DEAD_LETTER' AND attempt_count = 3 \
                AND error_code = 'EVENT_VERSION_UNSUPPORTED' AND aggregate_id = 'o9'";
    assert_eq!(db.wait_for(dead, 1, WAIT).await, 1);
    let done =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED' AND aggregate_id = 'o1'";
    assert_eq!(db.wait_for(done, 1, WAIT).await, 1);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM projections WHERE order_id = 'o1' AND status = 'PAID'")
            .await,
        1
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM projections").await,
        1,
        "the v9 event was never applied"
    );
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn a_stale_event_is_recorded_and_state_never_moves_backwards() {
    let db = TestDb::new().await;
    setup(&db).await;
    let rt = start_projector(
        &db,
        projector_config("projector").skip_stale(true),
        Projector::default(),
    )
    .await;
    let reg = registry();
    let conn = db.pool.get().await.unwrap();
    reg.enqueue(&conn, &changed("o1", "DELIVERED", 13))
        .await
        .unwrap();
    drop(conn);
    rt.handle().wake();
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 1, WAIT).await, 1);
    let conn = db.pool.get().await.unwrap();
    reg.enqueue(&conn, &changed("o1", "SENT", 12))
        .await
        .unwrap();
    drop(conn);
    rt.handle().wake();
    assert_eq!(db.wait_for(done, 2, WAIT).await, 2);
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM projections WHERE status = 'DELIVERED' AND version = 13"
        )
        .await,
        1
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE error_code = 'EVENT_STALE' AND aggregate_version = 12 \
                  AND last_error LIKE '%version 13%'")
            .await,
        1
    );
    db.finish(&[&rt]).await;
}

/// One change may emit several events, each at the aggregate's version after it: with
/// `skip_stale`, the second is applied too, not taken for a stale copy of the first. An older
/// version is still stale.
#[actix_rt::test]
async fn events_of_one_change_share_its_version_and_are_all_applied() {
    let metrics = prometheus();
    let db = TestDb::new().await;
    let event = |kind: &str, version: i64| {
        NewEvent::new(kind, "order", "o1", json!({"order_id": "o1"})).aggregate_version(version)
    };
    let conn = db.pool.get().await.unwrap();
    actix_outbox::enqueue_many(
        &conn,
        &[event("ORDER_PLACED", 5), event("PAYMENT_REQUESTED", 5)],
    )
    .await
    .unwrap();
    actix_outbox::enqueue(&conn, &event("ORDER_PLACED", 4))
        .await
        .unwrap();
    drop(conn);
    let cfg = consumer("one_change", 3)
        .subscribe("ORDER_PLACED")
        .subscribe("PAYMENT_REQUESTED")
        .skip_stale(true);
    let rt = start(&db, vec![(cfg, Behaviour::default())]).await;
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 3, WAIT).await, 3);
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM effects e JOIN actix_outbox.inbox_events i USING (event_id) \
                  WHERE i.aggregate_version = 5"
        )
        .await,
        2
    );
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE error_code = 'EVENT_STALE' \
                  AND aggregate_version = 4"
        )
        .await,
        1
    );
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 2);
    // The stale row counts as processed, as its status says (counted just after the commit).
    let line = "inbox_processed_total{consumer=\"one_change\"} 3";
    within(WAIT, async {
        while !metrics.render().contains(line) {
            actix_rt::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn shuffled_events_end_in_the_state_of_each_aggregates_latest_version() {
    let db = TestDb::new().await;
    setup(&db).await;
    // 50 aggregates × 20 versions, enqueued in a shuffled order (fixed seed).
    let mut events: Vec<NewEvent> = (0..50)
        .flat_map(|a| (1..=20).map(move |v| changed(&format!("agg{a}"), &format!("S{v}"), v)))
        .collect();
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    for i in (1..events.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        events.swap(i, (seed % (i as u64 + 1)) as usize);
    }
    let reg = registry();
    let conn = db.pool.get().await.unwrap();
    for chunk in events.chunks(37) {
        reg.enqueue_many(&conn, chunk).await.unwrap();
    }
    drop(conn);
    let cfg = projector_config("projector")
        .skip_stale(true)
        .concurrency(2)
        .batch_size(16);
    let rt = start_projector(&db, cfg, Projector::default()).await;

    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 1000, WAIT).await, 1000);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM projections WHERE status = 'S20' AND version = 20")
            .await,
        50
    );
    let stale = db
        .count(
            "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE error_code = 'EVENT_STALE'",
        )
        .await;
    assert!(
        stale > 0 && stale < 1000,
        "some events arrived late and were recorded stale ({stale})"
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.aggregate_versions WHERE version = 20")
            .await,
        50
    );
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn two_different_events_with_one_business_key_cause_one_effect() {
    let db = TestDb::new().await;
    setup(&db).await;
    let rt = start_projector(
        &db,
        projector_config("projector"),
        Projector {
            notify: true,
            ..Default::default()
        },
    )
    .await;
    let reg = registry();
    let conn = db.pool.get().await.unwrap();
    // Two distinct events (different ids and versions) that both mean "o1 is COMPLETED".
    reg.enqueue(&conn, &changed("o1", "COMPLETED", 3))
        .await
        .unwrap();
    reg.enqueue(&conn, &changed("o1", "COMPLETED", 4))
        .await
        .unwrap();
    drop(conn);
    rt.handle().wake();
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 2, WAIT).await, 2);
    assert_eq!(db.count("SELECT count(*) AS n FROM notifications").await, 1);
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM actix_outbox.idempotency_keys WHERE key = 'notification:o1:COMPLETED'"
        )
        .await,
        1
    );
    db.finish(&[&rt]).await;
}

/// A handler's follow-up of a type the runtime's registry knows is validated by it, as the
/// producer's events are: one it refuses (a version it does not write) fails the delivery for
/// good, with the registry's code, and neither it nor the handler's other writes commit.
#[actix_rt::test]
async fn a_follow_up_the_registry_refuses_fails_its_delivery_and_is_not_enqueued() {
    let db = TestDb::new().await;
    setup(&db).await;
    let p = Projector {
        follow_up: true,
        follow_up_version: Some(2),
        ..Default::default()
    };
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .events(registry().register::<NotificationRequested>())
        .consumer(projector_config("projector"), move || p.clone())
        .start()
        .await
        .unwrap();
    let conn = db.pool.get().await.unwrap();
    registry()
        .enqueue(&conn, &changed("o1", "COMPLETED", 2))
        .await
        .unwrap();
    drop(conn);
    rt.handle().wake();
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'DEAD_LETTER' \
                AND attempt_count = 1 AND error_code = 'EVENT_SCHEMA_INVALID'";
    assert_eq!(db.wait_for(dead, 1, WAIT).await, 1);
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE event_type = 'NOTIFICATION_REQUESTED'"
        )
        .await,
        0
    );
    assert_eq!(db.count("SELECT count(*) AS n FROM projections").await, 0);
    db.finish(&[&rt]).await;
}

/// The follow-up's type is not in the runtime's registry, which lists the types its consumers
/// read: it is enqueued all the same. The publisher never polls here: the follow-up, committed
/// with the first event's delivery, is published because its enqueue woke the publishers.
#[actix_rt::test]
async fn a_chain_keeps_one_correlation_id_and_links_causation() {
    let db = TestDb::new().await;
    setup(&db).await;
    let config = fast_runtime().poll_interval(Duration::MAX);
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(config)
        .events(registry())
        .consumer(projector_config("projector"), || Projector {
            follow_up: true,
            ..Default::default()
        })
        .consumer(
            consumer("notifier", 3).subscribe("NOTIFICATION_REQUESTED"),
            || Recorder {
                name: "notifier".into(),
                behaviour: Behaviour::default(),
            },
        )
        .start()
        .await
        .unwrap();
    // The request's id is the correlation id.
    let first = changed("o1", "COMPLETED", 2).correlation_id("req-123");
    let conn = db.pool.get().await.unwrap();
    registry().enqueue(&conn, &first).await.unwrap();
    drop(conn);
    rt.handle().wake();

    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    // projector and notifier get ORDER_STATUS_CHANGED; notifier gets NOTIFICATION_REQUESTED.
    assert_eq!(db.wait_for(done, 3, WAIT).await, 3);
    let second = format!(
        "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE event_type = 'NOTIFICATION_REQUESTED' \
         AND correlation_id = 'req-123' AND causation_id = '{}'",
        first.id()
    );
    assert_eq!(db.count(&second).await, 1);

    let mut conn = db.pool.get().await.unwrap();
    let timeline = actix_outbox::ops::timeline(&mut conn, "req-123")
        .await
        .unwrap();
    drop(conn);
    let kinds: Vec<(String, String, Option<String>)> = timeline
        .iter()
        .map(|t| (t.kind.clone(), t.event_type.clone(), t.consumer.clone()))
        .collect();
    assert_eq!(timeline.len(), 5, "{kinds:?}");
    assert_eq!(
        kinds[0],
        ("outbox".into(), "ORDER_STATUS_CHANGED".into(), None)
    );
    assert_eq!(timeline.iter().filter(|t| t.kind == "inbox").count(), 3);
    let follow = timeline
        .iter()
        .find(|t| t.kind == "outbox" && t.event_type == "NOTIFICATION_REQUESTED")
        .unwrap();
    assert_eq!(
        follow.causation_id.as_deref(),
        Some(first.id().to_string().as_str())
    );
    assert!(timeline
        .iter()
        .all(|t| t.status == "PUBLISHED" || t.status == "PROCESSED"));
    db.finish(&[&rt]).await;
}

/// The boot-time contract check: a stored version no upcaster of this build lifts and a
/// subscription its consumer no longer lists are reported by health until a start finds them
/// fixed, and refuse the start when configured to.
#[actix_rt::test]
async fn a_contract_mismatch_at_start_is_reported_until_fixed_and_can_refuse_the_start() {
    use actix_outbox::health::{ContractCheck, StatsConfig, StatsSampler};
    let db = TestDb::new().await;
    // A version-1 event in the outbox, and a subscription an older build of `projector` made.
    let conn = db.pool.get().await.unwrap();
    let old = NewEvent::new(
        "ORDER_STATUS_CHANGED",
        "order",
        "o-1",
        json!({"order_id": "o-1", "state": "PAID", "version": 1}),
    )
    .version(1);
    enqueue(&conn, &old).await.unwrap();
    drop(conn);
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(
        "INSERT INTO actix_outbox.consumer_states (consumer) VALUES ('projector');
         INSERT INTO actix_outbox.consumer_subscriptions (consumer, event_type)
             VALUES ('projector', 'ORDER_CANCELLED');",
    )
    .await
    .unwrap();
    drop(conn);
    // This build reads v2 and has no upcaster from v1.
    let no_upcaster = || EventRegistry::new().register::<StatusChanged>();
    let build = |registry: EventRegistry, check: ContractCheck| {
        let config = fast_runtime().contract_check(check);
        let cfg = consumer("projector", 3);
        OutboxRuntime::builder(db.pool.clone())
            .config(config)
            .events(registry)
            .consumer(cfg, || Recorder {
                name: "projector".into(),
                behaviour: Behaviour::default(),
            })
    };
    let refused = build(no_upcaster(), ContractCheck::Refuse).start().await;
    let err = refused.err().expect("the start is refused");
    assert_eq!(err.code().as_str(), "CONFIG_INVALID");
    assert!(
        err.to_string()
            .contains("ORDER_STATUS_CHANGED v1 has no upcaster"),
        "{err}"
    );

    let sampler = StatsSampler::new(db.pool.clone(), StatsConfig::default()).unwrap();
    let findings = async || {
        let report = sampler.run_once().await.unwrap();
        let mut found: Vec<String> = report
            .reasons
            .iter()
            .filter(|r| r.code == "CONTRACT_MISMATCH")
            .map(|r| r.message.split(':').next().unwrap_or_default().to_owned())
            .collect();
        found.sort();
        found
    };
    assert_eq!(
        findings().await,
        vec!["SUBSCRIPTION_UNHANDLED", "VERSION_UNLIFTABLE"]
    );

    // Warned, the same build starts, and health still says so.
    let rt = build(no_upcaster(), ContractCheck::Warn)
        .start()
        .await
        .unwrap();
    assert_eq!(findings().await.len(), 2);
    rt.shutdown().await;

    // Fixed: the upcaster ships and the stale subscription is removed. The next start clears
    // both findings.
    let mut conn = db.pool.get().await.unwrap();
    let projector = actix_outbox::event::ConsumerName::new("projector").unwrap();
    actix_outbox::ops::unsubscribe(&mut conn, &projector, "ORDER_CANCELLED")
        .await
        .unwrap();
    drop(conn);
    let rt = build(registry(), ContractCheck::Refuse)
        .start()
        .await
        .unwrap();
    assert_eq!(findings().await, Vec::<String>::new());
    db.finish(&[&rt]).await;
}

/// An upcaster that panics fails its event as unreadable (`EVENT_SCHEMA_INVALID`, dead-lettered
/// at once), and the batch goes on: the other events of the batch, read by the same upcaster,
/// are applied once each. (Calls run on the handler's thread, where a panic would otherwise
/// end the batch's run and give every row back, again and again.)
#[actix_rt::test]
async fn an_upcaster_that_panics_fails_its_event_alone() {
    let db = TestDb::new().await;
    let reg = EventRegistry::new().register::<StatusChanged>().upcaster(
        "ORDER_STATUS_CHANGED",
        1,
        |mut v| {
            let state = v.get_mut("state").map(serde_json::Value::take);
            if state.as_ref().and_then(|s| s.as_str()) == Some("BOOM") {
                panic!("injected panic in an upcaster");
            }
            v["status"] = state.ok_or("v1 payload without state")?;
            Ok(v)
        },
    );
    let conn = db.pool.get().await.unwrap();
    for (i, state) in ["PAID", "PAID", "BOOM", "PAID", "PAID"].iter().enumerate() {
        let v1 = NewEvent::new(
            "ORDER_STATUS_CHANGED",
            "order",
            format!("o{i}"),
            json!({"order_id": format!("o{i}"), "state": state, "version": 2}),
        )
        .version(1);
        enqueue(&conn, &v1).await.unwrap();
    }
    drop(conn);
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .events(reg)
        .consumer(consumer("upcast-panic", 3), || Recorder {
            name: "upcast-panic".into(),
            behaviour: Behaviour::default(),
        })
        .start()
        .await
        .unwrap();
    rt.handle().wake();
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'DEAD_LETTER' \
                AND error_code = 'EVENT_SCHEMA_INVALID' AND aggregate_id = 'o2'";
    assert_eq!(db.wait_for(dead, 1, WAIT).await, 1);
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 4, WAIT).await, 4);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM effects").await,
        4,
        "an effect was applied twice, or the panicking event's"
    );
    db.finish(&[&rt]).await;
}
