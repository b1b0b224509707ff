//! The consumer's log lines, one place for the fields each carries (ARCHITECTURE §6).

use super::{ConsumerConfig, HandlerError};
use crate::store::inbox::InboxRow;
use crate::telemetry::metrics;

pub(crate) fn started(cfg: &ConsumerConfig, row: &InboxRow) {
    tracing::debug!(
        name: "consumer.started",
        consumer = %cfg.name, event_id = %row.event_id, event_type = %row.event_type,
        aggregate_id = %row.aggregate_id, correlation_id = %row.correlation_id,
        causation_id = row.causation_id.as_deref(), attempt = row.attempt_count + 1,
        "consumer.started"
    );
}

pub(crate) fn completed(cfg: &ConsumerConfig, row: &InboxRow) {
    tracing::debug!(
        name: "consumer.completed",
        consumer = %cfg.name, event_id = %row.event_id, event_type = %row.event_type,
        aggregate_id = %row.aggregate_id, correlation_id = %row.correlation_id,
        causation_id = row.causation_id.as_deref(), attempt = row.attempt_count + 1,
        "consumer.completed"
    );
}

pub(crate) fn failed(cfg: &ConsumerConfig, row: &InboxRow, err: &HandlerError) {
    tracing::warn!(
        name: "consumer.failed",
        consumer = %cfg.name, event_id = %row.event_id, event_type = %row.event_type,
        aggregate_id = %row.aggregate_id, correlation_id = %row.correlation_id,
        causation_id = row.causation_id.as_deref(), attempt = row.attempt_count + 1,
        error_code = %err.code(), error = %err.message(),
        "consumer.failed"
    );
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
