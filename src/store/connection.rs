//! How connections notice a dead network: TCP keepalive and `tcp_user_timeout` on the
//! client's socket, the same on the server's side of it, an idle-in-transaction limit on the
//! server, and a bound on establishing a connection. The runtime bounds each of its own round
//! trips as well ([`DB_TIMEOUT`](super::DB_TIMEOUT)); these settings cover what that bound
//! cannot: a pooled connection that died while idle, and a session the server keeps (with its
//! row locks) for a client that is gone.

use std::time::Duration;

use actix_rt::ArbiterHandle;
use diesel::ConnectionError;
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};

use crate::error::{Error, Result};

thread_local! {
    /// On a thread where user code runs beside the runtime (a handler's, a side effect's):
    /// the runtime's thread, which opens the connections this thread asks the pool for.
    static DRIVER: std::cell::RefCell<Option<ArbiterHandle>> = const { std::cell::RefCell::new(None) };
}

/// Makes `thread` (one of the runtime's handler or side-effect threads) have the connections
/// it asks a pool for (of a manager built by [`ConnectionConfig::manager`]) opened on the
/// calling thread, the runtime's. Runs before anything sent to `thread` after it.
pub(crate) fn open_connections_here_for(thread: &ArbiterHandle) {
    match actix_rt::Arbiter::try_current() {
        Some(runtime) => {
            thread.spawn_fn(move || DRIVER.with(|d| *d.borrow_mut() = Some(runtime)));
        }
        None => tracing::warn!(
            "the runtime was started outside an actix arbiter: connections a handler's thread \
             asks the pool for are opened, and driven, on that thread"
        ),
    }
}

/// Network settings for the connections of a pool built by [`connect_with`](crate::db::connect_with)
/// (and [`connect`](crate::connect), with the defaults).
///
/// Each is applied only where nothing else set it: a URL parameter of the same name wins over
/// a client-side setting, and a server-side setting is made only when the server reports it at
/// its built-in default (`pg_settings.source = 'default'`), so a value from
/// `postgresql.conf`, `ALTER ROLE … SET` or `ALTER DATABASE … SET` stays in force.
///
/// # What each one catches
///
/// - A peer that vanished while the connection was idle in the pool (a failover without a
///   reset, an expired NAT entry): TCP keepalive closes the socket after
///   `keepalive_idle + keepalive_retries × keepalive_interval` (25 s by default), so the next
///   statement on it fails at once instead of waiting.
/// - A peer that vanished with a statement in flight: `tcp_user_timeout` closes the socket
///   once sent data has gone unacknowledged that long (keepalive does not probe while data is
///   outstanding, and retransmission alone gives up only after ~15 minutes).
/// - A client that vanished while its transaction held row locks: the server's own keepalive
///   (the same values, as `tcp_keepalives_*` and `tcp_user_timeout`) ends the session, and
///   `idle_in_transaction_timeout` ends it even when the path still acknowledges packets.
/// - A path that accepts packets and answers nothing (a hung proxy): no TCP setting notices
///   that, since the proxy acknowledges everything. The runtime's client-side bound on each
///   round trip does, and the connection is then closed rather than returned to the pool.
///
/// No `statement_timeout` is set: handlers run their own statements on these connections, and
/// only the application knows how long those may take. The runtime bounds its statements in
/// the client instead. Set one in the URL (`options=-c statement_timeout=…`) or on the role if
/// you want a server-side limit for everything.
///
/// # Pools you build yourself
///
/// Build the manager with [`ConnectionConfig::manager`] and configure bb8 as you like; set
/// bb8's `connection_timeout` (bb8 itself does not bound establishing a connection: the
/// manager built here does, with `connect_timeout`). With a manager of your own, add the
/// client-side parameters to your URL ([`ConnectionConfig::url`] does it) and the server-side
/// settings to your role or database.
///
/// Note that tokio-postgres reads `tcp_user_timeout` in a URL as seconds, where libpq reads
/// milliseconds.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ConnectionConfig {
    /// Idle time before the first keepalive probe (`keepalives_idle`, and the server's
    /// `tcp_keepalives_idle`). Default 10 s. Whole seconds, rounded up.
    pub keepalive_idle: Duration,
    /// Time between keepalive probes (`keepalives_interval`, `tcp_keepalives_interval`).
    /// Default 5 s. Whole seconds, rounded up.
    pub keepalive_interval: Duration,
    /// Unanswered probes before the connection is dropped (`keepalives_retries`,
    /// `tcp_keepalives_count`). Default 3.
    pub keepalive_retries: u32,
    /// How long sent data may stay unacknowledged before the connection is dropped
    /// (`tcp_user_timeout`, on both sides; Linux only, ignored elsewhere). Default 20 s. Whole
    /// seconds on the client, rounded up.
    pub tcp_user_timeout: Duration,
    /// How long establishing one connection may take: TCP connect, TLS, authentication and the
    /// session settings, through a path that may be a black hole. Default 10 s.
    pub connect_timeout: Duration,
    /// The server ends a session whose transaction has been idle this long
    /// (`idle_in_transaction_session_timeout`), releasing its locks. Default 60 s: longer
    /// than the default handler timeout (30 s), since a handler's transaction is open while
    /// it runs, and a handler that must keep its transaction idle for longer needs a longer
    /// value here. `None` leaves the server's setting alone.
    pub idle_in_transaction_timeout: Option<Duration>,
    /// How long [`connect_with`](crate::db::connect_with)'s pool waits for a connection (bb8's
    /// `connection_timeout`): for a free one, or for a new one to be established, retries
    /// included. Default 30 s.
    pub acquire_timeout: Duration,
}

impl Default for ConnectionConfig {
    fn default() -> Self {
        ConnectionConfig {
            keepalive_idle: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(5),
            keepalive_retries: 3,
            tcp_user_timeout: Duration::from_secs(20),
            connect_timeout: Duration::from_secs(10),
            idle_in_transaction_timeout: Some(Duration::from_secs(60)),
            acquire_timeout: Duration::from_secs(30),
        }
    }
}

impl ConnectionConfig {
    /// Checks the settings.
    ///
    /// # Errors
    /// [`Error::Config`] for a zero duration or zero keepalive retries.
    pub fn validate(&self) -> Result<()> {
        let durations = [
            self.keepalive_idle,
            self.keepalive_interval,
            self.tcp_user_timeout,
            self.connect_timeout,
            self.acquire_timeout,
            self.idle_in_transaction_timeout.unwrap_or(Duration::MAX),
        ];
        // Zero means "the system default" to both tokio-postgres and PostgreSQL, which is the
        // opposite of what a caller asking for a short bound meant.
        if durations.iter().any(|d| d.as_millis() == 0) || self.keepalive_retries == 0 {
            return Err(Error::Config(
                "connection timeouts and keepalive retries must be positive".into(),
            ));
        }
        Ok(())
    }

    /// `database_url` with the client-side parameters (`keepalives`, `keepalives_idle`,
    /// `keepalives_interval`, `keepalives_retries`, `tcp_user_timeout`) added where it does not
    /// set them. Takes a URL (`postgres://…`) or a `key=value` connection string.
    pub fn url(&self, database_url: &str) -> String {
        let params = [
            ("keepalives", "1".to_owned()),
            ("keepalives_idle", secs(self.keepalive_idle)),
            ("keepalives_interval", secs(self.keepalive_interval)),
            ("keepalives_retries", self.keepalive_retries.to_string()),
            ("tcp_user_timeout", secs(self.tcp_user_timeout)),
        ];
        let mut out = database_url.to_owned();
        let is_url = ["postgres://", "postgresql://"]
            .iter()
            .any(|p| database_url.starts_with(p));
        for (key, value) in params {
            if has_param(database_url, is_url, key) {
                continue;
            }
            if is_url {
                match out.chars().last() {
                    Some('?') | Some('&') => {}
                    _ if out.contains('?') => out.push('&'),
                    _ => out.push('?'),
                }
            } else if !out.is_empty() {
                out.push(' ');
            }
            out.push_str(key);
            out.push('=');
            out.push_str(&value);
        }
        out
    }

    /// A connection manager for `database_url` that applies these settings: the client-side
    /// ones through [`ConnectionConfig::url`], the server-side ones with one statement when a
    /// connection is established, and the whole of establishing bounded by `connect_timeout`.
    ///
    /// A connection is opened on the runtime's thread even when a handler's thread (or a side
    /// effect's) asked the pool for it: its I/O is driven for its whole life by the thread
    /// that opened it, and the pool lends it to anyone afterwards. Opened on a handler's
    /// thread, it would stop answering whoever borrows it next (the publisher, another
    /// consumer, a web request) whenever that handler blocks its thread.
    pub fn manager(&self, database_url: &str) -> AsyncDieselConnectionManager<AsyncPgConnection> {
        let cfg = self.clone();
        let mut manager = ManagerConfig::default();
        manager.custom_setup = Box::new(move |url| {
            let (url, cfg) = (url.to_owned(), cfg.clone());
            // Read on the thread that asks: the pool's task runs on the borrower's thread.
            let driver = DRIVER.with(|d| d.borrow().clone());
            Box::pin(async move {
                match driver {
                    Some(driver) => cfg.establish_on(&driver, url).await,
                    None => cfg.establish(&url).await,
                }
            })
        });
        AsyncDieselConnectionManager::new_with_config(self.url(database_url), manager)
    }

    /// [`establish`](Self::establish) run on `driver`'s thread (fails if that thread is gone:
    /// its runtime stopped, and this thread goes with it).
    async fn establish_on(
        &self,
        driver: &ArbiterHandle,
        url: String,
    ) -> diesel::ConnectionResult<AsyncPgConnection> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let cfg = self.clone();
        // Not sent (the thread is gone): `tx` is dropped, and so is the answer.
        driver.spawn(async move {
            let _ = tx.send(cfg.establish(&url).await);
        });
        // `connect_timeout` runs on the runtime's thread; this bounds the wait when that thread
        // is blocked or no longer runs. A connection that comes later is closed there.
        let waited = self.connect_timeout + Duration::from_secs(1);
        match tokio::time::timeout(waited, rx).await {
            Ok(Ok(opened)) => opened,
            Ok(Err(_)) => Err(ConnectionError::BadConnection(
                "the runtime's thread stopped while a connection was being opened".into(),
            )),
            Err(_) => Err(ConnectionError::BadConnection(format!(
                "the runtime's thread opened no connection within {waited:?}"
            ))),
        }
    }

    async fn establish(&self, url: &str) -> diesel::ConnectionResult<AsyncPgConnection> {
        let settings = self.session_settings();
        let work = async {
            let mut conn = AsyncPgConnection::establish(url).await?;
            conn.batch_execute(&settings)
                .await
                .map_err(ConnectionError::CouldntSetupConfiguration)?;
            Ok(conn)
        };
        tokio::time::timeout(self.connect_timeout, work)
            .await
            .unwrap_or_else(|_| {
                Err(ConnectionError::BadConnection(format!(
                    "no connection within {:?}",
                    self.connect_timeout
                )))
            })
    }

    /// One statement that makes the server-side settings the server has at their built-in
    /// default. Only numbers from this config are formatted into it.
    fn session_settings(&self) -> String {
        let mut settings = vec![
            ("tcp_keepalives_idle", secs(self.keepalive_idle)),
            ("tcp_keepalives_interval", secs(self.keepalive_interval)),
            ("tcp_keepalives_count", self.keepalive_retries.to_string()),
            (
                "tcp_user_timeout",
                format!("{}ms", self.tcp_user_timeout.as_millis()),
            ),
        ];
        if let Some(idle) = self.idle_in_transaction_timeout {
            settings.push((
                "idle_in_transaction_session_timeout",
                format!("{}ms", idle.as_millis()),
            ));
        }
        let values: Vec<String> = settings
            .iter()
            .map(|(name, value)| format!("('{name}', '{value}')"))
            .collect();
        // The join skips a setting an older server does not know (tcp_user_timeout is new in
        // PostgreSQL 12).
        format!(
            "SELECT set_config(s.name, s.value, false) FROM (VALUES {}) AS s(name, value) \
             JOIN pg_settings p ON p.name = s.name WHERE p.source = 'default'",
            values.join(", ")
        )
    }
}

/// Whole seconds, rounded up: tokio-postgres and the server read 0 as "the system default".
fn secs(d: Duration) -> String {
    d.as_secs()
        .saturating_add(u64::from(d.subsec_nanos() > 0))
        .max(1)
        .to_string()
}

/// Whether the connection string sets `key` already.
fn has_param(conninfo: &str, is_url: bool, key: &str) -> bool {
    if is_url {
        let Some((_, query)) = conninfo.split_once('?') else {
            return false;
        };
        query.split('&').any(|kv| kv.split('=').next() == Some(key))
    } else {
        let tokens: Vec<&str> = conninfo.split_whitespace().collect();
        tokens.iter().enumerate().any(|(i, t)| {
            t.strip_prefix(key).is_some_and(|rest| {
                rest.starts_with('=')
                    || (rest.is_empty() && tokens.get(i + 1).is_some_and(|n| n.starts_with('=')))
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_parameters_are_added_to_a_url() {
        let cfg = ConnectionConfig::default();
        assert_eq!(
            cfg.url("postgres://u@h:5432/db"),
            "postgres://u@h:5432/db?keepalives=1&keepalives_idle=10&keepalives_interval=5\
             &keepalives_retries=3&tcp_user_timeout=20"
        );
        assert_eq!(
            cfg.url("postgres://u@h/db?sslmode=disable&keepalives_idle=60&tcp_user_timeout=5"),
            "postgres://u@h/db?sslmode=disable&keepalives_idle=60&tcp_user_timeout=5\
             &keepalives=1&keepalives_interval=5&keepalives_retries=3"
        );
        assert!(cfg
            .url("postgres://h/db?")
            .starts_with("postgres://h/db?keepalives=1&"));
    }

    #[test]
    fn missing_parameters_are_added_to_a_key_value_string() {
        let cfg = ConnectionConfig {
            tcp_user_timeout: Duration::from_millis(1500),
            ..ConnectionConfig::default()
        };
        assert_eq!(
            cfg.url("host=h dbname=db keepalives_idle = 30"),
            "host=h dbname=db keepalives_idle = 30 keepalives=1 keepalives_interval=5 \
             keepalives_retries=3 tcp_user_timeout=2"
        );
    }

    #[test]
    fn zero_bounds_are_rejected() {
        assert!(ConnectionConfig::default().validate().is_ok());
        let mut cfg = ConnectionConfig {
            idle_in_transaction_timeout: None,
            ..ConnectionConfig::default()
        };
        assert!(cfg.validate().is_ok());
        cfg.idle_in_transaction_timeout = Some(Duration::ZERO);
        assert!(cfg.validate().is_err());
        let cfg = ConnectionConfig {
            connect_timeout: Duration::ZERO,
            ..ConnectionConfig::default()
        };
        assert!(cfg.validate().is_err());
    }
}
