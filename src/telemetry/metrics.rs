//! Metric updates made by the runtime's hot paths. Each is one call into the `metrics` facade
//! (a no-op until the application installs a recorder) plus one bump of a process-wide tally.
//!
//! The tally exists because the health check needs rates (duplicates per delivery) and the
//! dashboard needs recent failure counts, and a `metrics` recorder cannot be read back. The
//! stats sampler *takes* the tally on every run ([`take_deltas`]): several runtimes in one
//! process (or a test calling `run_once` by hand) therefore never count one increment twice,
//! and the sums stored with the samples add up across instances.
//!
//! Names are prefixed `outbox_` / `inbox_`; per-consumer series carry a `consumer` label.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

/// Outbox rows moved to PUBLISHED (counter).
pub(crate) const OUTBOX_PUBLISHED_TOTAL: &str = "outbox_published_total";
/// Claims or external publishes that failed (counter).
pub(crate) const OUTBOX_FAILED_TOTAL: &str = "outbox_failed_total";
/// Rows waiting to be published: PENDING + RETRY_PENDING (gauge).
pub(crate) const OUTBOX_PENDING: &str = "outbox_pending";
/// Rows waiting for a publish retry (gauge).
pub(crate) const OUTBOX_RETRY_PENDING: &str = "outbox_retry_pending";
/// Rows leased by an external publisher (gauge).
pub(crate) const OUTBOX_PROCESSING: &str = "outbox_processing";
/// Rows that will not be published without an operator (gauge).
pub(crate) const OUTBOX_DEAD_LETTER: &str = "outbox_dead_letter";
pub(crate) const OUTBOX_UNROUTED: &str = "outbox_unrouted_events";
/// Age of the oldest row waiting to be published (gauge, 0 when none waits).
pub(crate) const OUTBOX_OLDEST_PENDING_AGE: &str = "outbox_oldest_pending_age_seconds";
/// 0 = OK, 1 = WARNING, 2 = CRITICAL (gauge).
pub(crate) const OUTBOX_HEALTH_STATE: &str = "outbox_health_state";
/// Inbox rows written for a consumer (counter).
pub(crate) const INBOX_RECEIVED_TOTAL: &str = "inbox_received_total";
/// Inbox rows a consumer marked PROCESSED, stale ones (`EVENT_STALE`) included (counter).
pub(crate) const INBOX_PROCESSED_TOTAL: &str = "inbox_processed_total";
/// Deliveries absorbed because the inbox row already existed (counter).
pub(crate) const INBOX_DUPLICATE_TOTAL: &str = "inbox_duplicate_total";
/// Failed attempts, retried or dead-lettered (counter).
pub(crate) const INBOX_FAILED_TOTAL: &str = "inbox_failed_total";
/// Rows moved to DEAD_LETTER (counter).
pub(crate) const INBOX_DEAD_LETTERED_TOTAL: &str = "inbox_dead_lettered_total";
/// Rows not yet processed: RECEIVED + RETRY_PENDING (gauge).
pub(crate) const INBOX_BACKLOG: &str = "inbox_backlog";
/// Rows waiting for a retry (gauge).
pub(crate) const INBOX_RETRY_PENDING: &str = "inbox_retry_pending";
/// Rows in DEAD_LETTER (gauge).
pub(crate) const INBOX_DEAD_LETTER: &str = "inbox_dead_letter";
/// Time since the oldest due row became due (gauge, 0 when none is due).
pub(crate) const INBOX_OLDEST_DUE_AGE: &str = "inbox_oldest_due_age_seconds";
/// 1 while the consumer's pause switch is on (gauge).
pub(crate) const INBOX_PAUSED: &str = "inbox_paused";
/// Event created → processed by the consumer (histogram, seconds).
/// Gauge per consumer: handlers that overran their timeout and still hold a connection.
pub(crate) const CONSUMER_HUNG_HANDLERS: &str = "outbox_consumer_hung_handlers";
/// Gauge per consumer: 1 while its loops wait for a hung handler to let go.
pub(crate) const CONSUMER_STALLED: &str = "outbox_consumer_stalled";
pub(crate) const INBOX_DELIVERY_LATENCY: &str = "inbox_delivery_latency_seconds";

/// Bucket bounds for [`INBOX_DELIVERY_LATENCY`]: from a poke-driven delivery (milliseconds) to
/// a retried one (the default policy's last wait is 16 minutes).
#[cfg(feature = "admin")]
pub(crate) const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];

/// Increments since the tally was last taken.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct Deltas {
    pub published: u64,
    pub publish_failed: u64,
    pub consumers: BTreeMap<String, ConsumerDeltas>,
}

/// One consumer's increments since the tally was last taken.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ConsumerDeltas {
    pub received: u64,
    pub processed: u64,
    pub duplicates: u64,
    pub failed: u64,
    pub dead_lettered: u64,
}

static TALLY: Mutex<Deltas> = Mutex::new(Deltas {
    published: 0,
    publish_failed: 0,
    consumers: BTreeMap::new(),
});

/// A poisoned lock only means a panic elsewhere while counting; the numbers are still usable.
fn tally() -> MutexGuard<'static, Deltas> {
    TALLY.lock().unwrap_or_else(|p| p.into_inner())
}

fn bump_consumer(consumer: &str, n: u64, field: impl FnOnce(&mut ConsumerDeltas) -> &mut u64) {
    if n == 0 {
        return;
    }
    let mut t = tally();
    let entry = match t.consumers.get_mut(consumer) {
        Some(e) => e,
        None => t.consumers.entry(consumer.to_owned()).or_default(),
    };
    *field(entry) += n;
}

/// Returns the increments made since the previous call and starts a new tally.
pub(crate) fn take_deltas() -> Deltas {
    std::mem::take(&mut *tally())
}

/// Puts back increments taken by a sampler run that could not store them.
pub(crate) fn give_back(d: Deltas) {
    let mut t = tally();
    t.published += d.published;
    t.publish_failed += d.publish_failed;
    for (consumer, d) in d.consumers {
        let e = t.consumers.entry(consumer).or_default();
        e.received += d.received;
        e.processed += d.processed;
        e.duplicates += d.duplicates;
        e.failed += d.failed;
        e.dead_lettered += d.dead_lettered;
    }
}

fn consumer_counter(name: &'static str, consumer: &str, n: u64) {
    // Incrementing by 0 still registers the series, so a scrape shows 0 rather than nothing.
    metrics::counter!(name, "consumer" => consumer.to_owned()).increment(n);
}

/// Outbox rows moved to PUBLISHED.
pub(crate) fn outbox_published(n: u64) {
    metrics::counter!(OUTBOX_PUBLISHED_TOTAL).increment(n);
    if n > 0 {
        tally().published += n;
    }
}
/// Claims (or external publishes) that failed.
pub(crate) fn outbox_publish_failed(n: u64) {
    metrics::counter!(OUTBOX_FAILED_TOTAL).increment(n);
    if n > 0 {
        tally().publish_failed += n;
    }
}
/// Inbox rows marked PROCESSED for `consumer`.
pub(crate) fn inbox_processed(consumer: &str, n: u64) {
    consumer_counter(INBOX_PROCESSED_TOTAL, consumer, n);
    bump_consumer(consumer, n, |d| &mut d.processed);
}
/// Failed attempts of `consumer` (retried or dead-lettered).
pub(crate) fn inbox_failed(consumer: &str, n: u64) {
    consumer_counter(INBOX_FAILED_TOTAL, consumer, n);
    bump_consumer(consumer, n, |d| &mut d.failed);
}
/// Inbox rows of `consumer` moved to DEAD_LETTER.
pub(crate) fn inbox_dead_lettered(consumer: &str, n: u64) {
    consumer_counter(INBOX_DEAD_LETTERED_TOTAL, consumer, n);
    bump_consumer(consumer, n, |d| &mut d.dead_lettered);
}
/// Deliveries to `consumer` absorbed by the inbox because the event was already there.
pub(crate) fn inbox_duplicate(consumer: &str, n: u64) {
    consumer_counter(INBOX_DUPLICATE_TOTAL, consumer, n);
    bump_consumer(consumer, n, |d| &mut d.duplicates);
}
/// Inbox rows of `consumer` newly received.
pub(crate) fn inbox_received(consumer: &str, n: u64) {
    consumer_counter(INBOX_RECEIVED_TOTAL, consumer, n);
    bump_consumer(consumer, n, |d| &mut d.received);
}
/// Event created → processed by `consumer`, in seconds.
pub(crate) fn delivery_latency(consumer: &str, seconds: f64) {
    metrics::histogram!(INBOX_DELIVERY_LATENCY, "consumer" => consumer.to_owned()).record(seconds);
}

/// Handlers of `consumer` holding a connection past their timeout, now.
pub(crate) fn consumer_hung(consumer: &str, n: usize) {
    metrics::gauge!(CONSUMER_HUNG_HANDLERS, "consumer" => consumer.to_owned()).set(n as f64);
}
/// Whether `consumer`'s loops wait for a hung handler to let go.
pub(crate) fn consumer_stalled(consumer: &str, stalled: bool) {
    metrics::gauge!(CONSUMER_STALLED, "consumer" => consumer.to_owned()).set(if stalled {
        1.0
    } else {
        0.0
    });
}

/// Registers help texts with the installed recorder. Harmless to call more than once.
pub(crate) fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        OUTBOX_PUBLISHED_TOTAL,
        "Outbox events published (handed to every subscribed consumer or the transport)"
    );
    describe_counter!(
        OUTBOX_FAILED_TOTAL,
        "Outbox claims or publishes that failed"
    );
    describe_gauge!(
        OUTBOX_PENDING,
        "Outbox events waiting to be published (PENDING + RETRY_PENDING)"
    );
    describe_gauge!(
        OUTBOX_RETRY_PENDING,
        "Outbox events waiting for a publish retry"
    );
    describe_gauge!(
        OUTBOX_PROCESSING,
        "Outbox events leased by an external publisher"
    );
    describe_gauge!(OUTBOX_DEAD_LETTER, "Outbox events that need an operator");
    describe_gauge!(
        OUTBOX_UNROUTED,
        "Events published over the last hour to no consumer (none was subscribed to the type)"
    );
    describe_gauge!(
        CONSUMER_HUNG_HANDLERS,
        "Handlers that overran their timeout and still hold a connection (at most the consumer's concurrency)"
    );
    describe_gauge!(
        CONSUMER_STALLED,
        "1 while the consumer waits for one of its hung handlers to let go of its connection"
    );
    describe_gauge!(
        OUTBOX_OLDEST_PENDING_AGE,
        Unit::Seconds,
        "Age of the oldest outbox event waiting to be published"
    );
    describe_gauge!(
        OUTBOX_HEALTH_STATE,
        "Lag health: 0 = OK, 1 = WARNING, 2 = CRITICAL"
    );
    describe_counter!(INBOX_RECEIVED_TOTAL, "Inbox rows written per consumer");
    describe_counter!(INBOX_PROCESSED_TOTAL, "Inbox rows processed per consumer");
    describe_counter!(
        INBOX_DUPLICATE_TOTAL,
        "Deliveries absorbed because the consumer already had the event"
    );
    describe_counter!(INBOX_FAILED_TOTAL, "Failed handler attempts per consumer");
    describe_counter!(
        INBOX_DEAD_LETTERED_TOTAL,
        "Inbox rows moved to DEAD_LETTER per consumer"
    );
    describe_gauge!(
        INBOX_BACKLOG,
        "Inbox rows not yet processed (RECEIVED + RETRY_PENDING)"
    );
    describe_gauge!(INBOX_RETRY_PENDING, "Inbox rows waiting for a retry");
    describe_gauge!(INBOX_DEAD_LETTER, "Inbox rows that need an operator");
    describe_gauge!(
        INBOX_OLDEST_DUE_AGE,
        Unit::Seconds,
        "How long the consumer's oldest due row has been waiting"
    );
    describe_gauge!(INBOX_PAUSED, "1 while the consumer is paused");
    describe_histogram!(
        INBOX_DELIVERY_LATENCY,
        Unit::Seconds,
        "Event created to processed by the consumer"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tally_is_taken_once() {
        // Unique names: other unit tests of this binary may count in parallel.
        inbox_received("tally-test-a", 3);
        inbox_duplicate("tally-test-a", 2);
        inbox_failed("tally-test-a", 0);
        let first = take_deltas();
        let a = first
            .consumers
            .get("tally-test-a")
            .copied()
            .unwrap_or_default();
        assert_eq!((a.received, a.duplicates, a.failed), (3, 2, 0));
        let again = take_deltas();
        assert!(!again.consumers.contains_key("tally-test-a"));
    }
}
