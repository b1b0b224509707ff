//! The operator API's error: an HTTP status, a stable code and a message, sent as
//! `{"error":{"code":"STABLE_CODE","message":"..."}}`. Codes follow the crate's style
//! ([`ErrorCode`]): upper snake case, never changed once released.

use actix_web::http::{header, StatusCode};
use actix_web::{HttpResponse, ResponseError};
use serde_json::json;

use crate::error::{Error, ErrorCode};

/// An action sent by a browser from another site's page (403).
pub(crate) const CROSS_SITE: ErrorCode = ErrorCode::from_static("ADMIN_CROSS_SITE");
/// A row of the action is held by a batch in progress past the wait (409).
pub(crate) const ROW_BUSY: ErrorCode = ErrorCode::from_static("ROW_BUSY");
/// No valid credentials (401).
pub(crate) const UNAUTHORIZED: ErrorCode = ErrorCode::from_static("ADMIN_UNAUTHORIZED");
/// The body is not the JSON the endpoint takes (400).
pub(crate) const INVALID_BODY: ErrorCode = ErrorCode::from_static("INVALID_BODY");
/// A body over 64 KiB (413).
pub(crate) const BODY_TOO_LARGE: ErrorCode = ErrorCode::from_static("BODY_TOO_LARGE");
/// Unknown or malformed query parameters (400).
pub(crate) const INVALID_QUERY: ErrorCode = ErrorCode::from_static("INVALID_QUERY");
/// A path id that is not an inbox id (integer) or an event id (UUID) (400).
pub(crate) const INVALID_ID: ErrorCode = ErrorCode::from_static("INVALID_ID");
/// A `before` cursor that is not an id (400).
pub(crate) const INVALID_CURSOR: ErrorCode = ErrorCode::from_static("INVALID_CURSOR");
/// A status filter that is not a status of that table (400).
pub(crate) const INVALID_STATUS: ErrorCode = ErrorCode::from_static("INVALID_STATUS");
/// A page size outside 1..=200 (400).
pub(crate) const INVALID_LIMIT: ErrorCode = ErrorCode::from_static("INVALID_LIMIT");
/// A consumer name that cannot exist (400).
pub(crate) const INVALID_CONSUMER: ErrorCode = ErrorCode::from_static("INVALID_CONSUMER");
/// The action needs a reason and none (or an empty one) was given (400).
pub(crate) const REASON_REQUIRED: ErrorCode = ErrorCode::from_static("REASON_REQUIRED");
/// A reason longer than 1000 characters (400).
pub(crate) const REASON_TOO_LONG: ErrorCode = ErrorCode::from_static("REASON_TOO_LONG");
/// A bulk action without ids (400).
pub(crate) const NO_IDS: ErrorCode = ErrorCode::from_static("NO_IDS");
/// A bulk action over more than 100 ids (400).
pub(crate) const TOO_MANY_IDS: ErrorCode = ErrorCode::from_static("TOO_MANY_IDS");
/// A bulk action naming one id twice (400).
pub(crate) const DUPLICATE_IDS: ErrorCode = ErrorCode::from_static("DUPLICATE_IDS");
/// A bulk action whose `confirm` is not `RETRY <count>` (400).
pub(crate) const CONFIRMATION_MISMATCH: ErrorCode = ErrorCode::from_static("CONFIRMATION_MISMATCH");
/// No row with that id (404).
pub(crate) const ROW_NOT_FOUND: ErrorCode = ErrorCode::from_static("ROW_NOT_FOUND");
/// No outbox or inbox row carries that correlation id (404).
pub(crate) const CORRELATION_NOT_FOUND: ErrorCode = ErrorCode::from_static("CORRELATION_NOT_FOUND");
pub(crate) const EVENT_NOT_FOUND: ErrorCode = ErrorCode::from_static("EVENT_NOT_FOUND");
/// The consumer is not subscribed to that event type (404).
pub(crate) const SUBSCRIPTION_NOT_FOUND: ErrorCode =
    ErrorCode::from_static("SUBSCRIPTION_NOT_FOUND");
/// Retry of a row that is not a dead letter (409).
pub(crate) const NOT_A_DEAD_LETTER: ErrorCode = ErrorCode::from_static("NOT_A_DEAD_LETTER");
/// Ignore of a row that is neither a dead letter nor waiting for a retry (409).
pub(crate) const NOT_IGNORABLE: ErrorCode = ErrorCode::from_static("NOT_IGNORABLE");
/// No metrics handle was configured (404).
pub(crate) const METRICS_NOT_CONFIGURED: ErrorCode =
    ErrorCode::from_static("METRICS_NOT_CONFIGURED");
/// No such endpoint (404).
pub(crate) const NOT_FOUND: ErrorCode = ErrorCode::from_static("NOT_FOUND");
/// The endpoint exists for another method (405).
pub(crate) const METHOD_NOT_ALLOWED: ErrorCode = ErrorCode::from_static("METHOD_NOT_ALLOWED");

/// An operator API failure.
#[derive(Debug, Clone)]
pub(crate) struct AdminError {
    pub status: StatusCode,
    pub code: ErrorCode,
    pub message: String,
}

impl AdminError {
    pub(crate) fn new(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Self {
        AdminError {
            status,
            code,
            message: message.into(),
        }
    }

    pub(crate) fn bad_request(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    pub(crate) fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            UNAUTHORIZED,
            "valid operator credentials are required (Authorization: Bearer <token>)",
        )
    }
}

impl std::fmt::Display for AdminError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl ResponseError for AdminError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut res = HttpResponse::build(self.status);
        if self.status == StatusCode::UNAUTHORIZED {
            res.insert_header((header::WWW_AUTHENTICATE, "Bearer realm=\"actix-outbox\""));
        }
        res.insert_header((header::CACHE_CONTROL, "no-store"))
            .json(json!({"error": {"code": self.code.as_str(), "message": self.message}}))
    }
}

impl From<Error> for AdminError {
    fn from(e: Error) -> Self {
        let status = match &e {
            Error::UnknownConsumer(_) | Error::UnknownReplay(_) => StatusCode::NOT_FOUND,
            Error::NotReplaySafe(_) => StatusCode::CONFLICT,
            Error::InvalidReplay(_) => StatusCode::BAD_REQUEST,
            Error::Database(_) | Error::Pool(_) | Error::Stopped => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if status.is_server_error() {
            tracing::warn!(error = %e, code = %e.code(), "operator API request failed");
        }
        AdminError::new(status, e.code(), e.to_string())
    }
}

/// Lets `AsyncConnection::transaction` roll back on a statement error inside an action.
impl From<diesel::result::Error> for AdminError {
    fn from(e: diesel::result::Error) -> Self {
        Error::Database(e).into()
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<bb8::RunError<E>> for AdminError {
    fn from(e: bb8::RunError<E>) -> Self {
        Error::from(e).into()
    }
}
