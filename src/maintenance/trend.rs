//! The outbox backlog's trend over the recent samples, for health: going down, steady,
//! growing or stuck, and how fast a backlog going down drains.

use super::health::{human, HealthConfig, Trend};
use crate::store::stats::Sample;

/// The last `trend_samples` samples, `current` included, oldest first: those of `current`'s
/// instance only, so that the window spans `trend_samples` of its intervals however many
/// instances sample (with the samples of all, four instances made it a quarter as long).
pub(super) fn trend_window<'a>(
    cfg: &HealthConfig,
    current: &'a Sample,
    previous: &'a [Sample],
) -> Vec<&'a Sample> {
    let mut window: Vec<&Sample> = previous
        .iter()
        .rev()
        .filter(|s| current.instance.is_none() || s.instance == current.instance)
        .take(cfg.trend_samples.saturating_sub(1))
        .collect();
    window.reverse();
    window.push(current);
    window
}

pub(super) fn span_seconds(window: &[&Sample]) -> f64 {
    match (window.first(), window.last()) {
        (Some(a), Some(b)) => (b.at - a.at).num_milliseconds().max(0) as f64 / 1000.0,
        _ => 0.0,
    }
}

/// For a backlog going down (a paced drain after an outage, say): how fast, and about how
/// long is left at that pace, so that a lag that is being worked off reads as such.
pub(super) fn draining(trend: Trend, window: &[&Sample]) -> String {
    let (Trend::Decreasing, Some(first), Some(last)) = (trend, window.first(), window.last())
    else {
        return String::new();
    };
    let span = span_seconds(window);
    let gone = (first.outbox.pending - last.outbox.pending) as f64;
    if span <= 0.0 || gone <= 0.0 {
        return String::new();
    }
    let rate = gone / span;
    format!(
        "; draining at {rate:.0}/s, about {} left at this pace",
        human(last.outbox.pending as f64 / rate)
    )
}

pub(super) fn outbox_trend(cfg: &HealthConfig, current: &Sample, previous: &[Sample]) -> Trend {
    if current.outbox.pending == 0 {
        return Trend::Empty;
    }
    let window = trend_window(cfg, current, previous);
    if window.len() < cfg.trend_samples || window.iter().any(|s| s.outbox.pending == 0) {
        return Trend::Unknown;
    }
    let first = &window[0].outbox;
    let last = &current.outbox;
    // The head is the oldest *due* row. A window in which some sample had nothing due (every
    // waiting row in its retry backoff) says nothing about the publisher.
    let head_stuck = window.iter().all(|s| s.outbox.head_seq.is_some())
        && window
            .windows(2)
            .all(|w| w[0].outbox.head_seq == w[1].outbox.head_seq);
    if last.pending < first.pending {
        Trend::Decreasing
    } else if head_stuck {
        Trend::Stuck
    } else if last.pending > first.pending {
        Trend::Growing
    } else {
        Trend::Steady
    }
}
