//! Upgrading an install of an earlier version, which kept the library's tables in `public` and
//! its versions in diesel's `public.__diesel_schema_migrations`: `migrate` moves it into the
//! library's schema in place, every row kept once, and a runtime started on it goes on
//! delivering what was due. Every assertion counts or compares rows; none reads logs or
//! measures time.

use crate::common;

use std::collections::BTreeMap;

use actix_outbox::db::{migrate_with, MigrateConfig, MigrateReport, MIGRATIONS};
use common::*;
use diesel::sql_types::{BigInt, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use uuid::Uuid;

/// What `public` holds of the application: all that is left there once the library moved.
const APP_IN_PUBLIC: [&str; 7] = [
    "__diesel_schema_migrations",
    "__diesel_schema_migrations_pkey",
    "effects",
    "effects_id_seq",
    "effects_pkey",
    "orders",
    "orders_pkey",
];

/// The application's own diesel migration, older than the library's.
const APP_VERSION: &str = "20250101000000";

/// A database session that cannot exist: PostgreSQL's pids are operating-system pids, and
/// Linux's never exceed 4,194,304.
const DEAD_BACKEND: i32 = 2_147_483_000;

/// The tables an earlier version kept in `public` (its last version: `inbox_in_flight` was
/// dropped by `inbox_lease`), each with what its rows are counted by.
const TABLES: &[(&str, &str)] = &[
    ("outbox_events", "status"),
    ("inbox_events", "consumer || '/' || status"),
    ("consumer_states", "consumer || '/' || paused"),
    ("consumer_subscriptions", "consumer || '/' || event_type"),
    ("idempotency_keys", "NULL"),
    ("reconcile_runs", "NULL"),
    ("admin_audit", "NULL"),
    ("outbox_stats_samples", "NULL"),
    ("aggregate_versions", "NULL"),
    ("inbox_leases", "consumer"),
    ("unrouted_events", "NULL"),
    ("contract_findings", "NULL"),
    ("replays", "status"),
];

/// Everything the runtime leaves alone: after it has run, these are exactly as the earlier
/// version left them.
const UNTOUCHED: &[&str] = &[
    "idempotency_keys",
    "admin_audit",
    "aggregate_versions",
    "replays",
    "reconcile_runs",
];

#[derive(QueryableByName)]
struct Tally {
    #[diesel(sql_type = Text)]
    k: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[derive(QueryableByName)]
struct Line {
    #[diesel(sql_type = Text)]
    k: String,
    #[diesel(sql_type = Text)]
    v: String,
}

async fn lines(db: &TestDb, sql: &str) -> BTreeMap<String, String> {
    let mut conn = db.pool.get().await.unwrap();
    let rows: Vec<Line> = diesel::sql_query(sql)
        .load(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    rows.into_iter().map(|r| (r.k, r.v)).collect()
}

/// Rows per (table, what `TABLES` counts them by) in `schema`.
async fn census(db: &TestDb, schema: &str) -> BTreeMap<String, i64> {
    let sql = TABLES
        .iter()
        .map(|(t, by)| {
            format!(
                "SELECT '{t}' || coalesce('/' || ({by}), '') AS k, count(*) AS n \
                 FROM {schema}.{t} GROUP BY 1"
            )
        })
        .collect::<Vec<_>>()
        .join(" UNION ALL ");
    let mut conn = db.pool.get().await.unwrap();
    let rows: Vec<Tally> = diesel::sql_query(&sql)
        .load(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    rows.into_iter().map(|r| (r.k, r.n)).collect()
}

/// Every row of each of `tables` in `schema`, every column, as one digest per table.
async fn fingerprints(db: &TestDb, schema: &str, tables: &[&str]) -> BTreeMap<String, String> {
    let sql = tables
        .iter()
        .map(|t| {
            format!(
                "SELECT '{t}' AS k, md5(coalesce(string_agg(r::text, '|' ORDER BY r::text), '')) \
                 AS v FROM {schema}.{t} r"
            )
        })
        .collect::<Vec<_>>()
        .join(" UNION ALL ");
    lines(db, &sql).await
}

/// The relations (tables, indexes, sequences) and functions in `public`.
async fn in_public(db: &TestDb) -> Vec<String> {
    let sql = "SELECT relname::text AS k, relkind::text AS v FROM pg_class \
               WHERE relnamespace = 'public'::regnamespace \
               UNION ALL SELECT proname::text || '()', 'function' FROM pg_proc \
               WHERE pronamespace = 'public'::regnamespace";
    lines(db, sql).await.into_keys().collect()
}

/// An install of an earlier version, made as it was made: diesel's migrations table, then each
/// of the library's migrations up to `until` run in `public` (in a transaction of its own
/// unless it runs without one) and recorded there. Before them, the application's own: its
/// table, the `effects` the test consumers write, and its row in the diesel history.
async fn install_in_public(url: &str, until: &str) {
    let mut conn = AsyncPgConnection::establish(url).await.unwrap();
    conn.batch_execute(&format!(
        "SET search_path = public;
         CREATE TABLE IF NOT EXISTS __diesel_schema_migrations (
             version VARCHAR(50) PRIMARY KEY NOT NULL,
             run_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP);
         CREATE TABLE orders (id text PRIMARY KEY, status text NOT NULL, version bigint NOT NULL DEFAULT 1);
         INSERT INTO orders (id, status) VALUES ('o-1', 'PLACED'), ('o-2', 'COMPLETED');
         CREATE TABLE effects (id bigserial PRIMARY KEY, consumer text NOT NULL, event_id uuid NOT NULL,
                               attempt int NOT NULL);
         INSERT INTO __diesel_schema_migrations (version) VALUES ('{APP_VERSION}');"
    ))
    .await
    .unwrap();
    for m in MIGRATIONS.iter().filter(|m| m.version <= until) {
        let record = format!(
            "INSERT INTO __diesel_schema_migrations (version) VALUES ('{}')",
            m.version
        );
        let what = format!("legacy migration {}_{}", m.version, m.name);
        if m.transactional {
            conn.transaction::<_, diesel::result::Error, _>(async |c| {
                for st in m.statements() {
                    c.batch_execute(st).await?;
                }
                c.batch_execute(&record).await
            })
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        } else {
            for st in m.statements() {
                conn.batch_execute(st)
                    .await
                    .unwrap_or_else(|e| panic!("{what}: {st}: {e}"));
            }
            conn.batch_execute(&record).await.unwrap();
        }
    }
}

/// One outbox row of the earlier version, of `event_type`; `set` is the rest of its state.
fn outbox_row(id: Uuid, aggregate: &str, event_type: &str, set: &str) -> String {
    format!(
        "INSERT INTO public.outbox_events (id, event_type, aggregate_type, aggregate_id, \
             aggregate_version, payload, correlation_id) \
         VALUES ('{id}', '{event_type}', 'order', '{aggregate}', 2, \
             jsonb_build_object('order_id', '{aggregate}'), 'corr-{aggregate}');
         UPDATE public.outbox_events SET {set} WHERE id = '{id}';"
    )
}

/// The inbox row of `consumer` for outbox event `id`, as the fan-out wrote it (but for
/// `event_seq`, which versions before `ordered_consumers` lack); `set` is the rest of its state.
fn inbox_row(id: Uuid, consumer: &str, set: &str) -> String {
    format!(
        "INSERT INTO public.inbox_events (event_id, consumer, event_type, event_version, \
             aggregate_type, aggregate_id, aggregate_version, payload, metadata, correlation_id, \
             causation_id, event_created_at) \
         SELECT id, '{consumer}', event_type, event_version, aggregate_type, aggregate_id, \
             aggregate_version, payload, metadata, correlation_id, causation_id, created_at \
         FROM public.outbox_events WHERE id = '{id}';
         UPDATE public.inbox_events SET {set} WHERE event_id = '{id}' AND consumer = '{consumer}';"
    )
}

/// The events of the earlier version's install, by what was left to do for them.
struct Legacy {
    /// Outbox PENDING.
    pending: [Uuid; 2],
    /// Outbox RETRY_PENDING, due.
    retrying: Uuid,
    /// Outbox RETRY_PENDING, due tomorrow.
    retry_later: Uuid,
    /// Outbox PROCESSING, leased by an external publisher that died.
    leased_out: Uuid,
    /// Outbox DEAD_LETTER and IGNORED.
    dead_out: Uuid,
    ignored_out: Uuid,
    /// Outbox PUBLISHED, of a type nobody is subscribed to (in `unrouted_events`).
    unrouted: Uuid,
    /// Outbox PUBLISHED; `shipping` processed each, `billing`'s row is in the state named.
    received: Uuid,
    retry_due: Uuid,
    processed: Uuid,
    dead: Uuid,
    ignored: Uuid,
    /// `billing`'s row is leased by a loop whose process and session are gone.
    leased: Uuid,
}

impl Legacy {
    fn new() -> Legacy {
        let id = Uuid::now_v7;
        Legacy {
            pending: [id(), id()],
            retrying: id(),
            retry_later: id(),
            leased_out: id(),
            dead_out: id(),
            ignored_out: id(),
            unrouted: id(),
            received: id(),
            retry_due: id(),
            processed: id(),
            dead: id(),
            ignored: id(),
            leased: id(),
        }
    }

    /// The published events with inbox rows.
    fn fanned_out(&self) -> [Uuid; 6] {
        [
            self.received,
            self.retry_due,
            self.processed,
            self.dead,
            self.ignored,
            self.leased,
        ]
    }

    /// The outbox events a runtime publishes: each to `billing` and `shipping`, once.
    fn due_out(&self) -> [Uuid; 4] {
        [
            self.pending[0],
            self.pending[1],
            self.retrying,
            self.leased_out,
        ]
    }

    /// Rows in every state, written as the earlier version wrote them, in `public`; each
    /// PROCESSED inbox row with the one effect its processing committed.
    async fn fill(&self, url: &str) {
        let mut sql = String::new();
        let due = "next_attempt_at = now() - interval '1 minute'";
        for (i, id) in self.pending.iter().enumerate() {
            sql += &outbox_row(*id, &format!("pending-{i}"), "ORDER_STATUS_CHANGED", due);
        }
        sql += &outbox_row(
            self.retrying,
            "retrying",
            "ORDER_STATUS_CHANGED",
            &format!(
                "status = 'RETRY_PENDING', attempt_count = 1, {due}, \
                 error_code = 'OUTBOX_PUBLISH_FAILED', last_error = 'broker away'"
            ),
        );
        sql += &outbox_row(
            self.retry_later,
            "retry-later",
            "ORDER_STATUS_CHANGED",
            "status = 'RETRY_PENDING', attempt_count = 2, \
             next_attempt_at = now() + interval '1 day', error_code = 'OUTBOX_PUBLISH_FAILED'",
        );
        sql += &outbox_row(
            self.leased_out,
            "leased-out",
            "ORDER_STATUS_CHANGED",
            "status = 'PROCESSING', attempt_count = 1, locked_by = 'nats-publisher-of-a-dead-process', \
             locked_until = now() - interval '1 hour', lease_token = 7",
        );
        sql += &outbox_row(
            self.dead_out,
            "dead-out",
            "ORDER_STATUS_CHANGED",
            "status = 'DEAD_LETTER', attempt_count = 10, error_code = 'OUTBOX_PUBLISH_FAILED', \
             last_error = 'broker refused it'",
        );
        sql += &outbox_row(
            self.ignored_out,
            "ignored-out",
            "ORDER_STATUS_CHANGED",
            "status = 'IGNORED'",
        );
        let published = "status = 'PUBLISHED', attempt_count = 1, published_at = now()";
        sql += &outbox_row(self.unrouted, "unrouted", "ORDER_ARCHIVED", published);
        sql += &format!(
            "INSERT INTO public.unrouted_events (event_id, event_type) \
             VALUES ('{}', 'ORDER_ARCHIVED');",
            self.unrouted
        );
        for (i, id) in self.fanned_out().iter().enumerate() {
            sql += &outbox_row(
                *id,
                &format!("fanned-{i}"),
                "ORDER_STATUS_CHANGED",
                published,
            );
            sql += &inbox_row(
                *id,
                "shipping",
                "status = 'PROCESSED', attempt_count = 1, processed_at = now()",
            );
        }
        sql += &inbox_row(self.received, "billing", "status = 'RECEIVED'");
        sql += &inbox_row(
            self.retry_due,
            "billing",
            &format!(
                "status = 'RETRY_PENDING', attempt_count = 1, {due}, \
                 error_code = 'INBOX_CONSUMER_FAILED', last_error = 'injected'"
            ),
        );
        sql += &inbox_row(
            self.processed,
            "billing",
            "status = 'PROCESSED', attempt_count = 1, processed_at = now()",
        );
        sql += &inbox_row(
            self.dead,
            "billing",
            "status = 'DEAD_LETTER', attempt_count = 5, error_code = 'INBOX_CONSUMER_FAILED', \
             last_error = 'injected'",
        );
        sql += &inbox_row(self.ignored, "billing", "status = 'IGNORED'");
        // Leased rows keep their due status; the lease names them. Its process (its pid is
        // above any Linux pid) and its session are gone, though its time has not run out.
        sql += &inbox_row(self.leased, "billing", "status = 'RECEIVED'");
        sql += &format!(
            "INSERT INTO public.inbox_leases (token, consumer, locked_by, backend, locked_until, ids) \
             SELECT 42, 'billing', '4194305-{}', {DEAD_BACKEND}, now() + interval '1 hour', \
                 ARRAY[id] \
             FROM public.inbox_events WHERE event_id = '{}' AND consumer = 'billing';",
            Uuid::now_v7().simple(),
            self.leased
        );
        sql += "UPDATE public.inbox_events i SET event_seq = o.seq \
                FROM public.outbox_events o WHERE o.id = i.event_id;
            INSERT INTO effects (consumer, event_id, attempt) \
                SELECT consumer, event_id, attempt_count FROM public.inbox_events \
                WHERE status = 'PROCESSED';";
        sql += "SELECT setval('public.outbox_lease_token_seq', 7);
            INSERT INTO public.consumer_states (consumer) VALUES ('billing'), ('shipping');
            INSERT INTO public.consumer_states (consumer, paused, paused_by, reason)
                VALUES ('archive', true, 'ops@example.com', 'archive store migrating');
            INSERT INTO public.consumer_subscriptions (consumer, event_type) VALUES
                ('billing', 'ORDER_STATUS_CHANGED'), ('shipping', 'ORDER_STATUS_CHANGED'),
                ('archive', 'ORDER_REFUNDED');
            INSERT INTO public.idempotency_keys (key, claimed_by, event_id) VALUES
                ('billing:invoice:o-1', 'billing', gen_random_uuid()),
                ('billing:invoice:o-2', 'billing', gen_random_uuid()),
                ('shipping:label:o-1', 'shipping', NULL);
            INSERT INTO public.reconcile_runs (rule, dry_run, finished_at, found, repaired)
                VALUES ('invoices', false, now(), 3, 2);
            INSERT INTO public.admin_audit (who, action, target, reason, details) VALUES
                ('ops@example.com', 'inbox.ignore', 'inbox:5', 'duplicate order', '{\"was\": \"DEAD_LETTER\"}'),
                ('ops@example.com', 'consumer.pause', 'consumer:archive', 'archive store migrating', '{}');
            INSERT INTO public.outbox_stats_samples (instance, interval_ms, sample, health)
                VALUES ('old-instance', 10000, '{\"pending\": 2}', '{\"state\": \"HEALTHY\"}');
            INSERT INTO public.aggregate_versions (consumer, aggregate_type, aggregate_id, version)
                VALUES ('billing', 'order', 'o-1', 3), ('shipping', 'order', 'o-1', 2);
            INSERT INTO public.contract_findings (code, consumer, event_type, message, found_by)
                VALUES ('SUBSCRIPTION_UNHANDLED', 'archive', 'ORDER_REFUNDED',
                        'no handler for ORDER_REFUNDED', 'old-instance');
            INSERT INTO public.replays (consumer, upto_id, cursor_id, total, done, rate, status,
                    requested_by, reason, finished_at)
                VALUES ('billing', 3, 3, 1, 1, 50, 'DONE', 'ops@example.com', 'rebuild', now());";
        let mut conn = AsyncPgConnection::establish(url).await.unwrap();
        conn.batch_execute(&sql).await.unwrap();
    }
}

/// What [`Legacy::fill`] wrote, counted as [`census`] counts.
fn legacy_census() -> BTreeMap<String, i64> {
    [
        ("outbox_events/PENDING", 2),
        ("outbox_events/RETRY_PENDING", 2),
        ("outbox_events/PROCESSING", 1),
        ("outbox_events/PUBLISHED", 7),
        ("outbox_events/DEAD_LETTER", 1),
        ("outbox_events/IGNORED", 1),
        ("inbox_events/billing/RECEIVED", 2),
        ("inbox_events/billing/RETRY_PENDING", 1),
        ("inbox_events/billing/PROCESSED", 1),
        ("inbox_events/billing/DEAD_LETTER", 1),
        ("inbox_events/billing/IGNORED", 1),
        ("inbox_events/shipping/PROCESSED", 6),
        ("consumer_states/archive/true", 1),
        ("consumer_states/billing/false", 1),
        ("consumer_states/shipping/false", 1),
        ("consumer_subscriptions/archive/ORDER_REFUNDED", 1),
        ("consumer_subscriptions/billing/ORDER_STATUS_CHANGED", 1),
        ("consumer_subscriptions/shipping/ORDER_STATUS_CHANGED", 1),
        ("idempotency_keys", 3),
        ("reconcile_runs", 1),
        ("admin_audit", 2),
        ("outbox_stats_samples", 1),
        ("aggregate_versions", 2),
        ("inbox_leases/billing", 1),
        ("unrouted_events", 1),
        ("contract_findings", 1),
        ("replays/DONE", 1),
    ]
    .into_iter()
    .map(|(k, n)| (k.to_owned(), n))
    .collect()
}

/// Each (consumer, event) with an effect has exactly one, and exactly the PROCESSED inbox rows
/// have one: returns (effects, PROCESSED rows with exactly one effect, largest count of one).
async fn effects_tally(db: &TestDb) -> (i64, i64, i64) {
    let effects = db.count("SELECT count(*) AS n FROM effects").await;
    let matched = db
        .count(
            "SELECT count(*) AS n FROM actix_outbox.inbox_events i WHERE i.status = 'PROCESSED' \
             AND (SELECT count(*) FROM effects e \
                  WHERE e.consumer = i.consumer AND e.event_id = i.event_id) = 1",
        )
        .await;
    let most = db
        .count(
            "SELECT coalesce(max(c), 0) AS n FROM \
             (SELECT count(*) AS c FROM effects GROUP BY consumer, event_id) x",
        )
        .await;
    (effects, matched, most)
}

fn ids(list: &[Uuid]) -> String {
    list.iter()
        .map(|u| format!("'{u}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[actix_rt::test]
async fn an_install_in_public_moves_into_the_schema_whole_and_goes_on_delivering() {
    let db = TestDb::empty().await;
    let last = MIGRATIONS.last().unwrap().version;
    install_in_public(&db.url, last).await;
    let legacy = Legacy::new();
    legacy.fill(&db.url).await;
    assert_eq!(census(&db, "public").await, legacy_census(), "as written");
    let names: Vec<&str> = TABLES.iter().map(|(t, _)| *t).collect();
    let before = fingerprints(&db, "public", &names).await;
    let legacy_seq = db
        .count("SELECT max(seq) AS n FROM public.outbox_events")
        .await;

    // The upgrade: moved, nothing left to apply.
    let report = migrate_with(&db.url, &MigrateConfig::default())
        .await
        .unwrap();
    assert_eq!(
        report,
        MigrateReport {
            moved_from_public: true,
            applied: vec![],
            lock_retries: 0,
        }
    );
    // Nothing of the library is left in `public`; the application's objects are all there.
    assert_eq!(in_public(&db).await, APP_IN_PUBLIC);
    assert_eq!(db.count("SELECT count(*) AS n FROM public.orders").await, 2);
    // The application's row, and the library's versions kept there too, so that an earlier
    // build that starts again finds nothing to migrate (and fails on the missing tables)
    // instead of making a second, empty install in `public`.
    let mut history = vec![APP_VERSION.to_owned()];
    history.extend(MIGRATIONS.iter().map(|m| m.version.to_owned()));
    assert_eq!(
        lines(
            &db,
            "SELECT version::text AS k, ''::text AS v FROM public.__diesel_schema_migrations"
        )
        .await
        .into_keys()
        .collect::<Vec<_>>(),
        history,
        "the application's diesel history, and the library's versions an earlier build reads"
    );
    // Every row moved once, unchanged; the versions with them.
    assert_eq!(census(&db, "actix_outbox").await, legacy_census(), "moved");
    assert_eq!(fingerprints(&db, "actix_outbox", &names).await, before);
    let recorded = lines(
        &db,
        "SELECT version AS k, name AS v FROM actix_outbox.schema_migrations",
    )
    .await;
    let shipped: BTreeMap<String, String> = MIGRATIONS
        .iter()
        .map(|m| (m.version.to_owned(), m.name.to_owned()))
        .collect();
    assert_eq!(recorded, shipped);
    assert_eq!(
        db.count("SELECT last_value AS n FROM actix_outbox.outbox_lease_token_seq")
            .await,
        7,
        "the lease token sequence moved with its value"
    );
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM pg_proc \
             WHERE oid = to_regprocedure('actix_outbox.inbox_lease_held(bigint, bigint)')"
        )
        .await,
        1
    );

    // Once moved, there is nothing more to do.
    let again = migrate_with(&db.url, &MigrateConfig::default())
        .await
        .unwrap();
    assert_eq!(again, MigrateReport::default());
    assert_eq!(census(&db, "actix_outbox").await, legacy_census());
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.schema_migrations")
            .await,
        MIGRATIONS.len() as i64
    );

    // A runtime on the upgraded database delivers what was due, each once.
    let rt = start(
        &db,
        vec![
            (consumer("billing", 5), Behaviour::default()),
            (consumer("shipping", 5), Behaviour::default()),
        ],
    )
    .await;
    // Before: 7 PROCESSED. Billing's RECEIVED, RETRY_PENDING and leased rows, and the 4 due
    // outbox events for both consumers.
    let processed =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(processed, 7 + 3 + 8, WAIT).await, 18);
    let due_out = format!(
        "SELECT count(*) AS n FROM actix_outbox.outbox_events \
         WHERE id IN ({}) AND status = 'PUBLISHED'",
        ids(&legacy.due_out())
    );
    assert_eq!(db.count(&due_out).await, 4);
    let fanned = format!(
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE event_id IN ({}) \
         AND consumer IN ('billing', 'shipping') AND status = 'PROCESSED'",
        ids(&legacy.due_out())
    );
    assert_eq!(db.count(&fanned).await, 8);
    assert_eq!(effects_tally(&db).await, (18, 18, 1));

    // New events, enqueued after the upgrade: delivered to each consumer once.
    for i in 0..3 {
        db.enqueue_one(&format!("after-{i}")).await;
    }
    rt.handle().wake();
    assert_eq!(db.wait_for(processed, 18 + 6, WAIT).await, 24);
    assert_eq!(effects_tally(&db).await, (24, 24, 1));
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) AS n FROM actix_outbox.outbox_events \
             WHERE aggregate_id LIKE 'after-%' AND seq > {legacy_seq}"
        ))
        .await,
        3,
        "new events are numbered after the old ones: the sequence moved with its table"
    );

    // The retries carried their attempts over: the retrying row's next attempt was its second,
    // and so was the leased row's, whose dead loop's attempt was counted.
    let attempt = |event: Uuid| {
        format!(
            "SELECT attempt::int8 AS n FROM effects WHERE consumer = 'billing' AND event_id = '{event}'"
        )
    };
    assert_eq!(db.count(&attempt(legacy.received)).await, 1);
    assert_eq!(db.count(&attempt(legacy.retry_due)).await, 2);
    assert_eq!(db.count(&attempt(legacy.leased)).await, 2);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.inbox_leases")
            .await,
        0,
        "the dead lease was settled"
    );

    // What was not due stays as it was: nothing re-applied, nothing published again.
    let inbox = |status: &str| {
        format!(
            "SELECT count(*) AS n FROM actix_outbox.inbox_events \
             WHERE consumer = 'billing' AND status = '{status}' AND event_id IN ('{}', '{}')",
            legacy.dead, legacy.ignored
        )
    };
    assert_eq!(db.count(&inbox("DEAD_LETTER")).await, 1);
    assert_eq!(db.count(&inbox("IGNORED")).await, 1);
    let not_due = ids(&[
        legacy.retry_later,
        legacy.dead_out,
        legacy.ignored_out,
        legacy.unrouted,
    ]);
    assert_eq!(
        lines(
            &db,
            &format!(
                "SELECT aggregate_id AS k, status AS v FROM actix_outbox.outbox_events \
                 WHERE id IN ({not_due})"
            )
        )
        .await,
        [
            ("dead-out", "DEAD_LETTER"),
            ("ignored-out", "IGNORED"),
            ("retry-later", "RETRY_PENDING"),
            ("unrouted", "PUBLISHED"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect::<BTreeMap<_, _>>()
    );
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE event_id IN ({not_due})"
        ))
        .await,
        0
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events")
            .await,
        12 + 8 + 6,
        "no inbox row doubled"
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.outbox_events")
            .await,
        14 + 3
    );
    // The keys, the audit trail, the replays and the rest of the history are as they were; the
    // paused consumer is still paused.
    assert_eq!(
        fingerprints(&db, "actix_outbox", UNTOUCHED).await,
        fingerprints_of(&before, UNTOUCHED)
    );
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM actix_outbox.consumer_states \
             WHERE consumer = 'archive' AND paused AND paused_by = 'ops@example.com'"
        )
        .await,
        1
    );
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) AS n FROM actix_outbox.unrouted_events WHERE event_id = '{}'",
            legacy.unrouted
        ))
        .await,
        1
    );
    db.finish(&[&rt]).await;
}

fn fingerprints_of(all: &BTreeMap<String, String>, tables: &[&str]) -> BTreeMap<String, String> {
    all.iter()
        .filter(|(t, _)| tables.contains(&t.as_str()))
        .map(|(t, v)| (t.clone(), v.clone()))
        .collect()
}

/// An install that stopped at an older version (`inbox_lease`: a leased inbox row was then
/// PROCESSING, its lease in its own columns): moved as it is, then brought up to date in the
/// schema, its lease carried over by `inbox_lease_table` and settled by the reaper.
#[actix_rt::test]
async fn an_older_install_in_public_is_moved_then_migrated_in_the_schema() {
    let db = TestDb::empty().await;
    let until = "20261201000010";
    install_in_public(&db.url, until).await;
    let (leased, waiting, pending) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    let published = "status = 'PUBLISHED', attempt_count = 1, published_at = now()";
    let mut sql = outbox_row(leased, "leased", "ORDER_STATUS_CHANGED", published);
    sql += &outbox_row(waiting, "waiting", "ORDER_STATUS_CHANGED", published);
    sql += &outbox_row(
        pending,
        "pending",
        "ORDER_STATUS_CHANGED",
        "status = 'PENDING'",
    );
    // Under `inbox_lease` the claim counted the attempt and moved the row to PROCESSING.
    sql += &inbox_row(
        leased,
        "billing",
        &format!(
            "status = 'PROCESSING', attempt_count = 1, lease_token = 9, \
             locked_until = now() + interval '1 hour', locked_by = '4194305-{}', \
             backend = {DEAD_BACKEND}",
            Uuid::now_v7().simple()
        ),
    );
    sql += &inbox_row(leased, "shipping", "status = 'RECEIVED'");
    sql += &inbox_row(
        waiting,
        "billing",
        "status = 'PROCESSED', attempt_count = 1, processed_at = now()",
    );
    sql += &inbox_row(
        waiting,
        "shipping",
        "status = 'PROCESSED', attempt_count = 1, processed_at = now()",
    );
    sql += "INSERT INTO effects (consumer, event_id, attempt) \
            SELECT consumer, event_id, attempt_count FROM public.inbox_events \
            WHERE status = 'PROCESSED';
        INSERT INTO public.consumer_states (consumer) VALUES ('billing'), ('shipping');
        INSERT INTO public.consumer_subscriptions (consumer, event_type) VALUES
            ('billing', 'ORDER_STATUS_CHANGED'), ('shipping', 'ORDER_STATUS_CHANGED');
        INSERT INTO public.idempotency_keys (key, claimed_by) VALUES ('billing:invoice:o-1', 'billing');";
    let mut conn = AsyncPgConnection::establish(&db.url).await.unwrap();
    conn.batch_execute(&sql).await.unwrap();
    drop(conn);

    let report = migrate_with(&db.url, &MigrateConfig::default())
        .await
        .unwrap();
    let rest: Vec<String> = MIGRATIONS
        .iter()
        .filter(|m| m.version > until)
        .map(|m| m.version.to_owned())
        .collect();
    assert!(!rest.is_empty());
    assert_eq!(
        report,
        MigrateReport {
            moved_from_public: true,
            applied: rest,
            lock_retries: 0,
        }
    );
    assert_eq!(in_public(&db).await, APP_IN_PUBLIC);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.schema_migrations")
            .await,
        MIGRATIONS.len() as i64
    );
    // The PROCESSING row is due again, its attempt uncounted, and held by the lease it had.
    assert_eq!(
        lines(
            &db,
            "SELECT i.consumer || '/' || i.status || '/' || i.attempt_count AS k, \
                 coalesce(l.token::text, '-') AS v \
             FROM actix_outbox.inbox_events i \
             LEFT JOIN actix_outbox.inbox_leases l ON i.id = ANY (l.ids) \
             WHERE i.status <> 'PROCESSED'"
        )
        .await,
        [("billing/RECEIVED/0", "9"), ("shipping/RECEIVED/0", "-")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect::<BTreeMap<_, _>>()
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.idempotency_keys")
            .await,
        1
    );

    let rt = start(
        &db,
        vec![
            (consumer("billing", 5), Behaviour::default()),
            (consumer("shipping", 5), Behaviour::default()),
        ],
    )
    .await;
    // 2 PROCESSED before; the leased event for both, the pending one for both.
    let processed =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(processed, 6, WAIT).await, 6);
    assert_eq!(effects_tally(&db).await, (6, 6, 1));
    assert_eq!(
        db.count(&format!(
            "SELECT attempt::int8 AS n FROM effects WHERE consumer = 'billing' AND event_id = '{leased}'"
        ))
        .await,
        2,
        "the dead loop's attempt was counted"
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.inbox_events")
            .await,
        6
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'PUBLISHED'")
            .await,
        3
    );
    db.finish(&[&rt]).await;
}

/// An application table named like one a later version of the library creates (`replays`,
/// created by 000016) is the application's in an install older than that version: the move
/// leaves it in `public` with its rows, and the later migration creates the library's own in
/// the schema.
#[actix_rt::test]
async fn an_application_table_named_like_a_later_library_table_stays_in_public() {
    let db = TestDb::empty().await;
    install_in_public(&db.url, "20261201000010").await;
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(
        "CREATE TABLE public.replays (id int PRIMARY KEY, film text NOT NULL);
         INSERT INTO public.replays VALUES (1, 'Stalker'), (2, 'Solaris');",
    )
    .await
    .unwrap();
    drop(conn);
    let report = actix_outbox::db::migrate_with(&db.url, &Default::default())
        .await
        .unwrap();
    assert!(report.moved_from_public, "{report:?}");
    assert_eq!(
        db.count("SELECT count(*) AS n FROM public.replays WHERE film IN ('Stalker', 'Solaris')")
            .await,
        2,
        "the application's table kept its place and rows"
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.replays")
            .await,
        0,
        "the library's own was created in the schema"
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.schema_migrations")
            .await,
        MIGRATIONS.len() as i64
    );
    db.finish(&[]).await;
}
