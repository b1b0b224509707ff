//! The crate's one error enum and the stable codes stored in `error_code` columns.
//!
//! Codes are part of the public contract: they are written to the database, logged and shown to
//! operators, so they never change once released. Callers branch on [`Error::code`] or
//! [`Error::is_transient`], never on message text.

use std::borrow::Cow;
use std::fmt;

/// A stable, machine-readable error code such as `INBOX_CONSUMER_FAILED`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ErrorCode(Cow<'static, str>);

impl ErrorCode {
    /// Publishing an outbox event to a transport failed.
    pub const OUTBOX_PUBLISH_FAILED: ErrorCode = ErrorCode::from_static("OUTBOX_PUBLISH_FAILED");
    /// Publishing an outbox event did not finish within its timeout.
    pub const OUTBOX_PUBLISH_TIMEOUT: ErrorCode = ErrorCode::from_static("OUTBOX_PUBLISH_TIMEOUT");
    /// An event's payload or envelope is not valid for its type.
    pub const EVENT_SCHEMA_INVALID: ErrorCode = ErrorCode::from_static("EVENT_SCHEMA_INVALID");
    /// No code can read this version of the event type.
    pub const EVENT_VERSION_UNSUPPORTED: ErrorCode =
        ErrorCode::from_static("EVENT_VERSION_UNSUPPORTED");
    /// The event is older than the aggregate version its consumer already applied; recorded,
    /// not applied. Informational, not an error.
    pub const EVENT_STALE: ErrorCode = ErrorCode::from_static("EVENT_STALE");
    /// A consumer's handler failed (returned an error, panicked or timed out).
    pub const INBOX_CONSUMER_FAILED: ErrorCode = ErrorCode::from_static("INBOX_CONSUMER_FAILED");
    /// An attempt ended without an outcome: the process handling the event died (an abort, an
    /// OOM kill, a crash in native code) or its connection broke. Counts as a failed attempt.
    pub const INBOX_ATTEMPT_INTERRUPTED: ErrorCode =
        ErrorCode::from_static("INBOX_ATTEMPT_INTERRUPTED");
    /// The event had already been processed by this consumer; informational, not an error.
    pub const DUPLICATE_EVENT: ErrorCode = ErrorCode::from_static("DUPLICATE_EVENT");
    /// PostgreSQL returned an error or the connection failed.
    pub const DATABASE_ERROR: ErrorCode = ErrorCode::from_static("DATABASE_ERROR");
    /// No connection could be taken from the pool in time.
    pub const POOL_TIMEOUT: ErrorCode = ErrorCode::from_static("POOL_TIMEOUT");
    /// The pool could not open a connection: the server refused it or could not be reached.
    pub const POOL_CONNECT_FAILED: ErrorCode = ErrorCode::from_static("POOL_CONNECT_FAILED");
    /// A database round trip did not answer within its bound; its connection was closed.
    pub const DATABASE_TIMEOUT: ErrorCode = ErrorCode::from_static("DATABASE_TIMEOUT");
    /// The library's migrations could not be applied.
    pub const MIGRATION_FAILED: ErrorCode = ErrorCode::from_static("MIGRATION_FAILED");
    /// The runtime was configured with invalid values.
    pub const CONFIG_INVALID: ErrorCode = ErrorCode::from_static("CONFIG_INVALID");
    /// A business idempotency key (or its `claimed_by`) refused before it was written: empty,
    /// holding a NUL, or longer than [`MAX_KEY_BYTES`](crate::keys::MAX_KEY_BYTES).
    pub const IDEMPOTENCY_KEY_INVALID: ErrorCode =
        ErrorCode::from_static("IDEMPOTENCY_KEY_INVALID");
    /// No consumer of that name was ever registered.
    pub const CONSUMER_UNKNOWN: ErrorCode = ErrorCode::from_static("CONSUMER_UNKNOWN");
    /// The runtime has stopped and no longer accepts requests.
    pub const RUNTIME_STOPPED: ErrorCode = ErrorCode::from_static("RUNTIME_STOPPED");
    /// A replay was asked of a consumer not marked
    /// [`replay_safe`](crate::ConsumerConfig::replay_safe).
    pub const CONSUMER_NOT_REPLAY_SAFE: ErrorCode =
        ErrorCode::from_static("CONSUMER_NOT_REPLAY_SAFE");
    /// A replay request whose range or rate cannot be run.
    pub const REPLAY_INVALID: ErrorCode = ErrorCode::from_static("REPLAY_INVALID");
    /// No replay has that id.
    pub const REPLAY_UNKNOWN: ErrorCode = ErrorCode::from_static("REPLAY_UNKNOWN");
    /// The database role lacks a privilege the runtime needs on the library's schema (the
    /// error names each object and privilege; `docs/security.md` lists the grants).
    pub const PRIVILEGE_MISSING: ErrorCode = ErrorCode::from_static("PRIVILEGE_MISSING");
    /// The library's schema is missing, or older than this build: run
    /// [`migrate`](crate::migrate) as its owner first.
    pub const SCHEMA_NOT_MIGRATED: ErrorCode = ErrorCode::from_static("SCHEMA_NOT_MIGRATED");
    /// A reconcile rule's search ran past its time bound
    /// ([`ReconcileRule::time_bound`](crate::reconcile::ReconcileRule::time_bound)) and was
    /// stopped by the server; the rule runs again at its next interval.
    pub const RECONCILE_TIMEOUT: ErrorCode = ErrorCode::from_static("RECONCILE_TIMEOUT");
    /// The pool's connections go through a pooler in transaction or statement mode, which the
    /// runtime cannot run behind (it relies on sessions: leases, advisory locks, `LISTEN`,
    /// prepared statements).
    pub const POOLER_UNSUPPORTED: ErrorCode = ErrorCode::from_static("POOLER_UNSUPPORTED");
    /// A NATS receiver's durable consumer, which this database bound before, is gone: the
    /// receiver does not recreate it from the stream's start (that would apply again every
    /// event whose processed inbox row retention deleted) and waits for an operator.
    pub const NATS_CONSUMER_LOST: ErrorCode = ErrorCode::from_static("NATS_CONSUMER_LOST");
    /// A side effect's call did not finish within `EffectConfig::timeout` (retried).
    pub const EFFECT_TIMEOUT: ErrorCode = ErrorCode::from_static("EFFECT_TIMEOUT");
    /// A side effect whose worker stopped (killed, most likely) during its last attempt:
    /// dead-lettered instead of called again.
    pub const EFFECT_ATTEMPT_INTERRUPTED: ErrorCode =
        ErrorCode::from_static("EFFECT_ATTEMPT_INTERRUPTED");
    /// A side effect's call panicked (retried).
    pub const EFFECT_PANICKED: ErrorCode = ErrorCode::from_static("EFFECT_PANICKED");
    /// A replay reached the end of its range with fewer rows re-applied than it counted when
    /// it was asked for: rows were deleted (by retention, say) before it reached them. It
    /// ends FAILED instead of DONE; what it applied stays applied.
    pub const REPLAY_GAP: ErrorCode = ErrorCode::from_static("REPLAY_GAP");
    /// A handler hung past its timeout and the grace: its rows were settled and its database
    /// session ended, releasing its locks and its snapshot (a warning and a health reason).
    pub const HANDLER_SESSION_ENDED: ErrorCode = ErrorCode::from_static("HANDLER_SESSION_ENDED");

    /// A code known at compile time.
    pub const fn from_static(code: &'static str) -> Self {
        ErrorCode(Cow::Borrowed(code))
    }

    /// An application-defined code, e.g. `PAYMENT_DECLINED`. Keep it stable and upper snake case.
    pub fn new(code: impl Into<String>) -> Self {
        ErrorCode(Cow::Owned(code.into()))
    }

    /// The code as stored in the database.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Everything that can go wrong in the library, each with a stable [`ErrorCode`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A query failed. Transient when the connection broke or the transaction lost a
    /// serialization race; otherwise the statement itself is wrong.
    #[error("database error: {0}")]
    Database(#[from] diesel::result::Error),
    /// No connection could be taken from the pool: none came free in time
    /// (`POOL_TIMEOUT`), or a new one could not be opened (`POOL_CONNECT_FAILED`, with the
    /// cause as its [`source`](std::error::Error::source)).
    #[error("connection pool: {0}")]
    Pool(#[source] PoolError),
    /// The event was rejected before it was written; the caller's transaction must fail.
    #[error("invalid event: {0}")]
    InvalidEvent(String),
    /// The idempotency key was rejected before it was written.
    #[error("invalid idempotency key: {0}")]
    InvalidKey(String),
    /// The runtime's configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Applying the library's migrations failed.
    #[error("migration failed: {0}")]
    Migration(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// No consumer of that name was ever registered.
    #[error("unknown consumer {0}")]
    UnknownConsumer(String),
    /// The runtime has stopped.
    #[error("the outbox runtime has stopped")]
    Stopped,
    /// A database round trip got no answer within its bound (a dead network or server); the
    /// connection was closed, and the work is retried on a fresh one.
    #[error("the database did not answer within {0:?}")]
    DatabaseTimeout(std::time::Duration),
    /// A replay was asked of a consumer whose code does not mark it
    /// [`replay_safe`](crate::ConsumerConfig::replay_safe).
    #[error(
        "consumer {0} is not replay-safe: its code must set ConsumerConfig::replay_safe(true)"
    )]
    NotReplaySafe(String),
    /// A replay request whose range or rate cannot be run; nothing was written.
    #[error("invalid replay: {0}")]
    InvalidReplay(String),
    /// No replay has that id.
    #[error("no replay {0}")]
    UnknownReplay(i64),
    /// The role lacks privileges the runtime needs on the library's schema: each
    /// `(privilege, object)`, e.g. `("UPDATE", "actix_outbox.inbox_events")`. Nothing was
    /// started or written.
    #[error("role {role} lacks {}: grant them as docs/security.md says (actix_outbox::db::grants)",
        missing.iter().map(|(p, o)| format!("{p} on {o}")).collect::<Vec<_>>().join(", "))]
    PrivilegeMissing {
        /// The role the pool connects as.
        role: String,
        /// What it lacks, as `(privilege, object)`.
        missing: Vec<(String, String)>,
    },
    /// The library's schema is missing or older than this build. Nothing was started.
    #[error("{0}")]
    NotMigrated(String),
    /// The pool goes through a transaction- or statement-mode pooler. Nothing was started.
    #[error("{0}")]
    PoolerUnsupported(String),
    /// A reconcile rule's search ran past its time bound and was stopped by the server.
    #[error("the reconcile rule's search ran past its time bound of {0:?} and was stopped")]
    ReconcileTimeout(std::time::Duration),
    /// A NATS receiver's durable consumer, bound by this database before, is gone.
    #[error("{0}")]
    NatsConsumerLost(String),
}

impl Error {
    /// The stable code for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            Error::Database(_) => ErrorCode::DATABASE_ERROR,
            Error::Pool(e) if e.timed_out => ErrorCode::POOL_TIMEOUT,
            Error::Pool(_) => ErrorCode::POOL_CONNECT_FAILED,
            Error::InvalidEvent(_) => ErrorCode::EVENT_SCHEMA_INVALID,
            Error::InvalidKey(_) => ErrorCode::IDEMPOTENCY_KEY_INVALID,
            Error::Config(_) => ErrorCode::CONFIG_INVALID,
            Error::Migration(_) => ErrorCode::MIGRATION_FAILED,
            Error::UnknownConsumer(_) => ErrorCode::CONSUMER_UNKNOWN,
            Error::Stopped => ErrorCode::RUNTIME_STOPPED,
            Error::DatabaseTimeout(_) => ErrorCode::DATABASE_TIMEOUT,
            Error::NotReplaySafe(_) => ErrorCode::CONSUMER_NOT_REPLAY_SAFE,
            Error::InvalidReplay(_) => ErrorCode::REPLAY_INVALID,
            Error::UnknownReplay(_) => ErrorCode::REPLAY_UNKNOWN,
            Error::PrivilegeMissing { .. } => ErrorCode::PRIVILEGE_MISSING,
            Error::NotMigrated(_) => ErrorCode::SCHEMA_NOT_MIGRATED,
            Error::PoolerUnsupported(_) => ErrorCode::POOLER_UNSUPPORTED,
            Error::ReconcileTimeout(_) => ErrorCode::RECONCILE_TIMEOUT,
            Error::NatsConsumerLost(_) => ErrorCode::NATS_CONSUMER_LOST,
        }
    }

    /// Whether the connection the call ran on is gone (closed by the server, a broken
    /// network), so that it must not be used again.
    pub(crate) fn lost_connection(&self) -> bool {
        use diesel::result::{DatabaseErrorKind as K, Error as D};
        matches!(
            self,
            Error::Database(D::DatabaseError(
                K::ClosedConnection | K::UnableToSendCommand,
                _
            ))
        )
    }

    /// Whether the same call may succeed if it is simply tried again.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Database(e) => is_transient_db_error(e),
            Error::Pool(_) | Error::DatabaseTimeout(_) => true,
            _ => false,
        }
    }
}

/// Connection loss and serialization failures go away on retry; constraint violations and
/// syntax errors do not. diesel reports SQLSTATEs it does not know as `Unknown`, which includes
/// syntax errors and missing tables, so `Unknown` is not transient.
pub(crate) fn is_transient_db_error(e: &diesel::result::Error) -> bool {
    use diesel::result::{DatabaseErrorKind as K, Error as D};
    matches!(
        e,
        D::DatabaseError(
            K::SerializationFailure | K::ClosedConnection | K::UnableToSendCommand,
            _
        ) | D::BrokenTransactionManager
    )
}

/// Why the pool could not lend a connection (see [`Error::Pool`]).
#[derive(Debug, thiserror::Error)]
#[error("{}", if self.timed_out { "no connection came free in time" } else { "could not open a connection" })]
pub struct PoolError {
    timed_out: bool,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl PoolError {
    /// No connection came free within the pool's connection timeout.
    pub fn timed_out(&self) -> bool {
        self.timed_out
    }

    /// A connection could not be opened, because of `source`.
    pub(crate) fn connect(source: impl std::error::Error + Send + Sync + 'static) -> Self {
        PoolError {
            timed_out: false,
            source: Some(Box::new(source)),
        }
    }
}

/// A connection that could not be opened, as the pool reports one: `POOL_CONNECT_FAILED`,
/// transient. For code that opens a connection of its own beside the pool.
impl From<diesel::ConnectionError> for Error {
    fn from(e: diesel::ConnectionError) -> Self {
        Error::Pool(PoolError::connect(e))
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<bb8::RunError<E>> for Error {
    fn from(e: bb8::RunError<E>) -> Self {
        Error::Pool(match e {
            bb8::RunError::TimedOut => PoolError {
                timed_out: true,
                source: None,
            },
            bb8::RunError::User(e) => PoolError::connect(e),
        })
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn pool_errors_say_which_and_keep_their_cause() {
        let timed_out = Error::from(bb8::RunError::<std::io::Error>::TimedOut);
        assert_eq!(timed_out.code(), ErrorCode::POOL_TIMEOUT);
        assert!(timed_out.is_transient());
        let refused = Error::from(bb8::RunError::User(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "connection refused",
        )));
        assert_eq!(refused.code(), ErrorCode::POOL_CONNECT_FAILED);
        assert!(refused.is_transient());
        let pool = refused.source().expect("the pool error");
        assert_eq!(
            pool.source().map(|e| e.to_string()).as_deref(),
            Some("connection refused")
        );
    }
}
