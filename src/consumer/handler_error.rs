//! [`HandlerError`]: why a handler did not process an event, classified by variant.

use std::time::Duration;

use crate::error::{Error, ErrorCode};

/// Why a handler did not process an event. Classification is by variant, never by message.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// May succeed later: retried after the policy's backoff.
    #[error("{code}: {message}")]
    Retry {
        /// Stored as `error_code`.
        code: ErrorCode,
        /// Stored as `last_error`, redacted.
        message: String,
    },
    /// May succeed after `after` (e.g. a rate limit said so); still counts as an attempt.
    #[error("{code}: {message} (retry after {after:?})")]
    RetryAfter {
        /// The earliest time to try again, from now.
        after: Duration,
        /// Stored as `error_code`.
        code: ErrorCode,
        /// Stored as `last_error`, redacted.
        message: String,
    },
    /// Cannot succeed: dead-lettered at once with its code.
    #[error("{code}: {message}")]
    Permanent {
        /// Stored as `error_code`.
        code: ErrorCode,
        /// Stored as `last_error`, redacted.
        message: String,
    },
}

impl HandlerError {
    /// A retryable failure with code `INBOX_CONSUMER_FAILED`.
    pub fn retry(message: impl Into<String>) -> Self {
        HandlerError::Retry {
            code: ErrorCode::INBOX_CONSUMER_FAILED,
            message: message.into(),
        }
    }
    /// A retryable failure not to be retried before `after`.
    pub fn retry_after(after: Duration, message: impl Into<String>) -> Self {
        HandlerError::RetryAfter {
            after,
            code: ErrorCode::INBOX_CONSUMER_FAILED,
            message: message.into(),
        }
    }
    /// A permanent failure with a stable `code`.
    pub fn permanent(code: ErrorCode, message: impl Into<String>) -> Self {
        HandlerError::Permanent {
            code,
            message: message.into(),
        }
    }
    /// The stable code stored with the failed row.
    pub fn code(&self) -> &ErrorCode {
        match self {
            HandlerError::Retry { code, .. }
            | HandlerError::RetryAfter { code, .. }
            | HandlerError::Permanent { code, .. } => code,
        }
    }
    /// The message stored as `last_error`, once redacted
    /// ([`RuntimeConfig::redact_errors`](crate::RuntimeConfig::redact_errors)).
    pub fn message(&self) -> &str {
        match self {
            HandlerError::Retry { message, .. }
            | HandlerError::RetryAfter { message, .. }
            | HandlerError::Permanent { message, .. } => message,
        }
    }
}

/// Database errors inside a handler are retried: the savepoint undoes the partial writes, and
/// the attempt limit bounds a statement that can never succeed.
impl From<diesel::result::Error> for HandlerError {
    /// Retried with `DATABASE_ERROR`, as an [`Error::Database`] is.
    fn from(e: diesel::result::Error) -> Self {
        HandlerError::Retry {
            code: ErrorCode::DATABASE_ERROR,
            message: format!("database: {e}"),
        }
    }
}

impl From<Error> for HandlerError {
    /// Database and pool errors are retried, like [`diesel::result::Error`]s, whichever way
    /// they reached the handler; errors that no retry can fix (an invalid follow-up event)
    /// are permanent with their code.
    fn from(e: Error) -> Self {
        match e {
            Error::Database(_) | Error::Pool(_) => HandlerError::Retry {
                code: e.code(),
                message: e.to_string(),
            },
            _ => HandlerError::Permanent {
                code: e.code(),
                message: e.to_string(),
            },
        }
    }
}
