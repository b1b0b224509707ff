//! Test databases are clones of a template that is migrated once per server and per set of
//! migrations, instead of each test running every migration on a database of its own.
//!
//! The template is `ao_tpl_<hash>`, the hash taken over every file under `migrations/` (path
//! and contents) and the business tables: a changed or added migration gets a new template,
//! and a template never holds an older schema than the migrations. It is built under a scratch
//! name (`ao_test_tpl_…`) and renamed when complete, under an advisory lock: nextest runs each
//! test in a process of its own, so the first tests of a run race for it; one builds, the
//! others wait and then clone. A build killed half-way leaves an `ao_test_` database, which
//! `scripts/test` drops at its next start, never a half-made template. `scripts/test` drops
//! the templates at its start too.
//!
//! `CREATE DATABASE … TEMPLATE` fails while anyone is connected to the template, so nobody may:
//! the builder closes its connections before the rename, and the template refuses connections
//! (`ALLOW_CONNECTIONS false`; its clones allow them).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use super::{with_database, Count};

/// The test's business tables, in the template next to the library's. `effects` has no unique
/// constraint on purpose: a duplicate effect must show.
const BUSINESS_TABLES: &str =
    "CREATE TABLE orders (id text PRIMARY KEY, status text NOT NULL, version bigint NOT NULL DEFAULT 1);
     CREATE TABLE audit_logs (id bigserial PRIMARY KEY, order_id text NOT NULL, action text NOT NULL);
     CREATE TABLE effects (id bigserial PRIMARY KEY, consumer text NOT NULL, event_id uuid NOT NULL,
                           attempt int NOT NULL);";

/// How long a clone or a rename waits for the template to be free, and a clone for a template
/// dropped under it (another run's `scripts/test` starting) to be rebuilt.
const PATIENCE: Duration = Duration::from_secs(60);

/// FNV-1a: stable across toolchains and runs, unlike `DefaultHasher`.
fn fnv1a(hash: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *hash ^= u64::from(b);
        *hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
}

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_under(&path, out);
        } else {
            out.push(path);
        }
    }
}

/// The template's hash: every migration file, then the business tables.
fn hash() -> u64 {
    static HASH: OnceLock<u64> = OnceLock::new();
    *HASH.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        let mut files = Vec::new();
        files_under(&root, &mut files);
        files.sort();
        let mut h = 0xcbf2_9ce4_8422_2325;
        for file in files {
            let rel = file.strip_prefix(&root).unwrap().to_string_lossy();
            let contents = std::fs::read(&file).unwrap();
            fnv1a(&mut h, rel.as_bytes());
            fnv1a(&mut h, &(contents.len() as u64).to_le_bytes());
            fnv1a(&mut h, &contents);
        }
        // The runner decides where the migrations land.
        let runner = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/store/migrate.rs");
        fnv1a(&mut h, &std::fs::read(runner).unwrap());
        fnv1a(&mut h, BUSINESS_TABLES.as_bytes());
        h
    })
}

/// `ao_tpl_<hash>`.
pub fn name() -> String {
    format!("ao_tpl_{:016x}", hash())
}

async fn exists(admin: &mut AsyncPgConnection, db: &str) -> bool {
    let c: Count = diesel::sql_query(format!(
        "SELECT count(*) AS n FROM pg_database WHERE datname = '{db}'"
    ))
    .get_result(admin)
    .await
    .expect("look up a database");
    c.n > 0
}

/// Runs `sql` on `admin`, retrying while it fails only because someone is still connected to
/// the database it names.
async fn while_in_use(admin: &mut AsyncPgConnection, sql: &str) -> Result<(), String> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        match admin.batch_execute(sql).await {
            Ok(()) => return Ok(()),
            Err(e)
                if e.to_string().contains("is being accessed by other users")
                    && Instant::now() < deadline =>
            {
                actix_rt::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Makes sure the server at `server_url` has the template, building it when no one has.
async fn ensure(admin: &mut AsyncPgConnection, server_url: &str) {
    let template = name();
    if exists(admin, &template).await {
        return;
    }
    // The key is the hash, so builds of different templates do not wait for each other.
    let key = hash() as i64;
    admin
        .batch_execute(&format!("SELECT pg_advisory_lock({key})"))
        .await
        .expect("lock the template's build");
    if !exists(admin, &template).await {
        let scratch = format!("ao_test_tpl_{}", uuid::Uuid::new_v4().simple());
        admin
            .batch_execute(&format!("CREATE DATABASE {scratch}"))
            .await
            .expect("create the template's scratch database");
        let url = with_database(server_url, &scratch);
        actix_outbox::migrate(&url)
            .await
            .expect("migrate the template");
        let mut conn = AsyncPgConnection::establish(&url)
            .await
            .expect("connect to the template");
        conn.batch_execute(BUSINESS_TABLES)
            .await
            .expect("create the business tables");
        drop(conn);
        admin
            .batch_execute(&format!(
                "ALTER DATABASE {scratch} WITH ALLOW_CONNECTIONS false"
            ))
            .await
            .expect("close the template to connections");
        // The connections just closed may not have ended on the server yet.
        while_in_use(
            admin,
            &format!("ALTER DATABASE {scratch} RENAME TO {template}"),
        )
        .await
        .expect("rename the template");
    }
    admin
        .batch_execute(&format!("SELECT pg_advisory_unlock({key})"))
        .await
        .expect("unlock the template's build");
}

/// Creates the database `db` on the server at `server_url` as a clone of the template.
pub async fn create(server_url: &str, db: &str) {
    let mut admin = AsyncPgConnection::establish(server_url)
        .await
        .expect("connect to the server");
    let template = name();
    let deadline = Instant::now() + PATIENCE;
    loop {
        ensure(&mut admin, server_url).await;
        match while_in_use(
            &mut admin,
            &format!("CREATE DATABASE {db} TEMPLATE {template}"),
        )
        .await
        {
            Ok(()) => return,
            // Dropped since `ensure` saw it (another run's `scripts/test` starting): again.
            Err(e) if e.contains("does not exist") && Instant::now() < deadline => {}
            Err(e) => panic!("create test database {db} from {template}: {e}"),
        }
    }
}
