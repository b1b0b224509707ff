//! Error text is redacted before it is stored: a secret in a handler's or a transport's error
//! message never reaches a `last_error` column. Each test reads the stored text itself.

use crate::common;

use actix_outbox::redact::default_redactor;
use actix_outbox::transport::{BoxFuture, ExternalConfig, OutboxEvent, Transport, TransportError};
use actix_outbox::{HandlerError, OutboxRuntime, RetryPolicy, RuntimeConfig};
use common::*;
use diesel::sql_types::Text;
use diesel::QueryableByName;
use diesel_async::RunQueryDsl;

/// An error message that quotes a password, an e-mail address and a bearer token, none of
/// which any other rule of the default redactor would catch.
const LEAKY: &str = "charge failed for ann@example.com: POST https://api.example.com/v1/charges \
                     with password=hunter2 and Authorization: Bearer abc123XYZ was refused (402)";

/// `LEAKY` as the default redactor stores it: the rest of the message kept.
const REDACTED: &str = "charge failed for [redacted]: POST https://api.example.com/v1/charges \
                        with password=[redacted] and Authorization: Bearer [redacted] was refused (402)";

const SECRETS: [&str; 3] = ["ann@example.com", "hunter2", "abc123XYZ"];

#[derive(QueryableByName)]
struct Stored {
    #[diesel(sql_type = Text)]
    last_error: String,
}

/// The `last_error` of the one dead-lettered row of `table`, once there is one.
async fn dead_letter_error(db: &TestDb, table: &str) -> String {
    let dead = format!("SELECT count(*) AS n FROM {table} WHERE status = 'DEAD_LETTER'");
    assert_eq!(
        db.wait_for(&dead, 1, WAIT).await,
        1,
        "{table}: no dead letter"
    );
    let mut conn = db.pool.get().await.unwrap();
    let row: Stored = diesel::sql_query(format!(
        "SELECT last_error FROM {table} WHERE status = 'DEAD_LETTER'"
    ))
    .get_result(&mut conn)
    .await
    .unwrap();
    row.last_error
}

/// A runtime with one consumer whose handler fails every event with [`LEAKY`], dead-lettered
/// at its first attempt.
async fn leaky_consumer(db: &TestDb, config: RuntimeConfig) -> OutboxRuntime {
    OutboxRuntime::builder(db.pool.clone())
        .config(config)
        .consumer_fn(consumer("c1", 1), |_| async {
            Err::<(), _>(HandlerError::retry(LEAKY))
        })
        .start()
        .await
        .expect("start runtime")
}

#[actix_rt::test]
async fn a_secret_in_a_handlers_error_never_reaches_inbox_last_error() {
    let db = TestDb::new().await;
    let rt = leaky_consumer(&db, fast_runtime()).await;
    db.enqueue_one("o-1").await;
    let stored = dead_letter_error(&db, "actix_outbox.inbox_events").await;
    for secret in SECRETS {
        assert!(!stored.contains(secret), "{secret} stored in {stored}");
    }
    assert_eq!(stored, REDACTED);
    db.finish(&[&rt]).await;
}

#[actix_rt::test]
async fn an_applications_redactor_replaces_the_default_and_may_call_it() {
    let db = TestDb::new().await;
    let config = fast_runtime()
        .redact_errors(|message| default_redactor(message).replace("api.example.com", "[host]"));
    let rt = leaky_consumer(&db, config).await;
    db.enqueue_one("o-1").await;
    let stored = dead_letter_error(&db, "actix_outbox.inbox_events").await;
    assert_eq!(stored, REDACTED.replace("api.example.com", "[host]"));
    db.finish(&[&rt]).await;

    // One that does not call it stores what it returns, secrets and all: it is the only one.
    let db = TestDb::new().await;
    let rt = leaky_consumer(&db, fast_runtime().redact_errors(|m| m.to_uppercase())).await;
    db.enqueue_one("o-1").await;
    let stored = dead_letter_error(&db, "actix_outbox.inbox_events").await;
    assert_eq!(stored, LEAKY.to_uppercase());
    db.finish(&[&rt]).await;
}

/// A broker whose refusal quotes [`LEAKY`].
#[derive(Clone)]
struct LeakyBroker;

impl Transport for LeakyBroker {
    fn publish<'a>(&'a self, _: &'a OutboxEvent) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async { Err(TransportError::Retryable(LEAKY.into())) })
    }
}

#[actix_rt::test]
async fn a_secret_in_a_transports_error_never_reaches_outbox_last_error() {
    let db = TestDb::new().await;
    let external = ExternalConfig::default()
        .retry(RetryPolicy::fixed(1, std::time::Duration::from_millis(20)))
        .reap_interval(std::time::Duration::from_millis(50));
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .external_transport(LeakyBroker, external)
        .start()
        .await
        .expect("start runtime");
    db.enqueue_one("o-1").await;
    let stored = dead_letter_error(&db, "actix_outbox.outbox_events").await;
    for secret in SECRETS {
        assert!(!stored.contains(secret), "{secret} stored in {stored}");
    }
    assert_eq!(stored, format!("publish failed: {REDACTED}"));
    db.finish(&[&rt]).await;
}
