//! Side effects (`actix_outbox::effects`): a consumer records intents in its inbox
//! transaction, a supervised worker calls a fake provider with each intent's key. The
//! provider lives in the database (tables the worker writes outside any transaction of the
//! library, as a remote system would keep them), so it survives the worker's kills and counts
//! every call.

use crate::common;

use std::hash::{Hash, Hasher};
use std::process::Child;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix_outbox::effects::{self, Effect, EffectConfig, NewEffect};
use actix_outbox::health::{StatsConfig, StatsSampler};
use actix_outbox::{ConsumerConfig, Delivery, ErrorCode, HandlerError, PgPool, RetryPolicy};
use common::*;
use diesel_async::SimpleAsyncConnection;

/// The provider's tables: one row per call, and its idempotency store, which answers a key
/// it has seen with the outcome it gave the first time (as Stripe's `Idempotency-Key` does).
const PROVIDER: &str = "
    CREATE TABLE provider_calls (n bigserial PRIMARY KEY, key text NOT NULL, outcome text NOT NULL);
    CREATE TABLE provider_effects (key text PRIMARY KEY, outcome text NOT NULL);";

fn hash(key: &str, attempt: u32) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (key, attempt).hash(&mut h);
    h.finish()
}

/// The fake provider: 10–40 ms per call; one call in ten fails before it does anything (a
/// 503, retried); otherwise the effect is applied once per key (a repeated key changes
/// nothing). Each call is counted with what it asked for.
async fn provider(pool: &PgPool, e: Effect) -> Result<(), HandlerError> {
    let h = hash(e.key(), e.attempt());
    actix_rt::time::sleep(Duration::from_millis(10 + h % 31)).await;
    let mut conn = pool
        .get()
        .await
        .map_err(|e| HandlerError::retry(e.to_string()))?;
    let key = e.key().replace('\'', "''");
    if h.is_multiple_of(10) {
        conn.batch_execute(&format!(
            "INSERT INTO provider_calls (key, outcome) VALUES ('{key}', 'unavailable')"
        ))
        .await?;
        return Err(HandlerError::retry("provider unavailable (503)"));
    }
    // What this call asks for: a key sent twice with two different requests would have two.
    let outcome = format!("sent:{}", e.payload()["order"].as_str().unwrap_or("?"));
    conn.batch_execute(&format!(
        "INSERT INTO provider_effects (key, outcome) VALUES ('{key}', '{outcome}') \
             ON CONFLICT (key) DO NOTHING;
         INSERT INTO provider_calls (key, outcome) VALUES ('{key}', '{outcome}')"
    ))
    .await?;
    Ok(())
}

/// The service under test: the `mailer` consumer records one e-mail intent per event, and the
/// worker of `email` sends them. Used by the kill test's child process and the tests below.
fn service(
    pool: PgPool,
    mailer: ConsumerConfig,
    email: EffectConfig,
) -> actix_outbox::OutboxBuilder {
    let provider_pool = pool.clone();
    actix_outbox::OutboxRuntime::builder(pool)
        .config(fast_runtime())
        .consumer_fn(mailer, |d: Delivery| async move {
            let mut conn = d.conn().await?;
            let payload = serde_json::json!({ "order": d.aggregate_id() });
            effects::record(&mut conn, &NewEffect::of(&d, "email", payload)).await?;
            Ok(())
        })
        .effect(email, move |e: Effect| {
            let pool = provider_pool.clone();
            async move { provider(&pool, e).await }
        })
}

fn mailer() -> ConsumerConfig {
    consumer("mailer", 20).batch_size(50)
}

/// The process the kill test restarts. Not a test of its own.
#[actix_rt::test]
#[ignore = "entry point of the side-effect kill test's child process"]
async fn effect_worker_child_entry() {
    let url = std::env::var("AO_CHILD_DB").expect("started by a child-process test");
    let pool = actix_outbox::connect(&url, 20).await.unwrap();
    let email = EffectConfig::new("email")
        .concurrency(10)
        .timeout(Duration::from_secs(2))
        .poll_interval(Duration::from_millis(50))
        .retry(RetryPolicy::fixed(20, Duration::from_millis(20)));
    let mailer = mailer()
        .handler_timeout(Duration::from_millis(500))
        .lease(Duration::from_secs(2));
    let _rt = service(pool, mailer, email).start().await.unwrap();
    std::future::pending::<()>().await;
}

fn spawn(db: &TestDb) -> Child {
    spawn_entry(&db.url, "effects::effect_worker_child_entry", &[])
}

const DONE: &str = "SELECT count(*) AS n FROM actix_outbox.side_effects WHERE status = 'DONE'";

/// 1,000 intents, recorded by a consumer and sent by the worker, while the process running
/// both is SIGKILLed five times mid-work. Every intent is called, each with its own key (the
/// consumer's name and its event's id); a key called twice (its worker was killed between
/// the call and the record of its outcome) gets the provider's first outcome back, so no key
/// has two outcomes; and every intent ends DONE, none dead-lettered.
#[actix_rt::test]
async fn a_thousand_intents_under_five_kills_are_each_called_with_their_own_key() {
    let db = TestDb::new().await;
    exec(&db, PROVIDER).await;
    db.produce_batched(1000, 100, "order").await;
    let mut child = spawn(&db);
    let mut kills = 0;
    let mut last = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(240);
    while Instant::now() < deadline {
        let done = db.count(DONE).await;
        if done == 1000 {
            break;
        }
        // A kill every 0.8 s once the calls have begun, while work is left.
        if kills < 5 && done > 50 && last.elapsed() > Duration::from_millis(800) {
            child.kill().unwrap();
            child.wait().unwrap();
            kills += 1;
            last = Instant::now();
            child = spawn(&db);
        }
        if child.try_wait().unwrap().is_some() {
            child = spawn(&db);
        }
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().ok();
    child.wait().ok();
    assert_eq!(kills, 5, "the work ended before five kills");
    assert_eq!(db.count(DONE).await, 1000, "every intent done");
    let inbox = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                 WHERE consumer = 'mailer' AND status = 'PROCESSED'";
    assert_eq!(db.count(inbox).await, 1000);
    // Each intent its own key, the consumer's name and its event's id.
    let keyed = "SELECT count(DISTINCT e.key) AS n FROM actix_outbox.side_effects e \
                 JOIN actix_outbox.outbox_events o ON e.key = 'mailer:' || o.id \
                 WHERE e.kind = 'email' AND e.event_id = o.id";
    assert_eq!(db.count(keyed).await, 1000);
    // The provider: every key reached, none with two outcomes.
    let reached =
        "SELECT count(DISTINCT key) AS n FROM provider_calls WHERE outcome <> 'unavailable'";
    assert_eq!(
        db.count(reached).await,
        1000,
        "a key never reached the provider"
    );
    let two = "SELECT count(*) AS n FROM (SELECT key FROM provider_calls \
               WHERE outcome <> 'unavailable' GROUP BY key HAVING count(DISTINCT outcome) > 1) k";
    assert_eq!(db.count(two).await, 0, "a key with two different outcomes");
    let wrong = "SELECT count(*) AS n FROM provider_effects p \
                 JOIN actix_outbox.side_effects e ON e.key = p.key \
                 WHERE p.outcome <> 'sent:' || (e.payload->>'order')";
    assert_eq!(
        db.count(wrong).await,
        0,
        "an outcome for another intent's payload"
    );
    let again = db
        .count(
            "SELECT count(*) AS n FROM (SELECT key FROM provider_calls \
             WHERE outcome <> 'unavailable' GROUP BY key HAVING count(*) > 1) k",
        )
        .await;
    let calls = db.count("SELECT count(*) AS n FROM provider_calls").await;
    eprintln!(
        "side effects under {kills} kills: {calls} provider calls for 1000 intents; \
         {again} keys called again after a kill (deduplicated by the provider)"
    );
    db.finish(&[]).await;
}

/// The outcomes, one by one: a permanent failure is dead-lettered at once with its code, a
/// call past its timeout is retried with `EFFECT_TIMEOUT`, a panic is a failure
/// (`EFFECT_PANICKED`) that takes no other row with it, a row whose worker died during its last
/// attempt is dead-lettered without being called again (`EFFECT_ATTEMPT_INTERRUPTED`), one
/// whose worker died earlier is called again alone, and recording an intent twice adds nothing.
#[actix_rt::test]
async fn failures_are_retried_dead_lettered_and_an_intent_is_recorded_once() {
    let db = TestDb::new().await;
    exec(
        &db,
        "INSERT INTO actix_outbox.side_effects (kind, key, payload, attempt_count, in_flight)
         VALUES ('call', 'boom', '{}', 0, false), ('call', 'refused', '{}', 0, false),
                ('call', 'slow', '{}', 0, false), ('call', 'interrupted', '{}', 3, true),
                ('call', 'suspect', '{}', 1, true), ('call', 'fine', '{}', 0, false),
                ('call', 'fine2', '{}', 0, false), ('call', 'fine3', '{}', 0, false)",
    )
    .await;
    {
        let mut conn = db.pool.get().await.unwrap();
        let again = NewEffect::new("call", "fine", serde_json::json!({"other": true}));
        assert!(
            !effects::record(&mut conn, &again).await.unwrap(),
            "recorded twice"
        );
        let bad = NewEffect::new("call", "", serde_json::json!({}));
        let err = effects::record(&mut conn, &bad).await.unwrap_err();
        assert_eq!(err.code(), ErrorCode::CONFIG_INVALID);
    }
    let called = Arc::new(Mutex::new(Vec::<String>::new()));
    let running = Arc::new(AtomicUsize::new(0));
    let suspect_beside = Arc::new(AtomicUsize::new(usize::MAX));
    let (seen, now, beside) = (called.clone(), running.clone(), suspect_beside.clone());
    // Far above the 20 ms a call takes, so that only `slow` times out on a loaded machine.
    let cfg = EffectConfig::new("call")
        .timeout(Duration::from_secs(2))
        .poll_interval(Duration::from_millis(20))
        .retry(RetryPolicy::fixed(3, Duration::from_millis(10)));
    let rt = actix_outbox::OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .effect(cfg, move |e: Effect| {
            seen.lock().unwrap().push(e.key().to_owned());
            let (now, beside) = (now.clone(), beside.clone());
            async move {
                let others = now.fetch_add(1, Ordering::SeqCst);
                if e.key() == "suspect" {
                    beside.store(others, Ordering::SeqCst);
                }
                actix_rt::time::sleep(Duration::from_millis(20)).await;
                now.fetch_sub(1, Ordering::SeqCst);
                match e.key() {
                    "boom" => panic!("the provider's client panicked"),
                    "refused" => Err(HandlerError::permanent(
                        ErrorCode::new("MAIL_REFUSED"),
                        "no such mailbox",
                    )),
                    "slow" if e.attempt() == 1 => {
                        actix_rt::time::sleep(Duration::from_secs(60)).await;
                        Ok(())
                    }
                    _ => Ok(()),
                }
            }
        })
        .start()
        .await
        .unwrap();
    let state = "SELECT count(*) AS n FROM actix_outbox.side_effects WHERE NOT in_flight AND (\
        (key = 'boom' AND status = 'DEAD_LETTER' AND error_code = 'EFFECT_PANICKED' AND attempt_count = 3) OR \
        (key = 'refused' AND status = 'DEAD_LETTER' AND error_code = 'MAIL_REFUSED' AND attempt_count = 1) OR \
        (key = 'slow' AND status = 'DONE' AND attempt_count = 2) OR \
        (key = 'interrupted' AND status = 'DEAD_LETTER' AND error_code = 'EFFECT_ATTEMPT_INTERRUPTED') OR \
        (key = 'suspect' AND status = 'DONE' AND attempt_count = 2) OR \
        (key LIKE 'fine%' AND status = 'DONE' AND done_at IS NOT NULL AND attempt_count = 1))";
    assert_eq!(db.wait_for(state, 8, WAIT).await, 8);
    let slow_timed_out = "SELECT count(*) AS n FROM actix_outbox.side_effects WHERE key = 'slow' \
                          AND error_code IS NULL";
    assert_eq!(db.count(slow_timed_out).await, 1, "DONE clears the error");
    let keys = called.lock().unwrap().clone();
    assert!(
        !keys.contains(&"interrupted".to_owned()),
        "called again: {keys:?}"
    );
    assert_eq!(keys.iter().filter(|k| k.starts_with("fine")).count(), 3);
    assert_eq!(
        suspect_beside.load(Ordering::SeqCst),
        0,
        "a row whose worker died was called beside others"
    );
    // Health names the kind with dead letters, and a kind no worker runs once it is late.
    exec(
        &db,
        "INSERT INTO actix_outbox.side_effects (kind, key, payload, next_attempt_at)
         VALUES ('emial', 'typo', '{}', now() - interval '1 hour')",
    )
    .await;
    let sampler = StatsSampler::new(db.pool.clone(), StatsConfig::default()).unwrap();
    let report = sampler.run_once().await.unwrap();
    let reasons: Vec<(String, String)> = report
        .reasons
        .iter()
        .filter(|r| r.code.starts_with("EFFECTS_"))
        .map(|r| (r.code.to_string(), r.message.clone()))
        .collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(reasons[0].0 == "EFFECTS_LATE" && reasons[0].1.contains("kind emial"));
    assert!(
        reasons[1].0 == "EFFECTS_DEAD_LETTERED"
            && reasons[1].1.contains("3 side effects of kind call")
    );
    // Not a second kind of the same name, nor a zero concurrency.
    for bad in [
        vec![EffectConfig::new("x"), EffectConfig::new("x")],
        vec![EffectConfig::new("y").concurrency(0)],
        vec![EffectConfig::new("z").timeout(Duration::MAX)],
        vec![EffectConfig::new("w").rate_limit(1e-30)],
    ] {
        let mut b = actix_outbox::OutboxRuntime::builder(db.pool.clone());
        for cfg in bad {
            b = b.effect(cfg, |_e: Effect| async { Ok(()) });
        }
        let refused = b.start().await.err().map(|e| e.code());
        assert_eq!(refused, Some(ErrorCode::CONFIG_INVALID));
    }
    db.finish(&[&rt]).await;
}

/// Two instances' workers of one kind on one database: each effect is called exactly once,
/// never by both at once (a claimed row stays leased while its call runs).
#[actix_rt::test]
async fn two_instances_call_each_effect_once() {
    let db = TestDb::new().await;
    exec(
        &db,
        "INSERT INTO actix_outbox.side_effects (kind, key, payload)
         SELECT 'twice', 'k' || i, '{}' FROM generate_series(1, 300) i",
    )
    .await;
    let calls = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut runtimes = Vec::new();
    for _ in 0..2 {
        let calls = calls.clone();
        let cfg = EffectConfig::new("twice")
            .concurrency(20)
            .poll_interval(Duration::from_millis(10));
        let rt = actix_outbox::OutboxRuntime::builder(db.pool.clone())
            .config(fast_runtime())
            .effect(cfg, move |e: Effect| {
                calls.lock().unwrap().push(e.key().to_owned());
                async move {
                    actix_rt::time::sleep(Duration::from_millis(15)).await;
                    Ok(())
                }
            })
            .start()
            .await
            .unwrap();
        runtimes.push(rt);
    }
    let done = "SELECT count(*) AS n FROM actix_outbox.side_effects WHERE status = 'DONE'";
    assert_eq!(db.wait_for(done, 300, WAIT).await, 300);
    let mut keys = calls.lock().unwrap().clone();
    assert_eq!(keys.len(), 300, "calls beyond one per effect");
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), 300);
    db.finish(&runtimes.iter().collect::<Vec<_>>()).await;
}

/// A call that blocks its thread (a synchronous client) stops neither the consumers nor the
/// runtime: a consumer handles its events meanwhile, and the call's timeout still fires.
#[actix_rt::test]
async fn a_call_that_blocks_its_thread_stalls_nothing_else() {
    static RELEASED: AtomicBool = AtomicBool::new(false);
    let db = TestDb::new().await;
    exec(
        &db,
        "INSERT INTO actix_outbox.side_effects (kind, key, payload) VALUES ('blocking', 'b', '{}')",
    )
    .await;
    let cfg = EffectConfig::new("blocking")
        .timeout(Duration::from_millis(300))
        .retry(RetryPolicy::fixed(5, Duration::from_secs(600)));
    let rt = actix_outbox::OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer_fn(consumer("plain", 3), |_d: Delivery| async { Ok(()) })
        .effect(cfg, |_e: Effect| {
            while !RELEASED.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(5));
            }
            async { Ok(()) }
        })
        .start()
        .await
        .unwrap();
    let timed_out = "SELECT count(*) AS n FROM actix_outbox.side_effects \
                     WHERE error_code = 'EFFECT_TIMEOUT' AND status = 'PENDING'";
    assert_eq!(
        db.wait_for(timed_out, 1, WAIT).await,
        1,
        "the timeout did not fire"
    );
    db.produce_batched(100, 50, "o").await;
    let handled = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                   WHERE consumer = 'plain' AND status = 'PROCESSED'";
    assert_eq!(db.wait_for(handled, 100, WAIT).await, 100);
    assert!(!RELEASED.load(Ordering::SeqCst));
    RELEASED.store(true, Ordering::SeqCst);
    db.finish(&[&rt]).await;
}

/// A backlog of effects reaches the provider at the worker's rate limit, not all at once:
/// 40 calls at 20 a second take at least 1.5 s from the first to the last (counted from the
/// rows' `done_at`), with no burst in between.
#[actix_rt::test]
async fn a_backlog_of_effects_is_called_at_the_rate_limit() {
    let db = TestDb::new().await;
    exec(
        &db,
        "INSERT INTO actix_outbox.side_effects (kind, key, payload)
         SELECT 'paced', 'k' || i, '{}' FROM generate_series(1, 40) i",
    )
    .await;
    let times = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let seen = times.clone();
    let cfg = EffectConfig::new("paced")
        .rate_limit(20.0)
        .poll_interval(Duration::from_millis(20));
    let rt = actix_outbox::OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .effect(cfg, move |_e: Effect| {
            seen.lock().unwrap().push(Instant::now());
            async { Ok(()) }
        })
        .start()
        .await
        .unwrap();
    let done = "SELECT count(*) AS n FROM actix_outbox.side_effects WHERE status = 'DONE'";
    assert_eq!(db.wait_for(done, 40, WAIT).await, 40);
    let spread = "SELECT (extract(epoch FROM max(done_at) - min(done_at)) * 1000)::bigint AS n \
                  FROM actix_outbox.side_effects";
    let ms = db.count(spread).await;
    assert!(ms >= 1500, "40 calls at 20/s spread over {ms} ms");
    // Evenly: a claim takes two (a tenth of a second at 20/s), so no 100 ms hold a burst.
    let mut at = times.lock().unwrap().clone();
    at.sort();
    let burst = at
        .iter()
        .map(|t| {
            at.iter()
                .filter(|u| **u >= *t && **u - *t < Duration::from_millis(100))
                .count()
        })
        .max()
        .unwrap_or(0);
    assert!(burst <= 4, "{burst} calls within 100 ms at 20/s");
    db.finish(&[&rt]).await;
}

async fn exec(db: &TestDb, sql: &str) {
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(sql).await.unwrap();
}

/// A call that takes pool connections of its own (so the pool opens new ones while the
/// effect's thread asks), gives them back, then blocks its thread: the connections it made the
/// pool open do not block with it, so a consumer and this test's own queries, which borrow
/// them next, go on.
#[actix_rt::test]
async fn connections_an_effect_thread_asks_the_pool_for_do_not_block_with_it() {
    static RELEASED: AtomicBool = AtomicBool::new(false);
    static BLOCKING: AtomicBool = AtomicBool::new(false);
    static ENDED: AtomicBool = AtomicBool::new(false);
    let db = TestDb::new().await;
    exec(
        &db,
        "INSERT INTO actix_outbox.side_effects (kind, key, payload) VALUES ('opens', 'b', '{}')",
    )
    .await;
    let cfg = EffectConfig::new("opens").timeout(Duration::from_secs(300));
    let pool = db.pool.clone();
    let rt = actix_outbox::OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer_fn(consumer("beside-effect", 3), |_d: Delivery| async {
            Ok(())
        })
        .effect(cfg, move |_e: Effect| {
            let pool = pool.clone();
            async move {
                make_pool_open(&pool, 20).await;
                BLOCKING.store(true, Ordering::SeqCst);
                let deadline = Instant::now() + Duration::from_secs(120);
                while !RELEASED.load(Ordering::SeqCst) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(5));
                }
                ENDED.store(true, Ordering::SeqCst);
                Ok(())
            }
        })
        .start()
        .await
        .unwrap();
    let deadline = Instant::now() + WAIT;
    while !BLOCKING.load(Ordering::SeqCst) && Instant::now() < deadline {
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(BLOCKING.load(Ordering::SeqCst), "the call blocks");
    db.produce_batched(100, 10, "o").await;
    let handled = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                   WHERE consumer = 'beside-effect' AND status = 'PROCESSED' \
                   AND attempt_count = 1";
    assert_eq!(db.wait_for(handled, 100, WAIT).await, 100);
    assert!(!ENDED.load(Ordering::SeqCst), "the block ended first");
    RELEASED.store(true, Ordering::SeqCst);
    db.finish(&[&rt]).await;
}
