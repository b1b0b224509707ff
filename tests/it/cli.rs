//! The operator CLI (`actix-outbox`, feature `cli`) end to end: the binary run against a real
//! database, every command's exit code, its `--json` answer parsed, the audit row of each
//! action, and the refusal of an action without a reason.

use crate::common;

use std::process::{Command, Output};
use std::time::Duration;

use actix_outbox::db::{self, Role};
use actix_outbox::{ConsumerConfig, Delivery, ErrorCode, HandlerError, OutboxRuntime};
use common::*;

use crate::embedding::{as_role, Roles};
use serde_json::Value;

/// Runs the CLI on `db` as operator alice.
fn cli(db: &TestDb, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_actix-outbox"))
        .args(args)
        .env("DATABASE_URL", &db.url)
        .env("ACTIX_OUTBOX_OPERATOR", "alice")
        .env_remove("ACTIX_OUTBOX_SCHEMA")
        .output()
        .expect("the CLI runs")
}

/// The exit code and the `--json` answer (stdout) of a command.
fn json(db: &TestDb, args: &[&str]) -> (i32, Value) {
    let mut all = args.to_vec();
    all.push("--json");
    let out = cli(db, &all);
    let text = String::from_utf8_lossy(&out.stdout);
    let v = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "{args:?}: not JSON ({e}): {text}\nstderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().expect("an exit code"), v)
}

async fn audit(db: &TestDb, action: &str) -> i64 {
    db.count(&format!(
        "SELECT count(*) AS n FROM actix_outbox.admin_audit WHERE who = 'alice' \
         AND action = '{action}' AND reason = 'on call'"
    ))
    .await
}

async fn audits(db: &TestDb) -> i64 {
    db.count("SELECT count(*) AS n FROM actix_outbox.admin_audit")
        .await
}

/// Every command, against events a real runtime dead-lettered and processed.
#[actix_rt::test]
async fn every_cli_command_acts_through_the_api_audits_and_exits_with_its_code() {
    let db = TestDb::new().await;
    let cfg = ConsumerConfig::new("mail")
        .subscribe("ORDER_STATUS_CHANGED")
        .replay_safe(true)
        .poll_interval(Duration::from_millis(100));
    let rt = OutboxRuntime::builder(db.pool.clone())
        .config(fast_runtime())
        .consumer_fn(cfg, |d: Delivery| async move {
            if d.aggregate_id().starts_with("bad") {
                return Err(HandlerError::permanent(
                    ErrorCode::new("MAIL_REFUSED"),
                    "refused",
                ));
            }
            Ok(())
        })
        .start()
        .await
        .unwrap();
    db.produce(3, "bad").await;
    db.produce(2, "good").await;
    let dead = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'DEAD_LETTER'";
    let done = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(dead, 3, WAIT).await, 3);
    assert_eq!(db.wait_for(done, 2, WAIT).await, 2);
    // The runtime stops: what follows is the operator's alone, and a replay stays running.
    rt.shutdown().await;

    // migrate: idempotent on a migrated database.
    let (code, v) = json(&db, &["migrate"]);
    assert_eq!(
        (code, v["schema"].as_str()),
        (0, Some("actix_outbox")),
        "{v}"
    );
    assert!(v["applied"].as_array().is_some_and(|a| a.is_empty()), "{v}");

    // health: the exit code is its state.
    let (code, v) = json(&db, &["health"]);
    let want = match v["state"].as_str() {
        Some("OK") => 0,
        Some("WARNING") => 1,
        Some("CRITICAL") => 2,
        other => panic!("no state: {other:?}"),
    };
    assert_eq!(code, want, "{v}");
    let (code, v) = json(&db, &["stats"]);
    assert_eq!(code, 0);
    let mail = v["consumers"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["consumer"] == "mail"))
        .unwrap_or_else(|| panic!("no mail consumer: {v}"));
    assert_eq!(mail["dead_letter"], 3, "{mail}");

    // dead-letters list and show, with the event's fan-out.
    let (code, v) = json(&db, &["dead-letters", "list", "--consumer", "mail"]);
    assert_eq!(code, 0);
    let items = v["items"].as_array().expect("items").clone();
    assert_eq!(items.len(), 3, "{v}");
    assert!(items.iter().all(|i| i["error_code"] == "MAIL_REFUSED"));
    let (code, v) = json(&db, &["dead-letters", "list", "--outbox"]);
    assert_eq!((code, v["items"].as_array().map(Vec::len)), (0, Some(0)));
    let event = items[0]["event_id"].as_str().unwrap().to_owned();
    let (code, v) = json(&db, &["dead-letters", "show", &event]);
    assert_eq!((code, &v["reached"]), (0, &Value::from(1)), "{v}");
    assert_eq!(v["consumers"][0]["status"], "DEAD_LETTER");
    let absent = "00000000-0000-0000-0000-000000000000";
    let (code, v) = json(&db, &["show", absent]);
    assert_eq!(
        (code, &v["error"]["code"]),
        (66, &Value::from("EVENT_NOT_FOUND"))
    );
    let (code, v) = json(&db, &["show", "not-a-uuid"]);
    assert_eq!(
        (code, &v["error"]["code"]),
        (65, &Value::from("INVALID_ID"))
    );

    // retry: refused without a reason, nothing written; then one row, then the rest, paced.
    let ids: Vec<String> = items.iter().map(|i| i["id"].to_string()).collect();
    let before = audits(&db).await;
    for args in [
        vec!["retry", "inbox", ids[0].as_str()],
        vec!["retry", "inbox", ids[0].as_str(), "--reason", "  "],
        vec!["ignore", "inbox", ids[0].as_str()],
        vec!["pause", "mail"],
        vec!["resume", "mail"],
        vec!["replay", "mail"],
    ] {
        let (code, v) = json(&db, &args);
        assert_eq!(
            (code, &v["error"]["code"]),
            (65, &Value::from("REASON_REQUIRED")),
            "{args:?}"
        );
    }
    let human = cli(&db, &["retry", "inbox", &ids[0]]);
    assert_eq!(human.status.code(), Some(65));
    assert!(String::from_utf8_lossy(&human.stderr).starts_with("REASON_REQUIRED: "));
    assert_eq!(
        audits(&db).await,
        before,
        "a refused action left an audit row"
    );
    assert_eq!(db.count(dead).await, 3, "a refused action changed a row");

    let (code, v) = json(&db, &["retry", "inbox", &ids[0], "--reason", "on call"]);
    assert_eq!((code, &v["changed"]), (0, &Value::from(1)), "{v}");
    assert_eq!(audit(&db, "inbox.retry").await, 1);
    let (code, v) = json(&db, &["retry", "inbox", &ids[0], "--reason", "on call"]);
    assert_eq!(
        (code, &v["error"]["code"]),
        (65, &Value::from("NOT_A_DEAD_LETTER"))
    );
    let (code, v) = json(
        &db,
        &[
            "retry", "inbox", &ids[1], &ids[2], "--reason", "on call", "--rate", "5",
        ],
    );
    assert_eq!(
        (code, &v["pace"]["per_second"]),
        (0, &Value::from(5)),
        "{v}"
    );
    assert_eq!(audit(&db, "inbox.retry_set").await, 1);
    assert_eq!(db.count(dead).await, 0);

    // ignore: an outbox row that failed to publish, set aside for good.
    exec(
        &db,
        "INSERT INTO actix_outbox.outbox_events (id, event_type, aggregate_type, aggregate_id,
             payload, correlation_id, status)
         VALUES ('00000000-0000-0000-0000-0000000000ee', 'T', 'order', 'o', '{}', 'c', 'DEAD_LETTER')",
    )
    .await;
    let outbox_id = "00000000-0000-0000-0000-0000000000ee";
    let (code, _) = json(&db, &["ignore", "outbox", outbox_id, "--reason", "on call"]);
    assert_eq!(code, 0);
    assert_eq!(audit(&db, "outbox.ignore").await, 1);
    let ignored = "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'IGNORED'";
    assert_eq!(db.count(ignored).await, 1);

    // A side effect whose calls failed: listed, retried, then set aside.
    exec(
        &db,
        "INSERT INTO actix_outbox.side_effects (id, kind, key, payload, status, attempt_count, error_code)
         VALUES (77, 'sms', 'mail:o1', '{}', 'DEAD_LETTER', 5, 'SMS_REFUSED')",
    )
    .await;
    let (code, v) = json(&db, &["dead-letters", "list", "--effects", "--kind", "sms"]);
    assert_eq!(
        (code, &v["items"][0]["error_code"]),
        (0, &Value::from("SMS_REFUSED")),
        "{v}"
    );
    let (code, _) = json(&db, &["retry", "effect", "77", "--reason", "on call"]);
    assert_eq!(code, 0);
    assert_eq!(audit(&db, "effect.retry").await, 1);
    let pending =
        "SELECT count(*) AS n FROM actix_outbox.side_effects WHERE id = 77 AND status = 'PENDING'";
    assert_eq!(db.count(pending).await, 1);
    let (code, _) = json(&db, &["ignore", "effect", "77", "--reason", "on call"]);
    assert_eq!(code, 0);
    assert_eq!(audit(&db, "effect.ignore").await, 1);
    let (code, v) = json(&db, &["retry", "effect", "77", "--reason", "on call"]);
    assert_eq!(
        (code, &v["error"]["code"]),
        (65, &Value::from("NOT_A_DEAD_LETTER"))
    );

    // pause until a time, resume.
    let (code, v) = json(
        &db,
        &[
            "pause",
            "mail",
            "--reason",
            "on call",
            "--until",
            "2099-01-01T00:00:00Z",
        ],
    );
    assert_eq!(code, 0, "{v}");
    assert_eq!(audit(&db, "consumer.pause").await, 1);
    let paused = "SELECT count(*) AS n FROM actix_outbox.consumer_states \
                  WHERE consumer = 'mail' AND paused AND paused_until IS NOT NULL";
    assert_eq!(db.count(paused).await, 1);
    let (code, _) = json(
        &db,
        &["pause", "mail", "--reason", "on call", "--until", "soon"],
    );
    assert_eq!(code, 65);
    let (code, _) = json(&db, &["resume", "mail", "--reason", "on call"]);
    assert_eq!(code, 0);
    assert_eq!(audit(&db, "consumer.resume").await, 1);

    // replay, the list of replays, cancel.
    let (code, v) = json(
        &db,
        &[
            "replay",
            "mail",
            "--reason",
            "on call",
            "--type",
            "ORDER_STATUS_CHANGED",
        ],
    );
    assert_eq!((code, &v["status"]), (0, &Value::from("RUNNING")), "{v}");
    let replay = v["id"].as_i64().expect("a replay id");
    let (code, v) = json(&db, &["replays", "--consumer", "mail"]);
    assert_eq!(
        (code, &v["items"][0]["id"]),
        (0, &Value::from(replay)),
        "{v}"
    );
    let (code, v) = json(&db, &["cancel", &replay.to_string()]);
    assert_eq!((code, &v["status"]), (0, &Value::from("CANCELLED")), "{v}");
    assert_eq!(audit(&db, "consumer.replay").await, 1);
    let cancelled = "SELECT count(*) AS n FROM actix_outbox.admin_audit \
                     WHERE who = 'alice' AND action = 'consumer.replay.cancel'";
    assert_eq!(db.count(cancelled).await, 1);
    let (code, _) = json(&db, &["replay", "nobody", "--reason", "on call"]);
    assert_eq!(code, 66, "an unknown consumer");

    // timeline of one correlation id: the event's outbox row and its inbox row.
    let corr: String = {
        let (_, v) = json(&db, &["show", &event]);
        v["outbox"]["correlation_id"].as_str().unwrap().to_owned()
    };
    let (code, v) = json(&db, &["timeline", &corr]);
    assert_eq!(code, 0);
    assert!(v["entries"].as_array().is_some_and(|e| e.len() == 2), "{v}");

    // Tables by default; help for every command; wrong command lines; no database.
    let table = cli(&db, &["dead-letters", "list", "--consumer", "mail"]);
    assert_eq!(table.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&table.stdout).contains("items (0)"));
    for command in [
        "migrate",
        "health",
        "stats",
        "dead-letters",
        "show",
        "retry",
        "ignore",
        "pause",
        "resume",
        "replay",
        "replays",
        "cancel",
        "timeline",
    ] {
        let help = cli(&db, &[command, "--help"]);
        assert_eq!(help.status.code(), Some(0), "{command}");
        assert!(String::from_utf8_lossy(&help.stdout).contains("Usage: actix-outbox"));
    }
    assert_eq!(cli(&db, &["bogus"]).status.code(), Some(64));
    let (code, v) = json(
        &db,
        &["pause", "mail", "--reason", "on call", "--operator", " "],
    );
    assert_eq!(
        (code, &v["error"]["code"]),
        (65, &Value::from("CONFIG_INVALID"))
    );
    assert_eq!(
        cli(&db, &["retry", "sideways", "1"]).status.code(),
        Some(64)
    );
    let nowhere = Command::new(env!("CARGO_BIN_EXE_actix-outbox"))
        .args([
            "health",
            "--database-url",
            "postgres://nobody@127.0.0.1:1/none",
        ])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert_eq!(nowhere.status.code(), Some(69));

    // Least privilege: the operator role reads; acting needs the runtime's role.
    let roles = Roles::create(&db, &["reader", "actor"]).await;
    {
        let mut owner = db.pool.get().await.unwrap();
        db::grant(&mut owner, Role::Operator, roles.get(0))
            .await
            .unwrap();
        db::grant(&mut owner, Role::Runtime, roles.get(1))
            .await
            .unwrap();
    }
    let reader = as_role(&db.url, roles.get(0));
    let actor = as_role(&db.url, roles.get(1));
    let pause = ["pause", "mail", "--reason", "on call", "--database-url"];
    for read in [&["stats"][..], &["dead-letters", "list"], &["show", &event]] {
        let out = cli(&db, &[read, &["--database-url", &reader]].concat());
        assert_eq!(out.status.code(), Some(0), "{read:?} as the operator role");
    }
    let refused = cli(&db, &[&pause[..], &[&reader]].concat());
    assert_eq!(refused.status.code(), Some(69));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("permission denied"), "{said}");
    assert_eq!(
        audit(&db, "consumer.pause").await,
        1,
        "a refused pause was audited"
    );
    assert_eq!(
        cli(&db, &[&pause[..], &[&actor]].concat()).status.code(),
        Some(0)
    );
    assert_eq!(audit(&db, "consumer.pause").await, 2);
    db.finish(&[]).await;
    roles.drop_all().await;
}

/// The CLI migrates into, and operates on, the schema the application chose
/// (`ACTIX_OUTBOX_SCHEMA` or `--schema`), never the default one.
#[actix_rt::test]
async fn the_cli_migrates_into_and_reads_the_schema_it_is_given() {
    let db = TestDb::empty().await;
    let (code, v) = json(&db, &["migrate", "--schema", "ops_elsewhere"]);
    assert_eq!(
        (code, &v["schema"]),
        (0, &Value::from("ops_elsewhere")),
        "{v}"
    );
    assert!(
        v["applied"].as_array().is_some_and(|a| !a.is_empty()),
        "{v}"
    );
    let tables =
        |schema: &str| format!("SELECT count(*) AS n FROM pg_tables WHERE schemaname = '{schema}'");
    assert!(db.count(&tables("ops_elsewhere")).await > 10);
    assert_eq!(db.count(&tables("actix_outbox")).await, 0);
    let (code, v) = json(&db, &["stats", "--schema", "ops_elsewhere"]);
    assert_eq!((code, v["outbox"]["pending"].as_i64()), (0, Some(0)), "{v}");
    let (code, _) = json(&db, &["stats"]);
    assert_eq!(code, 69, "the default schema holds nothing here");
    let (code, v) = json(&db, &["stats", "--schema", "no such schema"]);
    assert_eq!(
        (code, &v["error"]["code"]),
        (65, &Value::from("CONFIG_INVALID")),
        "{v}"
    );
    db.finish(&[]).await;
}

async fn exec(db: &TestDb, sql: &str) {
    use diesel_async::SimpleAsyncConnection;
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(sql).await.unwrap();
}
