//! The order service's HTTP contract: bodies, headers and error codes. The service (`api.rs`)
//! and the demo's load driver (`examples/demo_load`, which includes this file with `#[path]`)
//! both use these types, so a change to the API shows up in both at compile time.
//!
//! Errors are `{"error": {"code", "message"}}` ([`ErrorBody`]); the codes below are stable.

// Each of the two programs uses part of the contract.
#![allow(dead_code)]

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Text, Timestamptz};
use diesel::QueryableByName;
use serde::{Deserialize, Serialize};

/// Makes a create idempotent: a repeat with the same key and body returns the first order.
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";
/// `true` on a create answered with the order an earlier request with its key made.
pub const IDEMPOTENT_REPLAYED: &str = "Idempotent-Replayed";
/// A correlation id, carried into the audit log and the event.
pub const REQUEST_ID: &str = "X-Request-Id";

/// The most a request body may hold, in bytes.
pub const MAX_BODY: usize = 16 * 1024;

/// The stable error codes, with the status each comes with.
pub mod code {
    /// The body is not the JSON the endpoint takes: malformed, or of the wrong shape (422).
    pub const INVALID_BODY: &str = "INVALID_BODY";
    /// A body over [`MAX_BODY`](super::MAX_BODY) bytes (413).
    pub const BODY_TOO_LARGE: &str = "BODY_TOO_LARGE";
    /// A body that is not `application/json` (415).
    pub const UNSUPPORTED_MEDIA_TYPE: &str = "UNSUPPORTED_MEDIA_TYPE";
    /// The body could not be read, e.g. the client broke off (400).
    pub const UNREADABLE_BODY: &str = "UNREADABLE_BODY";
    /// A field out of its bounds, e.g. an empty `customer_id` (422).
    pub const VALIDATION_FAILED: &str = "VALIDATION_FAILED";
    /// An `Idempotency-Key` that is not 1-200 visible ASCII characters (422).
    pub const INVALID_IDEMPOTENCY_KEY: &str = "INVALID_IDEMPOTENCY_KEY";
    /// An `Idempotency-Key` sent before with another body (422).
    pub const IDEMPOTENCY_KEY_REUSED: &str = "IDEMPOTENCY_KEY_REUSED";
    /// A status that is not one of [`OrderStatus`](super::OrderStatus) (422).
    pub const INVALID_STATUS: &str = "INVALID_STATUS";
    /// A change the state machine does not allow, e.g. out of COMPLETED (422).
    pub const INVALID_TRANSITION: &str = "INVALID_TRANSITION";
    /// No order with that id (404).
    pub const ORDER_NOT_FOUND: &str = "ORDER_NOT_FOUND";
    /// No such endpoint (404).
    pub const NOT_FOUND: &str = "NOT_FOUND";
    /// The endpoint exists for another method (405).
    pub const METHOD_NOT_ALLOWED: &str = "METHOD_NOT_ALLOWED";
    /// No database connection; try again (503).
    pub const SERVICE_UNAVAILABLE: &str = "SERVICE_UNAVAILABLE";
    /// Anything else; the details are in the service's log (500).
    pub const INTERNAL_ERROR: &str = "INTERNAL_ERROR";
}

/// Every error the service answers with.
#[derive(Debug, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// One of [`code`].
    pub code: String,
    pub message: String,
}

/// `POST /orders`.
#[derive(Debug, Serialize, Deserialize)]
pub struct CreateOrder {
    /// 1-100 characters, none of them a control character, after trimming.
    pub customer_id: String,
    /// Not negative.
    pub total_cents: i64,
}

/// `POST /orders/{id}/status`.
#[derive(Debug, Serialize, Deserialize)]
pub struct ChangeStatus {
    /// One of [`OrderStatus`], by its name.
    pub status: String,
}

/// The answer to a create (201) or a status change (200).
#[derive(Debug, Serialize, Deserialize)]
pub struct OrderState {
    pub id: String,
    pub status: String,
    pub version: i64,
}

/// `GET /orders/{id}`: the order as stored.
#[derive(Debug, Serialize, Deserialize, QueryableByName)]
pub struct Order {
    #[diesel(sql_type = Text)]
    pub id: String,
    #[diesel(sql_type = Text)]
    pub customer_id: String,
    #[diesel(sql_type = BigInt)]
    pub total_cents: i64,
    #[diesel(sql_type = Text)]
    pub status: String,
    #[diesel(sql_type = BigInt)]
    pub version: i64,
    /// `api` for orders made through the API.
    #[diesel(sql_type = Text)]
    pub source: String,
    #[diesel(sql_type = Timestamptz)]
    pub created_at: DateTime<Utc>,
    #[diesel(sql_type = Timestamptz)]
    pub updated_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderStatus {
    Waiting,
    Paid,
    Completed,
    Cancelled,
}

impl OrderStatus {
    pub fn parse(s: &str) -> Option<OrderStatus> {
        Some(match s {
            "WAITING" => OrderStatus::Waiting,
            "PAID" => OrderStatus::Paid,
            "COMPLETED" => OrderStatus::Completed,
            "CANCELLED" => OrderStatus::Cancelled,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            OrderStatus::Waiting => "WAITING",
            OrderStatus::Paid => "PAID",
            OrderStatus::Completed => "COMPLETED",
            OrderStatus::Cancelled => "CANCELLED",
        }
    }

    /// The state machine. COMPLETED and CANCELLED are terminal, and a status never moves to
    /// itself, so a repeated request is refused instead of writing a second event.
    pub fn can_move_to(self, to: OrderStatus) -> bool {
        use OrderStatus::*;
        matches!(
            (self, to),
            (Waiting, Paid | Completed | Cancelled) | (Paid, Completed | Cancelled)
        )
    }
}
