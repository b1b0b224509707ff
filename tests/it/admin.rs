//! The operator API against real PostgreSQL, through actix-web's test service. Every assertion
//! about "nothing changed" compares a fingerprint of every outbox, inbox, consumer and audit row
//! taken before and after the request.

use crate::common;

use std::time::Duration;

use actix_outbox::{admin::admin_scope, admin::AdminConfig};
use actix_web::test::{init_service, TestRequest};
use actix_web::App;
use common::*;
use diesel::sql_types::{BigInt, Text};
use diesel::QueryableByName;
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use serde_json::{json, Value};

const TOKEN: &str = "alice-secret-token-0001";
const MARKER: &str = "SECRET-PAYLOAD-MARKER";

fn config(db: &TestDb) -> AdminConfig {
    AdminConfig::new(db.pool.clone())
        .bearer_token("alice", TOKEN)
        .unwrap()
}

fn get(uri: &str) -> TestRequest {
    TestRequest::get()
        .uri(uri)
        .insert_header(("Authorization", format!("Bearer {TOKEN}")))
}

fn post(uri: &str, body: Value) -> TestRequest {
    TestRequest::post()
        .uri(uri)
        .insert_header(("Authorization", format!("Bearer {TOKEN}")))
        .insert_header(("Content-Type", "application/json"))
        .set_payload(body.to_string())
}

fn json_of(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// Asserts a JSON error with `status` and `code`, and returns its message.
fn assert_error(got: &(u16, String), status: u16, code: &str) -> String {
    assert_eq!(got.0, status, "{}", got.1);
    let v = json_of(&got.1);
    assert_eq!(v["error"]["code"], code, "{}", got.1);
    let message = v["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(!message.is_empty(), "an error names the problem: {}", got.1);
    message
}

#[derive(QueryableByName)]
struct TextRow {
    #[diesel(sql_type = Text)]
    s: String,
}

async fn text(db: &TestDb, sql: &str) -> String {
    let mut conn = db.pool.get().await.unwrap();
    let r: TextRow = diesel::sql_query(sql)
        .get_result(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    r.s
}

/// Every column an action could touch, of every row, plus the audit trail's size.
async fn fingerprint(db: &TestDb) -> String {
    text(
        db,
        "SELECT coalesce((SELECT string_agg(concat_ws('|', id, status, attempt_count, next_attempt_at, \
                 updated_at, locked_by), ',' ORDER BY id) FROM actix_outbox.outbox_events), '') \
             || '#' || coalesce((SELECT string_agg(concat_ws('|', id, status, attempt_count, \
                 next_attempt_at, updated_at), ',' ORDER BY id) FROM actix_outbox.inbox_events), '') \
             || '#' || coalesce((SELECT string_agg(concat_ws('|', consumer, paused, paused_by, reason, \
                 updated_at), ',' ORDER BY consumer) FROM actix_outbox.consumer_states), '') \
             || '#' || coalesce((SELECT string_agg(consumer || '|' || event_type, ',' \
                 ORDER BY consumer, event_type) FROM actix_outbox.consumer_subscriptions), '') \
             || '#' || (SELECT count(*) FROM actix_outbox.admin_audit) AS s",
    )
    .await
}

/// Ids of the seeded rows.
struct Seed {
    outbox_published: uuid::Uuid,
    outbox_dead: uuid::Uuid,
    outbox_pending: uuid::Uuid,
    /// Three of `mail`'s dead letters.
    inbox_dead: Vec<i64>,
    inbox_processed: i64,
    inbox_retry: i64,
    stats_processed: i64,
}

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// Two consumers, outbox rows in three states and inbox rows in four, all of one correlation
/// (`corr-1`), every payload carrying [`MARKER`].
async fn seed(db: &TestDb) -> Seed {
    let (published, dead, pending) = (
        uuid::Uuid::now_v7(),
        uuid::Uuid::now_v7(),
        uuid::Uuid::now_v7(),
    );
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(&format!(
        "INSERT INTO actix_outbox.consumer_states (consumer) VALUES ('mail'), ('stats');
         INSERT INTO actix_outbox.consumer_subscriptions (consumer, event_type)
             VALUES ('mail', 'ORDER_STATUS_CHANGED'), ('stats', 'ORDER_STATUS_CHANGED');
         INSERT INTO actix_outbox.outbox_events (id, event_type, aggregate_type, aggregate_id, aggregate_version,
                 payload, correlation_id, status, attempt_count, error_code, last_error, published_at,
                 created_at)
         VALUES ('{published}', 'ORDER_STATUS_CHANGED', 'order', 'o-1', 2, '{{\"email\": \"{MARKER}\"}}',
                 'corr-1', 'PUBLISHED', 1, NULL, NULL, now(), now() - interval '3 minutes'),
                ('{dead}', 'ORDER_SHIPPED', 'order', 'o-2', 3, '{{\"email\": \"{MARKER}\"}}',
                 'corr-1', 'DEAD_LETTER', 5, 'OUTBOX_PUBLISH_FAILED', 'broker refused', NULL,
                 now() - interval '2 minutes'),
                ('{pending}', 'ORDER_STATUS_CHANGED', 'order', 'o-3', 1, '{{\"email\": \"{MARKER}\"}}',
                 'corr-2', 'PENDING', 0, NULL, NULL, NULL, now());
         INSERT INTO actix_outbox.inbox_events (event_id, consumer, event_type, event_version, aggregate_type,
                 aggregate_id, payload, correlation_id, event_created_at, status, attempt_count,
                 error_code, last_error, processed_at, next_attempt_at, received_at)
         SELECT '{published}', c, 'ORDER_STATUS_CHANGED', 1, 'order', 'o-1',
                '{{\"email\": \"{MARKER}\"}}', 'corr-1', now() - interval '3 minutes', s, a, e, m, p,
                now() + interval '1 hour', now() - interval '1 minute'
         FROM (VALUES ('stats', 'PROCESSED', 1, NULL, NULL, now())) v(c, s, a, e, m, p);
         INSERT INTO actix_outbox.inbox_events (event_id, consumer, event_type, event_version, aggregate_type,
                 aggregate_id, payload, correlation_id, event_created_at, status, attempt_count,
                 error_code, last_error, processed_at, next_attempt_at)
         SELECT gen_random_uuid(), 'mail', 'ORDER_STATUS_CHANGED', 1, 'order', 'o-' || i,
                '{{\"email\": \"{MARKER}\"}}', 'corr-9', now() - interval '5 minutes', s, a, e, m, p,
                now() + interval '1 hour'
         FROM (VALUES (10, 'DEAD_LETTER', 5, 'INBOX_CONSUMER_FAILED', 'smtp down', NULL::timestamptz),
                      (11, 'DEAD_LETTER', 5, 'INBOX_CONSUMER_FAILED', 'smtp down', NULL),
                      (12, 'DEAD_LETTER', 1, 'EVENT_SCHEMA_INVALID', 'bad payload', NULL),
                      (13, 'PROCESSED', 1, NULL, NULL, now()),
                      (14, 'RETRY_PENDING', 2, 'INBOX_CONSUMER_FAILED', 'timeout', NULL))
              v(i, s, a, e, m, p);"
    ))
    .await
    .unwrap();
    let ids = |sql: &'static str| {
        let pool = db.pool.clone();
        async move {
            let mut conn = pool.get().await.unwrap();
            diesel::sql_query(sql)
                .load::<Id>(&mut conn)
                .await
                .unwrap()
                .into_iter()
                .map(|r| r.id)
                .collect::<Vec<_>>()
        }
    };
    Seed {
        outbox_published: published,
        outbox_dead: dead,
        outbox_pending: pending,
        inbox_dead: ids("SELECT id FROM actix_outbox.inbox_events WHERE consumer = 'mail' AND status = 'DEAD_LETTER' ORDER BY id").await,
        inbox_processed: ids("SELECT id FROM actix_outbox.inbox_events WHERE consumer = 'mail' AND status = 'PROCESSED'").await[0],
        inbox_retry: ids("SELECT id FROM actix_outbox.inbox_events WHERE status = 'RETRY_PENDING'").await[0],
        stats_processed: ids("SELECT id FROM actix_outbox.inbox_events WHERE consumer = 'stats'").await[0],
    }
}

async fn audit_rows(db: &TestDb) -> i64 {
    db.count("SELECT count(*) AS n FROM actix_outbox.admin_audit")
        .await
}

#[actix_rt::test]
async fn requests_without_valid_credentials_get_401_and_touch_nothing() {
    let db = TestDb::new().await;
    let s = seed(&db).await;
    let app = init_service(App::new().service(admin_scope("/ops", config(&db)))).await;
    let before = fingerprint(&db).await;
    let dead = s.inbox_dead[0];
    let gets = [
        "/ops/health".to_owned(),
        "/ops/overview".into(),
        "/ops/metrics".into(),
        "/ops/outbox".into(),
        "/ops/inbox?status=DEAD_LETTER".into(),
        "/ops/consumers".into(),
        "/ops/blocked".into(),
        "/ops/replays".into(),
        "/ops/audit".into(),
        "/ops/timeline/corr-1".into(),
        "/ops/no-such-endpoint".into(),
    ];
    let posts = [
        (format!("/ops/inbox/{dead}/retry"), json!({})),
        (format!("/ops/outbox/{}/retry", s.outbox_dead), json!({})),
        (
            "/ops/inbox/retry".into(),
            json!({"ids": s.inbox_dead, "confirm": "RETRY 3"}),
        ),
        (
            "/ops/outbox/retry".into(),
            json!({"ids": [s.outbox_dead], "confirm": "RETRY 1"}),
        ),
        (format!("/ops/inbox/{dead}/ignore"), json!({"reason": "x"})),
        (
            format!("/ops/outbox/{}/ignore", s.outbox_dead),
            json!({"reason": "x"}),
        ),
        ("/ops/consumers/mail/pause".into(), json!({"reason": "x"})),
        ("/ops/consumers/mail/resume".into(), json!({})),
        ("/ops/consumers/mail/replay".into(), json!({"reason": "x"})),
        ("/ops/replays/1/cancel".into(), json!({})),
        (
            "/ops/consumers/mail/subscriptions/ORDER_STATUS_CHANGED/remove".into(),
            json!({"reason": "x"}),
        ),
    ];
    let credentials: [Option<String>; 5] = [
        None,
        Some("Bearer wrong-token-0000000000".into()),
        Some(format!("Basic {TOKEN}")),
        Some(TOKEN.into()),
        Some(format!("Bearer {TOKEN}x")),
    ];
    for cred in &credentials {
        let with = |r: TestRequest| match cred {
            Some(c) => r.insert_header(("Authorization", c.as_str())),
            None => r,
        };
        for uri in &gets {
            let got = call!(app, with(TestRequest::get().uri(uri)));
            assert_error(&got, 401, "ADMIN_UNAUTHORIZED");
            assert!(!got.1.contains(MARKER));
        }
        for (uri, body) in &posts {
            let req = with(
                TestRequest::post()
                    .uri(uri)
                    .insert_header(("Content-Type", "application/json"))
                    .set_payload(body.to_string()),
            );
            let got = call!(app, req);
            assert_error(&got, 401, "ADMIN_UNAUTHORIZED");
        }
    }
    assert_eq!(
        fingerprint(&db).await,
        before,
        "a refused request changed something"
    );
    assert_eq!(audit_rows(&db).await, 0);

    // The page itself carries no data and is the one thing served without credentials.
    for uri in ["/ops/", "/ops"] {
        let (status, body) = call!(app, TestRequest::get().uri(uri));
        assert_eq!(status, 200, "{uri}");
        assert!(body.contains("<html") && !body.contains(MARKER));
    }
    // A config without tokens refuses even a token that would otherwise be right.
    let closed =
        init_service(App::new().service(admin_scope("/ops", AdminConfig::new(db.pool.clone()))))
            .await;
    assert_error(
        &call!(closed, get("/ops/overview")),
        401,
        "ADMIN_UNAUTHORIZED",
    );
    // Tokens that can be guessed are refused at configuration.
    assert!(AdminConfig::new(db.pool.clone())
        .bearer_token("bob", "short")
        .is_err());
    db.finish(&[]).await;
}

#[actix_rt::test]
async fn a_custom_guard_replaces_the_tokens() {
    let db = TestDb::new().await;
    let s = seed(&db).await;
    let cfg = config(&db).guard(|req| {
        req.headers()
            .get("x-authenticated-user")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    });
    let app = init_service(App::new().service(admin_scope("/ops", cfg))).await;
    // The bearer token alone no longer opens anything.
    assert_error(&call!(app, get("/ops/overview")), 401, "ADMIN_UNAUTHORIZED");
    let req = TestRequest::post()
        .uri(&format!("/ops/inbox/{}/retry", s.inbox_dead[0]))
        .insert_header(("x-authenticated-user", "carol"));
    let (status, body) = call!(app, req);
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        text(&db, "SELECT who AS s FROM actix_outbox.admin_audit").await,
        "carol",
        "the guard's name is the audit's who"
    );
    db.finish(&[]).await;
}

/// With a guard that reads a session cookie, a browser would send the operator's credentials
/// with a form posted from any other site's page. Actions sent from another site are refused,
/// whatever their body, and change nothing; the page's own requests (same origin) and clients
/// that are not browsers go through.
#[actix_rt::test]
async fn an_action_sent_from_another_sites_page_is_refused() {
    let db = TestDb::new().await;
    let s = seed(&db).await;
    let cfg = config(&db).guard(|req| req.cookie("session").map(|c| c.value().to_owned()));
    let app = init_service(App::new().service(admin_scope("/ops", cfg))).await;
    let retry = format!("/ops/inbox/{}/retry", s.inbox_dead[0]);
    let before = fingerprint(&db).await;
    let forged = |headers: &[(&'static str, &'static str)]| {
        let mut req = TestRequest::post()
            .uri(&retry)
            .cookie(actix_web::cookie::Cookie::new("session", "carol"))
            .insert_header(("Content-Type", "text/plain"))
            .set_payload("{\"reason\":\"x\"}");
        for h in headers {
            req = req.insert_header(*h);
        }
        req
    };
    for headers in [
        &[("Sec-Fetch-Site", "cross-site")][..],
        &[("Sec-Fetch-Site", "same-site")][..],
        // An older browser: no Sec-Fetch-Site, but an Origin that is not the API's.
        &[("Origin", "https://evil.example")][..],
        &[("Origin", "null")][..],
    ] {
        assert_error(&call!(app, forged(headers)), 403, "ADMIN_CROSS_SITE");
    }
    assert_eq!(
        fingerprint(&db).await,
        before,
        "a forged action changed something"
    );
    // Reading is not an action.
    let read = TestRequest::get()
        .uri("/ops/overview")
        .cookie(actix_web::cookie::Cookie::new("session", "carol"))
        .insert_header(("Sec-Fetch-Site", "cross-site"));
    assert_eq!(call!(app, read).0, 200);
    // The page's own request goes through, and so does a client that is not a browser.
    let (status, body) = call!(app, forged(&[("Sec-Fetch-Site", "same-origin")]));
    assert_eq!(status, 200, "{body}");
    let script = TestRequest::post()
        .uri(&format!("/ops/inbox/{}/retry", s.inbox_dead[1]))
        .cookie(actix_web::cookie::Cookie::new("session", "carol"));
    let (status, body) = call!(app, script);
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.admin_audit")
            .await,
        2,
        "the two admitted actions, audited"
    );
    db.finish(&[]).await;
}

/// A row held by a consumer batch in progress (here: a transaction that locks it and hangs,
/// like a handler past its timeout) is waited for a moment, then the action is refused with
/// `ROW_BUSY` and changes nothing; once the row is free, the action goes through.
#[actix_rt::test]
async fn an_action_on_a_row_a_batch_holds_is_refused_as_busy_not_left_waiting() {
    let db = TestDb::new().await;
    let s = seed(&db).await;
    let app = init_service(App::new().service(admin_scope("/ops", config(&db)))).await;
    let id = s.inbox_dead[0];
    let mut holder = db.pool.get().await.unwrap();
    diesel_async::SimpleAsyncConnection::batch_execute(
        &mut *holder,
        &format!("BEGIN; SELECT 1 FROM actix_outbox.inbox_events WHERE id = {id} FOR UPDATE"),
    )
    .await
    .unwrap();
    let before = fingerprint(&db).await;
    let retry = format!("/ops/inbox/{id}/retry");
    let got = within(Duration::from_secs(20), async {
        call!(app, post(&retry, json!({})))
    })
    .await;
    assert_error(&got, 409, "ROW_BUSY");
    let bulk = post(
        "/ops/inbox/retry",
        json!({"ids": [s.inbox_dead[1], id], "confirm": "RETRY 2"}),
    );
    assert_error(
        &within(Duration::from_secs(20), async { call!(app, bulk) }).await,
        409,
        "ROW_BUSY",
    );
    assert_eq!(
        fingerprint(&db).await,
        before,
        "a refused action changed something"
    );
    diesel_async::SimpleAsyncConnection::batch_execute(&mut *holder, "ROLLBACK")
        .await
        .unwrap();
    drop(holder);
    let (status, body) = call!(app, post(&retry, json!({})));
    assert_eq!(status, 200, "{body}");
    db.finish(&[]).await;
}

#[actix_rt::test]
async fn retrying_a_dead_letter_changes_exactly_that_row_and_audits_it() {
    let db = TestDb::new().await;
    let s = seed(&db).await;
    let app = init_service(App::new().service(admin_scope("/ops", config(&db)))).await;
    let id = s.inbox_dead[0];
    let others = format!(
        "SELECT string_agg(concat_ws('|', id, status, attempt_count, next_attempt_at, updated_at), ',' ORDER BY id) AS s \
         FROM actix_outbox.inbox_events WHERE id <> {id}"
    );
    let others_before = text(&db, &others).await;
    let outbox_before = text(&db, "SELECT string_agg(concat_ws('|', id, status, updated_at), ',' ORDER BY id) AS s FROM actix_outbox.outbox_events").await;

    let got = call!(
        app,
        post(
            &format!("/ops/inbox/{id}/retry"),
            json!({"reason": "smtp fixed"})
        )
    );
    assert_eq!(got.0, 200, "{}", got.1);
    let v = json_of(&got.1);
    assert_eq!(v["action"], "inbox.retry");
    assert_eq!(v["changed"], 1);
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE id = {id} AND status = 'RETRY_PENDING' \
             AND attempt_count = 5 AND next_attempt_at <= now()"
        ))
        .await,
        1,
        "due now, attempt count kept"
    );
    assert_eq!(
        text(&db, &others).await,
        others_before,
        "no other inbox row changed"
    );
    assert_eq!(
        text(&db, "SELECT string_agg(concat_ws('|', id, status, updated_at), ',' ORDER BY id) AS s FROM actix_outbox.outbox_events").await,
        outbox_before
    );
    assert_eq!(audit_rows(&db).await, 1);
    assert_eq!(
        text(
            &db,
            "SELECT concat_ws('|', who, action, target, reason, details->'rows'->0->>'status', \
                 details->'rows'->0->>'attempt_count') AS s FROM actix_outbox.admin_audit"
        )
        .await,
        format!("alice|inbox.retry|inbox:{id}|smtp fixed|DEAD_LETTER|5")
    );
    // Retrying it again: it is no longer a dead letter.
    let before = fingerprint(&db).await;
    let again = call!(app, post(&format!("/ops/inbox/{id}/retry"), json!({})));
    let msg = assert_error(&again, 409, "NOT_A_DEAD_LETTER");
    assert!(msg.contains("RETRY_PENDING"), "{msg}");
    assert_eq!(fingerprint(&db).await, before);

    // The outbox's dead letter goes back to PENDING for the publisher.
    let got = call!(
        app,
        post(&format!("/ops/outbox/{}/retry", s.outbox_dead), json!({}))
    );
    assert_eq!(got.0, 200, "{}", got.1);
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE id = '{}' AND status = 'PENDING' \
             AND attempt_count = 5 AND next_attempt_at <= now() AND locked_by IS NULL",
            s.outbox_dead
        ))
        .await,
        1
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'PUBLISHED'")
            .await,
        1
    );
    assert_eq!(audit_rows(&db).await, 2);
    assert_eq!(
        text(&db, "SELECT concat_ws('|', who, action, target) AS s FROM actix_outbox.admin_audit ORDER BY id DESC LIMIT 1").await,
        format!("alice|outbox.retry|outbox:{}", s.outbox_dead)
    );
    db.finish(&[]).await;
}

#[actix_rt::test]
async fn a_bulk_retry_is_bounded_confirmed_and_all_or_nothing() {
    let db = TestDb::new().await;
    let s = seed(&db).await;
    let app = init_service(App::new().service(admin_scope("/ops", config(&db)))).await;
    let before = fingerprint(&db).await;
    let two = &s.inbox_dead[..2];
    let too_many: Vec<i64> = (1..=101).collect();
    let refused = [
        (
            json!({"ids": two, "confirm": "RETRY 3"}),
            400,
            "CONFIRMATION_MISMATCH",
        ),
        (json!({"ids": two}), 400, "CONFIRMATION_MISMATCH"),
        (
            json!({"ids": two, "confirm": "yes"}),
            400,
            "CONFIRMATION_MISMATCH",
        ),
        (json!({"ids": [], "confirm": "RETRY 0"}), 400, "NO_IDS"),
        (json!({}), 400, "NO_IDS"),
        (
            json!({"ids": too_many, "confirm": "RETRY 101"}),
            400,
            "TOO_MANY_IDS",
        ),
        (
            json!({"ids": [two[0], two[0]], "confirm": "RETRY 2"}),
            400,
            "DUPLICATE_IDS",
        ),
        (
            json!({"ids": ["x"], "confirm": "RETRY 1"}),
            400,
            "INVALID_BODY",
        ),
        (
            json!({"ids": two, "confirm": "RETRY 2", "all": true}),
            400,
            "INVALID_BODY",
        ),
        // One row that is not a dead letter spoils the whole set.
        (
            json!({"ids": [two[0], two[1], s.inbox_processed], "confirm": "RETRY 3"}),
            409,
            "NOT_A_DEAD_LETTER",
        ),
        (
            json!({"ids": [two[0], 999_999], "confirm": "RETRY 2"}),
            404,
            "ROW_NOT_FOUND",
        ),
    ];
    for (body, status, code) in refused {
        let got = call!(app, post("/ops/inbox/retry", body.clone()));
        assert_error(&got, status, code);
        assert_eq!(fingerprint(&db).await, before, "{body} changed something");
    }
    let msg = assert_error(
        &call!(
            app,
            post(
                "/ops/inbox/retry",
                json!({"ids": [two[0], s.inbox_processed], "confirm": "RETRY 2"})
            )
        ),
        409,
        "NOT_A_DEAD_LETTER",
    );
    assert!(
        msg.contains(&format!("{} is PROCESSED", s.inbox_processed)),
        "{msg}"
    );

    let got = call!(
        app,
        post(
            "/ops/inbox/retry",
            json!({"ids": two, "confirm": "RETRY 2", "reason": "smtp back"})
        )
    );
    assert_eq!(got.0, 200, "{}", got.1);
    assert_eq!(json_of(&got.1)["changed"], 2);
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'RETRY_PENDING' \
                  AND next_attempt_at <= now() + interval '1 second'"
        )
        .await,
        2,
        "exactly the two named rows, the second a tenth of a second after the first at the \
         default pace (the seeded retry is due in an hour)"
    );
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'DEAD_LETTER'"
        )
        .await,
        1
    );
    assert_eq!(audit_rows(&db).await, 1, "one action, one audit row");
    assert_eq!(
        text(
            &db,
            "SELECT concat_ws('|', action, target, jsonb_array_length(details->'rows')) AS s FROM actix_outbox.admin_audit"
        )
        .await,
        "inbox.retry_set|inbox:[2 rows]|2"
    );

    // The outbox has the same bulk action.
    let got = call!(
        app,
        post(
            "/ops/outbox/retry",
            json!({"ids": [s.outbox_dead], "confirm": "RETRY 1"})
        )
    );
    assert_eq!(got.0, 200, "{}", got.1);
    let before = fingerprint(&db).await;
    let got = call!(
        app,
        post(
            "/ops/outbox/retry",
            json!({"ids": [s.outbox_published, s.outbox_pending], "confirm": "RETRY 2"})
        )
    );
    assert_error(&got, 409, "NOT_A_DEAD_LETTER");
    assert_eq!(fingerprint(&db).await, before);
    db.finish(&[]).await;
}

#[actix_rt::test]
async fn ignoring_needs_a_reason_and_takes_only_failed_rows() {
    let db = TestDb::new().await;
    let s = seed(&db).await;
    let app = init_service(App::new().service(admin_scope("/ops", config(&db)))).await;
    let before = fingerprint(&db).await;
    let id = s.inbox_dead[2];
    for body in [json!({}), json!({"reason": "   "})] {
        let got = call!(app, post(&format!("/ops/inbox/{id}/ignore"), body));
        assert_error(&got, 400, "REASON_REQUIRED");
    }
    let long = "x".repeat(1001);
    let got = call!(
        app,
        post(&format!("/ops/inbox/{id}/ignore"), json!({"reason": long}))
    );
    assert_error(&got, 400, "REASON_TOO_LONG");
    let got = call!(
        app,
        post(
            &format!("/ops/inbox/{}/ignore", s.inbox_processed),
            json!({"reason": "done already"})
        )
    );
    assert_error(&got, 409, "NOT_IGNORABLE");
    let got = call!(
        app,
        post(
            &format!("/ops/outbox/{}/ignore", s.outbox_published),
            json!({"reason": "x"})
        )
    );
    assert_error(&got, 409, "NOT_IGNORABLE");
    assert_eq!(fingerprint(&db).await, before);

    let got = call!(
        app,
        post(
            &format!("/ops/inbox/{id}/ignore"),
            json!({"reason": "customer deleted the order"})
        )
    );
    assert_eq!(got.0, 200, "{}", got.1);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'IGNORED'")
            .await,
        1
    );
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE id = {id} AND status = 'IGNORED' \
             AND error_code = 'EVENT_SCHEMA_INVALID'"
        ))
        .await,
        1,
        "the failure it was ignored for stays readable"
    );
    // A row waiting for a retry may be ignored too.
    let got = call!(
        app,
        post(
            &format!("/ops/inbox/{}/ignore", s.inbox_retry),
            json!({"reason": "obsolete"})
        )
    );
    assert_eq!(got.0, 200, "{}", got.1);
    let got = call!(
        app,
        post(
            &format!("/ops/outbox/{}/ignore", s.outbox_dead),
            json!({"reason": "never ship"})
        )
    );
    assert_eq!(got.0, 200, "{}", got.1);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'IGNORED'")
            .await,
        1
    );
    assert_eq!(audit_rows(&db).await, 3);
    assert_eq!(
        text(
            &db,
            &format!("SELECT concat_ws('|', who, action, target, reason) AS s FROM actix_outbox.admin_audit WHERE target = 'inbox:{id}'")
        )
        .await,
        format!("alice|inbox.ignore|inbox:{id}|customer deleted the order")
    );
    db.finish(&[]).await;
}

#[actix_rt::test]
async fn pause_and_resume_use_the_pause_switch_and_are_audited() {
    let db = TestDb::new().await;
    seed(&db).await;
    let app = init_service(App::new().service(admin_scope("/ops", config(&db)))).await;
    let before = fingerprint(&db).await;
    assert_error(
        &call!(app, post("/ops/consumers/nobody/resume", json!({}))),
        404,
        "CONSUMER_UNKNOWN",
    );
    assert_error(
        &call!(app, post("/ops/consumers/mail/pause", json!({}))),
        400,
        "REASON_REQUIRED",
    );
    for until in ["tomorrow", "2020-01-01T00:00:00Z"] {
        assert_error(
            &call!(
                app,
                post(
                    "/ops/consumers/mail/pause",
                    json!({"reason": "x", "until": until})
                )
            ),
            400,
            "INVALID_BODY",
        );
    }
    assert_error(
        &call!(
            app,
            post("/ops/consumers/bad%20name/pause", json!({"reason": "x"}))
        ),
        400,
        "INVALID_CONSUMER",
    );
    assert_eq!(fingerprint(&db).await, before);

    let got = call!(
        app,
        post(
            "/ops/consumers/mail/pause",
            json!({"reason": "smtp maintenance"})
        )
    );
    assert_eq!(got.0, 200, "{}", got.1);
    assert_eq!(
        text(&db, "SELECT concat_ws('|', paused, paused_by, reason) AS s FROM actix_outbox.consumer_states WHERE consumer = 'mail'").await,
        "t|alice|smtp maintenance"
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.consumer_states WHERE paused")
            .await,
        1,
        "only mail"
    );
    let got = call!(app, post("/ops/consumers/mail/resume", json!({})));
    assert_eq!(got.0, 200, "{}", got.1);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.consumer_states WHERE paused")
            .await,
        0
    );
    assert_eq!(
        text(
            &db,
            "SELECT string_agg(concat_ws('|', action, target, details->>'paused'), ',' ORDER BY id) AS s FROM actix_outbox.admin_audit"
        )
        .await,
        "consumer.pause|consumer:mail|false,consumer.resume|consumer:mail|true"
    );
    // A consumer no runtime has registered yet can be paused, with an end: it will start
    // paused, and the list says who paused it, why and until when.
    let until = (chrono::Utc::now() + chrono::TimeDelta::hours(2)).to_rfc3339();
    let got = call!(
        app,
        post(
            "/ops/consumers/newcomer/pause",
            json!({"reason": "ships switched off", "until": until})
        )
    );
    assert_eq!(got.0, 200, "{}", got.1);
    let listed = json_of(&call!(app, get("/ops/consumers")).1);
    let newcomer = &listed["items"][1];
    assert_eq!(newcomer["consumer"], "newcomer");
    assert_eq!(newcomer["paused"], true);
    assert_eq!(newcomer["paused_by"], "alice");
    assert_eq!(newcomer["reason"], "ships switched off");
    let at = newcomer["paused_until"].as_str().unwrap();
    let at = chrono::DateTime::parse_from_rfc3339(at).unwrap();
    let want = chrono::DateTime::parse_from_rfc3339(&until).unwrap();
    assert!((at - want).num_milliseconds().abs() < 1, "{at} vs {want}");
    assert_eq!(listed["items"][0]["consumer"], "mail");
    assert_eq!(
        listed["items"][0]["subscriptions"][0],
        "ORDER_STATUS_CHANGED"
    );
    db.finish(&[]).await;
}

#[actix_rt::test]
async fn a_replay_is_refused_unless_safe_checked_listed_cancelled_and_audited() {
    let db = TestDb::new().await;
    seed(&db).await;
    let app = init_service(App::new().service(admin_scope("/ops", config(&db)))).await;
    let replays = "SELECT count(*) AS n FROM actix_outbox.replays";
    let ask = |body: Value| post("/ops/consumers/mail/replay", body);
    assert_error(
        &call!(app, ask(json!({"reason": "rebuild"}))),
        409,
        "CONSUMER_NOT_REPLAY_SAFE",
    );
    assert_error(
        &call!(
            app,
            post("/ops/consumers/nobody/replay", json!({"reason": "x"}))
        ),
        404,
        "CONSUMER_UNKNOWN",
    );
    // The consumer's code marks it safe when it registers; here, by hand.
    diesel::sql_query(
        "UPDATE actix_outbox.consumer_states SET replay_safe = true WHERE consumer = 'mail'",
    )
    .execute(&mut db.pool.get().await.unwrap())
    .await
    .unwrap();
    assert_error(&call!(app, ask(json!({}))), 400, "REASON_REQUIRED");
    assert_error(
        &call!(app, ask(json!({"reason": "x", "rate": 0}))),
        400,
        "REPLAY_INVALID",
    );
    assert_error(
        &call!(app, ask(json!({"reason": "x", "from": "yesterday"}))),
        400,
        "INVALID_BODY",
    );
    assert_error(
        &call!(
            app,
            ask(
                json!({"reason": "x", "from": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"})
            )
        ),
        400,
        "REPLAY_INVALID",
    );
    assert_error(
        &call!(app, ask(json!({"reason": "x", "speed": 3}))),
        400,
        "INVALID_BODY",
    );
    assert_eq!(db.count(replays).await, 0, "refused requests write nothing");
    assert_eq!(audit_rows(&db).await, 0);

    let processed = db
        .count("SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'mail' AND status = 'PROCESSED' AND error_code IS NULL")
        .await;
    let got = call!(
        app,
        ask(
            json!({"reason": "rebuild the projection", "event_types": ["ORDER_STATUS_CHANGED"], "rate": 5})
        )
    );
    assert_eq!(got.0, 200, "{}", got.1);
    let replay = json_of(&got.1);
    assert_eq!(replay["total"], processed);
    assert_eq!(replay["status"], "RUNNING");
    assert_eq!(replay["requested_by"], "alice");
    let id = replay["id"].as_i64().unwrap();

    let listed = json_of(&call!(app, get("/ops/replays?consumer=mail")).1);
    assert_eq!(listed["items"][0]["id"], id);
    assert_eq!(listed["items"][0]["done"], 0);
    let got = call!(app, post(&format!("/ops/replays/{id}/cancel"), json!({})));
    assert_eq!(got.0, 200, "{}", got.1);
    assert_eq!(json_of(&got.1)["status"], "CANCELLED");
    assert_error(
        &call!(app, post("/ops/replays/424242/cancel", json!({}))),
        404,
        "REPLAY_UNKNOWN",
    );
    assert_error(
        &call!(app, post("/ops/replays/x/cancel", json!({}))),
        400,
        "INVALID_ID",
    );
    assert_eq!(
        text(
            &db,
            "SELECT string_agg(concat_ws('|', who, action, target, reason), ',' ORDER BY id) AS s FROM actix_outbox.admin_audit"
        )
        .await,
        "alice|consumer.replay|consumer:mail|rebuild the projection,alice|consumer.replay.cancel|consumer:mail"
    );
}

#[actix_rt::test]
async fn removing_a_subscription_needs_a_reason_is_audited_and_touches_only_that_one() {
    let db = TestDb::new().await;
    seed(&db).await;
    let app = init_service(App::new().service(admin_scope("/ops", config(&db)))).await;
    let before = fingerprint(&db).await;
    let remove = |path: &str, body: serde_json::Value| post(path, body);
    assert_error(
        &call!(
            app,
            remove(
                "/ops/consumers/nobody/subscriptions/ORDER_STATUS_CHANGED/remove",
                json!({"reason": "x"})
            )
        ),
        404,
        "CONSUMER_UNKNOWN",
    );
    assert_error(
        &call!(
            app,
            remove(
                "/ops/consumers/mail/subscriptions/ORDER_CANCELLED/remove",
                json!({"reason": "x"})
            )
        ),
        404,
        "SUBSCRIPTION_NOT_FOUND",
    );
    assert_error(
        &call!(
            app,
            remove(
                "/ops/consumers/mail/subscriptions/ORDER_STATUS_CHANGED/remove",
                json!({})
            )
        ),
        400,
        "REASON_REQUIRED",
    );
    assert_eq!(
        fingerprint(&db).await,
        before,
        "refused actions change nothing"
    );

    let got = call!(
        app,
        remove(
            "/ops/consumers/mail/subscriptions/ORDER_STATUS_CHANGED/remove",
            json!({"reason": "mail no longer handles status changes"})
        )
    );
    assert_eq!(got.0, 200, "{}", got.1);
    assert_eq!(
        text(
            &db,
            "SELECT string_agg(consumer || '|' || event_type, ',') AS s FROM actix_outbox.consumer_subscriptions"
        )
        .await,
        "stats|ORDER_STATUS_CHANGED",
        "only mail's subscription is gone"
    );
    assert_eq!(
        text(
            &db,
            "SELECT concat_ws('|', who, action, target, reason, details->>'event_type') AS s FROM actix_outbox.admin_audit"
        )
        .await,
        "alice|consumer.unsubscribe|consumer:mail|mail no longer handles status changes|ORDER_STATUS_CHANGED"
    );
    let listed = json_of(&call!(app, get("/ops/consumers")).1);
    assert_eq!(listed["items"][0]["consumer"], "mail");
    assert_eq!(listed["items"][0]["subscriptions"], json!([]));
    db.finish(&[]).await;
}

#[actix_rt::test]
async fn bad_input_is_a_4xx_json_error_that_names_the_problem_and_changes_nothing() {
    let db = TestDb::new().await;
    let s = seed(&db).await;
    let app = init_service(App::new().service(admin_scope("/ops", config(&db)))).await;
    let before = fingerprint(&db).await;
    let cases: Vec<(TestRequest, u16, &str)> = vec![
        (get("/ops/inbox?status=DONE"), 400, "INVALID_STATUS"),
        (get("/ops/outbox?status=RECEIVED"), 400, "INVALID_STATUS"),
        (get("/ops/inbox?limit=500"), 400, "INVALID_LIMIT"),
        (get("/ops/inbox?limit=0"), 400, "INVALID_LIMIT"),
        (get("/ops/outbox?limit=many"), 400, "INVALID_LIMIT"),
        (get("/ops/outbox?consumer=mail"), 400, "INVALID_QUERY"),
        (get("/ops/inbox?stauts=DEAD_LETTER"), 400, "INVALID_QUERY"),
        (get("/ops/inbox?before=abc"), 400, "INVALID_CURSOR"),
        (get("/ops/outbox?before=42"), 400, "INVALID_CURSOR"),
        (get("/ops/inbox?consumer=a%20b"), 400, "INVALID_CONSUMER"),
        (
            get("/ops/timeline/nothing-here"),
            404,
            "CORRELATION_NOT_FOUND",
        ),
        (get("/ops/nowhere"), 404, "NOT_FOUND"),
        (get("/ops/inbox/1/retry"), 405, "METHOD_NOT_ALLOWED"),
        (post("/ops/health", json!({})), 405, "METHOD_NOT_ALLOWED"),
        (post("/ops/inbox/abc/retry", json!({})), 400, "INVALID_ID"),
        (post("/ops/inbox/-4/retry", json!({})), 400, "INVALID_ID"),
        (
            post("/ops/outbox/not-a-uuid/retry", json!({})),
            400,
            "INVALID_ID",
        ),
        (
            post("/ops/inbox/999999/retry", json!({})),
            404,
            "ROW_NOT_FOUND",
        ),
        (
            post(
                &format!("/ops/outbox/{}/retry", uuid::Uuid::now_v7()),
                json!({}),
            ),
            404,
            "ROW_NOT_FOUND",
        ),
        (
            post(
                &format!("/ops/inbox/{}/retry", s.inbox_processed),
                json!({}),
            ),
            409,
            "NOT_A_DEAD_LETTER",
        ),
        (
            post(
                &format!("/ops/outbox/{}/retry", s.outbox_pending),
                json!({}),
            ),
            409,
            "NOT_A_DEAD_LETTER",
        ),
        (
            post(
                &format!("/ops/inbox/{}/retry", s.inbox_dead[0]),
                json!({"reason": 7}),
            ),
            400,
            "INVALID_BODY",
        ),
        (
            post(
                &format!("/ops/inbox/{}/retry", s.inbox_dead[0]),
                json!({"force": true}),
            ),
            400,
            "INVALID_BODY",
        ),
        (get("/ops/metrics"), 404, "METRICS_NOT_CONFIGURED"),
        // What PostgreSQL would refuse is bad input, not a database failure.
        (get("/ops/outbox?type=A%00B"), 400, "INVALID_QUERY"),
        (
            post(
                "/ops/consumers/mail/subscriptions/A%00B/remove",
                json!({"reason": "x"}),
            ),
            400,
            "INVALID_QUERY",
        ),
        (
            post(
                &format!("/ops/inbox/{}/retry", s.inbox_dead[0]),
                json!({"reason": "a\u{0}b"}),
            ),
            400,
            "INVALID_BODY",
        ),
        (post("/ops/", json!({})), 405, "METHOD_NOT_ALLOWED"),
        (
            post(
                &format!("/ops/inbox/{}/ignore", s.inbox_dead[0]),
                json!({"reason": "x".repeat(70_000)}),
            ),
            413,
            "BODY_TOO_LARGE",
        ),
    ];
    for (req, status, code) in cases {
        let got = call!(app, req);
        assert_error(&got, status, code);
    }
    let broken = TestRequest::post()
        .uri(&format!("/ops/inbox/{}/retry", s.inbox_dead[0]))
        .insert_header(("Authorization", format!("Bearer {TOKEN}")))
        .set_payload("{not json");
    assert_error(&call!(app, broken), 400, "INVALID_BODY");
    assert_eq!(
        fingerprint(&db).await,
        before,
        "bad input changed something"
    );
    db.finish(&[]).await;
}

#[actix_rt::test]
async fn lists_show_metadata_never_the_payload_and_page_within_bounds() {
    let db = TestDb::new().await;
    let s = seed(&db).await;
    let app = init_service(App::new().service(admin_scope("/ops", config(&db)))).await;

    let (status, body) = call!(app, get("/ops/outbox"));
    assert_eq!(status, 200, "{body}");
    assert!(!body.contains(MARKER), "payload leaked: {body}");
    let v = json_of(&body);
    let items = v["items"].as_array().unwrap();
    assert_eq!(items.len(), 3);
    assert!(items.iter().all(|i| i.get("payload").is_none()));
    // Newest first, with the fields an operator needs.
    assert_eq!(items[0]["id"], s.outbox_pending.to_string());
    let dead = &items[1];
    for (field, want) in [
        ("event_type", json!("ORDER_SHIPPED")),
        ("aggregate_type", json!("order")),
        ("aggregate_id", json!("o-2")),
        ("aggregate_version", json!(3)),
        ("status", json!("DEAD_LETTER")),
        ("attempt_count", json!(5)),
        ("error_code", json!("OUTBOX_PUBLISH_FAILED")),
        ("correlation_id", json!("corr-1")),
    ] {
        assert_eq!(dead[field], want, "{field}");
    }
    assert!(dead["created_at"].is_string() && dead["updated_at"].is_string());

    let (status, body) = call!(app, get("/ops/inbox?status=dead_letter&consumer=mail"));
    assert_eq!(status, 200, "{body}");
    assert!(!body.contains(MARKER), "payload leaked: {body}");
    let v = json_of(&body);
    let ids: Vec<i64> = v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_i64().unwrap())
        .collect();
    let mut want = s.inbox_dead.clone();
    want.reverse();
    assert_eq!(ids, want);
    assert_eq!(v["items"][0]["consumer"], "mail");
    assert_eq!(v["next_before"], Value::Null);

    // Pages of two, following the cursor.
    let page1 = json_of(&call!(app, get("/ops/inbox?limit=2")).1);
    assert_eq!(page1["items"].as_array().unwrap().len(), 2);
    let cursor = page1["next_before"].as_str().unwrap().to_owned();
    let page2 = json_of(&call!(app, get(&format!("/ops/inbox?limit=2&before={cursor}"))).1);
    let first_of_2 = page2["items"][0]["id"].as_i64().unwrap();
    assert!(first_of_2 < cursor.parse::<i64>().unwrap());
    let all = db
        .count("SELECT count(*) AS n FROM actix_outbox.inbox_events")
        .await;
    let full = json_of(&call!(app, get("/ops/inbox?limit=200")).1);
    assert_eq!(full["items"].as_array().unwrap().len() as i64, all);

    // Filters by type and consumer.
    let v = json_of(&call!(app, get("/ops/outbox?type=ORDER_SHIPPED")).1);
    assert_eq!(v["items"].as_array().unwrap().len(), 1);
    let v = json_of(&call!(app, get("/ops/inbox?consumer=stats")).1);
    assert_eq!(v["items"][0]["id"], s.stats_processed);

    // Health, overview and the timeline carry no payload either.
    for uri in ["/ops/health", "/ops/overview", "/ops/timeline/corr-1"] {
        let (status, body) = call!(app, get(uri));
        assert_eq!(status, 200, "{uri}: {body}");
        assert!(!body.contains(MARKER), "{uri} leaked the payload");
    }

    // Only an application that asks for it sees payloads, and then only redacted.
    let redacted = config(&db).redacted_payloads(|event_type, p| {
        json!({"type": event_type, "keys": p.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>())})
    });
    let app = init_service(App::new().service(admin_scope("/ops", redacted))).await;
    let (_, body) = call!(app, get("/ops/inbox?consumer=stats"));
    assert!(!body.contains(MARKER), "{body}");
    let v = json_of(&body);
    assert_eq!(
        v["items"][0]["payload"],
        json!({"type": "ORDER_STATUS_CHANGED", "keys": ["email"]})
    );
    db.finish(&[]).await;
}

#[actix_rt::test]
async fn the_timeline_shows_every_row_of_a_correlation_in_order() {
    let db = TestDb::new().await;
    let s = seed(&db).await;
    let app = init_service(App::new().service(admin_scope("/ops", config(&db)))).await;
    let (status, body) = call!(app, get("/ops/timeline/corr-1"));
    assert_eq!(status, 200, "{body}");
    let v = json_of(&body);
    let entries = v["entries"].as_array().unwrap();
    let seen: Vec<(String, String, String)> = entries
        .iter()
        .map(|e| {
            (
                e["kind"].as_str().unwrap().to_owned(),
                e["event_id"].as_str().unwrap().to_owned(),
                e["status"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            (
                "outbox".into(),
                s.outbox_published.to_string(),
                "PUBLISHED".into()
            ),
            (
                "outbox".into(),
                s.outbox_dead.to_string(),
                "DEAD_LETTER".into()
            ),
            (
                "inbox".into(),
                s.outbox_published.to_string(),
                "PROCESSED".into()
            ),
        ],
        "oldest first: created 3 and 2 minutes ago, then received 1 minute ago"
    );
    assert_eq!(entries[2]["consumer"], "stats");
    assert!(entries[2]["finished_at"].is_string());
    assert_eq!(v["truncated"], false);
    db.finish(&[]).await;
}

/// A row a batch holds is listed IN_FLIGHT, with since when, by which process and until when,
/// and found by that filter (and not by RECEIVED's) while its slow handler runs; then it is
/// PROCESSED. The event's fan-out view says IN_FLIGHT too.
#[actix_rt::test]
async fn a_row_in_flight_during_a_slow_handler_is_listed_as_such_then_processed() {
    let db = TestDb::new().await;
    // Long enough for every request below to come while it runs, on a loaded machine too.
    let slow = Behaviour {
        work: Duration::from_secs(8),
        ..Behaviour::default()
    };
    let rt = start(
        &db,
        vec![(
            consumer("slow", 3).handler_timeout(Duration::from_secs(30)),
            slow,
        )],
    )
    .await;
    let app = init_service(App::new().service(admin_scope("/ops", config(&db)))).await;
    db.enqueue_one("o-1").await;
    rt.handle().wake();
    let leased = "SELECT count(*) AS n FROM actix_outbox.inbox_leases WHERE consumer = 'slow'";
    assert_eq!(db.wait_for(leased, 1, WAIT).await, 1);

    let got = call!(app, get("/ops/inbox?status=IN_FLIGHT&consumer=slow"));
    assert_eq!(got.0, 200, "{}", got.1);
    let items = json_of(&got.1)["items"].clone();
    assert_eq!(items.as_array().map(Vec::len), Some(1), "{}", got.1);
    let row = &items[0];
    assert_eq!(row["status"], "IN_FLIGHT", "{row}");
    for field in ["leased_since", "leased_by", "leased_until"] {
        assert!(row[field].is_string(), "{field} missing: {row}");
    }
    let unfiltered = json_of(&call!(app, get("/ops/inbox?consumer=slow")).1);
    assert_eq!(unfiltered["items"][0]["status"], "IN_FLIGHT");
    let received = json_of(&call!(app, get("/ops/inbox?status=RECEIVED&consumer=slow")).1);
    assert_eq!(
        received["items"].as_array().map(Vec::len),
        Some(0),
        "a row in flight listed as RECEIVED"
    );
    let event_id = row["event_id"].as_str().unwrap().to_owned();
    let fanout = json_of(&call!(app, get(&format!("/ops/events/{event_id}"))).1);
    assert!(fanout.to_string().contains("IN_FLIGHT"), "{fanout}");

    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                WHERE consumer = 'slow' AND status = 'PROCESSED'";
    assert_eq!(db.wait_for(done, 1, WAIT).await, 1);
    let after = json_of(&call!(app, get("/ops/inbox?consumer=slow")).1);
    assert_eq!(after["items"][0]["status"], "PROCESSED");
    assert!(after["items"][0]["leased_by"].is_null());
    let none = json_of(&call!(app, get("/ops/inbox?status=IN_FLIGHT")).1);
    assert_eq!(none["items"].as_array().map(Vec::len), Some(0));
    db.finish(&[&rt]).await;
}

/// A consumer reading through its cursor has no inbox row on the happy path, and its fan-out
/// view says so rather than "never got it": IN_FLIGHT while a batch holds the event, PROCESSED
/// once the cursor has moved past it, and RECEIVED for an event still past the cursor (here,
/// paused) — while the processed event of the same aggregate, in the same slot, stays
/// PROCESSED though a later stamp of that slot lies past the cursor.
#[actix_rt::test]
async fn a_cursor_consumers_fan_out_view_follows_its_cursor() {
    let db = TestDb::new().await;
    let slow = Behaviour {
        work: Duration::from_secs(6),
        ..Behaviour::default()
    };
    let cfg = consumer("slow_cur", 3)
        .cursor(true)
        .handler_timeout(Duration::from_secs(30));
    let rt = start(&db, vec![(cfg, slow)]).await;
    let app = init_service(App::new().service(admin_scope("/ops", config(&db)))).await;
    let consumer_of = |v: &Value| v["consumers"][0].clone();

    db.enqueue_one("o-1").await;
    rt.handle().wake();
    let leased = "SELECT count(*) AS n FROM actix_outbox.inbox_leases WHERE consumer = 'slow_cur'";
    assert_eq!(db.wait_for(leased, 1, WAIT).await, 1);
    let outbox = json_of(&call!(app, get("/ops/outbox")).1);
    let first = outbox["items"][0]["id"].as_str().unwrap().to_owned();
    let held = consumer_of(&json_of(
        &call!(app, get(&format!("/ops/events/{first}"))).1,
    ));
    assert_eq!(held["status"], "IN_FLIGHT", "{held}");
    assert_eq!(held["cursor"], true, "{held}");
    assert_eq!(held["got"], true, "{held}");
    assert!(held["inbox_id"].is_null(), "{held}");

    assert_eq!(db.wait_for(leased, 0, WAIT).await, 0);
    pause(&db, "slow_cur").await;
    db.enqueue_one("o-1").await;
    rt.handle().wake();
    let published =
        "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'PUBLISHED'";
    assert_eq!(db.wait_for(published, 2, WAIT).await, 2);
    let outbox = json_of(&call!(app, get("/ops/outbox")).1);
    let second = outbox["items"][0]["id"].as_str().unwrap().to_owned();
    assert_ne!(first, second);
    let done = json_of(&call!(app, get(&format!("/ops/events/{first}"))).1);
    assert_eq!(consumer_of(&done)["status"], "PROCESSED", "{done}");
    assert_eq!(done["reached"], 1, "{done}");
    let waiting = consumer_of(&json_of(
        &call!(app, get(&format!("/ops/events/{second}"))).1,
    ));
    assert_eq!(waiting["status"], "RECEIVED", "{waiting}");
    assert_eq!(
        db.count(&inbox_rows_of("slow_cur")).await,
        0,
        "the view wrote inbox rows"
    );
    // Turned off while the event still waits past its cursor: the view follows the cursor
    // the consumer reads until it drops it.
    rt.shutdown().await;
    let rt = start(&db, vec![(consumer("slow_cur", 3), Behaviour::default())]).await;
    let retiring = consumer_of(&json_of(
        &call!(app, get(&format!("/ops/events/{second}"))).1,
    ));
    assert_eq!(retiring["status"], "RECEIVED", "{retiring}");
    assert_eq!(retiring["cursor"], false, "{retiring}");
    db.finish(&[&rt]).await;
}

fn inbox_rows_of(consumer: &str) -> String {
    format!("SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = '{consumer}'")
}

/// A bulk retry does not make its rows due all at once: they fall due one after another at a
/// pace (10 a second unless the request's `"rate"` says), which the answer and the audit row
/// show. A single retry is due at once.
#[actix_rt::test]
async fn a_bulk_retry_makes_its_rows_due_at_a_pace_the_operator_sees_and_sets() {
    let db = TestDb::new().await;
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(
        "INSERT INTO actix_outbox.consumer_states (consumer) VALUES ('mail');
         INSERT INTO actix_outbox.inbox_events (event_id, consumer, event_type, event_version,
                 aggregate_type, aggregate_id, payload, correlation_id, event_created_at, status,
                 attempt_count, error_code, last_error, next_attempt_at)
         SELECT gen_random_uuid(), 'mail', 'ORDER_STATUS_CHANGED', 1, 'order', 'o-' || i, '{}',
                'corr-' || i, now(), 'DEAD_LETTER', 5, 'INBOX_CONSUMER_FAILED', 'smtp down',
                now() - interval '1 hour'
         FROM generate_series(1, 41) i",
    )
    .await
    .unwrap();
    drop(conn);
    let app = init_service(App::new().service(admin_scope("/ops", config(&db)))).await;
    let all: Vec<i64> = {
        #[derive(QueryableByName)]
        struct Id {
            #[diesel(sql_type = BigInt)]
            id: i64,
        }
        let mut conn = db.pool.get().await.unwrap();
        let rows: Vec<Id> =
            diesel::sql_query("SELECT id FROM actix_outbox.inbox_events ORDER BY id")
                .load(&mut conn)
                .await
                .unwrap();
        rows.into_iter().map(|r| r.id).collect()
    };
    let ids = |from: usize, to: usize| all[from - 1..to].to_vec();
    let spread = |ids: &[i64]| {
        format!(
            "SELECT (extract(epoch FROM max(next_attempt_at) - min(next_attempt_at)) * 1000)::int8 \
             AS n FROM actix_outbox.inbox_events WHERE id = ANY('{{{}}}'::int8[])",
            ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
        )
    };

    // 20 rows at 5 a second: the last is due 3.8 s after the first.
    let first = ids(1, 20);
    let got = call!(
        app,
        post(
            "/ops/inbox/retry",
            json!({"ids": first, "confirm": "RETRY 20", "rate": 5})
        )
    );
    assert_eq!(got.0, 200, "{}", got.1);
    let out = json_of(&got.1);
    assert_eq!(out["pace"]["per_second"], 5, "{out}");
    assert_eq!(out["pace"]["last_due_in_seconds"], 3.8, "{out}");
    assert_eq!(db.count(&spread(&first)).await, 3800);
    let audited = text(
        &db,
        "SELECT (details->'pace'->>'per_second') AS s FROM actix_outbox.admin_audit \
         WHERE action = 'inbox.retry_set'",
    )
    .await;
    assert_eq!(audited, "5");

    // Unless asked, 10 a second: 20 rows over 1.9 s.
    let second = ids(21, 40);
    let got = call!(
        app,
        post(
            "/ops/inbox/retry",
            json!({"ids": second, "confirm": "RETRY 20"})
        )
    );
    assert_eq!(got.0, 200, "{}", got.1);
    assert_eq!(json_of(&got.1)["pace"]["per_second"], 10);
    assert_eq!(db.count(&spread(&second)).await, 1900);

    // A pace of nothing is refused, and a single retry is due at once.
    let last = all[40];
    let got = call!(
        app,
        post(
            "/ops/inbox/retry",
            json!({"ids": [last], "confirm": "RETRY 1", "rate": 0})
        )
    );
    assert_error(&got, 400, "INVALID_BODY");
    let got = call!(app, post(&format!("/ops/inbox/{last}/retry"), json!({})));
    assert_eq!(got.0, 200, "{}", got.1);
    assert!(json_of(&got.1)["pace"].is_null());
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE id = {last} \
             AND next_attempt_at <= now()"
        ))
        .await,
        1
    );
    db.finish(&[]).await;
}

/// The dashboard's overview counts each state from the tables, per consumer and for the
/// outbox, as seeded: the dashboard's cards and table are drawn from exactly these numbers.
#[actix_rt::test]
async fn the_overview_counts_each_state_per_consumer_and_for_the_outbox() {
    let db = TestDb::new().await;
    seed(&db).await;
    let app = init_service(App::new().service(admin_scope("/ops", config(&db)))).await;
    let got = call!(app, get("/ops/overview"));
    assert_eq!(got.0, 200, "{}", got.1);
    let v = json_of(&got.1);
    let o = &v["outbox"];
    assert_eq!(
        (
            &o["pending"],
            &o["retrying"],
            &o["processing"],
            &o["dead_letter"]
        ),
        (&json!(1), &json!(0), &json!(0), &json!(1)),
        "{o}"
    );
    let consumer = |name: &str| {
        v["consumers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["consumer"] == name)
            .unwrap_or_else(|| panic!("no {name} in {v}"))
            .clone()
    };
    let mail = consumer("mail");
    // One retry waiting an hour (not due), three dead letters.
    assert_eq!(
        (
            &mail["backlog"],
            &mail["retrying"],
            &mail["due"],
            &mail["dead_letter"]
        ),
        (&json!(1), &json!(1), &json!(0), &json!(3)),
        "{mail}"
    );
    let stats = consumer("stats");
    assert_eq!(
        (&stats["backlog"], &stats["due"], &stats["dead_letter"]),
        (&json!(0), &json!(0), &json!(0)),
        "{stats}"
    );
    db.finish(&[]).await;
}
