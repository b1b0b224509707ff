//! What became of one event for each consumer (`GET {admin}/events/{id}`), and the alarm for
//! events published while no consumer was subscribed to their type (`EVENTS_UNROUTED`), against
//! real PostgreSQL.

use crate::common;

use actix_outbox::admin::{admin_scope, AdminConfig};
use actix_outbox::health::{StatsConfig, StatsSampler};
use actix_outbox::NewEvent;
use actix_web::test::{call_and_read_body_json, init_service, TestRequest};
use actix_web::App;
use common::*;
use serde_json::Value;

const TOKEN: &str = "ops-token-0123456789";

fn shipped(order: &str) -> NewEvent {
    NewEvent::new(
        "ORDER_SHIPPED",
        "order",
        order,
        serde_json::json!({ "order_id": order }),
    )
}

#[actix_rt::test]
async fn an_event_published_before_its_consumer_subscribed_is_reported_and_shown_unreached() {
    let db = TestDb::new().await;
    // ORDER_SHIPPED has no consumer yet: the runtime publishes it to nobody.
    let rt = start(&db, vec![(consumer("mail", 3), Behaviour::default())]).await;
    let conn = db.pool.get().await.unwrap();
    let early = actix_outbox::enqueue(&conn, &shipped("o-1")).await.unwrap();
    drop(conn);
    rt.handle().wake();
    let published =
        "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'PUBLISHED'";
    assert_eq!(db.wait_for(published, 1, WAIT).await, 1);
    rt.shutdown().await;

    // The consumer of ORDER_SHIPPED is deployed: it gets the next one, never the first.
    let shipping = consumer("shipping", 3).subscribe("ORDER_SHIPPED");
    let rt = start(&db, vec![(shipping, Behaviour::default())]).await;
    let conn = db.pool.get().await.unwrap();
    let late = actix_outbox::enqueue(&conn, &shipped("o-2")).await.unwrap();
    drop(conn);
    rt.handle().wake();
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 1, WAIT).await, 1);

    // Health says so, with the type.
    let sampler = StatsSampler::new(db.pool.clone(), StatsConfig::default()).unwrap();
    let report = sampler.run_once().await.unwrap();
    let unrouted: Vec<_> = report
        .reasons
        .iter()
        .filter(|r| r.code == "EVENTS_UNROUTED")
        .collect();
    assert_eq!(unrouted.len(), 1, "{report:?}");
    assert!(unrouted[0].message.contains("1 event"), "{report:?}");
    assert!(unrouted[0].message.contains("ORDER_SHIPPED"), "{report:?}");

    // The fan-out view: the first reached nobody, and the consumer subscribed now never got it;
    // the second reached it and was processed.
    let admin = AdminConfig::new(db.pool.clone())
        .bearer_token("ops", TOKEN)
        .unwrap();
    let app = init_service(App::new().service(admin_scope("/ops", admin))).await;
    let view = async |id: uuid::Uuid| -> Value {
        let req = TestRequest::get()
            .uri(&format!("/ops/events/{id}"))
            .insert_header(("Authorization", format!("Bearer {TOKEN}")))
            .to_request();
        call_and_read_body_json(&app, req).await
    };
    let first = view(early.as_uuid()).await;
    assert_eq!(first["source"], "outbox", "{first}");
    assert_eq!(first["reached"], 0, "{first}");
    assert_eq!(first["outbox"]["status"], "PUBLISHED", "{first}");
    assert_eq!(first["consumers"][0]["consumer"], "shipping", "{first}");
    assert_eq!(first["consumers"][0]["subscribed"], true, "{first}");
    assert_eq!(first["consumers"][0]["got"], false, "{first}");
    let second = view(late.as_uuid()).await;
    assert_eq!(second["reached"], 1, "{second}");
    assert_eq!(second["consumers"][0]["got"], true, "{second}");
    assert_eq!(second["consumers"][0]["status"], "PROCESSED", "{second}");
    assert_eq!(second["consumers"][0]["attempt_count"], 1, "{second}");
    let req = TestRequest::get()
        .uri(&format!("/ops/events/{}", uuid::Uuid::now_v7()))
        .insert_header(("Authorization", format!("Bearer {TOKEN}")))
        .to_request();
    let missing = actix_web::test::call_service(&app, req).await;
    assert_eq!(missing.status().as_u16(), 404);
    db.finish(&[&rt]).await;
}
