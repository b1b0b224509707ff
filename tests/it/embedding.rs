//! The library inside an application's database: its own schema next to the application's
//! tables of the same names, least-privileged roles (`db::grants`), the checks a start makes
//! (`PRIVILEGE_MISSING`, `SCHEMA_NOT_MIGRATED`), and another schema chosen with `use_schema`.
//!
//! Roles are cluster-wide, so each test makes its own with a random suffix and drops them after
//! its database (a [`Roles`] guard drops both when a test fails half-way). Every assertion
//! counts rows or reads the catalog; none measures time.

use crate::common;

use std::time::Duration;

use actix_outbox::admin::{admin_scope, AdminConfig};
use actix_outbox::db::{self, MigrateConfig, Role, MIGRATIONS};
use actix_outbox::retention::{Retention, RetentionConfig};
use actix_outbox::{
    enqueue, enqueue_many, enqueue_with, ConsumerConfig, Error, ErrorCode, NewEvent, OutboxRuntime,
    PgPool, RetryPolicy,
};
use actix_web::test::{init_service, TestRequest};
use actix_web::App;
use common::*;
use diesel::sql_types::{BigInt, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

const TOKEN: &str = "embedding-operator-token-0001";

/// The library's tables, every one of which must be in its schema and none in `public`.
const LIBRARY_TABLES: &[&str] = &[
    "admin_audit",
    "aggregate_versions",
    "consumer_cursors",
    "consumer_states",
    "consumer_subscriptions",
    "contract_findings",
    "idempotency_keys",
    "inbox_events",
    "inbox_leases",
    "log_head",
    "log_stamps",
    "nats_bindings",
    "outbox_events",
    "outbox_stats_samples",
    "reconcile_runs",
    "replays",
    "schema_migrations",
    "side_effects",
    "unrouted_events",
];

/// The application's own tables, some named like the library's, with columns of its own (and
/// a few the library's statements would match, so that an unqualified statement would act on
/// them rather than fail), and its own diesel history. Plus the business tables of the tests
/// (`orders`, and `effects` as `tests/common/template.rs` makes it).
const APPLICATION: &str = "
    CREATE TABLE public.idempotency_keys (key text PRIMARY KEY, customer text NOT NULL,
        created_at timestamptz NOT NULL);
    INSERT INTO public.idempotency_keys VALUES
        ('pay-1', 'alice', now() - interval '400 days'), ('pay-2', 'bob', now() - interval '90 days'),
        ('pay-3', 'carol', now());
    CREATE TABLE public.outbox_events (id bigserial PRIMARY KEY, topic text NOT NULL, body text NOT NULL,
        status text NOT NULL, published_at timestamptz);
    INSERT INTO public.outbox_events (topic, body, status, published_at) VALUES
        ('billing', 'invoice 1', 'PUBLISHED', now() - interval '30 days'),
        ('billing', 'invoice 2', 'PENDING', NULL);
    CREATE TABLE public.replays (id serial PRIMARY KEY, what text NOT NULL, at timestamptz NOT NULL);
    INSERT INTO public.replays (what, at) VALUES ('ledger 2024', now() - interval '2 years');
    CREATE TABLE public.admin_audit (id serial PRIMARY KEY, who text NOT NULL, action text NOT NULL,
        at timestamptz NOT NULL);
    INSERT INTO public.admin_audit (who, action, at) VALUES
        ('root', 'refund', now() - interval '3 years'), ('root', 'login', now());
    CREATE TABLE public.__diesel_schema_migrations (version varchar(50) PRIMARY KEY NOT NULL,
        run_on timestamp NOT NULL DEFAULT CURRENT_TIMESTAMP);
    INSERT INTO public.__diesel_schema_migrations (version) VALUES ('20240101000000');
    CREATE TABLE public.orders (id text PRIMARY KEY, status text NOT NULL,
        version bigint NOT NULL DEFAULT 1);
    CREATE TABLE public.effects (id bigserial PRIMARY KEY, consumer text NOT NULL, event_id uuid NOT NULL,
        attempt int NOT NULL);";

/// Every row of the application's tables that the library must never touch.
const APPLICATION_ROWS: &str = "SELECT concat_ws(' # ',
        (SELECT string_agg(t::text, ',' ORDER BY t::text) FROM public.idempotency_keys t),
        (SELECT string_agg(t::text, ',' ORDER BY t::text) FROM public.outbox_events t),
        (SELECT string_agg(t::text, ',' ORDER BY t::text) FROM public.replays t),
        (SELECT string_agg(t::text, ',' ORDER BY t::text) FROM public.admin_audit t),
        (SELECT string_agg(t::text, ',' ORDER BY t::text) FROM public.__diesel_schema_migrations t)
    ) AS s";

/// The relations and functions of `public`, by name and kind.
const PUBLIC_CATALOG: &str = "SELECT concat_ws(' # ',
        (SELECT string_agg(c.relname || ':' || c.relkind::text, ',' ORDER BY c.relname) FROM pg_class c
             JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public'),
        (SELECT string_agg(p.oid::regprocedure::text, ',' ORDER BY 1) FROM pg_proc p
             JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'public')
    ) AS s";

#[derive(QueryableByName)]
struct S {
    #[diesel(sql_type = Text)]
    s: String,
}

#[derive(QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[derive(QueryableByName, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Grant {
    #[diesel(sql_type = Text)]
    object: String,
    #[diesel(sql_type = Text)]
    privileges: String,
}

async fn text_on(conn: &mut AsyncPgConnection, sql: &str) -> String {
    let r: S = diesel::sql_query(sql)
        .get_result(conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    r.s
}

async fn text(pool: &PgPool, sql: &str) -> String {
    text_on(&mut pool.get().await.unwrap(), sql).await
}

/// `sql` (a `SELECT … AS n`) on `conn`: its count, or the database's error.
async fn count_on(conn: &mut AsyncPgConnection, sql: &str) -> Result<i64, String> {
    diesel::sql_query(sql)
        .get_result::<N>(conn)
        .await
        .map(|r| r.n)
        .map_err(|e| e.to_string())
}

async fn exec(pool: &PgPool, sql: &str) {
    let mut conn = pool.get().await.unwrap();
    conn.batch_execute(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// `url` connecting as `role` (no password: the server trusts local connections).
pub(crate) fn as_role(url: &str, role: &str) -> String {
    let start = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[start..];
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let host = rest[..end]
        .rsplit_once('@')
        .map_or(&rest[..end], |(_, host)| host);
    format!("{}{role}@{host}{}", &url[..start], &rest[end..])
}

/// Roles of one test, named `ao_<kind>_<random>`. [`Roles::drop_all`] drops them once the
/// test's database is gone (its grants go with it); a test that fails first leaves the
/// guard's `Drop` to drop the database and then the roles.
pub(crate) struct Roles {
    database: String,
    names: Vec<String>,
    dropped: bool,
}

impl Roles {
    pub(crate) async fn create(db: &TestDb, kinds: &[&str]) -> Roles {
        let suffix = &uuid::Uuid::new_v4().simple().to_string()[..12];
        let names: Vec<String> = kinds.iter().map(|k| format!("ao_{k}_{suffix}")).collect();
        let roles = Roles {
            database: db.name.clone(),
            names,
            dropped: false,
        };
        let mut admin = AsyncPgConnection::establish(&base_url()).await.unwrap();
        for name in &roles.names {
            admin
                .batch_execute(&format!("CREATE ROLE {name} LOGIN"))
                .await
                .unwrap();
        }
        roles
    }

    pub(crate) fn get(&self, i: usize) -> &str {
        &self.names[i]
    }

    pub(crate) async fn drop_all(mut self) {
        let mut admin = AsyncPgConnection::establish(&base_url()).await.unwrap();
        for name in &self.names {
            admin
                .batch_execute(&format!("DROP ROLE IF EXISTS {name}"))
                .await
                .unwrap_or_else(|e| panic!("drop role {name}: {e}"));
        }
        self.dropped = true;
    }
}

impl Drop for Roles {
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        let (database, names) = (self.database.clone(), self.names.clone());
        // A runtime of its own: this runs while the test's is unwinding.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let Ok(mut admin) = AsyncPgConnection::establish(&base_url()).await else {
                    return;
                };
                let _ = admin
                    .batch_execute(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
                    .await;
                for name in names {
                    let _ = admin
                        .batch_execute(&format!("DROP ROLE IF EXISTS {name}"))
                        .await;
                }
            });
        })
        .join();
    }
}

/// What `role` was granted, object by object: `table|sequence|function|schema|database <name>`
/// and its privileges joined with `+`, in order.
async fn granted(pool: &PgPool, role: &str) -> Vec<Grant> {
    let mut conn = pool.get().await.unwrap();
    let mut got: Vec<Grant> = diesel::sql_query(
        "SELECT CASE c.relkind WHEN 'S' THEN 'sequence ' ELSE 'table ' END
                    || n.nspname || '.' || c.relname AS object,
                string_agg(a.privilege_type, '+' ORDER BY a.privilege_type) AS privileges
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace,
              LATERAL aclexplode(c.relacl) a
         WHERE a.grantee = $1::regrole GROUP BY 1
         UNION ALL
         SELECT 'schema ' || n.nspname, string_agg(a.privilege_type, '+' ORDER BY a.privilege_type)
         FROM pg_namespace n, LATERAL aclexplode(n.nspacl) a
         WHERE a.grantee = $1::regrole GROUP BY 1
         UNION ALL
         SELECT 'function ' || p.oid::regprocedure::text,
                string_agg(a.privilege_type, '+' ORDER BY a.privilege_type)
         FROM pg_proc p, LATERAL aclexplode(p.proacl) a
         WHERE a.grantee = $1::regrole GROUP BY 1
         UNION ALL
         SELECT 'database ' || d.datname, string_agg(a.privilege_type, '+' ORDER BY a.privilege_type)
         FROM pg_database d, LATERAL aclexplode(d.datacl) a
         WHERE a.grantee = $1::regrole GROUP BY 1",
    )
    .bind::<Text, _>(role)
    .load(&mut conn)
    .await
    .unwrap();
    got.sort();
    got
}

/// What [`Role::Runtime`] should hold, read from the catalog: the four row privileges on each
/// table of `schema` but the migration record (which it only reads), USAGE on each sequence,
/// EXECUTE on each function, USAGE on the schema.
async fn runtime_should_hold(pool: &PgPool, schema: &str) -> Vec<Grant> {
    let mut conn = pool.get().await.unwrap();
    let mut want: Vec<Grant> = diesel::sql_query(
        "SELECT CASE c.relkind WHEN 'S' THEN 'sequence ' ELSE 'table ' END
                    || n.nspname || '.' || c.relname AS object,
                CASE WHEN c.relkind = 'S' THEN 'USAGE'
                     WHEN c.relname = 'schema_migrations' THEN 'SELECT'
                     ELSE 'DELETE+INSERT+SELECT+UPDATE' END AS privileges
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = $1 AND c.relkind IN ('r', 'p', 'S')
         UNION ALL
         SELECT 'function ' || p.oid::regprocedure::text, 'EXECUTE'
         FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = $1
         UNION ALL
         SELECT 'schema ' || $1, 'USAGE'",
    )
    .bind::<Text, _>(schema)
    .load(&mut conn)
    .await
    .unwrap();
    want.sort();
    want
}

/// The tables of `schema`, sorted by name.
async fn tables_of(pool: &PgPool, schema: &str) -> Vec<String> {
    let sql = format!(
        "SELECT coalesce(string_agg(c.relname, ',' ORDER BY c.relname), '') AS s FROM pg_class c \
         JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = '{schema}' AND c.relkind IN ('r', 'p')"
    );
    let mut tables: Vec<String> = text(pool, &sql)
        .await
        .split(',')
        .filter(|t| !t.is_empty())
        .map(str::to_owned)
        .collect();
    tables.sort_unstable();
    tables
}

/// `n` events of `prefix`, each with a new id.
fn events(prefix: &str, n: usize) -> Vec<NewEvent> {
    (0..n)
        .map(|i| order_event(&format!("{prefix}-{i}")))
        .collect()
}

/// `SELECT count(DISTINCT event_id) … ` of `consumer`'s effects among `ids`.
fn distinct_effects(consumer: &str, ids: &[uuid::Uuid]) -> String {
    let list = ids
        .iter()
        .map(uuid::Uuid::to_string)
        .collect::<Vec<_>>()
        .join(",");
    format!(
        "SELECT count(DISTINCT event_id) AS n FROM public.effects \
         WHERE consumer = '{consumer}' AND event_id = ANY ('{{{list}}}'::uuid[])"
    )
}

/// An application database that already has tables named like the library's (with rows) and
/// its own diesel history: the migration leaves all of it as it was and puts every object of
/// the library in `actix_outbox`. Then the library runs on three least-privileged roles:
/// producers enqueue 1,000 events (through connections whose `search_path` is empty, or is
/// `public`, where the application's `outbox_events` is), a runtime with only
/// `Role::Runtime`'s grants delivers each exactly once to two consumers, settles a dead
/// process's lease and runs retention, and an operator with only `Role::Operator`'s grants
/// reads every list of the operator API.
#[actix_rt::test]
async fn an_application_with_tables_of_the_same_names_migrates_and_delivers_as_least_privileged_roles(
) {
    let db = TestDb::empty().await;
    let roles = Roles::create(&db, &["rt", "pr", "op"]).await;
    let (runtime_role, producer_role, operator_role) = (roles.get(0), roles.get(1), roles.get(2));
    exec(&db.pool, APPLICATION).await;
    let rows_before = text(&db.pool, APPLICATION_ROWS).await;
    let public_before = text(&db.pool, PUBLIC_CATALOG).await;

    // The owner migrates: the application's diesel history and tables are not an install of an
    // earlier version, and stay where and as they are.
    let report = db::migrate_with(&db.url, &MigrateConfig::default())
        .await
        .expect("migrate next to the application's tables");
    assert!(
        !report.moved_from_public,
        "nothing of the library was in public"
    );
    assert_eq!(report.applied.len(), MIGRATIONS.len());
    let again = db::migrate_with(&db.url, &MigrateConfig::default())
        .await
        .unwrap();
    assert!(again.applied.is_empty(), "a second migrate applies nothing");
    assert_eq!(text(&db.pool, APPLICATION_ROWS).await, rows_before);
    assert_eq!(
        text(&db.pool, PUBLIC_CATALOG).await,
        public_before,
        "no relation or function was added to public"
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM public.__diesel_schema_migrations")
            .await,
        1,
        "the application's diesel history holds its one version"
    );
    let mut library = LIBRARY_TABLES.to_vec();
    library.sort_unstable();
    assert_eq!(tables_of(&db.pool, "actix_outbox").await, library);
    let mut application = vec![
        "__diesel_schema_migrations",
        "admin_audit",
        "effects",
        "idempotency_keys",
        "orders",
        "outbox_events",
        "replays",
    ];
    application.sort_unstable();
    assert_eq!(
        tables_of(&db.pool, "public").await,
        application,
        "public holds the application's tables only"
    );
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) AS n FROM actix_outbox.schema_migrations WHERE version IN ({})",
            MIGRATIONS
                .iter()
                .map(|m| format!("'{}'", m.version))
                .collect::<Vec<_>>()
                .join(",")
        ))
        .await,
        MIGRATIONS.len() as i64
    );
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = 'actix_outbox' AND c.relkind = 'S' \
               AND c.relname = 'outbox_lease_token_seq'"
        )
        .await
            + db.count(
                "SELECT count(*) AS n FROM pg_proc WHERE \
                 oid = to_regprocedure('actix_outbox.inbox_lease_held(bigint, bigint)')"
            )
            .await,
        2,
        "the lease sequence and function are in the schema too"
    );

    // The roles: only the library's grants, run by the owner, and what each needs of the
    // application's business tables.
    {
        let mut owner = db.pool.get().await.unwrap();
        db::grant(&mut owner, Role::Runtime, runtime_role)
            .await
            .unwrap();
        db::grant(&mut owner, Role::Producer, producer_role)
            .await
            .unwrap();
        db::grant(&mut owner, Role::Operator, operator_role)
            .await
            .unwrap();
    }
    assert_eq!(
        granted(&db.pool, runtime_role).await,
        runtime_should_hold(&db.pool, "actix_outbox").await,
        "the runtime holds the row privileges on the library's tables, USAGE on its sequences \
         and schema, EXECUTE on its functions, and nothing else"
    );
    let default_acl = format!(
        "SELECT count(*) AS n FROM pg_default_acl d JOIN pg_namespace n ON n.oid = d.defaclnamespace, \
         LATERAL aclexplode(d.defaclacl) a \
         WHERE n.nspname = 'actix_outbox' AND a.grantee = '{runtime_role}'::regrole"
    );
    // Tables: SELECT, INSERT, UPDATE, DELETE; sequences: USAGE; functions: EXECUTE.
    assert_eq!(db.count(&default_acl).await, 6, "and so on later tables");
    let producer = granted(&db.pool, producer_role).await;
    assert_eq!(
        producer,
        vec![
            Grant {
                object: "schema actix_outbox".into(),
                privileges: "USAGE".into()
            },
            Grant {
                object: "sequence actix_outbox.outbox_events_seq_seq".into(),
                privileges: "USAGE".into()
            },
            Grant {
                object: "table actix_outbox.outbox_events".into(),
                privileges: "INSERT".into()
            },
        ]
    );
    let operator = granted(&db.pool, operator_role).await;
    assert!(
        operator.iter().all(|g| g.privileges == "SELECT"
            && g.object.starts_with("table actix_outbox.")
            || g.object == "schema actix_outbox" && g.privileges == "USAGE"),
        "{operator:?}"
    );
    assert_eq!(
        operator.len(),
        LIBRARY_TABLES.len() + 1,
        "SELECT on every table, USAGE on the schema: {operator:?}"
    );
    // No role may create anything: not in the database, not in any schema. PostgreSQL 15 no
    // longer lets PUBLIC create in `public`.
    assert!(
        db.count("SELECT current_setting('server_version_num')::int8 AS n")
            .await
            >= 150_000
    );
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM pg_namespace \
             WHERE nspname = 'public' AND has_schema_privilege('public', oid, 'CREATE')"
        )
        .await,
        0,
        "PUBLIC has no CREATE on public"
    );
    for role in [runtime_role, producer_role, operator_role] {
        let creates = format!(
            "SELECT (has_database_privilege('{role}', current_database(), 'CREATE')::int \
                 + has_schema_privilege('{role}', 'public', 'CREATE')::int \
                 + has_schema_privilege('{role}', 'actix_outbox', 'CREATE')::int \
                 + (SELECT count(*) FROM pg_namespace \
                    WHERE has_schema_privilege('{role}', oid, 'CREATE')))::int8 AS n"
        );
        assert_eq!(db.count(&creates).await, 0, "{role} may create something");
        let mut conn = AsyncPgConnection::establish(&as_role(&db.url, role))
            .await
            .unwrap();
        for ddl in [
            "CREATE TABLE public.ao_probe (x int)",
            "CREATE TABLE actix_outbox.ao_probe (x int)",
            "CREATE SCHEMA ao_probe",
        ] {
            let e = conn.batch_execute(ddl).await.unwrap_err().to_string();
            assert!(e.contains("permission denied"), "{role}: {ddl}: {e}");
        }
    }
    // The business tables, as the application grants them.
    exec(
        &db.pool,
        &format!(
            "GRANT INSERT, SELECT ON public.orders TO {producer_role};
             GRANT INSERT ON public.effects TO {runtime_role};
             GRANT USAGE ON SEQUENCE public.effects_id_seq TO {runtime_role};"
        ),
    )
    .await;

    // The runtime, as its role: two consumers, one more that a test pause keeps from its
    // event (for the reaper), retention of everything delivered.
    // A start that calls `migrate` as the runtime role, on a schema already up to date: it
    // needs no DDL right, and does nothing.
    let again = db::migrate_with(&as_role(&db.url, runtime_role), &MigrateConfig::default())
        .await
        .unwrap();
    assert!(
        again.applied.is_empty() && !again.moved_from_public,
        "{again:?}"
    );
    let runtime_pool = actix_outbox::connect(&as_role(&db.url, runtime_role), 30)
        .await
        .unwrap();
    let short = RetentionConfig::default()
        .published_outbox_after(Duration::from_millis(1))
        .processed_inbox_after(Duration::from_millis(1))
        .idempotency_keys_after(Duration::from_millis(1))
        .audit_after(Duration::from_millis(1))
        .reconcile_runs_after(Duration::from_millis(1))
        .aggregate_versions_after(Duration::from_millis(1));
    let config = fast_runtime()
        .retention(short.clone())
        .retention_interval(Duration::from_millis(200));
    let reap = ConsumerConfig::new("reap")
        .subscribe("ORDER_REAPED")
        .retry(RetryPolicy::fixed(3, Duration::from_secs(3600)))
        .poll_interval(Duration::from_millis(100));
    let rt = start_with(
        runtime_pool.clone(),
        config,
        vec![
            (consumer("ship", 3), Behaviour::default()),
            (consumer("mail", 3), Behaviour::default()),
            (reap, Behaviour::default()),
        ],
    )
    .await;
    let reap_name = actix_outbox::event::ConsumerName::new("reap").unwrap();
    {
        let mut conn = runtime_pool.get().await.unwrap();
        actix_outbox::ops::pause_consumer(&mut conn, &reap_name, "ops", "held for the test", None)
            .await
            .unwrap();
    }

    // The producers, as their role. 400 events through the pool, ten per transaction with
    // their orders.
    let producer_url = as_role(&db.url, producer_role);
    let producer_pool = actix_outbox::connect(&producer_url, 4).await.unwrap();
    let mut ids: Vec<uuid::Uuid> = Vec::with_capacity(1000);
    {
        let mut conn = producer_pool.get().await.unwrap();
        for chunk in events("pool", 400).chunks(10) {
            let written = conn
                .transaction::<_, Error, _>(async |c| {
                    for e in chunk {
                        diesel::sql_query("INSERT INTO orders (id, status) VALUES ($1, 'PLACED')")
                            .bind::<Text, _>(e.id().to_string())
                            .execute(c)
                            .await?;
                    }
                    enqueue_many(c, chunk).await
                })
                .await
                .unwrap();
            ids.extend(written.iter().map(|id| id.as_uuid()));
        }
    }
    // 300 through a connection whose search_path is empty: the application names its tables,
    // and so must the library.
    {
        let mut conn = AsyncPgConnection::establish(&producer_url).await.unwrap();
        conn.batch_execute("SET search_path = ''").await.unwrap();
        assert_eq!(
            count_on(
                &mut conn,
                "SELECT cardinality(current_schemas(false))::int8 AS n"
            )
            .await,
            Ok(0)
        );
        for e in events("empty-path", 300) {
            let id = conn
                .transaction::<_, Error, _>(async |c| {
                    diesel::sql_query(
                        "INSERT INTO public.orders (id, status) VALUES ($1, 'PLACED')",
                    )
                    .bind::<Text, _>(e.id().to_string())
                    .execute(c)
                    .await?;
                    enqueue(c, &e).await
                })
                .await
                .unwrap();
            ids.push(id.as_uuid());
        }
    }
    // 300 through a connection whose search_path is `public`, where the application's
    // `outbox_events` is: one statement per order and its three events.
    {
        let mut conn = AsyncPgConnection::establish(&producer_url).await.unwrap();
        conn.batch_execute("SET search_path = public")
            .await
            .unwrap();
        assert_eq!(
            text_on(&mut conn, "SELECT current_schemas(false)::text AS s").await,
            "{public}"
        );
        for (i, chunk) in events("public-path", 300).chunks(3).enumerate() {
            let placed = conn
                .transaction::<_, Error, _>(async |c| {
                    let order = diesel::sql_query(
                        "INSERT INTO orders (id, status) VALUES ($1, 'PLACED') RETURNING id",
                    )
                    .bind::<Text, _>(format!("public-path-order-{i}"));
                    enqueue_with(c, order, chunk).await
                })
                .await
                .unwrap();
            assert!(placed);
            ids.extend(chunk.iter().map(|e| e.id().as_uuid()));
        }
    }
    assert_eq!(ids.len(), 1000);
    // The event a dead process will have held.
    let reaped = NewEvent::new("ORDER_REAPED", "order", "reaped-1", serde_json::json!({}));
    {
        let conn = producer_pool.get().await.unwrap();
        enqueue(&conn, &reaped).await.unwrap();
    }
    rt.handle().wake();

    // Each of the 1,000 events reached each consumer once.
    for c in ["ship", "mail"] {
        let effects = format!("SELECT count(*) AS n FROM public.effects WHERE consumer = '{c}'");
        assert_eq!(db.wait_for(&effects, 1000, WAIT).await, 1000, "{c}");
        assert_eq!(db.count(&distinct_effects(c, &ids)).await, 1000, "{c}");
    }
    assert_eq!(
        db.count("SELECT count(*) AS n FROM public.effects").await,
        2000,
        "no duplicate, and nothing for the paused consumer"
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM public.orders").await,
        400 + 300 + 100
    );

    // The reaper, as the runtime's role, settles the lease of a process that died holding the
    // paused consumer's event, a day ago.
    let received = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                    WHERE consumer = 'reap' AND status = 'RECEIVED'";
    assert_eq!(db.wait_for(received, 1, WAIT).await, 1);
    exec(
        &db.pool,
        "INSERT INTO actix_outbox.inbox_leases (token, consumer, locked_by, backend, claimed_at, \
             locked_until, ids) \
         SELECT nextval('actix_outbox.outbox_lease_token_seq'), 'reap', 'gone', 0, \
             now() - interval '25 hours', now() - interval '25 hours', array_agg(id) \
         FROM actix_outbox.inbox_events WHERE consumer = 'reap'",
    )
    .await;
    {
        let mut conn = runtime_pool.get().await.unwrap();
        actix_outbox::ops::resume_consumer(&mut conn, &reap_name, "ops")
            .await
            .unwrap();
    }
    let charged = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE consumer = 'reap' \
                   AND status = 'RETRY_PENDING' AND attempt_count = 1 \
                   AND error_code = 'INBOX_ATTEMPT_INTERRUPTED'";
    assert_eq!(db.wait_for(charged, 1, WAIT).await, 1);
    assert_eq!(
        db.wait_for(
            "SELECT count(*) AS n FROM actix_outbox.inbox_leases",
            0,
            WAIT
        )
        .await,
        0,
        "the dead process's lease is gone"
    );

    // Retention, as the runtime's role: what was delivered goes, a key claimed now goes, the
    // application's rows of the same table names stay.
    {
        let mut conn = runtime_pool.get().await.unwrap();
        conn.transaction::<_, Error, _>(async |c| {
            let claim = actix_outbox::keys::claim_key(c, "embedding-key", "test", None).await?;
            assert_eq!(claim, actix_outbox::keys::KeyClaim::Claimed);
            Ok(())
        })
        .await
        .unwrap();
    }
    let delivered = "SELECT ((SELECT count(*) FROM actix_outbox.outbox_events \
                         WHERE event_type = 'ORDER_STATUS_CHANGED') \
                     + (SELECT count(*) FROM actix_outbox.inbox_events WHERE status = 'PROCESSED') \
                     + (SELECT count(*) FROM actix_outbox.idempotency_keys))::int8 AS n";
    assert_eq!(db.wait_for(delivered, 0, WAIT).await, 0);
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM actix_outbox.inbox_events \
             WHERE consumer = 'reap' AND status = 'RETRY_PENDING'"
        )
        .await,
        1,
        "an event still on its way stays"
    );
    // And once more by hand, as the runtime's role and as the owner.
    for pool in [&runtime_pool, &db.pool] {
        Retention::new(pool.clone(), short.clone())
            .unwrap()
            .run_once()
            .await
            .expect("retention");
    }
    assert_eq!(text(&db.pool, APPLICATION_ROWS).await, rows_before);

    // The operator API on a pool of the operator's role: every list answers.
    let operator_pool = actix_outbox::connect(&as_role(&db.url, operator_role), 4)
        .await
        .unwrap();
    let states_before = text(
        &db.pool,
        "SELECT string_agg(concat_ws('|', consumer, paused, updated_at), ',' ORDER BY consumer) \
         AS s FROM actix_outbox.consumer_states",
    )
    .await;
    {
        let admin = AdminConfig::new(operator_pool.clone())
            .bearer_token("alice", TOKEN)
            .unwrap();
        let app = init_service(App::new().service(admin_scope("/ops", admin))).await;
        let reaped_id = reaped.id().as_uuid();
        for uri in [
            "/ops/health".to_owned(),
            "/ops/overview".to_owned(),
            "/ops/charts?minutes=60".to_owned(),
            "/ops/outbox".to_owned(),
            "/ops/outbox?status=PUBLISHED".to_owned(),
            "/ops/inbox".to_owned(),
            "/ops/inbox?consumer=reap&status=RETRY_PENDING".to_owned(),
            "/ops/consumers".to_owned(),
            "/ops/blocked".to_owned(),
            "/ops/audit".to_owned(),
            "/ops/replays".to_owned(),
            format!("/ops/events/{reaped_id}"),
            format!("/ops/timeline/{reaped_id}"),
        ] {
            let got = call!(
                app,
                TestRequest::get()
                    .uri(&uri)
                    .insert_header(("Authorization", format!("Bearer {TOKEN}")))
            );
            assert_eq!(got.0, 200, "{uri}: {}", got.1);
            let _: serde_json::Value = serde_json::from_str(&got.1)
                .unwrap_or_else(|e| panic!("{uri}: not JSON ({e}): {}", got.1));
        }
        // Reads only: an action is refused by the database, and changes nothing.
        let got = call!(
            app,
            TestRequest::post()
                .uri("/ops/consumers/ship/pause")
                .insert_header(("Authorization", format!("Bearer {TOKEN}")))
                .insert_header(("Content-Type", "application/json"))
                .set_payload(r#"{"reason":"an operator role reads only"}"#)
        );
        assert_eq!(got.0, 503, "{got:?}");
        assert!(got.1.contains("DATABASE_ERROR"), "{got:?}");
        assert!(got.1.contains("permission denied"), "{got:?}");
    }
    assert_eq!(
        text(
            &db.pool,
            "SELECT string_agg(concat_ws('|', consumer, paused, updated_at), ',' ORDER BY consumer) \
             AS s FROM actix_outbox.consumer_states",
        )
        .await,
        states_before
    );
    {
        let mut conn = operator_pool.get().await.unwrap();
        let timeline = actix_outbox::ops::timeline(&mut conn, &reaped.id().as_uuid().to_string())
            .await
            .unwrap();
        assert!(
            timeline
                .iter()
                .any(|t| t.kind == "inbox" && t.consumer.as_deref() == Some("reap")),
            "{timeline:?}"
        );
    }

    // The application's tables, rows and diesel history are as they were; nothing went to
    // its `outbox_events`.
    assert_eq!(text(&db.pool, APPLICATION_ROWS).await, rows_before);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM public.outbox_events")
            .await,
        2
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM public.__diesel_schema_migrations")
            .await,
        1
    );
    drop((producer_pool, operator_pool, runtime_pool));
    db.finish(&[&rt]).await;
    roles.drop_all().await;
}

/// A start checks the role's privileges and the schema's version before it writes anything:
/// one privilege short, it names that privilege and table; with no grant at all, the schema's
/// USAGE; on a database never migrated, or migrated only part of the way,
/// `SCHEMA_NOT_MIGRATED`.
#[actix_rt::test]
async fn a_missing_privilege_is_refused_at_start_naming_the_table_and_privilege() {
    let db = TestDb::empty().await;
    actix_outbox::migrate(&db.url).await.unwrap();
    let roles = Roles::create(&db, &["rt", "none"]).await;
    let (short_role, bare_role) = (roles.get(0), roles.get(1));
    {
        let mut owner = db.pool.get().await.unwrap();
        db::grant(&mut owner, Role::Runtime, short_role)
            .await
            .unwrap();
        owner
            .batch_execute(&format!(
                "REVOKE UPDATE ON actix_outbox.inbox_events FROM {short_role}"
            ))
            .await
            .unwrap();
    }
    async fn start_as(url: &str) -> Error {
        let pool = actix_outbox::connect(url, 8).await.unwrap();
        let started = OutboxRuntime::builder(pool)
            .config(fast_runtime())
            .consumer(consumer("mail", 3), || Recorder {
                name: "mail".into(),
                behaviour: Behaviour::default(),
            })
            .start()
            .await;
        match started {
            Ok(rt) => {
                rt.shutdown().await;
                panic!("started on {url}")
            }
            Err(e) => e,
        }
    }
    let nothing_written = "SELECT ((SELECT count(*) FROM actix_outbox.consumer_states) \
                           + (SELECT count(*) FROM actix_outbox.consumer_subscriptions) \
                           + (SELECT count(*) FROM actix_outbox.contract_findings) \
                           + (SELECT count(*) FROM actix_outbox.outbox_stats_samples))::int8 AS n";

    let e = start_as(&as_role(&db.url, short_role)).await;
    assert_eq!(e.code(), ErrorCode::PRIVILEGE_MISSING, "{e}");
    let message = e.to_string();
    assert!(
        message.contains("UPDATE on actix_outbox.inbox_events"),
        "{message}"
    );
    match &e {
        Error::PrivilegeMissing { role, missing } => {
            assert_eq!(role, short_role);
            assert_eq!(
                missing,
                &[("UPDATE".to_owned(), "actix_outbox.inbox_events".to_owned())]
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(db.count(nothing_written).await, 0, "nothing was written");

    let e = start_as(&as_role(&db.url, bare_role)).await;
    assert_eq!(e.code(), ErrorCode::PRIVILEGE_MISSING, "{e}");
    let message = e.to_string();
    assert!(
        message.contains("USAGE on schema actix_outbox"),
        "{message}"
    );
    assert!(message.contains(bare_role), "{message}");
    assert_eq!(db.count(nothing_written).await, 0, "nothing was written");

    // A database never migrated: refused, and the start made no schema.
    let fresh = TestDb::empty().await;
    let e = start_as(&fresh.url).await;
    assert_eq!(e.code(), ErrorCode::SCHEMA_NOT_MIGRATED, "{e}");
    assert!(e.to_string().contains("not migrated"), "{e}");
    assert_eq!(
        fresh
            .count("SELECT count(*) AS n FROM pg_namespace WHERE nspname = 'actix_outbox'")
            .await,
        0
    );
    // Migrated only to its first version: refused too, naming that version.
    let first = MIGRATIONS[0].version;
    let config = MigrateConfig {
        until: Some(first.to_owned()),
        ..MigrateConfig::default()
    };
    db::migrate_with(&fresh.url, &config).await.unwrap();
    let e = start_as(&fresh.url).await;
    assert_eq!(e.code(), ErrorCode::SCHEMA_NOT_MIGRATED, "{e}");
    assert!(e.to_string().contains(first), "{e}");
    assert_eq!(
        fresh
            .count("SELECT count(*) AS n FROM actix_outbox.consumer_states")
            .await,
        0
    );
    fresh.finish(&[]).await;
    db.finish(&[]).await;
    roles.drop_all().await;
}

/// A role with only `Role::Producer`'s grants enqueues in its business transactions, by each
/// of the three calls, and can do nothing else with the library's tables.
#[actix_rt::test]
async fn a_producer_that_can_only_insert_events_can_enqueue() {
    let db = TestDb::empty().await;
    actix_outbox::migrate(&db.url).await.unwrap();
    exec(
        &db.pool,
        "CREATE TABLE public.orders (id text PRIMARY KEY, status text NOT NULL, \
             version bigint NOT NULL DEFAULT 1)",
    )
    .await;
    let roles = Roles::create(&db, &["pr"]).await;
    let producer = roles.get(0);
    assert_eq!(
        db::grants(Role::Producer, producer).unwrap(),
        [
            format!("GRANT USAGE ON SCHEMA actix_outbox TO {producer}"),
            format!("GRANT INSERT ON actix_outbox.outbox_events TO {producer}"),
            format!("GRANT USAGE ON SEQUENCE actix_outbox.outbox_events_seq_seq TO {producer}"),
        ]
    );
    {
        let mut owner = db.pool.get().await.unwrap();
        db::grant(&mut owner, Role::Producer, producer)
            .await
            .unwrap();
        owner
            .batch_execute(&format!(
                "GRANT INSERT, SELECT ON public.orders TO {producer}"
            ))
            .await
            .unwrap();
    }
    let mut conn = AsyncPgConnection::establish(&as_role(&db.url, producer))
        .await
        .unwrap();
    let (one, many, with) = (order_event("o-1"), events("o-many", 3), events("o-with", 2));
    let skipped = order_event("o-skipped");
    conn.transaction::<_, Error, _>(async |c| {
        diesel::sql_query("INSERT INTO orders (id, status) VALUES ('o-1', 'PLACED')")
            .execute(c)
            .await?;
        enqueue(c, &one).await?;
        enqueue_many(c, &many).await?;
        let placed = enqueue_with(
            c,
            diesel::sql_query(
                "INSERT INTO orders (id, status) VALUES ('o-2', 'PLACED') RETURNING id",
            ),
            &with,
        )
        .await?;
        assert!(placed);
        // A business statement that wrote nothing writes no event.
        let placed = enqueue_with(
            c,
            diesel::sql_query(
                "INSERT INTO orders (id, status) VALUES ('o-1', 'PLACED') \
                 ON CONFLICT DO NOTHING RETURNING id",
            ),
            std::slice::from_ref(&skipped),
        )
        .await?;
        assert!(!placed);
        Ok(())
    })
    .await
    .expect("the producer enqueues");
    let written: Vec<String> = std::iter::once(&one)
        .chain(&many)
        .chain(&with)
        .map(|e| format!("'{}'", e.id()))
        .collect();
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) AS n FROM actix_outbox.outbox_events \
             WHERE status = 'PENDING' AND id IN ({})",
            written.join(",")
        ))
        .await,
        6
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.outbox_events")
            .await,
        6
    );
    // Nothing more: it cannot read, change or delete the events, or touch another table.
    for sql in [
        "SELECT count(*) AS n FROM actix_outbox.outbox_events",
        "SELECT count(*) AS n FROM actix_outbox.inbox_events",
        "WITH u AS (UPDATE actix_outbox.outbox_events SET status = 'PUBLISHED' RETURNING 1) \
         SELECT count(*) AS n FROM u",
        "WITH d AS (DELETE FROM actix_outbox.outbox_events RETURNING 1) SELECT count(*) AS n FROM d",
        "WITH i AS (INSERT INTO actix_outbox.consumer_states (consumer) VALUES ('x') RETURNING 1) \
         SELECT count(*) AS n FROM i",
    ] {
        let e = count_on(&mut conn, sql).await.unwrap_err();
        assert!(e.contains("permission denied"), "{sql}: {e}");
    }
    drop(conn);
    // And a runtime on its role does not start.
    let pool = actix_outbox::connect(&as_role(&db.url, producer), 4)
        .await
        .unwrap();
    let started = OutboxRuntime::builder(pool).start().await;
    let code = match started {
        Ok(rt) => {
            rt.shutdown().await;
            panic!("a runtime started as the producer")
        }
        Err(e) => e.code(),
    };
    assert_eq!(code, ErrorCode::PRIVILEGE_MISSING);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM actix_outbox.outbox_events WHERE status = 'PENDING'")
            .await,
        6
    );
    db.finish(&[]).await;
    roles.drop_all().await;
}

/// A process that calls `use_schema("billing_outbox")` first keeps everything there: the
/// migrations, delivery, retention and the timeline; no `actix_outbox` schema is ever made.
/// The schema is the process's, so this needs nextest's process per test.
#[actix_rt::test]
async fn another_schema_holds_everything_when_configured() {
    if std::env::var_os("NEXTEST").is_none() {
        eprintln!(
            "another_schema_holds_everything_when_configured sets the process's schema: it needs \
             nextest's process per test (cargo nextest run), and does nothing under cargo test"
        );
        return;
    }
    db::use_schema("billing_outbox").unwrap();
    assert_eq!(db::schema(), "billing_outbox");
    assert!(db::grants(Role::Producer, "someone")
        .unwrap()
        .iter()
        .all(|g| !g.contains("actix_outbox") && g.contains("billing_outbox")));
    let db = TestDb::empty().await;
    exec(
        &db.pool,
        "CREATE TABLE public.effects (id bigserial PRIMARY KEY, consumer text NOT NULL, \
             event_id uuid NOT NULL, attempt int NOT NULL)",
    )
    .await;
    actix_outbox::migrate(&db.url).await.unwrap();
    let listening = format!(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = '{}' \
         AND query LIKE 'LISTEN billing\\_outbox\\_%'",
        db.name
    );
    let mut lib = LIBRARY_TABLES.to_vec();
    lib.sort_unstable();
    assert_eq!(tables_of(&db.pool, "billing_outbox").await, lib);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM billing_outbox.schema_migrations")
            .await,
        MIGRATIONS.len() as i64
    );

    let rt = start(&db, vec![(consumer("ledger", 3), Behaviour::default())]).await;
    assert_eq!(
        db.wait_for(&listening, 1, WAIT).await,
        1,
        "the runtime listens on the channels of its schema"
    );
    let batch: Vec<NewEvent> = (0..50)
        .map(|i| order_event(&format!("b-{i}")).correlation_id("billing-corr"))
        .collect();
    {
        let mut conn = db.pool.get().await.unwrap();
        for chunk in batch.chunks(10) {
            conn.transaction::<_, Error, _>(async |c| {
                enqueue_many(c, chunk).await?;
                Ok(())
            })
            .await
            .unwrap();
        }
    }
    rt.handle().wake();
    let ids: Vec<uuid::Uuid> = batch.iter().map(|e| e.id().as_uuid()).collect();
    assert_eq!(
        db.wait_for("SELECT count(*) AS n FROM public.effects", 50, WAIT)
            .await,
        50
    );
    assert_eq!(db.count(&distinct_effects("ledger", &ids)).await, 50);
    let processed = "SELECT count(*) AS n FROM billing_outbox.inbox_events \
                     WHERE consumer = 'ledger' AND status = 'PROCESSED'";
    assert_eq!(db.wait_for(processed, 50, WAIT).await, 50);
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM billing_outbox.outbox_events WHERE status = 'PUBLISHED'"
        )
        .await,
        50
    );
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM billing_outbox.consumer_states WHERE consumer = 'ledger'"
        )
        .await,
        1
    );
    {
        let mut conn = db.pool.get().await.unwrap();
        let timeline = actix_outbox::ops::timeline(&mut conn, "billing-corr")
            .await
            .unwrap();
        assert_eq!(
            timeline.iter().filter(|t| t.kind == "outbox").count(),
            50,
            "{timeline:?}"
        );
        assert_eq!(
            timeline
                .iter()
                .filter(|t| t.kind == "inbox" && t.status == "PROCESSED")
                .count(),
            50,
            "{timeline:?}"
        );
    }
    let short = RetentionConfig::default()
        .published_outbox_after(Duration::from_millis(1))
        .processed_inbox_after(Duration::from_millis(1))
        .idempotency_keys_after(Duration::from_millis(1));
    let report = Retention::new(db.pool.clone(), short)
        .unwrap()
        .run_once()
        .await
        .unwrap();
    assert_eq!((report.outbox_deleted, report.inbox_deleted), (50, 50));
    assert_eq!(
        db.count(
            "SELECT ((SELECT count(*) FROM billing_outbox.outbox_events) \
                 + (SELECT count(*) FROM billing_outbox.inbox_events))::int8 AS n"
        )
        .await,
        0
    );
    assert_eq!(
        db.count("SELECT count(*) AS n FROM pg_namespace WHERE nspname = 'actix_outbox'")
            .await,
        0,
        "no actix_outbox schema"
    );
    assert_eq!(
        db.count(
            "SELECT count(*) AS n FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = 'public' AND c.relname <> 'effects' AND c.relname <> 'effects_pkey' \
               AND c.relname <> 'effects_id_seq'"
        )
        .await,
        0,
        "nothing of the library in public"
    );
    db.finish(&[&rt]).await;
}
