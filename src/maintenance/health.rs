//! Lag health: pure functions from stats samples to an OK / WARNING / CRITICAL report, tested
//! without a database or an actor.
//!
//! The checks answer "is follow-up work happening on time?":
//! - the oldest outbox event still waiting to be published, and each consumer's oldest *due*
//!   inbox row (a row waiting for its retry backoff is not late), against warn/critical ages;
//! - whether the outbox backlog is actually going down: a publisher that is alive but stuck
//!   keeps the same oldest event at the head of the queue sample after sample;
//! - dead letters (WARNING: someone has to decide about them);
//! - a duplicate-delivery rate far above its usual level (a redelivery loop, a lease that is
//!   too short for the transport).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::trend::{draining, outbox_trend, span_seconds, trend_window};
use crate::store::stats::{ConsumerGauges, Sample};

/// Overall state, ordered: the report takes the worst of its reasons.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum HealthState {
    /// Everything is on time.
    Ok,
    /// Something needs a look: lag past the warning age, dead letters, duplicates.
    Warning,
    /// Follow-up work is badly late or not moving at all.
    Critical,
}

impl HealthState {
    /// `OK`, `WARNING` or `CRITICAL`.
    pub fn as_str(&self) -> &'static str {
        match self {
            HealthState::Ok => "OK",
            HealthState::Warning => "WARNING",
            HealthState::Critical => "CRITICAL",
        }
    }

    /// 0, 1 or 2, for a gauge.
    pub(crate) fn level(&self) -> f64 {
        match self {
            HealthState::Ok => 0.0,
            HealthState::Warning => 1.0,
            HealthState::Critical => 2.0,
        }
    }
}

impl std::fmt::Display for HealthState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

pub use super::health_config::HealthConfig;

/// Whether the outbox backlog is going down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Trend {
    /// Nothing waits to be published.
    Empty,
    /// Fewer samples than [`HealthConfig::trend_samples`], or the backlog was empty in some.
    Unknown,
    /// Fewer events wait than at the start of the window.
    Decreasing,
    /// Events are published but as many arrive.
    Steady,
    /// Events are published but more arrive: the publisher is falling behind.
    Growing,
    /// Nothing was published during the whole window.
    Stuck,
}

/// One finding of the health check.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct HealthReason {
    /// How bad this finding is.
    pub state: HealthState,
    /// Stable code, e.g. `OUTBOX_STUCK`, `INBOX_LAG`, `DEAD_LETTERS`.
    pub code: String,
    /// The consumer concerned, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consumer: Option<String>,
    /// A sentence an operator can act on.
    pub message: String,
}

/// Outbox part of a [`HealthReport`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct OutboxHealth {
    /// Events waiting to be published.
    pub pending: i64,
    /// Events waiting for a publish retry (included in `pending`).
    pub retrying: i64,
    /// Events that will not be published without an operator.
    pub dead_letter: i64,
    /// Age of the oldest waiting event.
    pub oldest_pending_age_seconds: f64,
    /// Whether the backlog is going down.
    pub trend: Trend,
}

/// One consumer's part of a [`HealthReport`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ConsumerHealth {
    /// The consumer's name.
    pub consumer: String,
    /// Its pause switch is on.
    pub paused: bool,
    /// Rows not yet processed (received or waiting for a retry).
    pub backlog: i64,
    /// How long its oldest due row has been waiting.
    pub oldest_due_age_seconds: f64,
    /// How long the oldest event it has not processed yet has existed.
    #[serde(default)]
    pub oldest_waiting_age_seconds: f64,
    /// Its allowed delay (`ConsumerConfig::allowed_delay`), if it has one.
    #[serde(default)]
    pub allowed_delay_seconds: Option<f64>,
    /// Rows that need an operator.
    pub dead_letter: i64,
    /// Duplicates per delivery over the recent samples, when there were deliveries.
    pub duplicate_rate: Option<f64>,
}

/// The lag health of the outbox and every consumer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct HealthReport {
    /// The worst state among `reasons`; OK when there are none.
    pub state: HealthState,
    /// When the numbers were sampled.
    pub checked_at: DateTime<Utc>,
    /// Every finding, worst first.
    pub reasons: Vec<HealthReason>,
    /// The outbox.
    pub outbox: OutboxHealth,
    /// Every registered consumer.
    pub consumers: Vec<ConsumerHealth>,
}

impl HealthReport {
    /// Adds a finding and raises the overall state to it.
    pub(crate) fn push(
        &mut self,
        state: HealthState,
        code: &str,
        consumer: Option<&str>,
        message: String,
    ) {
        self.state = self.state.max(state);
        self.reasons.push(HealthReason {
            state,
            code: code.to_owned(),
            consumer: consumer.map(str::to_owned),
            message,
        });
        // Stable sort: worst first, otherwise in the order found.
        self.reasons.sort_by_key(|r| std::cmp::Reverse(r.state));
    }
}

/// Assesses `current` given the samples before it (`previous`, oldest first).
pub(crate) fn assess(cfg: &HealthConfig, current: &Sample, previous: &[Sample]) -> HealthReport {
    let trend = outbox_trend(cfg, current, previous);
    let o = &current.outbox;
    let mut report = HealthReport {
        state: HealthState::Ok,
        checked_at: current.at,
        reasons: Vec::new(),
        outbox: OutboxHealth {
            pending: o.pending,
            retrying: o.retrying,
            dead_letter: o.dead_letter,
            oldest_pending_age_seconds: o.oldest_pending_age_seconds,
            trend,
        },
        consumers: Vec::new(),
    };

    let window = trend_window(cfg, current, previous);
    if let Some(state) = lag_state(
        o.oldest_pending_age_seconds,
        cfg.outbox_warn_after,
        cfg.outbox_critical_after,
    ) {
        report.push(
            state,
            "OUTBOX_LAG",
            None,
            format!(
                "the oldest event waiting to be published is {} old ({} waiting){}",
                human(o.oldest_pending_age_seconds),
                o.pending,
                draining(trend, &window)
            ),
        );
    }
    match trend {
        Trend::Stuck => report.push(
            HealthState::Critical,
            "OUTBOX_STUCK",
            None,
            format!(
                "nothing was published over the last {} samples ({}): {} events wait and the \
                 oldest has not moved; is the publisher running?",
                window.len(),
                human(span_seconds(&window)),
                o.pending
            ),
        ),
        Trend::Growing => report.push(
            HealthState::Warning,
            "OUTBOX_GROWING",
            None,
            format!(
                "events arrive faster than they are published: {} → {} waiting over the last {} samples",
                window[0].outbox.pending,
                o.pending,
                window.len()
            ),
        ),
        _ => {}
    }
    for h in &current.snapshots {
        let after = |d: Duration| h.age_seconds >= d.as_secs_f64();
        if !after(cfg.snapshot_warn_after) {
            continue;
        }
        let state = if after(cfg.snapshot_critical_after) {
            HealthState::Critical
        } else {
            HealthState::Warning
        };
        report.push(
            state,
            "LONG_SNAPSHOT",
            None,
            format!(
                "session {} ({}, {}) has held a snapshot for {}: vacuum removes no row that \
                 died since, in any table, and each claim walks more dead entries; its \
                 statement: {}",
                h.pid,
                if h.application.is_empty() {
                    "no application name"
                } else {
                    &h.application
                },
                h.state,
                human(h.age_seconds),
                h.query
            ),
        );
    }
    for f in &current.contract {
        let consumer = (!f.consumer.is_empty()).then_some(f.consumer.as_str());
        report.push(
            HealthState::Warning,
            "CONTRACT_MISMATCH",
            consumer,
            format!("{}: {}", f.code, f.message),
        );
    }
    if o.unrouted > 0 {
        report.push(
            HealthState::Warning,
            "EVENTS_UNROUTED",
            None,
            format!(
                "{} published over the last hour reached no consumer ({}): none was subscribed \
                 to the type when it was published, and a consumer subscribed later never sees \
                 it; GET /events/{{id}} shows one",
                plural(o.unrouted, "event"),
                o.unrouted_types.join(", ")
            ),
        );
    }
    for e in &current.effects {
        effect_reasons(cfg, e, &mut report);
    }
    if o.dead_letter > 0 {
        report.push(
            HealthState::Warning,
            "DEAD_LETTERS",
            None,
            format!(
                "{} could not be published and {} a decision (retry or ignore)",
                plural(o.dead_letter, "event"),
                if o.dead_letter == 1 { "needs" } else { "need" }
            ),
        );
    }

    for c in &current.consumers {
        let name = Some(c.consumer.as_str());
        if let Some(state) = lag_state(
            c.oldest_due_age_seconds,
            cfg.inbox_warn_after,
            cfg.inbox_critical_after,
        ) {
            if c.paused {
                report.push(
                    HealthState::Warning,
                    "CONSUMER_PAUSED",
                    name,
                    format!(
                        "{} is paused; {} events wait, the oldest for {}",
                        c.consumer,
                        c.backlog,
                        human(c.oldest_due_age_seconds)
                    ),
                );
            } else if c.allowed_delay_seconds.is_none() {
                report.push(
                    state,
                    "INBOX_LAG",
                    name,
                    format!(
                        "{} is behind: its oldest due event has waited {} ({} waiting)",
                        c.consumer,
                        human(c.oldest_due_age_seconds),
                        c.backlog
                    ),
                );
            }
        }
        if c.log_held_age_seconds >= cfg.log_held_warn_after.as_secs_f64() {
            report.push(
                HealthState::Warning,
                "LOG_HELD",
                name,
                format!(
                    "{} has left events unread past its cursor for {}: retention keeps the \
                     outbox from then on, for every consumer, until it reads them or they move \
                     into its inbox",
                    c.consumer,
                    human(c.log_held_age_seconds)
                ),
            );
        }
        // A consumer with an allowed delay is judged by it, not by the global thresholds.
        if let (Some(allowed), false) = (c.allowed_delay_seconds, c.paused) {
            let critical = c.critical_delay_seconds.unwrap_or(allowed * 3.0);
            let age = c.oldest_waiting_age_seconds;
            let state = if age > critical {
                Some(HealthState::Critical)
            } else if age > allowed {
                Some(HealthState::Warning)
            } else {
                None
            };
            if let Some(state) = state {
                report.push(
                    state,
                    "CONSUMER_LATE",
                    name,
                    format!(
                        "{} is late: an event has waited {} for it, past its allowed delay of \
                         {} ({} waiting)",
                        c.consumer,
                        human(age),
                        human(allowed),
                        c.backlog
                    ),
                );
            }
        }
        if let Some(state) = lag_state(
            c.oldest_in_flight_age_seconds,
            cfg.inbox_warn_after,
            cfg.inbox_critical_after,
        ) {
            report.push(
                state,
                "CONSUMER_HUNG",
                name,
                format!(
                    "{} has held an event for {}: a handler hangs past its timeout, keeping \
                     it (the consumer waits once `concurrency` of them hang)",
                    c.consumer,
                    human(c.oldest_in_flight_age_seconds)
                ),
            );
        }
        let ended = recent_sum(cfg, &c.consumer, current, previous, |c| c.sessions_ended);
        if ended > 0 {
            report.push(
                HealthState::Warning,
                crate::error::ErrorCode::HANDLER_SESSION_ENDED.as_str(),
                name,
                format!(
                    "{} had {} a handler hung past its timeout and the grace: the engine ended \
                     {}, releasing its locks and snapshot, and charged the attempt",
                    c.consumer,
                    plural(ended as i64, "database session"),
                    if ended == 1 { "it" } else { "them" }
                ),
            );
        }
        if c.dead_letter > 0 {
            report.push(
                HealthState::Warning,
                "DEAD_LETTERS",
                name,
                format!(
                    "{} has {} that {} a decision (retry or ignore)",
                    c.consumer,
                    plural(c.dead_letter, "failed event"),
                    if c.dead_letter == 1 { "needs" } else { "need" }
                ),
            );
        }
        let dup = duplicates(cfg, &c.consumer, current, previous);
        if dup.alarming {
            report.push(
                HealthState::Warning,
                "DUPLICATE_RATE_HIGH",
                name,
                format!(
                    "{} received {} duplicate deliveries in the last {} samples ({:.0}% of \
                     deliveries, usually {:.1}%)",
                    c.consumer,
                    dup.recent_duplicates,
                    dup.samples,
                    dup.recent_rate.unwrap_or(0.0) * 100.0,
                    dup.usual_rate * 100.0
                ),
            );
        }
        report.consumers.push(ConsumerHealth {
            consumer: c.consumer.clone(),
            paused: c.paused,
            backlog: c.backlog,
            oldest_due_age_seconds: c.oldest_due_age_seconds,
            oldest_waiting_age_seconds: c.oldest_waiting_age_seconds,
            allowed_delay_seconds: c.allowed_delay_seconds,
            dead_letter: c.dead_letter,
            duplicate_rate: dup.recent_rate,
        });
    }
    report
}

/// Whether a health state change deserves a log line: every change does, and so does a first
/// assessment that is not OK.
pub(crate) fn transition(
    previous: Option<HealthState>,
    next: HealthState,
) -> Option<(Option<HealthState>, HealthState)> {
    match previous {
        Some(p) if p == next => None,
        None if next == HealthState::Ok => None,
        p => Some((p, next)),
    }
}

/// A kind of side effect: dead letters wait for an operator (`EFFECTS_DEAD_LETTERED`), and
/// calls due past the inbox's thresholds mean no worker makes them, or not fast enough
/// (`EFFECTS_LATE`: a kind no instance registers waits for ever).
fn effect_reasons(
    cfg: &HealthConfig,
    e: &crate::store::effects::EffectGauges,
    report: &mut HealthReport,
) {
    if e.dead_letter > 0 {
        report.push(
            HealthState::Warning,
            "EFFECTS_DEAD_LETTERED",
            None,
            format!(
                "{} of kind {} failed for good and {} a decision (GET /effects?status=DEAD_LETTER)",
                plural(e.dead_letter, "side effect"),
                e.kind,
                if e.dead_letter == 1 { "needs" } else { "need" }
            ),
        );
    }
    let late = cfg.inbox_warn_after;
    if let Some(state) = lag_state(e.oldest_due_age_seconds, late, cfg.inbox_critical_after) {
        report.push(
            state,
            "EFFECTS_LATE",
            None,
            format!(
                "{} of kind {} due, the oldest for {}: is a worker for it running \
                 (OutboxBuilder::effect) on some instance?",
                plural(e.due, "side effect"),
                e.kind,
                human(e.oldest_due_age_seconds)
            ),
        );
    }
}

fn lag_state(age_seconds: f64, warn: Duration, critical: Duration) -> Option<HealthState> {
    if age_seconds >= critical.as_secs_f64() && age_seconds > 0.0 {
        Some(HealthState::Critical)
    } else if age_seconds >= warn.as_secs_f64() && age_seconds > 0.0 {
        Some(HealthState::Warning)
    } else {
        None
    }
}

struct DuplicateCheck {
    /// Samples in the recent window.
    samples: usize,
    recent_duplicates: u64,
    recent_rate: Option<f64>,
    usual_rate: f64,
    alarming: bool,
}

/// Where the recent samples begin in `previous`: with the current one, the last
/// `trend_samples`.
fn recent_from(cfg: &HealthConfig, previous: &[Sample]) -> usize {
    previous
        .len()
        .saturating_sub(cfg.trend_samples.saturating_sub(1))
}

/// `field` of `consumer` summed over the recent samples of every instance (the current one and
/// the last `trend_samples - 1` before it), as [`duplicates`] counts them.
fn recent_sum(
    cfg: &HealthConfig,
    consumer: &str,
    current: &Sample,
    previous: &[Sample],
    field: impl Fn(&ConsumerGauges) -> u64,
) -> u64 {
    previous[recent_from(cfg, previous)..]
        .iter()
        .chain(std::iter::once(current))
        .flat_map(|s| s.consumers.iter().filter(|c| c.consumer == consumer))
        .map(field)
        .sum()
}

/// Duplicates per delivery (new rows + duplicates) in the last `trend_samples` samples of every
/// instance (each sample holds what its own instance counted), against the same rate over the
/// older ones.
fn duplicates(
    cfg: &HealthConfig,
    consumer: &str,
    current: &Sample,
    previous: &[Sample],
) -> DuplicateCheck {
    let sum = |samples: &mut dyn Iterator<Item = &Sample>| {
        samples
            .flat_map(|s| s.consumers.iter().filter(|c| c.consumer == consumer))
            .fold((0u64, 0u64), |(d, r), c| (d + c.duplicates, r + c.received))
    };
    let older = recent_from(cfg, previous);
    let recent = &previous[older..];
    let (recent_dup, recent_rcv) = sum(&mut recent.iter().chain(std::iter::once(current)));
    let (usual_dup, usual_rcv) = sum(&mut previous[..older].iter());
    let rate = |d: u64, r: u64| (d + r > 0).then(|| d as f64 / (d + r) as f64);
    let recent_rate = rate(recent_dup, recent_rcv);
    let usual_rate = rate(usual_dup, usual_rcv).unwrap_or(0.0);
    let alarming = recent_dup >= cfg.duplicate_min_count
        && recent_rate.is_some_and(|r| {
            r >= cfg.duplicate_rate_floor && r >= usual_rate * cfg.duplicate_rate_factor
        });
    DuplicateCheck {
        samples: recent.len() + 1,
        recent_duplicates: recent_dup,
        recent_rate,
        usual_rate,
        alarming,
    }
}

/// `1 event`, `3 events`.
fn plural(n: i64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// `42 s`, `3 min 5 s`, `2 h 10 min`.
pub(crate) fn human(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match s {
        0..=59 => format!("{s} s"),
        60..=3599 => format!("{} min {} s", s / 60, s % 60),
        _ => format!("{} h {} min", s / 3600, (s % 3600) / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::stats::OutboxGauges;

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + secs, 0).unwrap()
    }

    fn outbox(pending: i64, head: Option<i64>, oldest: f64) -> OutboxGauges {
        OutboxGauges {
            pending,
            head_seq: head,
            oldest_pending_age_seconds: oldest,
            ..Default::default()
        }
    }

    fn sample(secs: i64, o: OutboxGauges, consumers: Vec<ConsumerGauges>) -> Sample {
        Sample {
            at: at(secs),
            outbox: o,
            consumers,
            instance: None,
            contract: Vec::new(),
            snapshots: Vec::new(),
            effects: Vec::new(),
        }
    }

    fn consumer(name: &str) -> ConsumerGauges {
        ConsumerGauges {
            consumer: name.into(),
            ..Default::default()
        }
    }

    fn codes(r: &HealthReport) -> Vec<&str> {
        r.reasons.iter().map(|r| r.code.as_str()).collect()
    }

    #[test]
    fn a_snapshot_held_past_its_thresholds_is_named_with_its_session() {
        let cfg = HealthConfig::default();
        let held = |age: f64| crate::store::snapshots::HeldSnapshot {
            pid: 4242,
            application: "pg_dump".into(),
            state: "active".into(),
            age_seconds: age,
            query: "COPY public.orders TO stdout".into(),
        };
        let mut now = sample(0, outbox(0, None, 0.0), vec![]);
        now.snapshots = vec![held(60.0)];
        assert_eq!(assess(&cfg, &now, &[]).state, HealthState::Ok);
        now.snapshots = vec![held(400.0)];
        let r = assess(&cfg, &now, &[]);
        assert_eq!(
            (r.state, codes(&r)),
            (HealthState::Warning, vec!["LONG_SNAPSHOT"])
        );
        let m = &r.reasons[0].message;
        assert!(
            m.contains("4242") && m.contains("pg_dump") && m.contains("COPY"),
            "{m}"
        );
        now.snapshots = vec![held(2000.0)];
        assert_eq!(assess(&cfg, &now, &[]).state, HealthState::Critical);
    }

    #[test]
    fn an_idle_system_is_ok() {
        let cfg = HealthConfig::default();
        let now = sample(0, outbox(0, None, 0.0), vec![consumer("mail")]);
        let r = assess(&cfg, &now, &[]);
        assert_eq!(r.state, HealthState::Ok);
        assert!(r.reasons.is_empty());
        assert_eq!(r.outbox.trend, Trend::Empty);
        assert_eq!(r.consumers.len(), 1);
    }

    #[test]
    fn outbox_age_warns_after_a_minute_and_is_critical_after_five() {
        let cfg = HealthConfig::default();
        let r = assess(&cfg, &sample(0, outbox(3, Some(1), 59.0), vec![]), &[]);
        assert_eq!(r.state, HealthState::Ok);
        let r = assess(&cfg, &sample(0, outbox(3, Some(1), 60.0), vec![]), &[]);
        assert_eq!(
            (r.state, codes(&r)),
            (HealthState::Warning, vec!["OUTBOX_LAG"])
        );
        let r = assess(&cfg, &sample(0, outbox(3, Some(1), 301.0), vec![]), &[]);
        assert_eq!(
            (r.state, codes(&r)),
            (HealthState::Critical, vec!["OUTBOX_LAG"])
        );
    }

    #[test]
    fn a_live_but_stuck_publisher_is_critical_before_the_age_limits() {
        let cfg = HealthConfig::default();
        // Five samples, 5 s apart: 10 events wait throughout and the head never moves.
        let prev: Vec<_> = (0..4)
            .map(|i| sample(i * 5, outbox(10, Some(7), (i * 5) as f64), vec![]))
            .collect();
        let now = sample(20, outbox(10, Some(7), 20.0), vec![]);
        let r = assess(&cfg, &now, &prev);
        assert_eq!(r.outbox.trend, Trend::Stuck);
        assert_eq!(
            (r.state, codes(&r)),
            (HealthState::Critical, vec!["OUTBOX_STUCK"])
        );
        assert!(
            r.reasons[0].message.contains("20 s"),
            "{}",
            r.reasons[0].message
        );

        // The same samples, the four earlier ones taken by other instances within the last
        // second: this instance has no history yet, so nothing is judged.
        let mine = |mut s: Sample, instance: &str| {
            s.instance = Some(instance.into());
            s
        };
        let others: Vec<_> = (0..4)
            .map(|i| {
                mine(
                    sample(20, outbox(10, Some(7), 20.0), vec![]),
                    &format!("i{i}"),
                )
            })
            .collect();
        let r = assess(&cfg, &mine(now.clone(), "me"), &others);
        assert_eq!(r.outbox.trend, Trend::Unknown);

        // The same numbers with one sample fewer say nothing yet.
        let r = assess(&cfg, &now, &prev[1..]);
        assert_eq!(r.outbox.trend, Trend::Unknown);
        assert_eq!(r.state, HealthState::Ok);
    }

    #[test]
    fn a_lag_being_worked_off_says_it_is_draining() {
        let cfg = HealthConfig::default();
        // 10,000 waiting four samples (of 15 s) ago, 4,000 now: 100/s, 40 s left.
        let prev: Vec<_> = (0..4)
            .map(|i| {
                sample(
                    i * 15,
                    outbox(10_000 - i * 1_500, Some(i * 1_500), 300.0),
                    vec![],
                )
            })
            .collect();
        let r = assess(
            &cfg,
            &sample(60, outbox(4_000, Some(6_000), 240.0), vec![]),
            &prev,
        );
        assert_eq!(r.outbox.trend, Trend::Decreasing);
        assert_eq!(codes(&r), vec!["OUTBOX_LAG"]);
        let m = &r.reasons[0].message;
        assert!(m.contains("draining at 100/s, about 40 s left"), "{m}");
    }

    #[test]
    fn a_paused_consumer_is_paused_not_late_and_a_growing_lag_is_not_draining() {
        let cfg = HealthConfig::default();
        let paused = ConsumerGauges {
            paused: true,
            backlog: 3,
            oldest_waiting_age_seconds: 500.0,
            oldest_due_age_seconds: 500.0,
            allowed_delay_seconds: Some(30.0),
            critical_delay_seconds: Some(90.0),
            ..consumer("mail")
        };
        let r = assess(&cfg, &sample(0, outbox(0, None, 0.0), vec![paused]), &[]);
        assert_eq!(codes(&r), vec!["CONSUMER_PAUSED"]);

        let prev: Vec<_> = (0..4)
            .map(|i| sample(i * 15, outbox(1_000 + i * 100, Some(i), 300.0), vec![]))
            .collect();
        let r = assess(
            &cfg,
            &sample(60, outbox(2_000, Some(5), 360.0), vec![]),
            &prev,
        );
        assert_eq!(r.outbox.trend, Trend::Growing);
        assert!(
            r.reasons.iter().all(|x| !x.message.contains("draining")),
            "{r:?}"
        );
    }

    #[test]
    fn a_cursor_consumer_holding_the_log_past_the_limit_is_named() {
        let cfg = HealthConfig::default();
        let holds = |age: f64| ConsumerGauges {
            paused: true,
            backlog: 40,
            oldest_due_age_seconds: age,
            log_held_age_seconds: age,
            ..consumer("mail")
        };
        let r = assess(
            &cfg,
            &sample(0, outbox(0, None, 0.0), vec![holds(600.0)]),
            &[],
        );
        assert_eq!(
            codes(&r),
            vec!["CONSUMER_PAUSED"],
            "ten minutes is not yet held"
        );
        let r = assess(
            &cfg,
            &sample(0, outbox(0, None, 0.0), vec![holds(7200.0)]),
            &[],
        );
        assert_eq!(codes(&r), vec!["CONSUMER_PAUSED", "LOG_HELD"]);
        let held = r.reasons.iter().find(|x| x.code == "LOG_HELD").unwrap();
        assert_eq!(held.consumer.as_deref(), Some("mail"));
        assert!(held.message.contains("2 h"), "{}", held.message);
    }

    #[test]
    fn a_moving_backlog_is_not_stuck() {
        let cfg = HealthConfig::default();
        let steady: Vec<_> = (0..4)
            .map(|i| sample(i, outbox(10, Some(i), 1.0), vec![]))
            .collect();
        let r = assess(&cfg, &sample(4, outbox(10, Some(4), 1.0), vec![]), &steady);
        assert_eq!((r.outbox.trend, r.state), (Trend::Steady, HealthState::Ok));

        let r = assess(&cfg, &sample(4, outbox(5, Some(7), 1.0), vec![]), &steady);
        assert_eq!(
            (r.outbox.trend, r.state),
            (Trend::Decreasing, HealthState::Ok)
        );

        let r = assess(&cfg, &sample(4, outbox(50, Some(4), 1.0), vec![]), &steady);
        assert_eq!(r.outbox.trend, Trend::Growing);
        assert_eq!(
            (r.state, codes(&r)),
            (HealthState::Warning, vec!["OUTBOX_GROWING"])
        );

        // An empty sample inside the window means the backlog did drain.
        let mut gap = steady.clone();
        gap[2].outbox = outbox(0, None, 0.0);
        let r = assess(&cfg, &sample(4, outbox(10, Some(0), 1.0), vec![]), &gap);
        assert_eq!(r.outbox.trend, Trend::Unknown);
    }

    #[test]
    fn rows_waiting_for_their_backoff_do_not_make_a_stuck_publisher() {
        let cfg = HealthConfig::default();
        // 10 rows wait throughout, but in one sample none of them was due yet.
        let mut prev: Vec<_> = (0..4)
            .map(|i| sample(i * 5, outbox(10, Some(7), 1.0), vec![]))
            .collect();
        prev[1].outbox.head_seq = None;
        let r = assess(&cfg, &sample(20, outbox(10, Some(7), 1.0), vec![]), &prev);
        assert_eq!((r.outbox.trend, r.state), (Trend::Steady, HealthState::Ok));
    }

    #[test]
    fn inbox_lag_counts_per_consumer_and_a_paused_consumer_only_warns() {
        let cfg = HealthConfig::default();
        let late = ConsumerGauges {
            backlog: 4,
            due: 4,
            oldest_due_age_seconds: 400.0,
            ..consumer("mail")
        };
        let slow = ConsumerGauges {
            oldest_due_age_seconds: 90.0,
            ..consumer("stats")
        };
        let r = assess(
            &cfg,
            &sample(0, outbox(0, None, 0.0), vec![late.clone(), slow]),
            &[],
        );
        assert_eq!(r.state, HealthState::Critical);
        assert_eq!(codes(&r), vec!["INBOX_LAG", "INBOX_LAG"]);
        assert_eq!(r.reasons[0].consumer.as_deref(), Some("mail"));
        assert_eq!(r.reasons[1].state, HealthState::Warning);

        let paused = ConsumerGauges {
            paused: true,
            ..late
        };
        let r = assess(&cfg, &sample(0, outbox(0, None, 0.0), vec![paused]), &[]);
        assert_eq!(
            (r.state, codes(&r)),
            (HealthState::Warning, vec!["CONSUMER_PAUSED"])
        );
    }

    #[test]
    fn an_event_held_past_the_inbox_thresholds_says_a_handler_hangs() {
        let cfg = HealthConfig::default();
        let hung = ConsumerGauges {
            backlog: 1,
            oldest_in_flight_age_seconds: 90.0,
            ..consumer("mail")
        };
        let r = assess(&cfg, &sample(0, outbox(0, None, 0.0), vec![hung]), &[]);
        assert_eq!(
            (r.state, codes(&r)),
            (HealthState::Warning, vec!["CONSUMER_HUNG"])
        );
        let brief = ConsumerGauges {
            oldest_in_flight_age_seconds: 0.2,
            ..consumer("mail")
        };
        let r = assess(&cfg, &sample(0, outbox(0, None, 0.0), vec![brief]), &[]);
        assert_eq!(r.state, HealthState::Ok, "a batch in flight is no hang");
    }

    #[test]
    fn a_consumer_with_an_allowed_delay_is_judged_by_it_alone() {
        let cfg = HealthConfig::default();
        let strict = ConsumerGauges {
            backlog: 3,
            oldest_waiting_age_seconds: 45.0,
            oldest_due_age_seconds: 45.0,
            allowed_delay_seconds: Some(30.0),
            critical_delay_seconds: Some(90.0),
            ..consumer("mail")
        };
        // Past the global inbox thresholds too, but judged by its own allowed delay (none).
        let lax = ConsumerGauges {
            backlog: 3,
            oldest_waiting_age_seconds: 200.0,
            oldest_due_age_seconds: 200.0,
            allowed_delay_seconds: Some(600.0),
            critical_delay_seconds: Some(1800.0),
            ..consumer("analytics")
        };
        let r = assess(
            &cfg,
            &sample(0, outbox(0, None, 0.0), vec![strict.clone(), lax]),
            &[],
        );
        assert_eq!(
            (r.state, codes(&r)),
            (HealthState::Warning, vec!["CONSUMER_LATE"])
        );
        assert_eq!(r.reasons[0].consumer.as_deref(), Some("mail"));
        let very = ConsumerGauges {
            oldest_waiting_age_seconds: 100.0,
            ..strict
        };
        let r = assess(&cfg, &sample(0, outbox(0, None, 0.0), vec![very]), &[]);
        assert_eq!(
            (r.state, codes(&r)),
            (HealthState::Critical, vec!["CONSUMER_LATE"])
        );
    }

    #[test]
    fn side_effects_dead_lettered_or_late_are_named_by_kind() {
        let cfg = HealthConfig::default();
        let gauges = |kind: &str, due, age, dead| crate::store::effects::EffectGauges {
            kind: kind.into(),
            due,
            oldest_due_age_seconds: age,
            dead_letter: dead,
        };
        let mut s = sample(0, OutboxGauges::default(), vec![]);
        s.effects = vec![
            gauges("sms", 0, 0.0, 2),
            gauges("emial", 40, 3600.0, 0),
            gauges("email", 3, 1.0, 0),
        ];
        let r = assess(&cfg, &s, &[]);
        assert_eq!(r.state, HealthState::Critical);
        assert_eq!(codes(&r), vec!["EFFECTS_LATE", "EFFECTS_DEAD_LETTERED"]);
        assert!(
            r.reasons[0].message.contains("kind emial"),
            "{:?}",
            r.reasons
        );
        assert!(r.reasons[1].message.contains("2 side effects of kind sms"));
    }

    #[test]
    fn dead_letters_warn() {
        let cfg = HealthConfig::default();
        let o = OutboxGauges {
            dead_letter: 1,
            ..Default::default()
        };
        let c = ConsumerGauges {
            dead_letter: 2,
            ..consumer("mail")
        };
        let r = assess(&cfg, &sample(0, o, vec![c]), &[]);
        assert_eq!(r.state, HealthState::Warning);
        assert_eq!(codes(&r), vec!["DEAD_LETTERS", "DEAD_LETTERS"]);
        assert!(r.reasons[1]
            .message
            .contains("mail has 2 failed events that need a decision"));
    }

    #[test]
    fn a_duplicate_rate_far_above_usual_warns() {
        let cfg = HealthConfig::default();
        let deliveries = |received: u64, duplicates: u64| ConsumerGauges {
            received,
            duplicates,
            ..consumer("mail")
        };
        // An hour of 1% duplicates …
        let usual: Vec<_> = (0..20)
            .map(|i| sample(i, outbox(0, None, 0.0), vec![deliveries(99, 1)]))
            .collect();
        let r = assess(
            &cfg,
            &sample(20, outbox(0, None, 0.0), vec![deliveries(99, 1)]),
            &usual,
        );
        assert_eq!(r.state, HealthState::Ok);
        assert_eq!(r.consumers[0].duplicate_rate, Some(0.01));

        // … then 30% in the recent window.
        let mut burst = usual.clone();
        for s in burst.iter_mut().skip(16) {
            s.consumers = vec![deliveries(70, 30)];
        }
        let r = assess(
            &cfg,
            &sample(20, outbox(0, None, 0.0), vec![deliveries(70, 30)]),
            &burst,
        );
        assert_eq!(
            (r.state, codes(&r)),
            (HealthState::Warning, vec!["DUPLICATE_RATE_HIGH"])
        );
        // Samples taken by two instances in turn, 12% in the recent ones: each instance counted
        // its own deliveries, so the rate is read over every instance's last samples (over this
        // instance's last five, older samples at 1% would dilute it to 7.6%, under the factor).
        let mut shared = usual.clone();
        for (i, s) in shared.iter_mut().enumerate() {
            s.instance = Some(if i % 2 == 0 { "a" } else { "b" }.into());
            if i >= 16 {
                s.consumers = vec![deliveries(88, 12)];
            }
        }
        let mut now = sample(20, outbox(0, None, 0.0), vec![deliveries(88, 12)]);
        now.instance = Some("a".into());
        let r = assess(&cfg, &now, &shared);
        assert_eq!(
            (r.state, codes(&r)),
            (HealthState::Warning, vec!["DUPLICATE_RATE_HIGH"])
        );
        assert!(r.reasons[0].message.contains("last 5 samples"));

        // A high rate that is usual for this consumer is not news.
        let always: Vec<_> = (0..20)
            .map(|i| sample(i, outbox(0, None, 0.0), vec![deliveries(70, 30)]))
            .collect();
        let r = assess(
            &cfg,
            &sample(20, outbox(0, None, 0.0), vec![deliveries(70, 30)]),
            &always,
        );
        assert_eq!(r.state, HealthState::Ok);

        // A handful of duplicates is below the minimum count.
        let r = assess(
            &cfg,
            &sample(0, outbox(0, None, 0.0), vec![deliveries(1, 3)]),
            &[],
        );
        assert_eq!(r.state, HealthState::Ok);
    }

    #[test]
    fn the_worst_reason_comes_first() {
        let cfg = HealthConfig::default();
        let o = OutboxGauges {
            dead_letter: 1,
            ..outbox(2, Some(1), 400.0)
        };
        let r = assess(&cfg, &sample(0, o, vec![]), &[]);
        assert_eq!(codes(&r), vec!["OUTBOX_LAG", "DEAD_LETTERS"]);
        assert_eq!(r.state, HealthState::Critical);
    }

    #[test]
    fn transitions_are_reported_once() {
        use HealthState::*;
        assert_eq!(transition(None, Ok), None);
        assert_eq!(transition(None, Warning), Some((None, Warning)));
        assert_eq!(transition(Some(Ok), Ok), None);
        assert_eq!(transition(Some(Ok), Critical), Some((Some(Ok), Critical)));
        assert_eq!(transition(Some(Critical), Ok), Some((Some(Critical), Ok)));
    }

    #[test]
    fn reports_round_trip_through_json() {
        let cfg = HealthConfig::default();
        let r = assess(
            &cfg,
            &sample(0, outbox(3, Some(1), 400.0), vec![consumer("a")]),
            &[],
        );
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["state"], "CRITICAL");
        assert_eq!(json["outbox"]["trend"], "UNKNOWN");
        let back: HealthReport = serde_json::from_value(json).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn invalid_configs_are_rejected() {
        assert!(HealthConfig::default().validate().is_ok());
        let bad = HealthConfig {
            outbox_warn_after: Duration::from_secs(600),
            ..HealthConfig::default()
        };
        assert!(bad.validate().is_err());
        let bad = HealthConfig {
            trend_samples: 1,
            ..HealthConfig::default()
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn durations_read_like_a_person_wrote_them() {
        assert_eq!(human(42.4), "42 s");
        assert_eq!(human(185.0), "3 min 5 s");
        assert_eq!(human(7800.0), "2 h 10 min");
    }
}
