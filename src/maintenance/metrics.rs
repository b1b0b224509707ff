//! Metric updates made by the runtime's hot paths. Each is one call into the `metrics` facade
//! (a no-op until the application installs a recorder).

/// Outbox rows moved to PUBLISHED.
pub(crate) fn outbox_published(_n: u64) {}
/// Claims (or external publishes) that failed.
pub(crate) fn outbox_publish_failed(_n: u64) {}
/// Inbox rows marked PROCESSED for `consumer`.
pub(crate) fn inbox_processed(_consumer: &str, _n: u64) {}
/// Failed attempts of `consumer` (retried or dead-lettered).
pub(crate) fn inbox_failed(_consumer: &str, _n: u64) {}
/// Inbox rows of `consumer` moved to DEAD_LETTER.
pub(crate) fn inbox_dead_lettered(_consumer: &str, _n: u64) {}
/// Deliveries to `consumer` absorbed by the inbox because the event was already there.
pub(crate) fn inbox_duplicate(_consumer: &str, _n: u64) {}
/// Inbox rows of `consumer` newly received.
pub(crate) fn inbox_received(_consumer: &str, _n: u64) {}
/// Event created → processed by `consumer`, in seconds.
pub(crate) fn delivery_latency(_consumer: &str, _seconds: f64) {}
