//! The core runtime against real PostgreSQL: outbox → publisher → registry → inbox → consumer.
//! Every assertion counts rows; none reads logs or measures time.

use crate::common;

use std::time::Duration;

use actix_outbox::{
    db::Prepared, enqueue, enqueue_many, enqueue_with, testing::Fault, Error, NewEvent,
};
use common::*;
use diesel::sql_types::{BigInt, Text};
use diesel::ExpressionMethods;
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};

const EFFECTS_PER_EVENT_MAX: &str =
    "SELECT coalesce(max(c), 0) AS n FROM (SELECT count(*) AS c FROM effects GROUP BY consumer, event_id) x";

#[actix_rt::test]
async fn business_change_and_event_commit_together_or_not_at_all() {
    let db = TestDb::new().await;
    let mut conn = db.pool.get().await.unwrap();

    // Committed: the order, its audit row and the event exist together.
    conn.transaction::<_, Error, _>(async |conn| {
        insert_order(conn, "o-ok").await?;
        enqueue(conn, &order_event("o-ok")).await?;
        Ok(())
    })
    .await
    .unwrap();

    // An error after the enqueue rolls everything back.
    let failed = conn
        .transaction::<(), Error, _>(async |conn| {
            insert_order(conn, "o-bad").await?;
            enqueue(conn, &order_event("o-bad")).await?;
            Err(Error::Config("business rule failed after enqueue".into()))
        })
        .await;
    assert!(failed.is_err());

    // A failing enqueue (invalid event) fails the caller's transaction: nothing is written.
    let invalid = conn
        .transaction::<_, Error, _>(async |conn| {
            insert_order(conn, "o-invalid").await?;
            enqueue(
                conn,
                &NewEvent::new("", "order", "o-invalid", serde_json::json!({})),
            )
            .await?;
            Ok(())
        })
        .await;
    assert_eq!(invalid.unwrap_err().code().as_str(), "EVENT_SCHEMA_INVALID");

    // The same event id twice is a database error, and that transaction rolls back too.
    let ev = order_event("o-dup");
    let dup = conn
        .transaction::<_, Error, _>(async |conn| {
            insert_order(conn, "o-dup").await?;
            enqueue_many(conn, &[ev.clone(), ev.clone()]).await?;
            Ok(())
        })
        .await;
    assert!(dup.is_err());
    drop(conn);

    assert_eq!(db.count("SELECT count(*) AS n FROM orders").await, 1);
    assert_eq!(db.count("SELECT count(*) AS n FROM audit_logs").await, 1);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.outbox_events")
            .await,
        1
    );
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE aggregate_id = 'o-ok'"
        )
        .await,
        1
    );
    db.finish(&[]).await;
}

/// The business insert and the enqueue sent together (pipelined) in one transaction.
async fn pipelined(
    conn: &mut diesel_async::AsyncPgConnection,
    order: &str,
    event: &NewEvent,
) -> Result<(), Error> {
    conn.transaction::<_, Error, _>(async |conn| {
        let conn: &diesel_async::AsyncPgConnection = conn;
        let insert = diesel::sql_query(
            "INSERT INTO orders (id, status, version) VALUES ($1, 'COMPLETED', 2)",
        )
        .bind::<diesel::sql_types::Text, _>(order);
        futures_util::try_join!(
            async { Ok(insert.execute(&mut &*conn).await?) },
            enqueue(conn, event)
        )?;
        Ok(())
    })
    .await
}

#[actix_rt::test]
async fn an_enqueue_pipelined_with_the_business_write_commits_with_it_or_not_at_all() {
    let db = TestDb::new().await;
    let mut conn = db.pool.get().await.unwrap();
    let first = order_event("p-ok");
    pipelined(&mut conn, "p-ok", &first).await.unwrap();

    // The business statement fails (the order exists): the event sent with it is not written.
    let err = pipelined(&mut conn, "p-ok", &order_event("p-biz")).await;
    assert_eq!(err.unwrap_err().code().as_str(), "DATABASE_ERROR");
    // The enqueue fails (the same event id again): the order sent with it is not written.
    let err = pipelined(&mut conn, "p-event", &first).await;
    assert_eq!(err.unwrap_err().code().as_str(), "DATABASE_ERROR");
    // The event is invalid, found before anything is written; the order may already be on
    // its way to the server, and rolls back.
    let invalid = NewEvent::new("", "order", "p-invalid", serde_json::json!({}));
    let err = pipelined(&mut conn, "p-invalid", &invalid).await;
    assert_eq!(err.unwrap_err().code().as_str(), "EVENT_SCHEMA_INVALID");
    // The connection is usable afterwards, outside any transaction.
    pipelined(&mut conn, "p-after", &order_event("p-after"))
        .await
        .unwrap();
    drop(conn);

    assert_eq!(db.count("SELECT count(*) AS n FROM orders").await, 2);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.outbox_events")
            .await,
        2
    );
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM orders o JOIN actix_outbox.outbox_events e ON e.aggregate_id = o.id"
        )
        .await,
        2
    );
    db.finish(&[]).await;
}

diesel::table! {
    orders (id) {
        id -> Text,
        status -> Text,
        version -> BigInt,
    }
}

/// Places `order` with `ON CONFLICT DO NOTHING … RETURNING`: no row when it exists.
fn place(order: &str) -> impl diesel::query_builder::QueryFragment<diesel::pg::Pg> + Send {
    Prepared(
        diesel::sql_query(
            "INSERT INTO orders (id, status, version) VALUES ($1, 'PLACED', $2) \
             ON CONFLICT DO NOTHING RETURNING id",
        )
        .bind::<Text, _>(order.to_owned())
        .bind::<BigInt, _>(1_i64),
    )
}

#[actix_rt::test]
async fn a_business_statement_and_its_events_written_as_one_statement_commit_together_or_not_at_all(
) {
    let db = TestDb::new().await;
    let rt = start(&db, vec![(consumer("c1", 3), Behaviour::default())]).await;
    let mut conn = db.pool.get().await.unwrap();
    let code = |r: Result<bool, Error>| r.unwrap_err().code().as_str().to_owned();

    // Written in autocommit: the order and both its events, which are then delivered.
    let written = [order_event("w-1"), order_event("w-1")];
    assert!(enqueue_with(&conn, place("w-1"), &written).await.unwrap());

    // The business statement returns no row, so no event: an insert that skipped, and an
    // update (uncached raw SQL, binds numbered before the events') that found nothing.
    assert!(!enqueue_with(&conn, place("w-1"), &[order_event("w-1")])
        .await
        .unwrap());
    let ship = diesel::sql_query(
        "UPDATE orders SET status = 'SHIPPED' WHERE id = $1 AND status = $2 RETURNING id",
    )
    .bind::<Text, _>("w-1")
    .bind::<Text, _>("PAID");
    assert!(!enqueue_with(&conn, ship, &[order_event("w-1")])
        .await
        .unwrap());

    // The event fails (its id exists): the order sent with it is not written.
    let again = enqueue_with(&conn, place("w-2"), &written[..1]).await;
    assert_eq!(code(again), "DATABASE_ERROR");
    // The business statement fails (NOT NULL): the event sent with it is not written.
    let broken =
        diesel::sql_query("INSERT INTO orders (id, status) VALUES ('w-3', NULL) RETURNING id");
    assert_eq!(
        code(enqueue_with(&conn, broken, &[order_event("w-3")]).await),
        "DATABASE_ERROR"
    );
    // No RETURNING: PostgreSQL rejects the statement before anything is written.
    let blind = diesel::sql_query("INSERT INTO orders (id, status) VALUES ('w-4', 'PLACED')");
    assert_eq!(
        code(enqueue_with(&conn, blind, &[order_event("w-4")]).await),
        "DATABASE_ERROR"
    );
    // No events: refused, since nothing would tell whether the statement returned a row.
    assert_eq!(
        code(enqueue_with(&conn, place("w-8"), &[]).await),
        "EVENT_SCHEMA_INVALID"
    );
    // An invalid event is refused before the statement is sent.
    let invalid = NewEvent::new("", "order", "w-5", serde_json::json!({}));
    assert_eq!(
        code(enqueue_with(&conn, place("w-5"), &[invalid]).await),
        "EVENT_SCHEMA_INVALID"
    );
    // Diesel's query builder composes the same way.
    let dsl = diesel::insert_into(orders::table)
        .values((orders::id.eq("w-7"), orders::status.eq("PLACED")))
        .returning(orders::id);
    assert!(enqueue_with(&conn, dsl, &[order_event("w-7")])
        .await
        .unwrap());
    // Inside a transaction it is one statement of it, and rolls back with it.
    let rolled_back = conn
        .transaction::<(), Error, _>(async |conn| {
            assert!(enqueue_with(conn, place("w-6"), &[order_event("w-6")]).await?);
            Err(Error::Config("a later step failed".into()))
        })
        .await;
    assert!(rolled_back.is_err());
    drop(conn);

    assert_eq!(db.count("SELECT count(*) AS n FROM orders").await, 2);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE aggregate_id = 'w-1'")
            .await,
        2
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.outbox_events")
            .await,
        3
    );
    rt.handle().wake();
    assert_eq!(
        db.wait_for("SELECT count(*) AS n FROM effects", 3, WAIT)
            .await,
        3
    );
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn one_event_published_three_times_gives_one_inbox_row_and_one_effect() {
    let db = TestDb::new().await;
    let rt = start(&db, vec![(consumer("c1", 3), Behaviour::default())]).await;
    db.produce(1, "o").await;
    rt.handle().wake();
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 1, WAIT).await, 1);

    // Publish the same event twice more, as a lost acknowledgement or an expired lease would.
    for round in 2..=3 {
        let mut conn = db.pool.get().await.unwrap();
        conn.batch_execute("UPDATE actix_outbox.outbox_events SET status = 'PENDING'")
            .await
            .unwrap();
        drop(conn);
        rt.handle().wake();
        let published = db
            .wait_for(
                &format!("SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'PUBLISHED' AND attempt_count = {round}"),
                1,
                WAIT,
            )
            .await;
        assert_eq!(published, 1);
    }
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events")
            .await,
        1
    );
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 1);
    assert_eq!(db.count(done).await, 1);
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn two_consumers_each_get_every_event_once_and_a_failing_one_blocks_nothing() {
    let db = TestDb::new().await;
    let broken = Behaviour {
        fail_attempts: u32::MAX,
        ..Default::default()
    };
    let rt = start(
        &db,
        vec![
            (consumer("healthy", 3), Behaviour::default()),
            (consumer("broken", 3), broken),
        ],
    )
    .await;
    db.produce(200, "o").await;
    rt.handle().wake();

    let healthy = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'healthy' AND status = 'PROCESSED'";
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'broken' AND status = 'DEAD_LETTER'";
    assert_eq!(db.wait_for(healthy, 200, WAIT).await, 200);
    assert_eq!(db.wait_for(dead, 200, WAIT).await, 200);

    // Exactly max_attempts attempts, with code and error kept; and none of the broken
    // consumer's writes survived its failures.
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'broken' AND attempt_count = 3 \
                  AND error_code = 'INBOX_CONSUMER_FAILED' AND last_error LIKE '%injected%'")
            .await,
        200
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM effects WHERE consumer = 'broken'")
            .await,
        0
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM effects WHERE consumer = 'healthy'")
            .await,
        200
    );
    assert_eq!(db.count(EFFECTS_PER_EVENT_MAX).await, 1);
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn a_handler_error_leaves_no_partial_state_and_is_retried_until_it_succeeds() {
    let db = TestDb::new().await;
    let flaky = Behaviour {
        fail_attempts: 2,
        ..Default::default()
    };
    let rt = start(&db, vec![(consumer("flaky", 5), flaky)]).await;
    db.produce(50, "o").await;
    rt.handle().wake();

    let done =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED' AND attempt_count = 3";
    assert_eq!(db.wait_for(done, 50, WAIT).await, 50);
    // The effect written by attempts 1 and 2 was rolled back with them; only attempt 3's stays.
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 50);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM effects WHERE attempt <> 3")
            .await,
        0
    );
    db.finish(&[&rt]).await;
}

/// A handler's own `transaction()` inside the delivery must be a savepoint of the batch's
/// transaction, not a transaction of its own: the batch's BEGIN and COMMIT are pipelined, and
/// the connection's transaction manager has to know about them. Were it not told, the nested
/// call would COMMIT the batch, and the failed first attempts' effects would stay.
#[actix_rt::test]
async fn a_handlers_nested_transaction_is_undone_with_its_failed_attempt() {
    let db = TestDb::new().await;
    let nested = Behaviour {
        fail_attempts: 1,
        nested: true,
        ..Default::default()
    };
    let rt = start(&db, vec![(consumer("nested", 5).batch_size(8), nested)]).await;
    db.produce(40, "o").await;
    rt.handle().wake();

    let done =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED' AND attempt_count = 2";
    assert_eq!(db.wait_for(done, 40, WAIT).await, 40);
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 40);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM effects WHERE attempt <> 2")
            .await,
        0
    );
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn a_handler_panic_is_retried_like_an_error_and_delivery_goes_on() {
    handler_panics(false).await;
}

/// The same with the consumers reading through cursors (storage v2): each panicking event
/// gets an inbox row, where its retry is counted. Processed means an effect.
#[actix_rt::test]
async fn a_cursor_handler_panic_is_retried_like_an_error_and_delivery_goes_on() {
    handler_panics(true).await;
}

async fn handler_panics(cursor: bool) {
    let db = TestDb::new().await;
    let panicky = Behaviour {
        panic_attempts: 1,
        ..Default::default()
    };
    // Panics in `handle` kill the handler actor; it is rebuilt from its factory.
    let killer = Behaviour {
        kill_attempts: 1,
        ..Default::default()
    };
    let rt = start(
        &db,
        vec![
            (consumer("panicky", 5).cursor(cursor), panicky),
            (consumer("killer", 5).cursor(cursor), killer),
            (consumer("calm", 5).cursor(cursor), Behaviour::default()),
        ],
    )
    .await;
    db.produce(30, "o").await;
    rt.handle().wake();

    let done = match cursor {
        false => "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'",
        true => "SELECT count(*) AS n FROM (SELECT DISTINCT consumer, event_id FROM effects) e",
    };
    assert_eq!(db.wait_for(done, 90, WAIT).await, 90);
    if cursor {
        for c in ["panicky", "killer", "calm"] {
            assert!(read_through_cursors(&db, c).await, "{c}");
        }
        let calm = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'calm'";
        assert_eq!(
            db.count(calm).await,
            0,
            "a calm consumer's event needed an inbox row"
        );
    }
    // Every panicking delivery rolled back; each event has exactly one effect per consumer.
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 90);
    assert_eq!(db.count(EFFECTS_PER_EVENT_MAX).await, 1);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM effects WHERE consumer IN ('panicky', 'killer') AND attempt = 1")
            .await,
        0
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'killer' AND attempt_count = 2")
            .await,
        30,
        "each event cost the killed actor exactly one attempt"
    );
    // More events after the panics still flow.
    db.produce(10, "later").await;
    rt.handle().wake();
    assert_eq!(db.wait_for(done, 120, WAIT).await, 120);
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn two_runtimes_on_one_database_process_every_event_once_per_consumer() {
    two_runtimes_on_one_database(false).await;
}

/// The same with the consumers reading through cursors (storage v2): both runtimes' batches
/// of a consumer share its cursors. Processed means an effect, as a cursor consumer has no
/// inbox row per event; the inbox holds only exceptions, of which none may be a dead letter.
#[actix_rt::test]
async fn two_runtimes_on_one_database_process_every_event_once_per_cursor_consumer() {
    two_runtimes_on_one_database(true).await;
}

async fn two_runtimes_on_one_database(cursor: bool) {
    let db = TestDb::new().await;
    let names = ["alpha", "beta", "gamma"];
    let cfgs = || {
        names
            .iter()
            .map(|n| {
                (
                    consumer(n, 5).concurrency(2).batch_size(16).cursor(cursor),
                    Behaviour::default(),
                )
            })
            .collect()
    };
    let other_pool = actix_outbox::connect(&db.url, 20).await.unwrap();
    let rt1 = start(&db, cfgs()).await;
    let rt2 = start_on(other_pool, cfgs()).await;

    // Four concurrent producers, 500 business transactions each.
    let producers: Vec<_> = (0..4)
        .map(|p| {
            let pool = db.pool.clone();
            let wake = if p % 2 == 0 {
                rt1.handle()
            } else {
                rt2.handle()
            };
            actix_rt::spawn(async move {
                let mut conn = pool.get_owned().await.unwrap();
                for i in 0..500 {
                    let order = format!("p{p}-{i}");
                    conn.transaction::<_, Error, _>(async |conn| {
                        insert_order(conn, &order).await?;
                        enqueue(conn, &order_event(&order)).await
                    })
                    .await
                    .unwrap();
                    wake.wake();
                }
            })
        })
        .collect();
    for p in producers {
        p.await.unwrap();
    }

    if cursor {
        let done = "SELECT count(*) AS n FROM (SELECT DISTINCT consumer, event_id FROM effects) e";
        assert_eq!(db.wait_for(done, 6000, WAIT).await, 6000);
        let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                    WHERE status = 'DEAD_LETTER'";
        assert_eq!(db.count(dead).await, 0);
        for name in names {
            assert!(
                read_through_cursors(&db, name).await,
                "{name} not on cursors"
            );
        }
    } else {
        let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
        assert_eq!(db.wait_for(done, 6000, WAIT).await, 6000);
        assert_eq!(
            db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events")
                .await,
            6000
        );
    }
    for name in names {
        let per =
            format!("SELECT count(DISTINCT event_id) AS n FROM effects WHERE consumer = '{name}'");
        assert_eq!(db.count(&per).await, 2000, "{name}");
    }
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 6000);
    assert_eq!(db.count(EFFECTS_PER_EVENT_MAX).await, 1);
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status <> 'PUBLISHED'"
        )
        .await,
        0
    );
    db.finish(&[&rt1, &rt2]).await;
}

/// Claims of one consumer, from many loops in two runtimes at once, never lease a row twice:
/// the handler is called exactly once per event. Every event fails once, into the dead letters,
/// so a row leased twice would show as a second call (its mark is fenced off, not its call).
#[actix_rt::test]
async fn concurrent_claims_of_one_consumer_never_lease_a_row_twice() {
    const EVENTS: i64 = 600;
    let db = TestDb::new().await;
    let behaviour = Behaviour {
        poison_aggregate: Some("*".into()),
        ..Behaviour::default()
    };
    let cfg = || {
        vec![(
            consumer("c", 1).concurrency(4).batch_size(3),
            behaviour.clone(),
        )]
    };
    let other_pool = actix_outbox::connect(&db.url, 20).await.unwrap();
    let rt1 = start(&db, cfg()).await;
    let rt2 = start_on(other_pool, cfg()).await;
    db.produce_batched(EVENTS as usize, 50, "o").await;
    rt1.handle().wake();
    rt2.handle().wake();
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'DEAD_LETTER' \
                AND attempt_count = 1";
    assert_eq!(db.wait_for(dead, EVENTS, WAIT).await, EVENTS);
    assert_eq!(
        std::sync::atomic::AtomicUsize::load(
            &behaviour.poison_calls,
            std::sync::atomic::Ordering::Relaxed
        ) as i64,
        EVENTS,
        "calls: a row was leased twice"
    );
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 0);
    db.finish(&[&rt1, &rt2]).await;
}

#[actix_rt::test]
async fn a_killed_publisher_is_restarted_and_the_backlog_drains() {
    let db = TestDb::new().await;
    let rt = start(&db, vec![(consumer("c1", 5), Behaviour::default())]).await;

    for round in 0..4 {
        db.produce(250, &format!("r{round}")).await;
        let fault = if round % 2 == 0 {
            Fault::PanicPublisher
        } else {
            Fault::StopPublisher
        };
        assert!(rt.inject_fault(fault).await, "the publisher was running");
        rt.handle().wake();
    }
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 1000, WAIT).await, 1000);
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, 1000);
    assert_eq!(db.count(EFFECTS_PER_EVENT_MAX).await, 1);

    let status = within(Duration::from_secs(10), rt.status()).await.unwrap();
    assert_eq!(status.restarts.get("publisher"), Some(&4), "{status:?}");
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn every_actor_is_restarted_after_a_panic_and_delivery_continues() {
    actors_restarted_after_a_panic(false).await;
}

/// The same with the consumer reading through its cursors (storage v2). Processed means an
/// effect.
#[actix_rt::test]
async fn every_actor_is_restarted_after_a_panic_and_cursor_delivery_continues() {
    actors_restarted_after_a_panic(true).await;
}

async fn actors_restarted_after_a_panic(cursor: bool) {
    let db = TestDb::new().await;
    let rt = start(
        &db,
        vec![(consumer("c1", 5).cursor(cursor), Behaviour::default())],
    )
    .await;
    db.produce(10, "before").await;
    rt.handle().wake();
    let done = match cursor {
        false => "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'",
        true => "SELECT count(DISTINCT event_id) AS n FROM effects",
    };
    assert_eq!(db.wait_for(done, 10, WAIT).await, 10);

    for fault in [
        Fault::PanicRegistry,
        Fault::PanicConsumer("c1".into()),
        Fault::PanicReconciler,
    ] {
        assert!(
            rt.inject_fault(fault.clone()).await,
            "{fault:?} hit a running actor"
        );
    }
    db.produce(10, "after").await;
    rt.handle().wake();
    assert_eq!(db.wait_for(done, 20, WAIT).await, 20);

    let status = rt.status().await.unwrap();
    for child in ["registry", "consumer:c1", "reconciler"] {
        assert_eq!(status.restarts.get(child), Some(&1), "{child}: {status:?}");
    }
    assert_eq!(read_through_cursors(&db, "c1").await, cursor);
    assert_eq!(db.count(EFFECTS_PER_EVENT_MAX).await, 1);
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn events_committed_while_no_publisher_runs_are_delivered_after_it_starts() {
    let db = TestDb::new().await;
    // Before any runtime exists.
    db.produce(40, "early").await;
    let rt = start(&db, vec![(consumer("c1", 5), Behaviour::default())]).await;
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 40, WAIT).await, 40);

    // After a shutdown, before the next start.
    assert!(rt.shutdown().await);
    assert!(rt.shutdown().await, "a second shutdown is a no-op");
    db.produce(40, "between").await;
    let rt2 = start(&db, vec![(consumer("c1", 5), Behaviour::default())]).await;
    assert_eq!(db.wait_for(done, 80, WAIT).await, 80);

    // While the publisher is dead and not yet replaced.
    assert!(rt2.inject_fault(Fault::StopPublisher).await);
    db.produce(40, "dead").await;
    assert_eq!(db.wait_for(done, 120, WAIT).await, 120);
    assert_eq!(db.count(EFFECTS_PER_EVENT_MAX).await, 1);
    db.finish(&[&rt2]).await;
}

#[actix_rt::test]
async fn a_consumer_registered_on_another_instance_still_gets_inbox_rows() {
    let db = TestDb::new().await;
    // Instance A runs only `a`; instance B runs only `b`. Events enqueued and published by A
    // must still reach `b` through B.
    let rt_a = start(&db, vec![(consumer("a", 5), Behaviour::default())]).await;
    let other_pool = actix_outbox::connect(&db.url, 10).await.unwrap();
    let rt_b = start_on(other_pool, vec![(consumer("b", 5), Behaviour::default())]).await;
    db.produce(100, "o").await;
    rt_a.handle().wake();
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 200, WAIT).await, 200);
    assert_eq!(
        db.count("SELECT count(DISTINCT event_id) AS n FROM effects WHERE consumer = 'b'")
            .await,
        100
    );
    db.finish(&[&rt_a, &rt_b]).await;
}

/// A poll interval of `Duration::MAX` ("never poll, wake-ups and LISTEN are enough") is a
/// valid setting: the publisher derived its reaper's interval from it by a multiplication that
/// overflowed, panicked at every start, and never published.
#[actix_rt::test]
async fn a_publisher_that_never_polls_still_publishes_on_wake_ups() {
    let db = TestDb::new().await;
    let config = fast_runtime().poll_interval(Duration::MAX);
    let rt = start_with(
        db.pool.clone(),
        config,
        vec![(consumer("c1", 3), Behaviour::default())],
    )
    .await;
    db.produce(5, "o").await;
    rt.handle().wake();
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 5, WAIT).await, 5);
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn invalid_configuration_is_rejected_with_a_stable_code() {
    let db = TestDb::new().await;
    let no_subscription = actix_outbox::ConsumerConfig::new("lonely");
    let err = actix_outbox::OutboxRuntime::builder(db.pool.clone())
        .consumer(no_subscription, || Recorder {
            name: "lonely".into(),
            behaviour: Behaviour::default(),
        })
        .start()
        .await
        .err()
        .expect("a consumer without subscriptions is rejected");
    assert_eq!(err.code().as_str(), "CONFIG_INVALID");
    // A bad name is refused with every other setting, at start.
    let bad_name = actix_outbox::ConsumerConfig::new("bad name!").subscribe("ORDER_PLACED");
    let err = actix_outbox::OutboxRuntime::builder(db.pool.clone())
        .consumer(bad_name, || Recorder {
            name: "bad name!".into(),
            behaviour: Behaviour::default(),
        })
        .start()
        .await
        .err()
        .expect("a consumer with an invalid name is rejected");
    assert_eq!(err.code().as_str(), "CONFIG_INVALID");
    let dup = start_twice(&db).await;
    assert_eq!(dup.code().as_str(), "CONFIG_INVALID");
    // Retention and stats settings are checked at start too: an invalid one turned retention
    // off, or the sampler to its defaults, with a log line at most.
    let retention = actix_outbox::retention::RetentionConfig::default().batch_size(0);
    let bad_retention = fast_runtime().retention(retention);
    let mut bad_stats = fast_runtime();
    bad_stats = bad_stats
        .stats(actix_outbox::health::StatsConfig::default().interval(Duration::from_micros(500)));
    for config in [bad_retention, bad_stats] {
        let refused = actix_outbox::OutboxRuntime::builder(db.pool.clone())
            .config(config)
            .start()
            .await;
        assert_eq!(
            refused
                .err()
                .map(|e| e.code().as_str().to_owned())
                .as_deref(),
            Some("CONFIG_INVALID")
        );
    }
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.consumer_states")
            .await,
        0,
        "nothing registered"
    );
    db.finish(&[]).await;
}

async fn start_twice(db: &TestDb) -> Error {
    let r = || Recorder {
        name: "twice".into(),
        behaviour: Behaviour::default(),
    };
    actix_outbox::OutboxRuntime::builder(db.pool.clone())
        .consumer(consumer("twice", 3), r)
        .consumer(consumer("twice", 3), r)
        .start()
        .await
        .err()
        .expect("duplicate consumer names are rejected")
}

/// Instances that start together on an empty database migrate it together: they take turns,
/// and the one waiting holds no snapshot that a `CREATE INDEX CONCURRENTLY` of the one
/// migrating would wait for (which deadlocked when the waiter waited inside one statement).
#[actix_rt::test]
async fn three_instances_migrate_an_empty_database_at_once() {
    let db = TestDb::empty().await;
    let (a, b, c) = futures_util::future::join3(
        actix_outbox::db::migrate_with(&db.url, &Default::default()),
        actix_outbox::db::migrate_with(&db.url, &Default::default()),
        actix_outbox::db::migrate_with(&db.url, &Default::default()),
    )
    .await;
    let reports = [a.unwrap(), b.unwrap(), c.unwrap()];
    let applied: usize = reports.iter().map(|r| r.applied.len()).sum();
    assert_eq!(applied, actix_outbox::db::MIGRATIONS.len(), "{reports:?}");
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.schema_migrations")
            .await,
        actix_outbox::db::MIGRATIONS.len() as i64
    );
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = 'actix_outbox' AND NOT i.indisvalid"
        )
        .await,
        0,
        "no index left invalid"
    );
    db.finish(&[]).await;
}

/// A migration that cannot take its table's lock (a session holds the table locked) times out
/// after `lock_timeout`, so it queues nobody's writes for longer, and is tried again until the
/// lock is free: it then applies, once.
#[actix_rt::test]
async fn a_migration_behind_a_held_lock_is_tried_again_until_it_applies() {
    let db = TestDb::empty().await;
    let until = actix_outbox::db::MigrateConfig {
        until: Some("20261202000018".into()),
        ..Default::default()
    };
    actix_outbox::db::migrate_with(&db.url, &until)
        .await
        .unwrap();
    let mut holder = diesel_async::AsyncPgConnection::establish(&db.url)
        .await
        .unwrap();
    holder
        .batch_execute("BEGIN; LOCK TABLE actix_outbox.outbox_events IN SHARE MODE")
        .await
        .unwrap();
    let url = db.url.clone();
    let migrating =
        actix_rt::spawn(
            async move { actix_outbox::db::migrate_with(&url, &Default::default()).await },
        );
    // 000019 sets the outbox's fillfactor, which waits for the lock: let it time out a few
    // times (500 ms each), then let go.
    let waiting = "SELECT count(*) AS n FROM pg_locks WHERE NOT granted \
                   AND relation = 'actix_outbox.outbox_events'::regclass";
    assert_eq!(
        db.wait_for(waiting, 1, WAIT).await,
        1,
        "the migration waits"
    );
    actix_rt::time::sleep(Duration::from_millis(1500)).await;
    holder.batch_execute("COMMIT").await.unwrap();
    let report = migrating.await.unwrap().unwrap();
    assert!(report.lock_retries >= 1, "{report:?}");
    assert!(
        report.applied.contains(&"20261202000019".to_owned()),
        "{report:?}"
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.schema_migrations")
            .await,
        actix_outbox::db::MIGRATIONS.len() as i64,
        "every version applied once"
    );
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM pg_class WHERE oid = 'actix_outbox.outbox_events'::regclass \
             AND reloptions @> ARRAY['fillfactor=50']"
        )
        .await,
        1
    );
    db.finish(&[]).await;
}

#[actix_rt::test]
async fn migrations_run_concurrently_and_twice_without_harm() {
    let db = TestDb::new().await;
    let (a, b) = futures_util::future::join(
        actix_outbox::migrate(&db.url),
        actix_outbox::migrate(&db.url),
    )
    .await;
    a.unwrap();
    b.unwrap();
    let shipped = actix_outbox::db::MIGRATIONS.len();
    assert!(shipped >= 2);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.schema_migrations")
            .await,
        shipped as i64,
        "each migration recorded once"
    );
    let mut conn = db.pool.get().await.unwrap();
    let bad = diesel::sql_query("INSERT INTO actix_outbox.outbox_events (id, event_type, aggregate_type, aggregate_id, payload, correlation_id, status) \
                                 VALUES (gen_random_uuid(), 'X', 'a', '1', '{}', 'c', 'NOPE')")
        .execute(&mut conn)
        .await;
    assert!(
        bad.is_err(),
        "the status CHECK constraint rejects unknown states"
    );
    drop(conn);
    db.finish(&[]).await;
}

/// The upgrade that narrowed the inbox's correlation index to received rows (migration
/// 000007), run on a database that already has inbox rows: a row whose event is not in this
/// database's outbox (it came from another one) is marked `external`, so the timeline still
/// finds it; a row fanned out from here is found through its outbox event.
#[actix_rt::test]
async fn upgrading_to_the_partial_correlation_index_keeps_received_rows_in_the_timeline() {
    let db = TestDb::empty().await;
    // An install of the version before 000007.
    let until = actix_outbox::db::MigrateConfig {
        until: Some("20261129000006".into()),
        ..Default::default()
    };
    let report = actix_outbox::db::migrate_with(&db.url, &until)
        .await
        .unwrap();
    assert_eq!(report.applied.len(), 6, "{report:?}");
    let local = uuid::Uuid::now_v7();
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(&format!(
        "INSERT INTO actix_outbox.outbox_events (id, event_type, aggregate_type, aggregate_id, payload, \
             correlation_id, status) \
         VALUES ('{local}', 'ORDER_STATUS_CHANGED', 'order', 'o-1', '{{}}', 'corr-up', 'PUBLISHED');
         INSERT INTO actix_outbox.inbox_events (event_id, consumer, event_type, event_version, aggregate_type, \
             aggregate_id, payload, correlation_id, event_created_at) \
         VALUES ('{local}', 'c1', 'ORDER_STATUS_CHANGED', 1, 'order', 'o-1', '{{}}', 'corr-up', now()), \
                (gen_random_uuid(), 'c1', 'ORDER_SHIPPED', 1, 'order', 'o-1', '{{}}', 'corr-up', now());"
    ))
    .await
    .unwrap();
    drop(conn);

    actix_outbox::migrate(&db.url).await.unwrap();
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE external")
            .await,
        1,
        "only the row without a local outbox event is marked received"
    );
    let mut conn = db.pool.get().await.unwrap();
    let timeline = actix_outbox::ops::timeline(&mut conn, "corr-up")
        .await
        .unwrap();
    drop(conn);
    let mut seen: Vec<(String, String)> = timeline
        .iter()
        .map(|t| (t.kind.clone(), t.event_type.clone()))
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        vec![
            ("inbox".into(), "ORDER_SHIPPED".into()),
            ("inbox".into(), "ORDER_STATUS_CHANGED".into()),
            ("outbox".into(), "ORDER_STATUS_CHANGED".into()),
        ]
    );
    db.finish(&[]).await;
}

/// A wake-up within `publish_gap` of the last claim is deferred to the end of the gap, never
/// dropped. Everything else polls every 30 s, so only the deferred claims can deliver within
/// the deadline: the wake-ups right after the start's claim, and then one right after a claim.
#[actix_rt::test]
async fn a_wake_up_within_the_publish_gap_is_deferred_not_lost() {
    let db = TestDb::new().await;
    let cfg = fast_runtime()
        .poll_interval(Duration::from_secs(30))
        .publish_gap(Duration::from_secs(2))
        .listen(false);
    let slow_poll = consumer("c1", 3).poll_interval(Duration::from_secs(30));
    let rt = start_with(
        db.pool.clone(),
        cfg,
        vec![(slow_poll, Behaviour::default())],
    )
    .await;
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    for round in 1..=3 {
        db.produce(1, &format!("first-{round}")).await;
        rt.handle().wake();
    }
    assert_eq!(db.wait_for(done, 3, Duration::from_secs(10)).await, 3);
    db.produce(1, "second").await;
    rt.handle().wake();
    assert_eq!(db.wait_for(done, 4, Duration::from_secs(10)).await, 4);
    db.finish(&[&rt]).await;
}

/// Instance B, on a pool of its own, running consumer `b`; it and its consumer poll every 30 s,
/// so only the LISTEN/NOTIFY path wakes them within a test's deadline.
async fn slow_polling_instance(db: &TestDb) -> actix_outbox::OutboxRuntime {
    let slow = fast_runtime().poll_interval(Duration::from_secs(30));
    let other_pool = actix_outbox::connect(&db.url, 10).await.unwrap();
    let slow_poll = consumer("b", 3).poll_interval(Duration::from_secs(30));
    start_with(other_pool, slow, vec![(slow_poll, Behaviour::default())]).await
}

#[actix_rt::test]
async fn another_instance_hears_about_its_inbox_rows_without_waiting_for_a_poll() {
    let db = TestDb::new().await;
    // B polls every 30 s; only the LISTEN/NOTIFY path can wake it within the deadline.
    let rt_b = slow_polling_instance(&db).await;
    let rt_a = start(&db, vec![(consumer("a", 3), Behaviour::default())]).await;
    // Let B's listener and first (empty) claims settle before the events exist.
    let listening = "SELECT count(*) AS n FROM pg_stat_activity \
                     WHERE datname = current_database() AND query LIKE 'LISTEN actix_outbox_inbox%'";
    assert_eq!(db.wait_for(listening, 2, WAIT).await, 2);

    db.produce(20, "o").await;
    rt_a.handle().wake();
    let done_b =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'b' AND status = 'PROCESSED'";
    assert_eq!(db.wait_for(done_b, 20, Duration::from_secs(10)).await, 20);
    db.finish(&[&rt_a, &rt_b]).await;
}

/// PostgreSQL refuses a notification payload of 8000 bytes or more. A claim that fans out to
/// more consumers than one payload can name must still commit, and still wake the other
/// instance's consumers (the payload then names them all as `*`).
#[actix_rt::test]
async fn a_claim_for_more_consumers_than_one_notification_can_name_still_wakes_them() {
    let db = TestDb::new().await;
    // 80 subscribers with 100-character names: 8,080 bytes of names. Nobody runs them.
    db.pool
        .get()
        .await
        .unwrap()
        .batch_execute(
            "INSERT INTO actix_outbox.consumer_states (consumer) \
                 SELECT 'x' || lpad(g::text, 99, '0') FROM generate_series(1, 80) g; \
             INSERT INTO actix_outbox.consumer_subscriptions (consumer, event_type) \
                 SELECT consumer, 'ORDER_STATUS_CHANGED' FROM actix_outbox.consumer_states",
        )
        .await
        .unwrap();
    let rt_b = slow_polling_instance(&db).await;
    let rt_a = start(&db, vec![(consumer("a", 3), Behaviour::default())]).await;
    let listening = format!(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = '{}' \
         AND query LIKE 'LISTEN actix_outbox_inbox%'",
        db.name
    );
    assert_eq!(db.wait_for(&listening, 2, WAIT).await, 2);

    db.produce(20, "o").await;
    rt_a.handle().wake();
    let published =
        "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'PUBLISHED'";
    assert_eq!(db.wait_for(published, 20, WAIT).await, 20);
    let done_b =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'b' AND status = 'PROCESSED'";
    assert_eq!(db.wait_for(done_b, 20, Duration::from_secs(10)).await, 20);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events")
            .await,
        20 * 82,
        "one inbox row per event and subscriber"
    );
    db.finish(&[&rt_a, &rt_b]).await;
}

/// A consumer redeployed without one of its event types keeps that subscription (another
/// instance may still run the old code) until an operator removes it; from then on events of
/// that type get no inbox row for it, and the other types flow on.
#[actix_rt::test]
async fn an_unsubscribed_event_type_is_no_longer_fanned_out_to_that_consumer() {
    let db = TestDb::new().await;
    let old = start(
        &db,
        vec![(
            consumer("c1", 3).subscribe("ORDER_CANCELLED"),
            Behaviour::default(),
        )],
    )
    .await;
    old.shutdown().await;
    let rt = start(&db, vec![(consumer("c1", 3), Behaviour::default())]).await;
    let subscribed =
        "SELECT count(*) AS n FROM actix_outbox.consumer_subscriptions WHERE consumer = 'c1'";
    assert_eq!(
        db.count(subscribed).await,
        2,
        "the new config removes nothing"
    );

    let c1 = actix_outbox::event::ConsumerName::new("c1").unwrap();
    let mut conn = db.pool.get().await.unwrap();
    assert!(
        actix_outbox::ops::unsubscribe(&mut conn, &c1, "ORDER_CANCELLED")
            .await
            .unwrap()
    );
    assert!(
        !actix_outbox::ops::unsubscribe(&mut conn, &c1, "ORDER_CANCELLED")
            .await
            .unwrap(),
        "already removed"
    );
    let nobody = actix_outbox::event::ConsumerName::new("nobody").unwrap();
    let unknown = actix_outbox::ops::unsubscribe(&mut conn, &nobody, "ORDER_CANCELLED").await;
    assert_eq!(unknown.unwrap_err().code().as_str(), "CONSUMER_UNKNOWN");
    let cancelled = NewEvent::new("ORDER_CANCELLED", "order", "o2", serde_json::json!({}));
    enqueue(&conn, &cancelled).await.unwrap();
    enqueue(&conn, &order_event("o1")).await.unwrap();
    drop(conn);
    rt.handle().wake();

    let published =
        "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'PUBLISHED'";
    assert_eq!(db.wait_for(published, 2, WAIT).await, 2);
    let processed =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(processed, 1, WAIT).await, 1);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE event_type = 'ORDER_CANCELLED'")
            .await,
        0
    );
    assert_eq!(db.count(subscribed).await, 1);
    db.finish(&[&rt]).await;
}

/// A consumer written as a plain async function (`consumer_fn`) gets every event, writes its
/// effect through the delivery's connection, and is retried like an actor: every event's
/// first attempt writes its effect and then fails, so a failed attempt's effect that
/// committed would show as a second effect row.
#[actix_rt::test]
async fn a_function_consumer_commits_each_effect_once_through_its_retries() {
    const EVENTS: i64 = 20;
    let db = TestDb::new().await;
    let rt = actix_outbox::OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer_fn(consumer("fn", 3), |d: actix_outbox::Delivery| async move {
            let mut conn = d.conn().await?;
            diesel::sql_query(
                "INSERT INTO effects (consumer, event_id, attempt) VALUES ('fn', $1, $2)",
            )
            .bind::<diesel::sql_types::Uuid, _>(d.event_id().as_uuid())
            .bind::<diesel::sql_types::Integer, _>(d.attempt() as i32)
            .execute(&mut *conn)
            .await?;
            if d.attempt() == 1 {
                return Err(actix_outbox::HandlerError::retry("the first attempt fails"));
            }
            Ok(())
        })
        .start()
        .await
        .unwrap();
    db.produce(EVENTS as usize, "f").await;
    rt.handle().wake();
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED' \
                AND attempt_count = 2";
    assert_eq!(db.wait_for(done, EVENTS, WAIT).await, EVENTS);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM effects WHERE attempt = 2")
            .await,
        EVENTS
    );
    assert_eq!(db.count("SELECT count(*) AS n FROM effects").await, EVENTS);
    db.finish(&[&rt]).await;
}
