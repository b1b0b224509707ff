//! Network faults: connections that stop answering without being closed (a hung proxy, a
//! failover without a reset, an expired NAT entry). The runtime's pool goes through a TCP
//! proxy that can freeze every open connection; events are produced through a direct
//! connection meanwhile. Nothing may be lost or doubled, and delivery must resume on fresh
//! connections within a bound.
//!
//! The proxy acknowledges everything it receives, so TCP keepalive and `tcp_user_timeout`
//! cannot notice the freeze: these tests exercise the runtime's own bound on each round trip.

use crate::common;
#[path = "../common/proxy.rs"]
mod proxy;

use std::time::{Duration, Instant};

use actix_outbox::{db::ConnectionConfig, transport::ExternalConfig, OutboxRuntime};
use common::*;
use proxy::Proxy;

/// `host:port` of the server in `url`.
fn server_addr(url: &str) -> String {
    let rest = &url[url.find("://").expect("a URL") + 3..];
    let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:5432")
    }
}

/// The runtime's bound on one round trip (`store::DB_TIMEOUT`).
const DB_TIMEOUT: Duration = Duration::from_secs(20);

/// How long after the freeze the publisher may take to have published every event: the bound
/// on the claim that hung, the check of the pool's idle connections, and a few claims.
const PUBLISHED_WITHIN: Duration = Duration::from_secs(DB_TIMEOUT.as_secs() + 10);

/// How long the runtime may keep a dead `LISTEN` connection: its quiet period before a
/// heartbeat (10 s), the heartbeat's bound, and the supervisor's restart.
const LISTENER_BACK_WITHIN: Duration = Duration::from_secs(10 + DB_TIMEOUT.as_secs() + 5);

/// How long after the freeze every event may take to be processed: the runtime's bound on the
/// round trips that were in flight (after which their connections are closed and the idle
/// ones checked), the server ending the frozen sessions' transactions (their row locks hold
/// the rows they claimed until then; 5 s here), and the backlog.
const RESUME_WITHIN: Duration = Duration::from_secs(DB_TIMEOUT.as_secs() + 20);

const PUBLISHED: &str =
    "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'PUBLISHED'";

/// Subscribes `x1` and `x2`, which no runtime runs: fan-out writes their inbox rows and nothing
/// consumes them, so a test of the publisher does not depend on the consumer engine.
async fn subscribe_bystanders(db: &TestDb) {
    use diesel_async::SimpleAsyncConnection;
    db.pool
        .get()
        .await
        .unwrap()
        .batch_execute(
            "INSERT INTO actix_outbox.consumer_states (consumer) VALUES ('x1'), ('x2'); \
             INSERT INTO actix_outbox.consumer_subscriptions (consumer, event_type) \
                 SELECT consumer, 'ORDER_STATUS_CHANGED' FROM actix_outbox.consumer_states",
        )
        .await
        .unwrap();
}

/// Sessions of this database whose last statement was the listener's `LISTEN`.
fn listening(db: &TestDb) -> String {
    format!(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = '{}' \
         AND query LIKE 'LISTEN%'",
        db.name
    )
}

/// Network settings for the test: the server ends a frozen session's open transaction after
/// 5 s instead of the default 60 s, so the test does not wait a minute for its locks.
fn network() -> ConnectionConfig {
    let mut net = ConnectionConfig::default();
    net.idle_in_transaction_timeout = Some(Duration::from_secs(5));
    net
}

/// Events in business transactions of five, `rounds` times, 25 ms apart: a steady stream, so
/// that claims and batches are in flight whenever the network goes.
async fn stream(db: &TestDb, rounds: usize, prefix: &str) {
    for k in 0..rounds {
        db.produce_batched(5, 5, &format!("{prefix}{k}")).await;
        actix_rt::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Pairs of (event, consumer) with no effect, or with more than one, over every outbox event
/// and both consumers.
async fn missing_and_doubled(db: &TestDb) -> (i64, i64) {
    let missing = db
        .count(
            "SELECT count(*) AS n FROM actix_outbox.outbox_events o \
             CROSS JOIN (VALUES ('net-one'), ('net-batch')) AS c(name) \
             WHERE NOT EXISTS (SELECT 1 FROM effects e \
                               WHERE e.event_id = o.id AND e.consumer = c.name)",
        )
        .await;
    let doubled = db
        .count(
            "SELECT count(*) AS n FROM (SELECT 1 FROM effects GROUP BY consumer, event_id \
             HAVING count(*) > 1) d",
        )
        .await;
    (missing, doubled)
}

/// The publisher's claim hangs on a black-holed connection (and so would every claim on the
/// pool's other connections, all frozen with it). It gives up after its bound, closes the
/// connection, checks the idle ones, and goes on claiming on new connections: every event is
/// fanned out once, within the bound. The listener, whose connection hears nothing, is
/// replaced too.
#[actix_rt::test]
async fn a_publisher_on_a_black_holed_connection_resumes_on_a_new_one_within_its_bound() {
    let db = TestDb::new().await;
    subscribe_bystanders(&db).await;
    let proxy = Proxy::start(&server_addr(&db.url));
    let pool = actix_outbox::db::connect_with(&proxy.url(&db.url), 6, &network())
        .await
        .expect("pool through the proxy");
    let rt = OutboxRuntime::builder(pool)
        .config(fast_runtime())
        .start()
        .await
        .expect("start runtime");
    assert_eq!(db.wait_for(&listening(&db), 1, WAIT).await, 1);

    within(WAIT, stream(&db, 20, "before-")).await;
    let frozen = proxy.freeze();
    let freeze = Instant::now();
    let accepted_at_freeze = proxy.accepted();
    within(WAIT, stream(&db, 20, "after-")).await;

    let left = PUBLISHED_WITHIN.saturating_sub(freeze.elapsed());
    let published = db.wait_for(PUBLISHED, 200, left).await;
    eprintln!(
        "froze {frozen} connections; all published {:?} after the freeze",
        freeze.elapsed()
    );
    assert_eq!(
        published, 200,
        "published within {PUBLISHED_WITHIN:?} of the freeze"
    );
    assert!(
        proxy.accepted() > accepted_at_freeze,
        "the publisher went on with new connections"
    );
    // Once per subscriber and event: a claim whose answer was lost committed whole or not at
    // all, and a repeated fan-out would have been refused by the inbox's unique key anyway.
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events")
            .await,
        400
    );

    // The frozen LISTEN session stays (the proxy keeps its socket); a new one joins it.
    let left = LISTENER_BACK_WITHIN.saturating_sub(freeze.elapsed());
    assert_eq!(
        db.wait_for(&listening(&db), 2, left).await,
        2,
        "a new listener within {LISTENER_BACK_WITHIN:?} of the freeze"
    );

    proxy.close_frozen();
    db.finish(&[&rt]).await;
}

/// The external route: lease claims and fenced marks on black-holed connections. Each is
/// bounded; a lease whose claim or mark got no answer expires and is reaped, and the event is
/// published again (a duplicate the inbox absorbs). Every event ends PUBLISHED, and reaches
/// each subscriber's inbox once.
#[actix_rt::test]
async fn the_external_route_on_a_black_holed_connection_resumes_within_its_bound() {
    use actix_outbox::testing::ScriptedTransport;
    let db = TestDb::new().await;
    subscribe_bystanders(&db).await;
    let proxy = Proxy::start(&server_addr(&db.url));
    let pool = actix_outbox::db::connect_with(&proxy.url(&db.url), 12, &network())
        .await
        .expect("pool through the proxy");
    // The broker side writes through a connection of its own, not through the proxy.
    let transport = ScriptedTransport::new(db.pool.clone());
    let external = ExternalConfig::default()
        .lease(Duration::from_secs(3))
        .publish_timeout(Duration::from_secs(1))
        .reap_interval(Duration::from_millis(200))
        .batch_size(20);
    let rt = OutboxRuntime::builder(pool)
        .config(fast_runtime())
        .external_transport(transport, external)
        .start()
        .await
        .expect("start runtime");

    within(WAIT, stream(&db, 20, "before-")).await;
    let freeze = Instant::now();
    proxy.freeze();
    within(WAIT, stream(&db, 20, "after-")).await;

    // A lease taken by a claim whose answer was lost outlives the freeze by its length.
    let bound = PUBLISHED_WITHIN + Duration::from_secs(3);
    let published = db
        .wait_for(PUBLISHED, 200, bound.saturating_sub(freeze.elapsed()))
        .await;
    eprintln!("all published {:?} after the freeze", freeze.elapsed());
    assert_eq!(published, 200, "published within {bound:?} of the freeze");
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events")
            .await,
        400,
        "each event once in each subscriber's inbox"
    );

    proxy.close_frozen();
    db.finish(&[&rt]).await;
}

/// Every connection of the runtime stops answering at once, in the middle of a stream of
/// events: the publisher is claiming, batches of both consumers are open. The runtime gives up
/// on them after its bound, closes them, and carries on with new connections; every event is
/// processed exactly once by each consumer.
#[actix_rt::test]
async fn a_black_holed_network_is_left_behind_and_nothing_is_lost_or_doubled() {
    black_holed_network(false).await;
}

/// The same with both consumers reading through cursors (storage v2): a batch's lease and its
/// cursor's move sit on a frozen connection, and the reaper promotes what it cannot settle.
/// Processed means an effect here, since a cursor consumer has no inbox row per event.
#[actix_rt::test]
async fn a_black_holed_network_is_left_behind_by_cursor_consumers_and_nothing_is_lost_or_doubled() {
    black_holed_network(true).await;
}

async fn black_holed_network(cursor: bool) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("actix_outbox=info")
        .with_test_writer()
        .try_init();
    let db = TestDb::new().await;
    let proxy = Proxy::start(&server_addr(&db.url));
    let pool = actix_outbox::db::connect_with(&proxy.url(&db.url), 12, &network())
        .await
        .expect("pool through the proxy");
    // Per-event deliveries of 10 ms in transactions of ten: a batch is open most of the time.
    let slow = Behaviour {
        work: Duration::from_millis(10),
        ..Behaviour::default()
    };
    let rt = OutboxRuntime::builder(pool)
        .config(fast_runtime())
        // A handler stuck in a statement on a frozen connection holds its row until its
        // session is gone (`idle_in_transaction_session_timeout`, 5 s here) and its timeout
        // has passed: short here, within the bound the test allows.
        .consumer(
            consumer("net-one", 5)
                .cursor(cursor)
                .batch_size(10)
                .handler_timeout(Duration::from_secs(2))
                .lease(Duration::from_secs(8)),
            move || Recorder {
                name: "net-one".into(),
                behaviour: slow.clone(),
            },
        )
        .batch_consumer(
            consumer("net-batch", 5)
                .cursor(cursor)
                .batch_size(50)
                .handler_timeout(Duration::from_secs(2))
                .lease(Duration::from_secs(8)),
            || BatchRecorder {
                name: "net-batch".into(),
                behaviour: Behaviour::default(),
            },
        )
        .start()
        .await
        .expect("start runtime");

    within(WAIT, stream(&db, 30, "before-")).await;
    let frozen = proxy.freeze();
    let freeze = Instant::now();
    let processed = match cursor {
        false => "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'",
        true => "SELECT count(*) AS n FROM (SELECT DISTINCT consumer, event_id FROM effects) e",
    };
    let done_at_freeze = db.count(processed).await;
    let accepted_at_freeze = proxy.accepted();
    // The stream goes on through the direct connection while the runtime's are black holes.
    within(WAIT, stream(&db, 30, "after-")).await;
    let produced = db
        .count("SELECT count(*) AS n FROM actix_outbox.outbox_events")
        .await;
    assert_eq!(produced, 300);

    let left = RESUME_WITHIN.saturating_sub(freeze.elapsed());
    let seen = db.wait_for(processed, 2 * produced, left).await;
    let took = freeze.elapsed();
    eprintln!(
        "froze {frozen} connections with {done_at_freeze} of {} deliveries done; all done \
         {took:?} after the freeze; {} connections made since",
        2 * produced,
        proxy.accepted() - accepted_at_freeze
    );
    if seen != 2 * produced {
        debug_dump(&db).await;
    }
    assert_eq!(
        seen,
        2 * produced,
        "every event processed by both consumers within {RESUME_WITHIN:?} of the freeze"
    );
    assert!(
        done_at_freeze < 2 * produced,
        "the freeze came while deliveries were under way"
    );
    assert!(
        proxy.accepted() > accepted_at_freeze,
        "delivery resumed on new connections"
    );
    assert_eq!(missing_and_doubled(&db).await, (0, 0));
    for name in ["net-one", "net-batch"] {
        assert_eq!(read_through_cursors(&db, name).await, cursor, "{name}");
    }
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status <> 'PUBLISHED'"
        )
        .await,
        0
    );

    // The frozen sockets would keep their sessions (one of them listening) for ever.
    proxy.close_frozen();
    db.finish(&[&rt]).await;
}

#[derive(diesel::QueryableByName, Debug)]
struct Row {
    #[diesel(sql_type = diesel::sql_types::Text)]
    r: String,
}

async fn debug_dump(db: &TestDb) {
    use diesel_async::RunQueryDsl;
    let mut conn = db.pool.get().await.unwrap();
    for q in [
        "SELECT status || ' ' || count(*) AS r FROM actix_outbox.outbox_events GROUP BY status",
        "SELECT consumer || ' ' || status || ' ' || count(*) || ' att ' || max(attempt_count) AS r FROM actix_outbox.inbox_events GROUP BY consumer, status",
        &format!("SELECT pid || ' ' || coalesce(state,'') || ' ' || coalesce(wait_event,'') || ' ' || now() - state_change || ' ' || left(query, 60) AS r FROM pg_stat_activity WHERE datname = '{}'", db.name),
        "SELECT coalesce(error_code,'') || ' ' || coalesce(left(last_error,80),'') AS r FROM actix_outbox.inbox_events WHERE last_error IS NOT NULL LIMIT 5",
    ] {
        let rows: Vec<Row> = diesel::sql_query(q).load(&mut conn).await.unwrap();
        for r in rows { eprintln!("  {}", r.r); }
    }
}

#[derive(diesel::QueryableByName)]
struct Settings {
    #[diesel(sql_type = diesel::sql_types::Text)]
    idle: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    keepalive: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    user_timeout: String,
}

async fn settings(pool: &actix_outbox::PgPool) -> (String, String, String) {
    use diesel_async::RunQueryDsl;
    let mut conn = pool.get().await.unwrap();
    let s: Settings = diesel::sql_query(
        "SELECT current_setting('idle_in_transaction_session_timeout') AS idle, \
                current_setting('tcp_keepalives_idle') AS keepalive, \
                current_setting('tcp_user_timeout') AS user_timeout",
    )
    .get_result(&mut conn)
    .await
    .unwrap();
    (s.idle, s.keepalive, s.user_timeout)
}

/// A pool's connections get the server-side settings, except where the server has a value of
/// its own (here one set on the database), which a DBA chose on purpose.
#[actix_rt::test]
async fn connections_get_the_server_side_settings_the_server_does_not_set_itself() {
    use diesel_async::SimpleAsyncConnection;
    let db = TestDb::new().await;
    let pool = actix_outbox::db::connect_with(&db.url, 2, &network())
        .await
        .unwrap();
    assert_eq!(
        settings(&pool).await,
        ("5s".to_owned(), "10".to_owned(), "20000".to_owned())
    );
    db.pool
        .get()
        .await
        .unwrap()
        .batch_execute(&format!(
            "ALTER DATABASE {} SET idle_in_transaction_session_timeout = '7min'",
            db.name
        ))
        .await
        .unwrap();
    let pool = actix_outbox::db::connect_with(&db.url, 2, &network())
        .await
        .unwrap();
    assert_eq!(settings(&pool).await.0, "7min");
    drop(pool);
    db.finish(&[]).await;
}
