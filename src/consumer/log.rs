//! The consumer's log lines, one place for the fields each carries (docs/operations.md, "Logs: following one event").

use super::{ConsumerConfig, HandlerError};
use crate::store::inbox::InboxRow;
use crate::telemetry::{self, metrics, EventFields};

pub(crate) fn started(cfg: &ConsumerConfig, row: &InboxRow) {
    telemetry::event!(debug, "consumer.started", fields(cfg, row));
}

pub(crate) fn completed(cfg: &ConsumerConfig, row: &InboxRow) {
    telemetry::event!(debug, "consumer.completed", fields(cfg, row));
}

pub(crate) fn failed(cfg: &ConsumerConfig, row: &InboxRow, err: &HandlerError) {
    telemetry::event!(warn, "consumer.failed", fields(cfg, row),
        error_code = %err.code(), error = %cfg.redact.apply(err.message()));
}

/// `row`'s fields, with its consumer and the attempt its handler is making now.
pub(super) fn fields<'a>(cfg: &'a ConsumerConfig, row: &'a InboxRow) -> EventFields<'a> {
    EventFields {
        consumer: Some(cfg.name.as_str()),
        attempt: Some(i64::from(row.attempt_count) + 1),
        ..EventFields::from(row)
    }
}

/// A handler overran its timeout keeping its connection; `n` are parked now.
pub(crate) fn hung(cfg: &ConsumerConfig, n: usize) {
    tracing::warn!(
        consumer = %cfg.name, hung = n, timeout = ?cfg.handler_timeout,
        "a handler overran its timeout and keeps its connection; parked until it lets go"
    );
    metrics::consumer_hung(cfg.name.as_str(), n);
}

/// The consumer's loops wait (or no longer wait) for a hung handler to let go.
pub(crate) fn waiting_for_hung(cfg: &ConsumerConfig, waiting: bool) {
    metrics::consumer_stalled(cfg.name.as_str(), waiting);
}
