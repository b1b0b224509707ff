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
//! [`FAMILIES`] lists every family with its kind, labels, unit and help text: [`describe`]
//! registers the help from it, and its tests hold the names to Prometheus' conventions
//! (`_total` on counters and only there, base units spelled out, one label set per family),
//! because dashboards and alerts are built on these names and a rename breaks them.

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
/// Events published over the last hour to no consumer (gauge).
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
/// Rows of a consumer with an allowed delay processed within it (counter; over
/// `inbox_processed_total`, the consumer's service level).
pub(crate) const INBOX_WITHIN_ALLOWED_DELAY_TOTAL: &str =
    "inbox_processed_within_allowed_delay_total";
/// Database sessions of handlers hung past their timeout and the grace, ended by the engine
/// (counter).
pub(crate) const HANDLER_SESSIONS_ENDED_TOTAL: &str = "outbox_handler_sessions_ended_total";
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
/// Handlers that overran their timeout and still hold a connection (gauge).
pub(crate) const CONSUMER_HUNG_HANDLERS: &str = "outbox_consumer_hung_handlers";
/// 1 while the consumer's loops wait for a hung handler to let go (gauge).
pub(crate) const CONSUMER_STALLED: &str = "outbox_consumer_stalled";
/// Event created → processed by the consumer (histogram, seconds).
pub(crate) const INBOX_DELIVERY_LATENCY: &str = "inbox_delivery_latency_seconds";

/// What a family is: its `# TYPE` in a scrape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One metric family: everything a scrape says about it besides its values.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Family {
    pub name: &'static str,
    pub kind: Kind,
    /// The label keys of every series of the family. A family whose series carried different
    /// keys could not be summed or joined in PromQL without `ignoring(…)`. Read by the tests,
    /// which hold the series a scrape shows to it.
    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "the tests check the series against it")
    )]
    pub labels: &'static [&'static str],
    /// The unit, which the name spells out too (`_seconds`).
    pub unit: Option<metrics::Unit>,
    /// The `# HELP` line.
    pub help: &'static str,
}

const NONE: &[&str] = &[];
const CONSUMER: &[&str] = &["consumer"];

const fn family(
    name: &'static str,
    kind: Kind,
    labels: &'static [&'static str],
    help: &'static str,
) -> Family {
    Family {
        name,
        kind,
        labels,
        unit: None,
        help,
    }
}

const fn seconds(family: Family) -> Family {
    Family {
        unit: Some(metrics::Unit::Seconds),
        ..family
    }
}

/// Every family the library records. The one place names meet their kind, labels and help.
pub(crate) const FAMILIES: &[Family] = &[
    family(
        OUTBOX_PUBLISHED_TOTAL,
        Kind::Counter,
        NONE,
        "Outbox events published (handed to every subscribed consumer or the transport)",
    ),
    family(
        OUTBOX_FAILED_TOTAL,
        Kind::Counter,
        NONE,
        "Outbox claims or publishes that failed",
    ),
    family(
        OUTBOX_PENDING,
        Kind::Gauge,
        NONE,
        "Outbox events waiting to be published (PENDING + RETRY_PENDING)",
    ),
    family(
        OUTBOX_RETRY_PENDING,
        Kind::Gauge,
        NONE,
        "Outbox events waiting for a publish retry",
    ),
    family(
        OUTBOX_PROCESSING,
        Kind::Gauge,
        NONE,
        "Outbox events leased by an external publisher",
    ),
    family(
        OUTBOX_DEAD_LETTER,
        Kind::Gauge,
        NONE,
        "Outbox events that need an operator",
    ),
    family(
        OUTBOX_UNROUTED,
        Kind::Gauge,
        NONE,
        "Events published over the last hour to no consumer (none was subscribed to the type)",
    ),
    seconds(family(
        OUTBOX_OLDEST_PENDING_AGE,
        Kind::Gauge,
        NONE,
        "Age of the oldest outbox event waiting to be published",
    )),
    family(
        OUTBOX_HEALTH_STATE,
        Kind::Gauge,
        NONE,
        "Lag health: 0 = OK, 1 = WARNING, 2 = CRITICAL",
    ),
    family(
        INBOX_RECEIVED_TOTAL,
        Kind::Counter,
        CONSUMER,
        "Inbox rows written per consumer",
    ),
    family(
        INBOX_PROCESSED_TOTAL,
        Kind::Counter,
        CONSUMER,
        "Inbox rows processed per consumer",
    ),
    family(
        INBOX_DUPLICATE_TOTAL,
        Kind::Counter,
        CONSUMER,
        "Deliveries absorbed because the consumer already had the event",
    ),
    family(
        INBOX_FAILED_TOTAL,
        Kind::Counter,
        CONSUMER,
        "Failed handler attempts per consumer",
    ),
    family(
        INBOX_DEAD_LETTERED_TOTAL,
        Kind::Counter,
        CONSUMER,
        "Inbox rows moved to DEAD_LETTER per consumer",
    ),
    family(
        INBOX_WITHIN_ALLOWED_DELAY_TOTAL,
        Kind::Counter,
        CONSUMER,
        "Inbox rows processed within their consumer's allowed delay (consumers that set one)",
    ),
    family(
        HANDLER_SESSIONS_ENDED_TOTAL,
        Kind::Counter,
        CONSUMER,
        "Database sessions of handlers hung past their timeout and the grace, ended to release their locks and snapshot",
    ),
    family(
        INBOX_BACKLOG,
        Kind::Gauge,
        CONSUMER,
        "Inbox rows not yet processed (RECEIVED + RETRY_PENDING)",
    ),
    family(
        INBOX_RETRY_PENDING,
        Kind::Gauge,
        CONSUMER,
        "Inbox rows waiting for a retry",
    ),
    family(
        INBOX_DEAD_LETTER,
        Kind::Gauge,
        CONSUMER,
        "Inbox rows that need an operator",
    ),
    seconds(family(
        INBOX_OLDEST_DUE_AGE,
        Kind::Gauge,
        CONSUMER,
        "How long the consumer's oldest due row has been waiting",
    )),
    family(
        INBOX_PAUSED,
        Kind::Gauge,
        CONSUMER,
        "1 while the consumer is paused",
    ),
    family(
        CONSUMER_HUNG_HANDLERS,
        Kind::Gauge,
        CONSUMER,
        "Handlers that overran their timeout and still hold a connection (at most the consumer's concurrency)",
    ),
    family(
        CONSUMER_STALLED,
        Kind::Gauge,
        CONSUMER,
        "1 while the consumer waits for one of its hung handlers to let go of its connection",
    ),
    seconds(family(
        INBOX_DELIVERY_LATENCY,
        Kind::Histogram,
        CONSUMER,
        "Event created to processed by the consumer",
    )),
];

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
    pub sessions_ended: u64,
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
        e.sessions_ended += d.sessions_ended;
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
/// Rows of `consumer` processed within its allowed delay.
pub(crate) fn processed_within_allowed_delay(consumer: &str, n: u64) {
    consumer_counter(INBOX_WITHIN_ALLOWED_DELAY_TOTAL, consumer, n);
}
/// A hung handler's database session of `consumer` ended by the engine.
pub(crate) fn handler_session_ended(consumer: &str) {
    consumer_counter(HANDLER_SESSIONS_ENDED_TOTAL, consumer, 1);
    bump_consumer(consumer, 1, |d| &mut d.sessions_ended);
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

/// Registers help texts (and units) with the installed recorder, from [`FAMILIES`]. Harmless
/// to call more than once.
pub(crate) fn describe() {
    metrics::with_recorder(|r| {
        for f in FAMILIES {
            let (name, help) = (f.name.into(), f.help.into());
            match f.kind {
                Kind::Counter => r.describe_counter(name, f.unit, help),
                Kind::Gauge => r.describe_gauge(name, f.unit, help),
                Kind::Histogram => r.describe_histogram(name, f.unit, help),
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How `f` breaks Prometheus' naming conventions (those `promtool check metrics` lints,
    /// plus our prefixes), one line each; empty when it does not.
    fn convention_breaks(f: &Family) -> Vec<String> {
        let mut breaks = Vec::new();
        let mut fail = |why: &str| breaks.push(format!("{}: {why}", f.name));
        let name = f.name;
        let words: Vec<&str> = name.split('_').collect();
        let snake = name.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            && words.iter().all(|w| !w.is_empty());
        if !snake {
            fail("not lower snake_case");
        }
        if !(name.starts_with("outbox_") || name.starts_with("inbox_")) {
            fail("not prefixed outbox_ or inbox_");
        }
        match (f.kind, name.ends_with("_total")) {
            (Kind::Counter, false) => fail("a counter must end in _total"),
            (Kind::Gauge | Kind::Histogram, true) => fail("only a counter ends in _total"),
            _ => {}
        }
        // A scrape writes a histogram as `_bucket`/`_sum`/`_count` series, and OpenMetrics
        // keeps `_created` and `_info` for itself.
        for reserved in ["bucket", "sum", "count", "created", "info"] {
            if words.last() == Some(&reserved) {
                fail(&format!("_{reserved} is a reserved suffix"));
            }
        }
        for kind in ["counter", "gauge", "histogram", "summary"] {
            if words.contains(&kind) {
                fail(&format!("the name repeats the type ({kind})"));
            }
        }
        // Base units only, spelled out: seconds and bytes, never their multiples.
        for unit in [
            "ms",
            "us",
            "ns",
            "sec",
            "secs",
            "millis",
            "milliseconds",
            "microseconds",
            "nanoseconds",
            "minutes",
            "hours",
            "days",
            "kb",
            "mb",
            "gb",
            "kilobytes",
            "megabytes",
            "gigabytes",
            "bits",
            "percent",
        ] {
            if words.contains(&unit) {
                fail(&format!(
                    "{unit} is not a base unit (seconds, bytes, ratio)"
                ));
            }
        }
        let base = name.strip_suffix("_total").unwrap_or(name);
        match f.unit {
            None if base.ends_with("_seconds") || base.ends_with("_bytes") => {
                fail("the name has a unit the family does not declare")
            }
            Some(metrics::Unit::Seconds) if !base.ends_with("_seconds") => {
                fail("a family in seconds ends in _seconds (before _total)")
            }
            Some(metrics::Unit::Bytes) if !base.ends_with("_bytes") => {
                fail("a family in bytes ends in _bytes (before _total)")
            }
            Some(metrics::Unit::Seconds | metrics::Unit::Bytes | metrics::Unit::Count) | None => {}
            Some(other) => fail(&format!("{} is not a base unit", other.as_str())),
        }
        if f.help.trim().is_empty() {
            fail("no help text");
        }
        for label in f.labels {
            let ok = label.starts_with(|c: char| c.is_ascii_lowercase())
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if !ok || ["le", "quantile"].contains(label) {
                fail(&format!("label {label:?} is not a plain snake_case name"));
            }
        }
        breaks
    }

    #[test]
    fn every_family_follows_the_prometheus_naming_conventions() {
        let breaks: Vec<String> = FAMILIES.iter().flat_map(convention_breaks).collect();
        assert!(breaks.is_empty(), "{breaks:#?}");
        // One family per name, and none named like another's histogram series.
        let mut names: Vec<&str> = FAMILIES.iter().map(|f| f.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), FAMILIES.len(), "a name is listed twice");
        for h in FAMILIES.iter().filter(|f| f.kind == Kind::Histogram) {
            for suffix in ["_bucket", "_sum", "_count"] {
                let series = format!("{}{suffix}", h.name);
                assert!(!names.contains(&series.as_str()), "{series} is taken");
            }
        }
    }

    #[test]
    fn the_convention_check_catches_what_it_should() {
        let bad = [
            family("inbox_failed", Kind::Counter, CONSUMER, "x"),
            family("outbox_pending_total", Kind::Gauge, NONE, "x"),
            family("outbox_lag_ms", Kind::Gauge, NONE, "x"),
            family("inbox_latency", Kind::Histogram, CONSUMER, "x"),
            seconds(family("inbox_latency", Kind::Histogram, CONSUMER, "x")),
            family("inbox_age_seconds", Kind::Gauge, CONSUMER, "x"),
            family("outbox_queue_count", Kind::Gauge, NONE, "x"),
            family("Outbox_Pending", Kind::Gauge, NONE, "x"),
            family("queue_pending", Kind::Gauge, NONE, "x"),
            family("outbox_pending", Kind::Gauge, NONE, " "),
            family("outbox_pending", Kind::Gauge, &["Consumer"], "x"),
        ];
        // The histogram without a unit is fine by the conventions; all the others break one.
        for f in &bad {
            let expected = !(f.name == "inbox_latency" && f.unit.is_none());
            assert_eq!(!convention_breaks(f).is_empty(), expected, "{f:?}");
        }
    }

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

    /// The metric names a text uses: its `outbox_…`/`inbox_…` words, a histogram's series
    /// suffix taken off.
    fn names_in(text: &str) -> Vec<String> {
        let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
        text.split(|c: char| !is_word(c))
            .filter(|w| w.starts_with("outbox_") || w.starts_with("inbox_"))
            .map(|w| {
                let histogram = FAMILIES.iter().find(|f| {
                    f.kind == Kind::Histogram
                        && ["_bucket", "_sum", "_count"]
                            .iter()
                            .any(|s| w.strip_suffix(s) == Some(f.name))
                });
                histogram.map_or(w, |f| f.name).to_owned()
            })
            .collect()
    }

    fn read_doc(path: &str) -> String {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    #[test]
    fn the_dashboard_and_the_metrics_doc_use_these_names() {
        let known = |n: &String| FAMILIES.iter().any(|f| f.name == n);
        let dashboard = read_doc("docs/grafana/actix-outbox.json");
        let exprs: String = dashboard
            .lines()
            .filter(|l| l.trim_start().starts_with("\"expr\""))
            .collect();
        let queried = names_in(&exprs);
        let unknown: Vec<&String> = queried.iter().filter(|n| !known(n)).collect();
        assert!(unknown.is_empty(), "the dashboard queries {unknown:?}");
        // Lag, throughput, failures and dead letters, at least.
        for needed in [
            OUTBOX_OLDEST_PENDING_AGE,
            INBOX_OLDEST_DUE_AGE,
            OUTBOX_PUBLISHED_TOTAL,
            INBOX_PROCESSED_TOTAL,
            OUTBOX_FAILED_TOTAL,
            INBOX_FAILED_TOTAL,
            INBOX_DEAD_LETTER,
        ] {
            assert!(
                queried.iter().any(|n| n == needed),
                "no panel shows {needed}"
            );
        }
        // The table under "## Metrics" in the runbook lists every family and nothing else.
        let ops = read_doc("docs/operations.md");
        let table: String = ops
            .split("## Metrics")
            .nth(1)
            .and_then(|s| s.split("\n## ").next())
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("| `"))
            .collect();
        let listed = names_in(&table);
        let unknown: Vec<&String> = listed.iter().filter(|n| !known(n)).collect();
        assert!(unknown.is_empty(), "docs/operations.md lists {unknown:?}");
        for f in FAMILIES {
            assert!(
                listed.iter().any(|n| n == f.name),
                "docs/operations.md does not list {}",
                f.name
            );
        }
    }

    /// The families as a Prometheus scrape shows them, through the same exporter as
    /// `install_prometheus_recorder` (a local recorder: the process's one stays free).
    #[cfg(feature = "admin")]
    #[test]
    fn a_scrape_shows_each_family_with_its_type_help_and_labels() {
        use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(
                Matcher::Full(INBOX_DELIVERY_LATENCY.to_owned()),
                LATENCY_BUCKETS,
            )
            .unwrap()
            .build_recorder();
        metrics::with_local_recorder(&recorder, || {
            describe();
            // The hot paths' own calls, with zero counts: they register their series without
            // touching the tally other tests take.
            outbox_published(0);
            outbox_publish_failed(0);
            inbox_received("c", 0);
            inbox_processed("c", 0);
            inbox_duplicate("c", 0);
            inbox_failed("c", 0);
            inbox_dead_lettered("c", 0);
            consumer_counter(HANDLER_SESSIONS_ENDED_TOTAL, "c", 0);
            processed_within_allowed_delay("c", 0);
            delivery_latency("c", 0.5);
            consumer_hung("c", 0);
            consumer_stalled("c", false);
            // The gauges the stats sampler sets, with the labels this table gives them.
            for f in FAMILIES.iter().filter(|f| f.kind == Kind::Gauge) {
                let labels: Vec<(&str, &str)> = f.labels.iter().map(|l| (*l, "c")).collect();
                metrics::gauge!(f.name, &labels).set(0.0);
            }
        });
        let text = recorder.handle().render();
        for f in FAMILIES {
            let kind = match f.kind {
                Kind::Counter => "counter",
                Kind::Gauge => "gauge",
                Kind::Histogram => "histogram",
            };
            let type_line = format!("# TYPE {} {kind}\n", f.name);
            assert!(
                text.contains(&type_line),
                "{type_line:?} missing from:\n{text}"
            );
            let help_line = format!("# HELP {} {}\n", f.name, f.help);
            assert!(
                text.contains(&help_line),
                "{help_line:?} missing from:\n{text}"
            );
            let series = match f.kind {
                Kind::Histogram => vec![format!("{}_count", f.name)],
                _ => vec![f.name.to_owned()],
            };
            for name in series {
                let line = text
                    .lines()
                    .find(|l| l.split(['{', ' ']).next() == Some(name.as_str()))
                    .unwrap_or_else(|| panic!("no {name} series in:\n{text}"));
                let keys: Vec<&str> = match line.split_once('{') {
                    Some((_, rest)) => rest
                        .split('}')
                        .next()
                        .unwrap_or("")
                        .split(',')
                        .filter_map(|kv| kv.split_once('=').map(|(k, _)| k))
                        .collect(),
                    None => Vec::new(),
                };
                assert_eq!(keys, f.labels, "{line}");
            }
        }
    }
}
