//! The claims keep their plans whatever the tables' statistics say. The publisher's claim: an
//! ordered `Index Scan` of the partial index `outbox_events_due` under the `LockRows`, and the
//! claimed rows found again by primary key, never by scanning the table. The consumer's claim
//! (the last test): an ordered `Index Scan` of `inbox_events_due`.
//!
//! The trap this guards: on a fresh table nobody has analyzed yet, PostgreSQL underestimates
//! the due rows, and with a plain `LIMIT $1` it picks a bitmap scan of the partial index that
//! reads and sorts every due row for each batch — tens of times slower on a backlog. A fix that
//! only hides the limit from the planner then makes it hash-join a large analyzed backlog
//! against a sequential scan of the whole table. Each test below builds one of those tables.
//!
//! The statement is not copied: it is included from `src/store/claim.sql`, the file the
//! library includes, so the plan asserted here is the plan of what the publisher runs.

use crate::common;

use common::*;
use diesel::sql_types::{BigInt, Bool, Json, Nullable, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use serde_json::Value;

/// The claim statement exactly as the library runs it.
const CLAIM_SQL: &str = include_str!("../../src/store/claim.sql");
/// What the library runs before it in the same transaction.
const PLAN_GUARD: &str = include_str!("../../src/store/plan_guard.sql");
/// The consumer's claim on the inbox, exactly as the library runs it (without a guard).
const INBOX_CLAIM_SQL: &str = include_str!("../../src/store/inbox_claim.sql");

#[derive(QueryableByName)]
struct ExplainRow {
    #[diesel(sql_type = Json)]
    #[diesel(column_name = "QUERY PLAN")]
    plan: Value,
}

/// One plan node, flattened: its type, its relation or index, and the `CTE …` it belongs to.
#[derive(Debug, Clone)]
struct Node {
    node_type: String,
    relation: Option<String>,
    index: Option<String>,
    cte: Option<String>,
    depth: usize,
}

fn flatten(plan: &Value, cte: Option<&str>, depth: usize, out: &mut Vec<Node>) {
    let text = |k: &str| plan.get(k).and_then(Value::as_str).map(str::to_owned);
    let subplan = text("Subplan Name");
    let cte = match subplan.as_deref() {
        Some(name) if name.starts_with("CTE ") => Some(name.to_owned()),
        _ => cte.map(str::to_owned),
    };
    out.push(Node {
        node_type: text("Node Type").unwrap_or_default(),
        relation: text("Relation Name"),
        index: text("Index Name"),
        cte: cte.clone(),
        depth,
    });
    for child in plan
        .get("Plans")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        flatten(child, cte.as_deref(), depth + 1, out);
    }
}

fn render(nodes: &[Node]) -> String {
    nodes
        .iter()
        .map(|n| {
            let on = match (&n.index, &n.relation) {
                (Some(i), _) => format!(" using {i}"),
                (None, Some(r)) => format!(" on {r}"),
                _ => String::new(),
            };
            format!("{}{}{on}", "  ".repeat(n.depth), n.node_type)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `EXPLAIN (FORMAT JSON)` of the claim with a batch of 500, twice: planned with the bound
/// value (a custom plan, what the publisher's cached statement gets for its first executions),
/// and as the generic plan PostgreSQL may switch a cached statement to after five.
async fn explain_claim(conn: &mut AsyncPgConnection) -> [(Vec<Node>, &'static str); 2] {
    conn.batch_execute(&format!("BEGIN; {PLAN_GUARD}"))
        .await
        .expect("apply the plan guard");
    let plans = explain_unguarded(conn).await;
    conn.batch_execute("ROLLBACK").await.unwrap();
    plans
}

async fn explain_unguarded(conn: &mut AsyncPgConnection) -> [(Vec<Node>, &'static str); 2] {
    let custom: ExplainRow = diesel::sql_query(format!("EXPLAIN (FORMAT JSON) {}", CLAIM_SQL))
        .bind::<BigInt, _>(500_i64)
        .bind::<Nullable<Text>, _>(None::<&str>)
        .bind::<Nullable<Text>, _>(None::<&str>)
        .bind::<Bool, _>(false)
        .get_result(conn)
        .await
        .expect("EXPLAIN the claim");
    conn.batch_execute(&format!(
        "PREPARE claim_plan_test (int8, text, text, bool) AS {}; SET plan_cache_mode = force_generic_plan",
        CLAIM_SQL
    ))
    .await
    .expect("PREPARE the claim");
    let generic: ExplainRow =
        diesel::sql_query("EXPLAIN (FORMAT JSON) EXECUTE claim_plan_test (500, NULL, NULL, false)")
            .get_result(conn)
            .await
            .expect("EXPLAIN the prepared claim");
    conn.batch_execute("DEALLOCATE claim_plan_test; SET plan_cache_mode = auto")
        .await
        .unwrap();
    [(custom, "custom plan"), (generic, "generic plan")].map(|(row, kind)| {
        let mut nodes = Vec::new();
        flatten(&row.plan[0]["Plan"], None, 0, &mut nodes);
        (nodes, kind)
    })
}

/// The plan ARCHITECTURE §3 and the claim's doc comment promise.
fn assert_claim_plan(plans: &[(Vec<Node>, &str)], case: &str) {
    for (nodes, kind) in plans {
        assert_one_plan(nodes, &format!("{case}, {kind}"));
    }
}

/// The due rows are read by an ordered scan of `index` that stops at the limit: nothing among
/// `nodes` reads or sorts every due row.
fn assert_ordered_scan(nodes: &[&Node], index: &str, case: &str, plan: &str) {
    assert!(
        nodes.iter().any(|n| {
            matches!(n.node_type.as_str(), "Index Scan" | "Index Only Scan")
                && n.index.as_deref() == Some(index)
        }),
        "{case}: the due rows are not read by an ordered scan of {index}:\n{plan}"
    );
    let unwanted: Vec<&&Node> = nodes
        .iter()
        .filter(|n| {
            matches!(
                n.node_type.as_str(),
                "Sort" | "Bitmap Heap Scan" | "Seq Scan"
            )
        })
        .collect();
    assert!(
        unwanted.is_empty(),
        "{case}: the claim reads or sorts every due row ({unwanted:?}):\n{plan}"
    );
}

fn assert_one_plan(nodes: &[Node], case: &str) {
    let plan = render(nodes);
    let due: Vec<&Node> = nodes
        .iter()
        .filter(|n| n.cte.as_deref() == Some("CTE due"))
        .collect();
    assert!(
        due.iter().any(|n| n.node_type == "LockRows"),
        "{case}: no LockRows in the due CTE:\n{plan}"
    );
    assert_ordered_scan(&due, "outbox_events_due", case, &plan);
    let table_scans: Vec<&Node> = nodes
        .iter()
        .filter(|n| n.node_type == "Seq Scan" && n.relation.as_deref() == Some("outbox_events"))
        .collect();
    assert!(
        table_scans.is_empty(),
        "{case}: the claim scans the whole outbox table:\n{plan}"
    );
}

/// Statistics stay exactly as each test leaves them: no autovacuum or autoanalyze may run in
/// between. One consumer subscribes, so the fan-out part is planned as in production.
async fn prepare(conn: &mut AsyncPgConnection) {
    conn.batch_execute(
        "ALTER TABLE outbox_events SET (autovacuum_enabled = off);
         INSERT INTO consumer_states (consumer) VALUES ('c1');
         INSERT INTO consumer_subscriptions (consumer, event_type) VALUES ('c1', 'ORDER_STATUS_CHANGED');",
    )
    .await
    .unwrap();
}

/// `n` events with `status`, written in one statement (the library's insert path would take
/// minutes for half a million rows and is not what is under test).
fn insert_rows(n: usize, status: &str) -> String {
    let published_at = if status == "PUBLISHED" {
        "now()"
    } else {
        "NULL"
    };
    format!(
        "INSERT INTO outbox_events (id, event_type, aggregate_type, aggregate_id, payload, \
             correlation_id, status, published_at) \
         SELECT gen_random_uuid(), 'ORDER_STATUS_CHANGED', 'order', 'o-' || g, \
             jsonb_build_object('order_id', 'o-' || g), 'c-' || g, '{status}', {published_at} \
         FROM generate_series(1, {n}) AS g"
    )
}

#[actix_rt::test]
async fn claim_uses_the_due_index_on_a_fresh_unanalyzed_table() {
    let db = TestDb::new().await;
    let mut conn = db.pool.get().await.unwrap();
    prepare(&mut conn).await;
    conn.batch_execute(&insert_rows(50_000, "PENDING"))
        .await
        .unwrap();
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM pg_stat_user_tables WHERE relname = 'outbox_events' \
             AND last_analyze IS NULL AND last_autoanalyze IS NULL"
        )
        .await,
        1,
        "the table must never have been analyzed"
    );
    let nodes = explain_claim(&mut conn).await;
    assert_claim_plan(&nodes, "fresh table, 50,000 PENDING, no ANALYZE");

    // The statement still does what it did: the 500 oldest rows, published and fanned out.
    diesel::sql_query(CLAIM_SQL)
        .bind::<BigInt, _>(500_i64)
        .bind::<Nullable<Text>, _>(None::<&str>)
        .bind::<Nullable<Text>, _>(None::<&str>)
        .bind::<Bool, _>(true)
        .execute(&mut conn)
        .await
        .expect("run the claim");
    drop(conn);
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM outbox_events WHERE status = 'PUBLISHED' AND seq <= 500"
        )
        .await,
        500
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM outbox_events WHERE status = 'PUBLISHED'")
            .await,
        500
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM inbox_events WHERE consumer = 'c1'")
            .await,
        500
    );
    db.finish(&[]).await;
}

#[actix_rt::test]
async fn claim_uses_the_due_index_on_a_large_analyzed_table() {
    let db = TestDb::new().await;
    let mut conn = db.pool.get().await.unwrap();
    prepare(&mut conn).await;
    conn.batch_execute(&insert_rows(500_000, "PUBLISHED"))
        .await
        .unwrap();
    conn.batch_execute(&insert_rows(1_000, "PENDING"))
        .await
        .unwrap();
    conn.batch_execute("ANALYZE outbox_events").await.unwrap();
    let nodes = explain_claim(&mut conn).await;
    drop(conn);
    assert_claim_plan(&nodes, "500,000 PUBLISHED + 1,000 PENDING, analyzed");
    db.finish(&[]).await;
}

/// The case a bare "hide the limit" fix gets wrong: 10% of an analyzed backlog looks large
/// enough to hash-join against a sequential scan of the table.
#[actix_rt::test]
async fn claim_finds_claimed_rows_by_key_on_an_analyzed_backlog() {
    let db = TestDb::new().await;
    let mut conn = db.pool.get().await.unwrap();
    prepare(&mut conn).await;
    conn.batch_execute(&insert_rows(200_000, "PENDING"))
        .await
        .unwrap();
    conn.batch_execute("ANALYZE outbox_events").await.unwrap();
    let nodes = explain_claim(&mut conn).await;
    drop(conn);
    assert_claim_plan(&nodes, "200,000 PENDING, analyzed");
    db.finish(&[]).await;
}

/// A fresh deployment: the publisher's cached statement gets its generic plan while the table
/// is still empty, and keeps it as the table grows until an ANALYZE. Unguarded, that plan scans
/// the whole table for every claim (checked below, so this test would notice if PostgreSQL
/// stopped doing that); with the guard the library runs first, it uses the indexes.
#[actix_rt::test]
async fn claim_planned_on_an_empty_table_still_uses_the_indexes() {
    let db = TestDb::new().await;
    let mut conn = db.pool.get().await.unwrap();
    prepare(&mut conn).await;
    let [_, (unguarded, _)] = explain_unguarded(&mut conn).await;
    assert!(
        unguarded
            .iter()
            .any(|n| n.node_type == "Seq Scan" && n.relation.as_deref() == Some("outbox_events")),
        "without the guard, an empty table was expected to get a table scan:\n{}",
        render(&unguarded)
    );
    let nodes = explain_claim(&mut conn).await;
    drop(conn);
    assert_claim_plan(&nodes, "empty table, never analyzed");
    db.finish(&[]).await;
}

/// The consumer's claim, behind the plan guard it runs with: its `ORDER BY` is the partial
/// index `inbox_events_due` column for column, so an ordered scan of that index that stops at
/// the limit wins in every state the outbox claim can be trapped in: a generic plan made while
/// the table was empty and kept as it grew, a fresh table nobody analyzed, a large analyzed
/// one; nothing else in it scans the inbox table.
#[actix_rt::test]
async fn the_consumers_claim_reads_its_due_index_in_order_whatever_the_statistics() {
    let db = TestDb::new().await;
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(&format!(
        "ALTER TABLE inbox_events SET (autovacuum_enabled = off);
         INSERT INTO consumer_states (consumer) VALUES ('c1');
         SET enable_seqscan = off; SET enable_bitmapscan = off;
         PREPARE inbox_claim_test (text, int8, int8, text, int8, bool) AS {INBOX_CLAIM_SQL};"
    ))
    .await
    .unwrap();
    // Six runs on the empty table make PostgreSQL settle on a generic plan and keep it.
    for _ in 0..6 {
        conn.batch_execute("EXECUTE inbox_claim_test ('c1', 500, 60000, 'p', 7, true)")
            .await
            .unwrap();
    }
    let explain = async |conn: &mut AsyncPgConnection, case: &str| {
        let row: ExplainRow = diesel::sql_query(
            "EXPLAIN (FORMAT JSON) EXECUTE inbox_claim_test ('c1', 500, 60000, 'p', 7, true)",
        )
        .get_result(conn)
        .await
        .expect("EXPLAIN the consumer's claim");
        let mut nodes = Vec::new();
        flatten(&row.plan[0]["Plan"], None, 0, &mut nodes);
        let due: Vec<&Node> = nodes
            .iter()
            .filter(|n| n.cte.as_deref() == Some("CTE due"))
            .collect();
        assert_ordered_scan(&due, "inbox_events_due", case, &render(&nodes));
        let scans: Vec<&Node> = nodes
            .iter()
            .filter(|n| {
                matches!(n.node_type.as_str(), "Seq Scan" | "Bitmap Heap Scan")
                    && n.relation.as_deref() == Some("inbox_events")
            })
            .collect();
        assert!(
            scans.is_empty(),
            "{case}: the claim scans the inbox table:\n{}",
            render(&nodes)
        );
        // An ordered consumer's rows look for an unfinished earlier event of their aggregate
        // by key, in the index that holds only ordered consumers' unfinished rows.
        assert!(
            nodes
                .iter()
                .any(|n| n.index.as_deref() == Some("inbox_events_ordered")),
            "{case}: the ordered test does not read inbox_events_ordered:\n{}",
            render(&nodes)
        );
    };
    explain(&mut conn, "empty table").await;

    // 60,000 rows for three consumers, one in ten due, written after the plan was made; half
    // of them ordered (as if their consumers had been, in turn).
    conn.batch_execute(
        "INSERT INTO inbox_events (event_id, consumer, event_type, event_version, \
             aggregate_type, aggregate_id, payload, correlation_id, event_created_at, status, \
             event_seq, ordered) \
         SELECT gen_random_uuid(), 'c' || (g % 3), 'ORDER_STATUS_CHANGED', 1, 'order', \
             'o-' || g, '{}', 'c-' || g, now(), \
             CASE WHEN g % 10 = 0 THEN 'RECEIVED' ELSE 'PROCESSED' END, g, g % 2 = 0 \
         FROM generate_series(1, 60000) AS g",
    )
    .await
    .unwrap();
    explain(&mut conn, "planned empty, now 60,000 rows, never analyzed").await;
    conn.batch_execute("SET plan_cache_mode = force_custom_plan")
        .await
        .unwrap();
    explain(&mut conn, "custom plan, never analyzed").await;
    conn.batch_execute("ANALYZE inbox_events; SET plan_cache_mode = force_generic_plan")
        .await
        .unwrap();
    explain(&mut conn, "generic plan, analyzed").await;
    conn.batch_execute("RESET plan_cache_mode; DEALLOCATE inbox_claim_test")
        .await
        .unwrap();

    // And it claims what it should: c1's 500 oldest due rows, under one lease.
    let claimed = diesel::sql_query(INBOX_CLAIM_SQL)
        .bind::<diesel::sql_types::Text, _>("c1")
        .bind::<diesel::sql_types::BigInt, _>(500)
        .bind::<diesel::sql_types::BigInt, _>(60000)
        .bind::<diesel::sql_types::Text, _>("p")
        .bind::<diesel::sql_types::BigInt, _>(7)
        .bind::<diesel::sql_types::Bool, _>(true)
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(claimed, 500);
    let leases = "SELECT count(*) AS n FROM inbox_leases WHERE consumer = 'c1'";
    assert_eq!(db.count(leases).await, 1);
    let named = "SELECT cardinality(ids)::int8 AS n FROM inbox_leases WHERE consumer = 'c1' \
                 AND ids <@ (SELECT array_agg(id) FROM inbox_events WHERE consumer = 'c1' \
                             AND status = 'RECEIVED')";
    assert_eq!(
        db.count(named).await,
        500,
        "the lease names the 500 rows, still due"
    );
    drop(conn);
    db.finish(&[]).await;
}
