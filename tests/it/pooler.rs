//! The runtime behind PgBouncer: a start refuses a pool that goes through a pooler in
//! transaction mode (`POOLER_UNSUPPORTED`, `runtime::preflight`), and runs normally through one
//! in session mode. Each test starts a private `pgbouncer` of its own, in front of its own test
//! database, on a free port. Every assertion counts rows or reads an error code.
//!
//! The tests need the `pgbouncer` binary (Debian's package `pgbouncer`, which `scripts/test`
//! installs when it runs as root). Missing, they fail, unless `AO_SKIP_PGBOUNCER=1` says that
//! is fine.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use actix_outbox::OutboxRuntime;
use common::*;

/// A private `pgbouncer` in front of one database, stopped (SIGKILL) and its folder removed
/// when dropped. Its log (stderr) is printed when a test fails while it runs.
struct PgBouncer {
    port: u16,
    dir: PathBuf,
    child: Child,
}

/// What PgBouncer is given of a `postgres://` URL.
struct Server {
    user: String,
    password: Option<String>,
    host: String,
    port: u16,
}

/// The user, password, host and port of `url` (`postgres://user[:password]@host[:port]/db?…`).
fn server(url: &str) -> Server {
    let rest = &url[url.find("://").expect("a URL") + 3..];
    let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
    let (userinfo, host_port) = authority
        .rsplit_once('@')
        .map_or((None, authority), |(u, h)| (Some(u), h));
    let (user, password) = match userinfo.map(|u| u.split_once(':').unwrap_or((u, ""))) {
        Some((u, p)) => (u.to_owned(), (!p.is_empty()).then(|| p.to_owned())),
        None => ("postgres".to_owned(), None),
    };
    let (host, port) = match host_port.rsplit_once(':') {
        Some((h, p)) => (h.to_owned(), p.parse().expect("a port")),
        None => (host_port.to_owned(), 5432),
    };
    Server {
        user,
        password,
        host,
        port,
    }
}

/// The `pgbouncer` binary: on `PATH`, or where Debian's package puts it (`/usr/sbin`, which
/// an unprivileged user's `PATH` may lack). `None` when the test may skip; a panic when it may
/// not: a green run must mean the pooler was really there.
fn pgbouncer_or_skip() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|dir| dir.join("pgbouncer"));
    if let Some(bin) = on_path
        .chain([PathBuf::from("/usr/sbin/pgbouncer")])
        .find(|p| p.is_file())
    {
        return Some(bin);
    }
    if std::env::var("AO_SKIP_PGBOUNCER").as_deref() == Ok("1") {
        eprintln!("skipping the pooler test (AO_SKIP_PGBOUNCER=1): no pgbouncer binary");
        return None;
    }
    panic!(
        "no pgbouncer binary on PATH or in /usr/sbin. scripts/test installs Debian's package \
         when it runs as root; otherwise apt-get install -y pgbouncer, or set \
         AO_SKIP_PGBOUNCER=1 to skip this test"
    )
}

/// The user pgbouncer runs as when we are root (it refuses to run as root): `postgres` when
/// there is one, else `nobody`.
fn unprivileged_user() -> &'static str {
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    if passwd.lines().any(|l| l.starts_with("postgres:")) {
        "postgres"
    } else {
        "nobody"
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// A port nothing listens on now (it may be taken before pgbouncer binds it: then another).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Writes `text` to `path`, readable by pgbouncer's user.
fn write_readable(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
}

/// A new folder for one pgbouncer: under `target/`, or under the system's temporary folder when
/// we are root and pgbouncer's user could not reach `target/` (a checkout in a private home).
fn bouncer_dir() -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let reachable = target.ancestors().all(|d| {
        d.metadata()
            .is_ok_and(|m| m.permissions().mode() & 0o001 != 0)
    });
    let parent = if is_root() && !reachable {
        std::env::temp_dir()
    } else {
        target.to_path_buf()
    };
    let dir = parent.join(format!("pgbouncer-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

impl PgBouncer {
    /// A pgbouncer in `pool_mode` with `default_pool_size` server connections, whose database
    /// `db.name` is `db.name` on `db`'s server. The client side is `trust`: a password in the
    /// URL is for the server only.
    fn start(bin: &Path, db: &TestDb, pool_mode: &str, default_pool_size: u32) -> PgBouncer {
        let s = server(&db.url);
        let password = s
            .password
            .as_deref()
            .map(|p| format!(" password={p}"))
            .unwrap_or_default();
        for _ in 0..5 {
            let dir = bouncer_dir();
            // `trust` still needs the user in the auth file.
            let auth = dir.join("userlist.txt");
            write_readable(&auth, &format!("\"{}\" \"\"\n", s.user));
            let port = free_port();
            // No unix socket and no log file: nothing to write but its stderr, which is ours.
            let ini = format!(
                "[databases]\n\
                 {name} = host={host} port={server_port} dbname={name} user={user}{password}\n\
                 \n\
                 [pgbouncer]\n\
                 listen_addr = 127.0.0.1\n\
                 listen_port = {port}\n\
                 unix_socket_dir =\n\
                 auth_type = trust\n\
                 auth_file = {auth}\n\
                 pool_mode = {pool_mode}\n\
                 default_pool_size = {default_pool_size}\n\
                 max_client_conn = 200\n",
                name = db.name,
                host = s.host,
                server_port = s.port,
                user = s.user,
                auth = auth.display(),
            );
            let config = dir.join("pgbouncer.ini");
            write_readable(&config, &ini);
            let mut cmd = Command::new(bin);
            if is_root() {
                // pgbouncer refuses to run as root.
                cmd.args(["-u", unprivileged_user()]);
            }
            let child = cmd
                .arg(&config)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join("pgbouncer.log")).unwrap())
                .spawn()
                .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
            // From here on, a panic stops it and prints its log.
            let mut bouncer = PgBouncer { port, dir, child };
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return bouncer;
                }
                if let Some(status) = bouncer.child.try_wait().unwrap() {
                    assert!(
                        bouncer.log().contains("Address already in use"),
                        "pgbouncer exited at start ({status})"
                    );
                    // Its port was taken since we found it free: another port.
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "pgbouncer did not listen on port {port} within 10 s"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        panic!("pgbouncer found no free port in 5 tries");
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }

    /// `url` (`postgres://user@host:port/db?…`) pointed at this pgbouncer.
    fn url(&self, url: &str) -> String {
        let scheme_end = url.find("://").expect("a URL") + 3;
        let rest = &url[scheme_end..];
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let authority = &rest[..authority_end];
        let user = authority.rsplit_once('@').map(|(u, _)| u);
        format!(
            "{}{}127.0.0.1:{}{}",
            &url[..scheme_end],
            user.map(|u| format!("{u}@")).unwrap_or_default(),
            self.port,
            &rest[authority_end..]
        )
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("pgbouncer's log ({}):\n{}", self.dir.display(), self.log());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const REGISTERED: &str = "SELECT count(*) AS n FROM actix_outbox.consumer_states";

/// Through a transaction pooler with room for two server connections, the start's check sees
/// its session answer from two backends and refuses, before anything is written. With the
/// check off, the same start on the same pool goes through: the refusal is the check's.
#[actix_rt::test]
async fn a_transaction_pooler_is_refused_at_start() {
    let Some(bin) = pgbouncer_or_skip() else {
        return;
    };
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&bin, &db, "transaction", 4);
    let pool = actix_outbox::connect(&bouncer.url(&db.url), 4)
        .await
        .expect("pool through pgbouncer");

    let start = |pooler_check: bool| {
        let name = "behind-transaction-pooler";
        OutboxRuntime::builder(pool.clone())
            .config(fast_runtime().pooler_check(pooler_check))
            .consumer(consumer(name, 3), move || Recorder {
                name: name.to_owned(),
                behaviour: Behaviour::default(),
            })
            .start()
    };

    let refused = match within(WAIT, start(true)).await {
        Ok(rt) => {
            rt.shutdown().await;
            panic!("a start through a transaction pooler was not refused");
        }
        Err(e) => e,
    };
    assert_eq!(refused.code().as_str(), "POOLER_UNSUPPORTED", "{refused}");
    assert_eq!(db.count(REGISTERED).await, 0, "a refused start wrote");

    // The control: the same start with the check off gets as far as registering its consumer.
    let rt = within(WAIT, start(false))
        .await
        .unwrap_or_else(|e| panic!("start with pooler_check(false): {e}"));
    assert_eq!(db.count(REGISTERED).await, 1);
    within(WAIT, rt.shutdown()).await;
    drop(pool);
    // Its server connections (one last ran the listener's LISTEN) go with it.
    drop(bouncer);
    db.finish(&[]).await;
}

/// Through a session pooler a client keeps its server connection, so the check passes and
/// the runtime runs as on a direct pool: 200 events, each handled once. Events are produced
/// and counted through the test's direct pool; only the runtime goes through pgbouncer.
#[actix_rt::test]
async fn a_session_pooler_is_accepted_and_delivers() {
    let Some(bin) = pgbouncer_or_skip() else {
        return;
    };
    let db = TestDb::new().await;
    // In session mode each client connection holds a server connection: room for the whole
    // pool and the runtime's connections of its own (the listener, the check's second one).
    let bouncer = PgBouncer::start(&bin, &db, "session", 30);
    let pool = actix_outbox::connect(&bouncer.url(&db.url), 8)
        .await
        .expect("pool through pgbouncer");
    let rt = within(
        WAIT,
        start_on(
            pool.clone(),
            vec![(consumer("behind-session-pooler", 3), Behaviour::default())],
        ),
    )
    .await;
    db.produce(200, "s").await;
    rt.handle().wake();

    let processed = "SELECT count(*) AS n FROM actix_outbox.inbox_events \
                     WHERE consumer = 'behind-session-pooler' AND status = 'PROCESSED'";
    assert_eq!(db.wait_for(processed, 200, WAIT).await, 200);
    assert_eq!(db.idle_in_transaction().await, 0);
    assert!(within(WAIT, rt.shutdown()).await, "a clean shutdown");

    // Counted after the shutdown, so that no late delivery can add one.
    assert_eq!(db.count(processed).await, 200);
    assert_eq!(
        db.count("SELECT count(*) AS n FROM effects WHERE consumer = 'behind-session-pooler'")
            .await,
        200
    );
    assert_eq!(
        db.count(
            "SELECT count(DISTINCT e.event_id) AS n FROM effects e \
             JOIN actix_outbox.outbox_events o ON o.id = e.event_id"
        )
        .await,
        200
    );
    drop(pool);
    drop(bouncer);
    db.finish(&[]).await;
}
