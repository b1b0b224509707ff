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
//!
//! The operator API's lists and look-ups (the tests after the claims') are held to the same
//! rule on a million-row inbox and outbox: each filter the API offers is read through a named
//! index, never by a sequential scan of the table. Their statements are included from the files
//! under `src/store/` the library includes.

use crate::common;

use common::*;
use diesel::sql_types::{BigInt, Bool, Json, Nullable, Text, Uuid as SqlUuid};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use serde_json::Value;

/// The claim statement exactly as the library runs it.
const CLAIM_SQL: &str = include_str!("../../src/store/claim.sql");
/// The external route's claim, exactly as the library runs it.
const LEASE_CLAIM_SQL: &str = include_str!("../../src/store/lease_claim.sql");
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
    /// The condition an index scan reads by (`Index Cond`), if any.
    index_cond: Option<String>,
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
        index_cond: text("Index Cond"),
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
        .bind::<BigInt, _>(i64::MIN)
        .get_result(conn)
        .await
        .expect("EXPLAIN the claim");
    conn.batch_execute(&format!(
        "PREPARE claim_plan_test (int8, text, text, bool, int8) AS {}; SET plan_cache_mode = force_generic_plan",
        CLAIM_SQL
    ))
    .await
    .expect("PREPARE the claim");
    let generic: ExplainRow = diesel::sql_query(
        "EXPLAIN (FORMAT JSON) EXECUTE claim_plan_test (500, NULL, NULL, false, 0)",
    )
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
        "ALTER TABLE actix_outbox.outbox_events SET (autovacuum_enabled = off);
         INSERT INTO actix_outbox.consumer_states (consumer) VALUES ('c1');
         INSERT INTO actix_outbox.consumer_subscriptions (consumer, event_type) VALUES ('c1', 'ORDER_STATUS_CHANGED');",
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
        "INSERT INTO actix_outbox.outbox_events (id, event_type, aggregate_type, aggregate_id, payload, \
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
        .bind::<BigInt, _>(i64::MIN)
        .execute(&mut conn)
        .await
        .expect("run the claim");
    drop(conn);
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'PUBLISHED' AND seq <= 500"
        )
        .await,
        500
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'PUBLISHED'")
            .await,
        500
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'c1'")
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
    conn.batch_execute("ANALYZE actix_outbox.outbox_events")
        .await
        .unwrap();
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
    conn.batch_execute("ANALYZE actix_outbox.outbox_events")
        .await
        .unwrap();
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
        "ALTER TABLE actix_outbox.inbox_events SET (autovacuum_enabled = off);
         INSERT INTO actix_outbox.consumer_states (consumer) VALUES ('c1');
         SET enable_seqscan = off; SET enable_bitmapscan = off;
         PREPARE inbox_claim_test (text, int8, int8, text, int8, bool, timestamptz, int8) AS {INBOX_CLAIM_SQL};"
    ))
    .await
    .unwrap();
    // Six runs on the empty table make PostgreSQL settle on a generic plan and keep it.
    for _ in 0..6 {
        conn.batch_execute("EXECUTE inbox_claim_test ('c1', 500, 60000, 'p', 7, true, NULL, 0)")
            .await
            .unwrap();
    }
    let explain = async |conn: &mut AsyncPgConnection, case: &str| {
        let row: ExplainRow = diesel::sql_query(
            "EXPLAIN (FORMAT JSON) EXECUTE inbox_claim_test ('c1', 500, 60000, 'p', 7, true, NULL, 0)",
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
        "INSERT INTO actix_outbox.inbox_events (event_id, consumer, event_type, event_version, \
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
    conn.batch_execute(
        "ANALYZE actix_outbox.inbox_events; SET plan_cache_mode = force_generic_plan",
    )
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
        .bind::<Nullable<diesel::sql_types::Timestamptz>, _>(None::<chrono::DateTime<chrono::Utc>>)
        .bind::<diesel::sql_types::BigInt, _>(i64::MIN)
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(claimed, 500);
    let leases = "SELECT count(*) AS n FROM actix_outbox.inbox_leases WHERE consumer = 'c1'";
    assert_eq!(db.count(leases).await, 1);
    let named = "SELECT cardinality(ids)::int8 AS n FROM actix_outbox.inbox_leases WHERE consumer = 'c1' \
                 AND ids <@ (SELECT array_agg(id) FROM actix_outbox.inbox_events WHERE consumer = 'c1' \
                             AND status = 'RECEIVED')";
    assert_eq!(
        db.count(named).await,
        500,
        "the lease names the 500 rows, still due"
    );
    drop(conn);
    db.finish(&[]).await;
}

/// Shared blocks the node reading `index` touched, summed over the plan of an
/// `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`.
fn blocks_read_through(plan: &Value, index: &str) -> i64 {
    let mine = if plan.get("Index Name").and_then(Value::as_str) == Some(index) {
        ["Shared Hit Blocks", "Shared Read Blocks"]
            .iter()
            .filter_map(|k| plan.get(*k).and_then(Value::as_i64))
            .sum()
    } else {
        0
    };
    mine + plan
        .get("Plans")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|p| blocks_read_through(p, index))
        .sum::<i64>()
}

/// `store::scan`: while another session holds a snapshot open, nothing can remove, or even
/// mark, the due-index entries of rows already delivered, and a claim that reads from the
/// start walks every one of them. A claim started past the last row the previous claim took
/// descends the index to it instead. Counted in blocks the claim reads, both claims'
/// (the publisher's and a consumer's), each from the start and from the start it is given.
#[actix_rt::test]
async fn under_a_held_snapshot_a_claim_started_past_delivered_rows_does_not_walk_them() {
    let db = TestDb::new().await;
    let mut conn = db.pool.get().await.unwrap();
    prepare(&mut conn).await;
    conn.batch_execute(&format!(
        "ALTER TABLE actix_outbox.inbox_events SET (autovacuum_enabled = off); {}; \
         INSERT INTO actix_outbox.inbox_events (event_id, consumer, event_type, event_version, \
             aggregate_type, aggregate_id, payload, correlation_id, event_created_at, \
             next_attempt_at, status) \
         SELECT gen_random_uuid(), 'c1', 'ORDER_STATUS_CHANGED', 1, 'order', 'o-' || g, '{{}}', \
             'c-' || g, now(), now() - interval '1 hour' + g * interval '1 ms', 'RECEIVED' \
         FROM generate_series(1, 20000) AS g",
        insert_rows(20_000, "PENDING")
    ))
    .await
    .unwrap();
    let mut holder = db.pool.get().await.unwrap();
    holder
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM actix_outbox.outbox_events")
        .await
        .unwrap();
    // 19,000 of each delivered behind the held snapshot.
    conn.batch_execute(
        "UPDATE actix_outbox.outbox_events SET status = 'PUBLISHED', published_at = now() \
         WHERE seq <= (SELECT min(seq) + 18999 FROM actix_outbox.outbox_events); \
         UPDATE actix_outbox.inbox_events SET status = 'PROCESSED', processed_at = now() \
         WHERE id <= (SELECT min(id) + 18999 FROM actix_outbox.inbox_events)",
    )
    .await
    .unwrap();
    #[derive(QueryableByName)]
    struct Last {
        #[diesel(sql_type = BigInt)]
        seq: i64,
        #[diesel(sql_type = BigInt)]
        id: i64,
        #[diesel(sql_type = Text)]
        at: String,
    }
    let last: Last = diesel::sql_query(
        "SELECT (SELECT max(seq) FROM actix_outbox.outbox_events WHERE status = 'PUBLISHED') AS seq, \
             i.id, i.next_attempt_at::text AS at FROM actix_outbox.inbox_events i \
         WHERE i.id = (SELECT max(id) FROM actix_outbox.inbox_events WHERE status = 'PROCESSED')",
    )
    .get_result(&mut conn)
    .await
    .unwrap();

    // Each claim as the runtime runs it (behind the plan guard), both as planned with its
    // values and as the generic plan a cached statement may switch to: in both, the start
    // must be a condition of the index scan, not a filter applied to every entry walked.
    let analyze = async |conn: &mut AsyncPgConnection, sql: &str, types: &str, args: &str| {
        let index = if sql == CLAIM_SQL || sql == LEASE_CLAIM_SQL {
            "outbox_events_due"
        } else {
            "inbox_events_due"
        };
        let mut blocks = Vec::new();
        for mode in ["force_custom_plan", "force_generic_plan"] {
            conn.batch_execute(&format!(
                "BEGIN; {PLAN_GUARD}; PREPARE start_test ({types}) AS {sql}; \
                 SET LOCAL plan_cache_mode = {mode}"
            ))
            .await
            .unwrap();
            let row: ExplainRow = diesel::sql_query(format!(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE start_test ({args})"
            ))
            .get_result(conn)
            .await
            .expect("EXPLAIN ANALYZE the claim");
            conn.batch_execute("ROLLBACK; DEALLOCATE start_test")
                .await
                .unwrap();
            blocks.push((mode, blocks_read_through(&row.plan[0]["Plan"], index)));
        }
        blocks
    };
    const OUTBOX_TYPES: &str = "int8, text, text, bool, int8";
    const LEASE_TYPES: &str = "int8, text, int8, int8";
    let leased = |after: i64| format!("250, 'p', 60000, {after}");
    const INBOX_TYPES: &str = "text, int8, int8, text, int8, bool, timestamptz, int8";
    let outbox = |after: i64| format!("250, NULL, NULL, false, {after}");
    let inbox = |after: &str, id: i64| format!("'c1', 250, 60000, 'p', 7, true, {after}, {id}");
    let from_start_at = "NULL";
    let started_at = format!("'{}'", last.at);
    let cases = [
        (
            "the publisher's claim",
            analyze(&mut conn, CLAIM_SQL, OUTBOX_TYPES, &outbox(i64::MIN)).await,
            analyze(&mut conn, CLAIM_SQL, OUTBOX_TYPES, &outbox(last.seq)).await,
        ),
        (
            "the external route's claim",
            analyze(&mut conn, LEASE_CLAIM_SQL, LEASE_TYPES, &leased(i64::MIN)).await,
            analyze(&mut conn, LEASE_CLAIM_SQL, LEASE_TYPES, &leased(last.seq)).await,
        ),
        (
            "a consumer's claim",
            analyze(
                &mut conn,
                INBOX_CLAIM_SQL,
                INBOX_TYPES,
                &inbox(from_start_at, i64::MIN),
            )
            .await,
            analyze(
                &mut conn,
                INBOX_CLAIM_SQL,
                INBOX_TYPES,
                &inbox(&started_at, last.id),
            )
            .await,
        ),
    ];
    holder.batch_execute("COMMIT").await.unwrap();
    for (claim, from_start, started) in cases {
        for ((mode, from_start), (_, started)) in from_start.into_iter().zip(started) {
            assert!(
                from_start > 20 * started.max(1),
                "{claim} ({mode}): from the start it read {from_start} blocks of its due \
                 index, started past the delivered rows {started}: the start is not read by \
                 the index"
            );
        }
    }
    drop((conn, holder));
    db.finish(&[]).await;
}

// ------------------------------------------------------------------ the operator API's lists

const LIST_INBOX_SQL: &str = include_str!("../../src/store/admin/list_inbox.sql");
const LIST_IN_FLIGHT_SQL: &str = include_str!("../../src/store/admin/list_inbox_in_flight.sql");
const LIST_OUTBOX_SQL: &str = include_str!("../../src/store/admin/list_outbox.sql");
const LIST_AUDIT_SQL: &str = include_str!("../../src/store/admin/list_audit.sql");
const BLOCKED_SQL: &str = include_str!("../../src/store/admin/blocked_aggregates.sql");
const EVENT_OUTBOX_SQL: &str = include_str!("../../src/store/admin/event_outbox.sql");
const EVENT_FANOUT_SQL: &str = include_str!("../../src/store/admin/event_fanout.sql");
const TIMELINE_SQL: &str = include_str!("../../src/store/timeline.sql");
const REPLAY_LIST_SQL: &str = include_str!("../../src/store/replay_list.sql");

/// `sql` as the library sends it: with a cursor consumer's status where its marker stands.
fn with_cursor_status(sql: &str) -> String {
    sql.replace(
        "/* cursor_status */",
        include_str!("../../src/store/cursor_status.sql"),
    )
}

/// The tables a list must never read whole.
const BIG: &[&str] = &["inbox_events", "outbox_events", "admin_audit", "replays"];

/// `EXPLAIN (FORMAT JSON)` of `$sql` with its parameters bound as the library binds them (so
/// planned with their values, as the library's uncached statements are), flattened.
macro_rules! explain {
    ($conn:expr, $sql:expr $(, $t:ty => $v:expr)* $(,)?) => {{
        let row: ExplainRow = diesel::sql_query(format!("EXPLAIN (FORMAT JSON) {}", $sql))
            $(.bind::<$t, _>($v))*
            .get_result($conn)
            .await
            .expect("EXPLAIN");
        let mut nodes = Vec::new();
        flatten(&row.plan[0]["Plan"], None, 0, &mut nodes);
        nodes
    }};
}

/// The history the lists are asked about, as a busy deployment holds it: 1,000,000 inbox rows
/// (4 consumers, 20 types; 1 in 10,000 each RECEIVED, RETRY_PENDING, DEAD_LETTER and IGNORED,
/// the rest PROCESSED; 30 of a rare consumer and 30 of a rare type; 1 in 1,000 received from
/// a broker), 1,000,000 outbox rows alike (1 in 10,000 in each state but PUBLISHED, 30 of the
/// rare type), an ordered consumer with 100 aggregates held up behind a failed head, 200,000
/// audit rows and 20,000 replays, and the RECEIVED rows leased, a lease per consumer. Written
/// by SQL in a few statements, then analyzed.
async fn build_history(conn: &mut AsyncPgConnection) {
    conn.batch_execute(
        "ALTER TABLE actix_outbox.inbox_events SET (autovacuum_enabled = off);
         ALTER TABLE actix_outbox.outbox_events SET (autovacuum_enabled = off);
         INSERT INTO actix_outbox.inbox_events (event_id, consumer, event_type, event_version, aggregate_type,
             aggregate_id, payload, correlation_id, event_created_at, status, processed_at,
             error_code, external)
         SELECT gen_random_uuid(),
             CASE WHEN g % 33333 = 7 THEN 'rare-consumer' ELSE 'c' || (g % 4) END,
             CASE WHEN g % 33333 = 9 THEN 'RARE_TYPE' ELSE 'T' || (g / 4 % 20) END,
             1, 'order', 'o-' || g, '{\"k\": 1}', 'corr-' || g, now(),
             CASE g % 10000 WHEN 1 THEN 'DEAD_LETTER' WHEN 2 THEN 'RETRY_PENDING'
                 WHEN 3 THEN 'IGNORED' WHEN 4 THEN 'RECEIVED' ELSE 'PROCESSED' END,
             CASE WHEN g % 10000 NOT IN (1, 2, 3, 4) THEN now() END,
             CASE WHEN g % 10000 IN (1, 2) THEN 'HANDLER_FAILED' END,
             g % 1000 = 5
         FROM generate_series(1, 1000000) AS g;
         INSERT INTO actix_outbox.inbox_events (event_id, consumer, event_type, event_version, aggregate_type,
             aggregate_id, payload, correlation_id, event_created_at, status, event_seq, ordered)
         SELECT gen_random_uuid(), 'c-ordered', 'T1', 1, 'order', 'held-' || (g / 3), '{}',
             'held-' || g, now(), CASE WHEN g % 3 = 0 THEN 'RETRY_PENDING' ELSE 'RECEIVED' END,
             g, true
         FROM generate_series(0, 299) AS g;
         INSERT INTO actix_outbox.outbox_events (id, event_type, aggregate_type, aggregate_id, payload,
             correlation_id, status, published_at)
         SELECT (lpad(to_hex(1700000000000 + g), 12, '0') || '70008000'
                 || lpad(to_hex(g), 12, '0'))::uuid,
             CASE WHEN g % 33333 = 9 THEN 'RARE_TYPE' ELSE 'T' || (g % 20) END, 'order',
             'o-' || g, '{\"k\": 1}', 'corr-' || g,
             CASE g % 10000 WHEN 1 THEN 'DEAD_LETTER' WHEN 2 THEN 'RETRY_PENDING'
                 WHEN 3 THEN 'IGNORED' WHEN 4 THEN 'PENDING' WHEN 5 THEN 'PROCESSING'
                 ELSE 'PUBLISHED' END,
             CASE WHEN g % 10000 NOT IN (1, 2, 3, 4, 5) THEN now() END
         FROM generate_series(1, 1000000) AS g;
         INSERT INTO actix_outbox.admin_audit (who, action, target)
         SELECT 'op', 'inbox.retry', 'inbox:' || g FROM generate_series(1, 200000) AS g;
         INSERT INTO actix_outbox.replays (consumer, upto_id, cursor_id, total, rate, requested_by, status)
         SELECT 'c' || (g % 4), 1000, 0, 1000, 100, 'op', 'DONE'
         FROM generate_series(1, 20000) AS g;
         INSERT INTO actix_outbox.consumer_states (consumer) VALUES ('c0'), ('c1'), ('c2'), ('c3');
         INSERT INTO actix_outbox.consumer_subscriptions (consumer, event_type)
         SELECT 'c' || c, 'T' || t FROM generate_series(0, 3) c, generate_series(0, 19) t;
         INSERT INTO actix_outbox.inbox_leases (token, consumer, locked_by, backend, locked_until, ids)
             SELECT 1000 + n, consumer, 'host:1:abc', 1, now() + interval '1 minute', ids
             FROM (SELECT consumer, row_number() OVER () AS n, array_agg(id) AS ids
                   FROM actix_outbox.inbox_events WHERE status = 'RECEIVED'
                   GROUP BY consumer) l;
         ANALYZE actix_outbox.inbox_leases;
         ANALYZE actix_outbox.inbox_events; ANALYZE actix_outbox.outbox_events; ANALYZE actix_outbox.admin_audit; ANALYZE actix_outbox.replays;
         ANALYZE actix_outbox.consumer_states; ANALYZE actix_outbox.consumer_subscriptions;",
    )
    .await
    .expect("write the history");
}

/// `case` reads its rows through `index` (an index scan, an index-only scan or a bitmap of
/// it), and no table of [`BIG`] is read by a sequential scan.
fn assert_served(nodes: &[Node], index: &str, case: &str) {
    let plan = render(nodes);
    assert!(
        nodes.iter().any(|n| {
            matches!(
                n.node_type.as_str(),
                "Index Scan" | "Index Only Scan" | "Bitmap Index Scan"
            ) && n.index.as_deref() == Some(index)
        }),
        "{case}: not read through {index}:\n{plan}"
    );
    let scans: Vec<&Node> = nodes
        .iter()
        .filter(|n| {
            n.node_type == "Seq Scan" && n.relation.as_deref().is_some_and(|r| BIG.contains(&r))
        })
        .collect();
    assert!(
        scans.is_empty(),
        "{case}: a whole table is scanned ({scans:?}):\n{plan}"
    );
}

async fn explain_inbox_list(
    conn: &mut AsyncPgConnection,
    status: Option<&str>,
    event_type: Option<&str>,
    consumer: Option<&str>,
    before: Option<i64>,
) -> Vec<Node> {
    let sql = if status == Some("IN_FLIGHT") {
        LIST_IN_FLIGHT_SQL
    } else {
        LIST_INBOX_SQL
    };
    explain!(conn, sql,
        Nullable<Text> => status, Nullable<Text> => event_type, Nullable<Text> => consumer,
        Nullable<BigInt> => before, BigInt => 50_i64, Bool => false)
}

async fn explain_outbox_list(
    conn: &mut AsyncPgConnection,
    status: Option<&str>,
    event_type: Option<&str>,
    before: Option<uuid::Uuid>,
) -> Vec<Node> {
    explain!(conn, LIST_OUTBOX_SQL,
        Nullable<Text> => status, Nullable<Text> => event_type,
        Nullable<SqlUuid> => before, BigInt => 50_i64, Bool => false)
}

/// The index that serves an inbox list filtered on `status` (`None`: any), whatever the other
/// filters, unless the rows asked for are a rare consumer's or type's among the delivered
/// ones (the known limit below). The delivered rows are the mass, so the primary key, walked
/// newest first, meets a page of them at once.
fn inbox_index(status: Option<&str>) -> &'static str {
    match status {
        None | Some("PROCESSED" | "IN_FLIGHT") => "inbox_events_pkey",
        Some("RECEIVED" | "RETRY_PENDING") => "inbox_events_due",
        Some("DEAD_LETTER") => "inbox_events_dead",
        Some("IGNORED") => "inbox_events_ignored",
        Some(other) => panic!("no inbox status {other}"),
    }
}

fn outbox_index(status: Option<&str>) -> &'static str {
    match status {
        None | Some("PUBLISHED") => "outbox_events_pkey",
        Some("PENDING" | "RETRY_PENDING") => "outbox_events_due",
        Some("PROCESSING") => "outbox_events_processing",
        Some("DEAD_LETTER") => "outbox_events_dead",
        Some("IGNORED") => "outbox_events_ignored",
        Some(other) => panic!("no outbox status {other}"),
    }
}

/// Every list of the operator API, with every filter it offers (each status, alone and with a
/// consumer and an event type, common or rare, and a page cursor), is read through an index
/// on a million-row inbox and outbox. The exception is the known limit below.
#[actix_rt::test]
async fn every_operator_list_and_filter_is_read_through_an_index() {
    let db = TestDb::new().await;
    let mut pooled = db.pool.get().await.unwrap();
    build_history(&mut pooled).await;
    let conn = &mut *pooled;

    let statuses = [
        None,
        Some("RECEIVED"),
        Some("RETRY_PENDING"),
        Some("DEAD_LETTER"),
        Some("IGNORED"),
        Some("PROCESSED"),
        Some("IN_FLIGHT"),
    ];
    let mut cases = 0;
    for status in statuses {
        for event_type in [None, Some("T3"), Some("RARE_TYPE")] {
            for consumer in [None, Some("c1"), Some("rare-consumer")] {
                let rare = event_type == Some("RARE_TYPE") || consumer == Some("rare-consumer");
                if rare && matches!(status, None | Some("PROCESSED")) {
                    continue; // the known limit
                }
                for before in [None, Some(500_000_i64)] {
                    let nodes =
                        explain_inbox_list(conn, status, event_type, consumer, before).await;
                    let case = format!(
                        "inbox list, status {status:?}, type {event_type:?}, consumer \
                         {consumer:?}, before {before:?}"
                    );
                    assert_served(&nodes, inbox_index(status), &case);
                    cases += 1;
                }
            }
        }
    }

    let statuses = [
        None,
        Some("PENDING"),
        Some("PROCESSING"),
        Some("RETRY_PENDING"),
        Some("DEAD_LETTER"),
        Some("IGNORED"),
        Some("PUBLISHED"),
    ];
    // The 500,000th outbox row's id: a page cursor halfway down.
    let middle: uuid::Uuid = "018bcfed-0920-7000-8000-00000007a120".parse().unwrap();
    for status in statuses {
        for event_type in [None, Some("T3"), Some("RARE_TYPE")] {
            if event_type == Some("RARE_TYPE") && matches!(status, None | Some("PUBLISHED")) {
                continue; // the known limit
            }
            for before in [None, Some(middle)] {
                let nodes = explain_outbox_list(conn, status, event_type, before).await;
                let case = format!(
                    "outbox list, status {status:?}, type {event_type:?}, before {before:?}"
                );
                assert_served(&nodes, outbox_index(status), &case);
                cases += 1;
            }
        }
    }

    for before in [None, Some(100_000_i64)] {
        let nodes = explain!(conn, LIST_AUDIT_SQL, Nullable<BigInt> => before, BigInt => 50_i64);
        assert_served(
            &nodes,
            "admin_audit_pkey",
            &format!("audit, before {before:?}"),
        );
        cases += 1;
    }
    for consumer in [None, Some("c1")] {
        let nodes = explain!(conn, REPLAY_LIST_SQL, Nullable<Text> => consumer, BigInt => 50_i64);
        assert_served(
            &nodes,
            "replays_pkey",
            &format!("replays, consumer {consumer:?}"),
        );
        cases += 1;
    }
    for consumer in [None, Some("c-ordered"), Some("c1")] {
        let nodes = explain!(conn, BLOCKED_SQL, Nullable<Text> => consumer, BigInt => 50_i64);
        let case = format!("blocked aggregates, consumer {consumer:?}");
        assert_served(&nodes, "inbox_events_ordered", &case);
        cases += 1;
    }

    // One event's fan-out and one correlation's timeline, by key.
    let event = middle;
    let nodes = explain!(conn, EVENT_OUTBOX_SQL, SqlUuid => event, Bool => false);
    assert_served(&nodes, "outbox_events_pkey", "event, its outbox row");
    let nodes = explain!(conn, with_cursor_status(EVENT_FANOUT_SQL), SqlUuid => event);
    assert_served(
        &nodes,
        "inbox_events_event_consumer",
        "event, its inbox rows",
    );
    assert_served(&nodes, "outbox_events_pkey", "event, its type");
    let timeline = with_cursor_status(TIMELINE_SQL);
    let nodes = explain!(conn, timeline, Text => "corr-5005", BigInt => 1000_i64);
    for index in [
        "outbox_events_correlation",
        "inbox_events_event_consumer",
        "inbox_events_correlation",
    ] {
        assert_served(&nodes, index, "timeline");
    }
    cases += 3;
    assert_eq!(cases, 154, "every case above was explained");
    drop(pooled);
    db.finish(&[]).await;
}

/// Known limit: the rows of a rare consumer or a rare event type among the delivered
/// (PROCESSED, PUBLISHED) ones, asked for alone or with that status, have no index: the list
/// scans the table (or the primary key, to its end) for them. An index that finds them costs
/// every delivered event one more B-tree entry (the figures are in `docs/operations.md`),
/// which the drain's write cost does not allow. Run with `--run-ignored all` to see the plans.
#[actix_rt::test]
#[ignore = "known limit: a rare consumer's or event type's delivered rows are found by a scan"]
async fn a_rare_consumer_or_type_among_delivered_rows_is_found_through_an_index() {
    let db = TestDb::new().await;
    let mut pooled = db.pool.get().await.unwrap();
    build_history(&mut pooled).await;
    let conn = &mut *pooled;
    let mut failures = Vec::new();
    let mut check = |nodes: Vec<Node>, column: &str, case: String| {
        // Found through an index on the filtered column, not walked past with a filter.
        let by_column = nodes
            .iter()
            .any(|n| n.index_cond.as_deref().is_some_and(|c| c.contains(column)));
        let table_scan = nodes.iter().any(|n| {
            n.node_type == "Seq Scan" && n.relation.as_deref().is_some_and(|r| BIG.contains(&r))
        });
        if !by_column || table_scan {
            failures.push(format!("{case}:\n{}", render(&nodes)));
        }
    };
    for status in [None, Some("PROCESSED")] {
        for (event_type, consumer, column) in [
            (None, Some("rare-consumer"), "consumer"),
            (Some("RARE_TYPE"), None, "event_type"),
        ] {
            let nodes = explain_inbox_list(conn, status, event_type, consumer, None).await;
            check(nodes, column, format!("inbox, status {status:?}, {column}"));
        }
    }
    for status in [None, Some("PUBLISHED")] {
        let nodes = explain_outbox_list(conn, status, Some("RARE_TYPE"), None).await;
        check(
            nodes,
            "event_type",
            format!("outbox, status {status:?}, event_type"),
        );
    }
    assert!(
        failures.is_empty(),
        "not found through an index:\n{}",
        failures.join("\n")
    );
    drop(pooled);
    db.finish(&[]).await;
}
