//! Ordered consumers (`ConsumerConfig::ordered`) against real PostgreSQL: an aggregate's events
//! applied in enqueue order, one at a time, across batch loops and runtimes, while other
//! aggregates flow; a dead-lettered event holding up its aggregate alone. Order and counts are
//! read from the effects the consumers committed.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use actix_outbox::{
    ConsumerConfig, Delivery, HandlerError, NewEvent, OutboxRuntime, PgPool, RetryPolicy,
};
use common::*;
use diesel::sql_types::{Integer, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};

/// Each effect's aggregate and place in it (`n`); `id` is the order effects were written in.
const APPLIED: &str = "CREATE TABLE applied (id bigserial PRIMARY KEY, aggregate text NOT NULL, \
                       n int NOT NULL, attempt int NOT NULL)";

/// Writes `applied (aggregate, n)` in the delivery's transaction. Fails, to be retried, the
/// first attempt of every event whose `k` (its place in the whole enqueue order) is a multiple
/// of `fail_every` (if set), and every attempt of the events of aggregate `poison` while `poisoned`.
#[derive(Clone)]
struct Applier {
    fail_every: Option<u64>,
    poison: Option<String>,
    poisoned: Arc<AtomicUsize>,
}

impl Actor for Applier {
    type Context = Context<Self>;
}

impl Handler<Delivery> for Applier {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, d: Delivery, _: &mut Context<Self>) -> Self::Result {
        let me = self.clone();
        Box::pin(async move {
            let (n, k) = (
                d.payload()["n"].as_i64().unwrap(),
                d.payload()["k"].as_u64().unwrap(),
            );
            let poisoned = me.poison.as_deref() == Some(d.aggregate_id())
                && AtomicUsize::load(&me.poisoned, Ordering::Relaxed) == 1;
            if poisoned || (d.attempt() == 1 && me.fail_every.is_some_and(|f| k.is_multiple_of(f)))
            {
                return Err(HandlerError::retry("injected failure"));
            }
            let mut conn = d.conn().await?;
            diesel::sql_query("INSERT INTO applied (aggregate, n, attempt) VALUES ($1, $2, $3)")
                .bind::<Text, _>(d.aggregate_id())
                .bind::<Integer, _>(n as i32)
                .bind::<Integer, _>(d.attempt() as i32)
                .execute(&mut *conn)
                .await?;
            Ok(())
        })
    }
}

/// `per` events for each of `aggregates` aggregates, interleaved (event `n` of every aggregate
/// before event `n + 1` of any), 100 per transaction.
async fn enqueue_interleaved(db: &TestDb, aggregates: usize, per: usize) {
    let mut events = Vec::new();
    for n in 0..per {
        for a in 0..aggregates {
            let k = events.len();
            events.push(NewEvent::new(
                "ORDER_STATUS_CHANGED",
                "order",
                format!("agg-{a}"),
                serde_json::json!({ "n": n, "k": k }),
            ));
        }
    }
    let mut conn = db.pool.get().await.unwrap();
    for chunk in events.chunks(100) {
        conn.transaction::<_, actix_outbox::Error, _>(async |c| {
            actix_outbox::enqueue_many(c, chunk).await?;
            Ok(())
        })
        .await
        .unwrap();
    }
}

async fn start_ordered(pool: PgPool, cfg: ConsumerConfig, applier: Applier) -> OutboxRuntime {
    OutboxRuntime::builder(pool)
        .config(fast_runtime())
        .consumer(cfg, move || applier.clone())
        .start()
        .await
        .expect("start runtime")
}

#[derive(QueryableByName)]
struct Applied {
    #[diesel(sql_type = Text)]
    aggregate: String,
    #[diesel(sql_type = Integer)]
    n: i32,
}

/// Per aggregate, the `n` of its effects in the order they were written.
async fn applied_order(db: &TestDb) -> std::collections::BTreeMap<String, Vec<i32>> {
    let mut conn = db.pool.get().await.unwrap();
    let rows: Vec<Applied> = diesel::sql_query("SELECT aggregate, n FROM applied ORDER BY id")
        .load(&mut conn)
        .await
        .unwrap();
    let mut order = std::collections::BTreeMap::<String, Vec<i32>>::new();
    for r in rows {
        order.entry(r.aggregate).or_default().push(r.n);
    }
    order
}

fn ordered(name: &str) -> ConsumerConfig {
    ConsumerConfig::new(name)
        .subscribe("ORDER_STATUS_CHANGED")
        .ordered(true)
        .retry(RetryPolicy::fixed(3, Duration::from_millis(50)))
        .poll_interval(Duration::from_millis(100))
        .batch_size(50)
        .concurrency(2)
}

/// Waits until every other aggregate's `others` events are applied, gives `aggregate` time to
/// (wrongly) move on, and asserts that none of its events was applied and `waiting` still wait.
async fn assert_held(db: &TestDb, aggregate: &str, others: i64, waiting: i64) {
    let applied_others =
        format!("SELECT count(*) AS n FROM applied WHERE aggregate <> '{aggregate}'");
    assert_eq!(db.wait_for(&applied_others, others, WAIT).await, others);
    actix_rt::time::sleep(Duration::from_millis(500)).await;
    let applied = format!("SELECT count(*) AS n FROM applied WHERE aggregate = '{aggregate}'");
    assert_eq!(db.count(&applied).await, 0, "{aggregate} moved on");
    let behind = format!(
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE aggregate_id = '{aggregate}' \
         AND status = 'RECEIVED'"
    );
    assert_eq!(db.count(&behind).await, waiting);
}

#[actix_rt::test]
async fn an_ordered_consumer_applies_each_aggregate_in_enqueue_order_across_two_runtimes() {
    let db = TestDb::new().await;
    db.pool
        .get()
        .await
        .unwrap()
        .batch_execute(APPLIED)
        .await
        .unwrap();
    let applier = Applier {
        fail_every: Some(5),
        poison: None,
        poisoned: Arc::default(),
    };
    let second = actix_outbox::connect(&db.url, 12).await.unwrap();
    let a = start_ordered(db.pool.clone(), ordered("ledger"), applier.clone()).await;
    let b = start_ordered(second, ordered("ledger"), applier).await;
    enqueue_interleaved(&db, 40, 25).await;

    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 1000, WAIT).await, 1000);
    assert_eq!(db.count("SELECT count(*) AS n FROM applied").await, 1000);
    // A fifth of the events failed their first attempt and were applied on their second.
    let retried = "SELECT count(*) AS n FROM applied WHERE attempt = 2";
    assert_eq!(db.count(retried).await, 200);
    let order = applied_order(&db).await;
    assert_eq!(order.len(), 40);
    for (aggregate, ns) in order {
        assert_eq!(ns, (0..25).collect::<Vec<_>>(), "{aggregate}");
    }
    db.finish(&[&a, &b]).await;
}

#[actix_rt::test]
async fn a_dead_lettered_event_holds_up_its_aggregate_alone_until_it_is_retried() {
    let db = TestDb::new().await;
    db.pool
        .get()
        .await
        .unwrap()
        .batch_execute(APPLIED)
        .await
        .unwrap();
    let poisoned = Arc::new(AtomicUsize::new(1));
    let applier = Applier {
        fail_every: None,
        poison: Some("agg-3".into()),
        poisoned: poisoned.clone(),
    };
    let cfg = ordered("ledger").retry(RetryPolicy::fixed(1, Duration::from_millis(10)));
    let rt = start_ordered(db.pool.clone(), cfg, applier).await;
    enqueue_interleaved(&db, 10, 5).await;

    // agg-3's first event is dead-lettered; its four others wait behind it, and every other
    // aggregate is applied in full.
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'DEAD_LETTER'";
    assert_eq!(db.wait_for(dead, 1, WAIT).await, 1);
    assert_held(&db, "agg-3", 45, 4).await;
    // The operator API names it: the head, its error, and the four events behind it.
    let admin = actix_outbox::admin::AdminConfig::new(db.pool.clone())
        .bearer_token("ops", "ops-token-0123456789")
        .unwrap();
    let app = actix_web::test::init_service(
        actix_web::App::new().service(actix_outbox::admin::admin_scope("/ops", admin)),
    )
    .await;
    let req = actix_web::test::TestRequest::get()
        .uri("/ops/blocked?consumer=ledger")
        .insert_header(("Authorization", "Bearer ops-token-0123456789"))
        .to_request();
    let blocked: serde_json::Value = actix_web::test::call_and_read_body_json(&app, req).await;
    let items = blocked["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{blocked}");
    assert_eq!(items[0]["aggregate_id"], "agg-3");
    assert_eq!(items[0]["waiting"], 4);
    assert_eq!(items[0]["status"], "DEAD_LETTER");
    assert_eq!(items[0]["error_code"], "INBOX_CONSUMER_FAILED");

    // The cause is fixed and an operator retries the dead letter: the aggregate goes on, in
    // order.
    poisoned.store(0, Ordering::Relaxed);
    let mut conn = db.pool.get().await.unwrap();
    diesel::sql_query(
        "UPDATE actix_outbox.inbox_events SET status = 'RETRY_PENDING', next_attempt_at = now() \
         WHERE status = 'DEAD_LETTER'",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    drop(conn);
    let agg3 = "SELECT count(*) AS n FROM applied WHERE aggregate = 'agg-3'";
    assert_eq!(db.wait_for(agg3, 5, WAIT).await, 5);
    assert_eq!(applied_order(&db).await["agg-3"], vec![0, 1, 2, 3, 4]);
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn an_ordered_consumer_that_skips_dead_letters_moves_past_them() {
    let db = TestDb::new().await;
    db.pool
        .get()
        .await
        .unwrap()
        .batch_execute(APPLIED)
        .await
        .unwrap();
    let applier = Applier {
        fail_every: None,
        poison: Some("agg-3".into()),
        poisoned: Arc::new(AtomicUsize::new(1)),
    };
    let cfg = ordered("ledger")
        .retry(RetryPolicy::fixed(1, Duration::from_millis(10)))
        .skip_dead_letters(true);
    let rt = start_ordered(db.pool.clone(), cfg, applier).await;
    // Two aggregates, the second poisoned from its first event on: its events are each
    // dead-lettered in turn, in order, and the other aggregate is applied in full.
    let conn = db.pool.get().await.unwrap();
    let events: Vec<NewEvent> = (0..4)
        .flat_map(|n| {
            ["agg-1", "agg-3"].map(|a| {
                NewEvent::new(
                    "ORDER_STATUS_CHANGED",
                    "order",
                    a,
                    serde_json::json!({"n": n, "k": n}),
                )
            })
        })
        .collect();
    actix_outbox::enqueue_many(&conn, &events).await.unwrap();
    drop(conn);
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'DEAD_LETTER'";
    assert_eq!(db.wait_for(dead, 4, WAIT).await, 4);
    assert_eq!(applied_order(&db).await["agg-1"], vec![0, 1, 2, 3]);
    db.finish(&[&rt]).await;
}

/// An event that waits in the outbox (here: not due for an hour, as a suspect the publisher
/// retries later would) holds up only the later events of its own aggregate, not an ordered
/// consumer's other aggregates.
#[actix_rt::test]
async fn an_event_waiting_in_the_outbox_holds_up_only_its_own_aggregate() {
    let db = TestDb::new().await;
    db.pool
        .get()
        .await
        .unwrap()
        .batch_execute(APPLIED)
        .await
        .unwrap();
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(
        "INSERT INTO actix_outbox.outbox_events (id, event_type, aggregate_type, aggregate_id, payload, \
             correlation_id, next_attempt_at) \
         VALUES (gen_random_uuid(), 'ORDER_STATUS_CHANGED', 'order', 'agg-0', \
             '{\"n\": -1, \"k\": 0}', 'stuck', now() + interval '1 hour')",
    )
    .await
    .unwrap();
    drop(conn);
    let applier = Applier {
        fail_every: None,
        poison: None,
        poisoned: Arc::default(),
    };
    let rt = start_ordered(db.pool.clone(), ordered("ledger"), applier).await;
    enqueue_interleaved(&db, 4, 3).await;

    assert_held(&db, "agg-0", 9, 3).await;
    db.finish(&[&rt]).await;
}
