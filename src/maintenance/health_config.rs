//! [`HealthConfig`]: the thresholds of the health check (`health.rs`).

use std::time::Duration;

/// Thresholds of the lag health check. Every setting has a setter that documents its default.
#[derive(Debug, Clone, PartialEq)]
pub struct HealthConfig {
    pub(crate) outbox_warn_after: Duration,
    pub(crate) outbox_critical_after: Duration,
    pub(crate) inbox_warn_after: Duration,
    pub(crate) inbox_critical_after: Duration,
    pub(crate) trend_samples: usize,
    pub(crate) duplicate_rate_factor: f64,
    pub(crate) duplicate_rate_floor: f64,
    pub(crate) duplicate_min_count: u64,
    pub(crate) snapshot_warn_after: Duration,
    pub(crate) snapshot_critical_after: Duration,
    pub(crate) log_held_warn_after: Duration,
}

/// Setters, one per setting: start from the default and chain them; the runtime checks the
/// whole at start.
impl HealthConfig {
    /// An outbox event waiting this long is a WARNING. Default 1 min.
    pub fn outbox_warn_after(mut self, outbox_warn_after: Duration) -> Self {
        self.outbox_warn_after = outbox_warn_after;
        self
    }

    /// … and this long CRITICAL. Default 5 min.
    pub fn outbox_critical_after(mut self, outbox_critical_after: Duration) -> Self {
        self.outbox_critical_after = outbox_critical_after;
        self
    }

    /// A consumer's oldest due inbox row waiting this long is a WARNING. Default 1 min.
    pub fn inbox_warn_after(mut self, inbox_warn_after: Duration) -> Self {
        self.inbox_warn_after = inbox_warn_after;
        self
    }

    /// … and this long CRITICAL (a paused consumer stays at WARNING). Default 5 min.
    pub fn inbox_critical_after(mut self, inbox_critical_after: Duration) -> Self {
        self.inbox_critical_after = inbox_critical_after;
        self
    }

    /// Samples of this instance (this one included) over which the outbox backlog must move:
    /// pending in all of them and the same oldest event at the head is CRITICAL
    /// (`OUTBOX_STUCK`); pending in all of them and growing is a WARNING (`OUTBOX_GROWING`).
    /// Default 5.
    pub fn trend_samples(mut self, trend_samples: usize) -> Self {
        self.trend_samples = trend_samples;
        self
    }

    /// The recent duplicate rate must be this many times the usual rate to warn. Default 10.
    pub fn duplicate_rate_factor(mut self, duplicate_rate_factor: f64) -> Self {
        self.duplicate_rate_factor = duplicate_rate_factor;
        self
    }

    /// … and at least this share of deliveries (0.0–1.0). Default 0.05.
    pub fn duplicate_rate_floor(mut self, duplicate_rate_floor: f64) -> Self {
        self.duplicate_rate_floor = duplicate_rate_floor;
        self
    }

    /// A session of the database (any role's, any application's) whose transaction has held a
    /// snapshot this long is a WARNING (`LONG_SNAPSHOT`, naming its pid, application, age and
    /// statement): vacuum removes nothing that died after it began, so every table bloats and
    /// each claim walks more dead entries. `pg_dump`, a long report and a stuck migration are
    /// the usual ones. Default 5 min. The role sees other roles' sessions only with
    /// `pg_read_all_stats` (or `pg_monitor`).
    pub fn snapshot_warn_after(mut self, after: Duration) -> Self {
        self.snapshot_warn_after = after;
        self
    }

    /// … and this long CRITICAL. Default 30 min.
    pub fn snapshot_critical_after(mut self, after: Duration) -> Self {
        self.snapshot_critical_after = after;
        self
    }

    /// A [cursor consumer](crate::ConsumerConfig::cursor) that has left an event unread past
    /// its cursor this long is a WARNING (`LOG_HELD`, naming it): the outbox is the cursors'
    /// shared log, and retention keeps it from that event on for every consumer, until the
    /// consumer reads it or retention moves it into the consumer's inbox
    /// ([`RetentionConfig::cursor_backlog_after`](crate::retention::RetentionConfig::cursor_backlog_after)).
    /// Default 1 hour.
    pub fn log_held_warn_after(mut self, after: Duration) -> Self {
        self.log_held_warn_after = after;
        self
    }

    /// … and at least this many duplicates in the recent samples. Default 20.
    pub fn duplicate_min_count(mut self, duplicate_min_count: u64) -> Self {
        self.duplicate_min_count = duplicate_min_count;
        self
    }
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            outbox_warn_after: Duration::from_secs(60),
            outbox_critical_after: Duration::from_secs(300),
            inbox_warn_after: Duration::from_secs(60),
            inbox_critical_after: Duration::from_secs(300),
            trend_samples: 5,
            duplicate_rate_factor: 10.0,
            duplicate_rate_floor: 0.05,
            duplicate_min_count: 20,
            snapshot_warn_after: Duration::from_secs(300),
            snapshot_critical_after: Duration::from_secs(1800),
            log_held_warn_after: Duration::from_secs(3600),
        }
    }
}

impl HealthConfig {
    pub(crate) fn validate(&self) -> crate::Result<()> {
        let bad = |why: &str| Err(crate::Error::Config(format!("health: {why}")));
        if self.outbox_warn_after > self.outbox_critical_after
            || self.inbox_warn_after > self.inbox_critical_after
            || self.snapshot_warn_after > self.snapshot_critical_after
        {
            return bad("a warning age must not exceed its critical age");
        }
        if self.trend_samples < 2 {
            return bad("trend_samples must be at least 2");
        }
        if !(self.duplicate_rate_factor >= 1.0 && self.duplicate_rate_factor.is_finite()) {
            return bad("duplicate_rate_factor must be at least 1");
        }
        if !(0.0..=1.0).contains(&self.duplicate_rate_floor) {
            return bad("duplicate_rate_floor must be within 0..=1");
        }
        Ok(())
    }
}
