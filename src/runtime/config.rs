//! [`RuntimeConfig`]: the runtime-wide settings, their defaults and their check.

use std::time::Duration;

use super::contract;
use crate::error::{Error, Result};
use crate::event::redact::Redactor;
use crate::maintenance::{RetentionConfig, StatsConfig};

/// Runtime-wide settings. Every setting has a setter that documents its default.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    pub(crate) publish_batch_size: u32,
    pub(crate) poll_interval: Duration,
    pub(crate) publish_gap: Duration,
    pub(crate) supervise_interval: Duration,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) reconcile_interval: Duration,
    pub(crate) consistency_window: Duration,
    pub(crate) reconcile_dry_run: bool,
    pub(crate) listen: bool,
    pub(crate) stats: StatsConfig,
    pub(crate) retention: Option<RetentionConfig>,
    pub(crate) retention_interval: Duration,
    pub(crate) contract_check: contract::ContractCheck,
    pub(crate) contract_window: u32,
    pub(crate) pooler_check: bool,
    pub(crate) redact: Redactor,
}

/// Setters, one per setting: start from the default and chain them; the runtime checks the
/// whole at start.
impl RuntimeConfig {
    /// What a start does when what this build registers (consumers, event types, upcasters)
    /// does not match what the database holds: a subscription a consumer no longer lists, a
    /// stored version no upcaster lifts, a subscription to a type none of the newest events
    /// has (a likely typo). Default [`ContractCheck::Warn`](crate::health::ContractCheck::Warn):
    /// each finding is logged and reported by health (`CONTRACT_MISMATCH`) until a start finds
    /// it fixed; `Refuse` also fails the start.
    pub fn contract_check(mut self, contract_check: contract::ContractCheck) -> Self {
        self.contract_check = contract_check;
        self
    }

    /// How many of the newest outbox events the contract check reads for the stored types and
    /// versions. Default 10,000 (read along the primary key: the same cost on any table size).
    pub fn contract_window(mut self, contract_window: u32) -> Self {
        self.contract_window = contract_window;
        self
    }

    /// Outbox rows claimed and fanned out per statement. Default 1,000 (a backlog drained
    /// 5-10 % faster than with 500 in the benchmark; a claim returns counts, not rows, so the
    /// size costs no memory).
    pub fn publish_batch_size(mut self, publish_batch_size: u32) -> Self {
        self.publish_batch_size = publish_batch_size;
        self
    }

    /// How often the publisher claims without a wake-up: the delay for events committed by
    /// other processes. Default 250 ms.
    pub fn poll_interval(mut self, poll_interval: Duration) -> Self {
        self.poll_interval = poll_interval;
        self
    }

    /// The shortest time between the starts of two claim loops: a wake-up (or poll tick)
    /// sooner than that after the last one waits for the rest of it, so that a steady stream
    /// of commits is claimed several events at a time. A wake-up after a quiet spell claims at
    /// once, and a claim that comes back full is followed at once. An event that commits right
    /// after a claim waits up to this long more (plus the timer's millisecond rounding).
    /// Default 2 ms; zero claims on every wake-up. Must be shorter than `poll_interval`.
    pub fn publish_gap(mut self, publish_gap: Duration) -> Self {
        self.publish_gap = publish_gap;
        self
    }

    /// How often the supervisor looks for dead children. Default 100 ms.
    pub fn supervise_interval(mut self, supervise_interval: Duration) -> Self {
        self.supervise_interval = supervise_interval;
        self
    }

    /// How long shutdown waits for in-flight deliveries. Default 30 s.
    pub fn shutdown_timeout(mut self, shutdown_timeout: Duration) -> Self {
        self.shutdown_timeout = shutdown_timeout;
        self
    }

    /// How often the reconciler runs its checks. Default 60 s.
    pub fn reconcile_interval(mut self, reconcile_interval: Duration) -> Self {
        self.reconcile_interval = reconcile_interval;
        self
    }

    /// How late a follow-up may be before the reconciler's built-in checks call it drift.
    /// Default 5 min.
    pub fn consistency_window(mut self, consistency_window: Duration) -> Self {
        self.consistency_window = consistency_window;
        self
    }

    /// Reconcile rules only report drift, never repair it. Default false.
    pub fn reconcile_dry_run(mut self, reconcile_dry_run: bool) -> Self {
        self.reconcile_dry_run = reconcile_dry_run;
        self
    }

    /// Whether a start refuses a pool that goes through a pooler in transaction or statement
    /// mode (`POOLER_UNSUPPORTED`): it looks for the session moving between two backends. The
    /// runtime is not supported behind such a pooler; turn the check off only where it
    /// misreads a set-up that does keep sessions. Default true.
    pub fn pooler_check(mut self, pooler_check: bool) -> Self {
        self.pooler_check = pooler_check;
        self
    }

    /// Hold one connection in `LISTEN` (opened through the pool's manager, outside the
    /// pool, and closed when the runtime stops), so other instances' fan-outs (and
    /// [`notify_publishers`](crate::ops::notify_publishers) calls) wake this one at once instead of
    /// at its next poll. Default true.
    pub fn listen(mut self, listen: bool) -> Self {
        self.listen = listen;
        self
    }

    /// The stats sampler behind metrics gauges and lag health. Default [`StatsConfig::default`].
    pub fn stats(mut self, stats: StatsConfig) -> Self {
        self.stats = stats;
        self
    }

    /// Deletes old PUBLISHED outbox rows, PROCESSED inbox rows and idempotency keys on
    /// `retention_interval`; dead letters are never deleted. Default `None`: keep everything
    /// (enable it, or run [`Retention::run_once`](crate::retention::Retention::run_once) on a schedule of
    /// your own).
    pub fn retention(mut self, retention: RetentionConfig) -> Self {
        self.retention = Some(retention);
        self
    }

    /// How often retention runs when enabled: at start, then at this interval, and every second
    /// while a run leaves expired rows behind. Default 1 h.
    pub fn retention_interval(mut self, retention_interval: Duration) -> Self {
        self.retention_interval = retention_interval;
        self
    }

    /// What of an error message is stored and logged: every `last_error` (inbox, outbox,
    /// replays) and `reconcile_runs.error` is `redact(message)` cut to 2,000 characters, and
    /// the failure log lines carry `redact(message)`. Replaces the default,
    /// [`default_redactor`](crate::redact::default_redactor), which blanks what looks like a
    /// secret or an e-mail address; call it from `redact` to keep it. `redact` runs while a
    /// batch's transaction is open: keep it quick, with no I/O. One that panics stores
    /// `[redacted]` alone.
    pub fn redact_errors<F>(mut self, redact: F) -> Self
    where
        F: Fn(&str) -> String + Send + Sync + 'static,
    {
        self.redact = Redactor::custom(redact);
        self
    }
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            publish_batch_size: 1000,
            poll_interval: Duration::from_millis(250),
            publish_gap: Duration::from_millis(2),
            supervise_interval: Duration::from_millis(100),
            shutdown_timeout: Duration::from_secs(30),
            reconcile_interval: Duration::from_secs(60),
            consistency_window: Duration::from_secs(300),
            reconcile_dry_run: false,
            listen: true,
            stats: StatsConfig::default(),
            retention: None,
            retention_interval: Duration::from_secs(3600),
            redact: Redactor::default(),
            contract_check: contract::ContractCheck::Warn,
            contract_window: 10_000,
            pooler_check: true,
        }
    }
}

impl RuntimeConfig {
    pub(super) fn validate(&self) -> Result<()> {
        if self.publish_batch_size == 0 || self.publish_batch_size > 10_000 {
            return Err(Error::Config(
                "publish_batch_size must be within 1..=10000".into(),
            ));
        }
        let intervals = [
            self.poll_interval,
            self.supervise_interval,
            self.reconcile_interval,
            self.retention_interval,
        ];
        if intervals.iter().any(|d| d.is_zero()) {
            return Err(Error::Config("intervals must be positive".into()));
        }
        if self.publish_gap >= self.poll_interval {
            return Err(Error::Config(
                "publish_gap must be shorter than poll_interval".into(),
            ));
        }
        // Checked here, not only when used: an invalid one would otherwise turn retention off,
        // or the stats sampler to its defaults, with no more than a log line.
        if let Some(retention) = &self.retention {
            retention.validate()?;
        }
        self.stats.validate()
    }
}
