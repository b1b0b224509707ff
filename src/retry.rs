//! Retry math: pure functions, tested without actors or a database.

use std::time::Duration;

use crate::error::Error;

/// How a consumer retries a failed event: at most `max_attempts` attempts in all, waiting
/// `base · factor^(n-1)` (capped at `cap`) after attempt `n`, spread by up to `jitter` of it.
///
/// The default is the shape operators know from production outboxes: 5 attempts, waiting
/// 2, 4, 8 and 16 minutes between them (a 5th failure dead-letters the event; the schedule's
/// next step, 32 minutes, would only be used with more attempts).
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    pub(crate) max_attempts: u32,
    pub(crate) base: Duration,
    pub(crate) factor: f64,
    pub(crate) cap: Duration,
    pub(crate) jitter: f64,
}

/// Setters, one per setting: start from the default and chain them; the runtime checks the
/// whole at start.
impl RetryPolicy {
    /// Attempts in all, including the first (≥ 1). Past it the event is dead-lettered.
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts;
        self
    }

    /// Wait after the first failure.
    pub fn base(mut self, base: Duration) -> Self {
        self.base = base;
        self
    }

    /// Growth per further failure (≥ 1.0).
    pub fn factor(mut self, factor: f64) -> Self {
        self.factor = factor;
        self
    }

    /// Longest wait.
    pub fn cap(mut self, cap: Duration) -> Self {
        self.cap = cap;
        self
    }

    /// Fraction of the wait (0.0–1.0) spread over events, so a burst of failures is not
    /// retried as a burst.
    pub fn jitter(mut self, jitter: f64) -> Self {
        self.jitter = jitter;
        self
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            base: Duration::from_secs(120),
            factor: 2.0,
            cap: Duration::from_secs(32 * 60),
            jitter: 0.1,
        }
    }
}

impl RetryPolicy {
    /// A policy waiting the same `delay` after each failure, without jitter.
    pub fn fixed(max_attempts: u32, delay: Duration) -> Self {
        RetryPolicy {
            max_attempts,
            base: delay,
            factor: 1.0,
            cap: delay,
            jitter: 0.0,
        }
    }

    /// Checks the invariants that the math relies on.
    pub fn validate(&self) -> Result<(), Error> {
        if self.max_attempts == 0 {
            return Err(Error::Config(
                "retry max_attempts must be at least 1".into(),
            ));
        }
        if !(self.factor >= 1.0 && self.factor.is_finite()) {
            return Err(Error::Config(format!(
                "retry factor {} must be ≥ 1",
                self.factor
            )));
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err(Error::Config(format!(
                "retry jitter {} must be within 0..=1",
                self.jitter
            )));
        }
        if self.cap < self.base {
            return Err(Error::Config("retry cap must not be below base".into()));
        }
        Ok(())
    }

    /// The wait after failed attempt `attempt` (1-based). `seed` picks the jitter: the same
    /// event and attempt always get the same wait, different events get different ones.
    pub fn delay(&self, attempt: u32, seed: u64) -> Duration {
        let exp = attempt.saturating_sub(1).min(64) as i32;
        let raw = self.base.as_secs_f64() * self.factor.powi(exp);
        let capped = raw.min(self.cap.as_secs_f64());
        // Jitter only shortens the wait, so a policy's documented wait is an upper bound.
        let spread = capped * self.jitter * unit_interval(seed ^ u64::from(attempt));
        // A cap near `Duration::MAX` rounds above it as a float: saturate, never panic.
        Duration::try_from_secs_f64((capped - spread).max(0.0)).unwrap_or(Duration::MAX)
    }

    /// Whether attempt number `attempt` (1-based, already counted) was the last one allowed.
    pub fn exhausted(&self, attempt: u32) -> bool {
        attempt >= self.max_attempts
    }
}

/// The longest wait a retry is stored with: ten years. A longer one (a `RetryAfter` of
/// `Duration::MAX`, a policy capped there) would overflow the database's interval arithmetic
/// and fail the mark itself, leaving the row to be claimed again at once, for ever.
pub(crate) const MAX_DELAY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// `delay` in whole milliseconds, at most [`MAX_DELAY`], as the marks bind it.
pub(crate) fn delay_ms(delay: Duration) -> i64 {
    delay.min(MAX_DELAY).as_millis() as i64
}

/// A deterministic value in [0, 1) from `seed` (splitmix64).
fn unit_interval(seed: u64) -> f64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_schedule_doubles_from_two_minutes() {
        let p = RetryPolicy {
            jitter: 0.0,
            ..RetryPolicy::default()
        };
        let mins: Vec<u64> = (1..=5).map(|n| p.delay(n, 7).as_secs() / 60).collect();
        assert_eq!(mins, vec![2, 4, 8, 16, 32]);
        assert!(!p.exhausted(4));
        assert!(p.exhausted(5));
    }

    #[test]
    fn cap_bounds_the_wait() {
        let p = RetryPolicy {
            jitter: 0.0,
            cap: Duration::from_secs(300),
            ..RetryPolicy::default()
        };
        assert_eq!(p.delay(10, 1), Duration::from_secs(300));
    }

    #[test]
    fn jitter_spreads_events_but_never_lengthens_a_wait() {
        let p = RetryPolicy::default();
        let waits: std::collections::HashSet<u128> = (0..100u64)
            .map(|seed| p.delay(1, seed).as_millis())
            .collect();
        assert!(
            waits.len() > 50,
            "jitter should spread 100 events, got {} waits",
            waits.len()
        );
        for seed in 0..100u64 {
            let d = p.delay(1, seed);
            assert!(d <= Duration::from_secs(120) && d >= Duration::from_secs(108));
            assert_eq!(d, p.delay(1, seed), "the same seed gives the same wait");
        }
    }

    #[test]
    fn invalid_policies_are_rejected() {
        assert!(RetryPolicy {
            max_attempts: 0,
            ..RetryPolicy::default()
        }
        .validate()
        .is_err());
        assert!(RetryPolicy {
            factor: 0.5,
            ..RetryPolicy::default()
        }
        .validate()
        .is_err());
        assert!(RetryPolicy {
            jitter: 2.0,
            ..RetryPolicy::default()
        }
        .validate()
        .is_err());
        assert!(RetryPolicy::default().validate().is_ok());
        assert!(RetryPolicy::fixed(3, Duration::from_millis(5))
            .validate()
            .is_ok());
    }
}
