//! The stats sampler: one `StatsActor` per runtime reads the gauges that need the database
//! (backlogs, oldest ages, dead letters) on an interval, so a Prometheus scrape or a dashboard
//! refresh never runs a count itself.
//!
//! Each run also assesses lag health ([`HealthReport`]) and stores sample and report in
//! `outbox_stats_samples`. Storing them, rather than keeping them in the actor, is what lets
//! the operator API of *any* instance show the same health, and lets the duplicate-rate check
//! look at the counts of every instance (each counts its own deliveries). The backlog's trend
//! is judged over the instance's own samples, which are an interval apart.
//! Samples older than [`StatsConfig::history`] are deleted by the sampler itself.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::prelude::*;

use super::health::{self, HealthConfig, HealthReport, HealthState};
use crate::error::{Error, Result};
use crate::store::stats::Sample;
use crate::store::{self, PgPool};
use crate::telemetry::metrics as m;

/// How the stats sampler runs. Every setting has a setter that documents its default.
#[derive(Debug, Clone, PartialEq)]
pub struct StatsConfig {
    pub(crate) interval: Duration,
    pub(crate) history: Duration,
    pub(crate) health: HealthConfig,
}

/// Setters, one per setting: start from the default and chain them; the runtime checks the
/// whole at start.
impl StatsConfig {
    /// How often the database gauges are sampled and health is assessed. Default 15 s.
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// How far back the "usual" duplicate rate looks; older samples are deleted. Default 1 h.
    pub fn history(mut self, history: Duration) -> Self {
        self.history = history;
        self
    }

    /// Health thresholds.
    pub fn health(mut self, health: HealthConfig) -> Self {
        self.health = health;
        self
    }
}

impl Default for StatsConfig {
    fn default() -> Self {
        StatsConfig {
            interval: Duration::from_secs(15),
            history: Duration::from_secs(3600),
            health: HealthConfig::default(),
        }
    }
}

impl StatsConfig {
    /// Checks the settings.
    ///
    /// # Errors
    /// [`Error::Config`] for an interval under 1 ms, a history shorter than the trend window, or
    /// invalid health thresholds.
    pub fn validate(&self) -> Result<()> {
        if self.interval < Duration::from_millis(1) {
            return Err(Error::Config("stats interval must be at least 1 ms".into()));
        }
        let window = u32::try_from(self.health.trend_samples)
            .ok()
            .and_then(|n| self.interval.checked_mul(n));
        if window.is_none_or(|w| self.history < w) {
            return Err(Error::Config(
                "stats history must cover at least trend_samples intervals".into(),
            ));
        }
        self.health.validate()
    }
}

/// Most samples a run reads back: an hour of samples from a dozen instances at the default
/// interval. Bounded so a misconfigured history cannot make each run read the whole table.
const HISTORY_LIMIT: i64 = 3000;
/// Most old samples one run deletes.
const PRUNE_BATCH: i64 = 1000;

/// Takes stats samples and assesses health. The runtime runs one inside its `StatsActor`;
/// tests and tools can call [`StatsSampler::run_once`] directly.
pub struct StatsSampler {
    pool: PgPool,
    config: StatsConfig,
    /// Written with each sample, so operators can tell instances' samples apart.
    instance: String,
    /// The state of the previous run, to log transitions only.
    last_state: Mutex<Option<HealthState>>,
}

impl StatsSampler {
    /// A sampler on `pool`.
    ///
    /// # Errors
    /// [`Error::Config`] when `config` is invalid ([`StatsConfig::validate`]).
    pub fn new(pool: PgPool, config: StatsConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self::unchecked(pool, config, instance_name()))
    }

    pub(crate) fn unchecked(pool: PgPool, config: StatsConfig, instance: String) -> Self {
        StatsSampler {
            pool,
            config,
            instance,
            last_state: Mutex::new(None),
        }
    }

    /// Samples the gauges once, assesses health against the stored history, stores both,
    /// updates the metric gauges, logs a warning if the health state changed, and deletes
    /// samples past the history.
    ///
    /// The counters that feed the duplicate rate are process-wide: the increments since the
    /// previous run (of any sampler in this process) are stored with this sample.
    ///
    /// # Errors
    /// [`Error::Database`] or [`Error::Pool`], or [`Error::DatabaseTimeout`] when a round trip
    /// got no answer in time (its connection is then closed); the increments taken are then put
    /// back for the next run.
    ///
    /// # Cancel safety
    /// Dropping the future loses at most the increments of this run from the stored samples
    /// (the metric counters themselves are unaffected).
    pub async fn run_once(&self) -> Result<HealthReport> {
        let mut conn = self.pool.get().await?;
        // Each round trip is bounded, so that a connection cut mid-run cannot keep the sampler
        // busy (and skipping every tick) for ever.
        let mut sample = store::bounded(&mut conn, store::DB_TIMEOUT, async |c| {
            store::stats::snapshot(c, self.config.health.snapshot_warn_after).await
        })
        .await?;
        sample.instance = Some(self.instance.clone());
        let deltas = m::take_deltas();
        let stored = async {
            add_deltas(&mut sample, &deltas);
            let history = self.config.history;
            let previous: Vec<Sample> = store::bounded(&mut conn, store::DB_TIMEOUT, async |c| {
                store::stats::recent_samples(c, history, HISTORY_LIMIT).await
            })
            .await?
            .into_iter()
            // A row this version cannot read (written by a newer one) is skipped.
            .filter_map(|v| serde_json::from_value(v).ok())
            .collect();
            let report = health::assess(&self.config.health, &sample, &previous);
            let sample_json = serde_json::to_value(&sample).unwrap_or_default();
            let report_json = serde_json::to_value(&report).unwrap_or_default();
            store::bounded(&mut conn, store::DB_TIMEOUT, async |c| {
                store::stats::insert_sample(
                    c,
                    &self.instance,
                    self.config.interval,
                    &sample_json,
                    &report_json,
                )
                .await
            })
            .await?;
            Ok::<_, Error>(report)
        }
        .await;
        let report = match stored {
            Ok(r) => r,
            Err(e) => {
                m::give_back(deltas);
                return Err(e);
            }
        };
        let keep = self
            .config
            .history
            .saturating_add(self.config.interval.saturating_mul(2));
        let pruned = store::bounded(&mut conn, store::DB_TIMEOUT, async |c| {
            store::stats::prune_samples(c, keep, PRUNE_BATCH).await
        })
        .await;
        if let Err(e) = pruned {
            // The sample is stored; old ones go at the next run.
            tracing::warn!(error = %e, code = %e.code(), "pruning old stats samples failed");
        }
        drop(conn);
        set_gauges(&sample, &report);
        self.log_transition(&report);
        Ok(report)
    }

    fn log_transition(&self, report: &HealthReport) {
        let mut last = self.last_state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((from, to)) = health::transition(*last, report.state) {
            let reasons: Vec<String> = report
                .reasons
                .iter()
                .map(|r| format!("{} {}: {}", r.state, r.code, r.message))
                .collect();
            tracing::warn!(
                name: "health.changed",
                from = from.map(|s| s.as_str()).unwrap_or("NONE"),
                to = to.as_str(),
                reasons = %reasons.join("; "),
                "health.changed: outbox lag health is now {to}"
            );
        }
        *last = Some(report.state);
    }
}

/// A name for a sampler's samples: readable (host and process), and unique by its random part,
/// since the host is often unknown (`HOSTNAME` unset) and every container's process may be 1.
/// The backlog's trend is judged over the samples of one name only.
pub(crate) fn instance_name() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "local".into());
    // A v7 id's last hex digits are random.
    let id = uuid::Uuid::now_v7().simple().to_string();
    format!("{host}:{}:{}", std::process::id(), &id[24..])
}

fn add_deltas(sample: &mut Sample, deltas: &m::Deltas) {
    sample.outbox.published = deltas.published;
    sample.outbox.publish_failed = deltas.publish_failed;
    for c in &mut sample.consumers {
        if let Some(d) = deltas.consumers.get(&c.consumer) {
            c.received = d.received;
            c.processed = d.processed;
            c.duplicates = d.duplicates;
            c.failed = d.failed;
            c.dead_lettered = d.dead_lettered;
            c.sessions_ended = d.sessions_ended;
        }
    }
}

fn set_gauges(sample: &Sample, report: &HealthReport) {
    let o = &sample.outbox;
    metrics::gauge!(m::OUTBOX_PENDING).set(o.pending as f64);
    metrics::gauge!(m::OUTBOX_RETRY_PENDING).set(o.retrying as f64);
    metrics::gauge!(m::OUTBOX_PROCESSING).set(o.processing as f64);
    metrics::gauge!(m::OUTBOX_DEAD_LETTER).set(o.dead_letter as f64);
    metrics::gauge!(m::OUTBOX_UNROUTED).set(o.unrouted as f64);
    metrics::gauge!(m::OUTBOX_OLDEST_PENDING_AGE).set(o.oldest_pending_age_seconds);
    metrics::gauge!(m::OUTBOX_HEALTH_STATE).set(report.state.level());
    // Registering the counters at zero makes "nothing happened" visible as 0, not as absent.
    metrics::counter!(m::OUTBOX_PUBLISHED_TOTAL).increment(0);
    metrics::counter!(m::OUTBOX_FAILED_TOTAL).increment(0);
    for c in &sample.consumers {
        let name = c.consumer.clone();
        for counter in [
            m::INBOX_RECEIVED_TOTAL,
            m::INBOX_PROCESSED_TOTAL,
            m::INBOX_DUPLICATE_TOTAL,
            m::INBOX_FAILED_TOTAL,
            m::INBOX_DEAD_LETTERED_TOTAL,
        ] {
            metrics::counter!(counter, "consumer" => name.clone()).increment(0);
        }
        metrics::gauge!(m::INBOX_BACKLOG, "consumer" => name.clone()).set(c.backlog as f64);
        metrics::gauge!(m::INBOX_RETRY_PENDING, "consumer" => name.clone()).set(c.retrying as f64);
        metrics::gauge!(m::INBOX_DEAD_LETTER, "consumer" => name.clone()).set(c.dead_letter as f64);
        metrics::gauge!(m::INBOX_OLDEST_DUE_AGE, "consumer" => name.clone())
            .set(c.oldest_due_age_seconds);
        metrics::gauge!(m::INBOX_PAUSED, "consumer" => name).set(if c.paused { 1.0 } else { 0.0 });
    }
}

/// Runs the [`StatsSampler`] on its interval. Started (and restarted, should it die) by the
/// supervisor; it stops by itself once the supervisor has let go of it.
pub(crate) struct StatsActor {
    sampler: Arc<StatsSampler>,
    interval: Duration,
    /// A run is in flight; a tick now is skipped rather than queued behind a slow database.
    busy: bool,
}

impl StatsActor {
    /// `config` should have been validated when the runtime was built; an invalid one is
    /// replaced by the defaults rather than stopping the runtime.
    /// `instance` names its samples; the supervisor keeps one name across restarts of this
    /// actor, so that the trend goes on over them.
    pub(crate) fn new(pool: PgPool, config: StatsConfig, instance: String) -> Self {
        let config = match config.validate() {
            Ok(()) => config,
            Err(e) => {
                tracing::error!(error = %e, "invalid stats config; using the defaults");
                StatsConfig::default()
            }
        };
        StatsActor {
            interval: config.interval,
            sampler: Arc::new(StatsSampler::unchecked(pool, config, instance)),
            busy: false,
        }
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        if self.busy {
            return;
        }
        self.busy = true;
        let sampler = self.sampler.clone();
        let run = async move {
            if let Err(e) = sampler.run_once().await {
                tracing::warn!(error = %e, code = %e.code(), "stats sample failed");
            }
        };
        ctx.spawn(run.into_actor(self).map(|(), act, _| act.busy = false));
    }
}

impl Actor for StatsActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        m::describe();
        ctx.run_interval(self.interval, |act, ctx| {
            // The supervisor holds the only address: once it is gone (shutdown), so is this.
            if !ctx.connected() {
                ctx.stop();
                return;
            }
            act.tick(ctx);
        });
        self.tick(ctx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_stats_configs_are_rejected() {
        assert!(StatsConfig::default().validate().is_ok());
        let c = StatsConfig {
            interval: Duration::ZERO,
            ..StatsConfig::default()
        };
        assert!(c.validate().is_err());
        let c = StatsConfig {
            history: Duration::from_secs(30), // shorter than 5 samples of 15 s
            ..StatsConfig::default()
        };
        assert!(c.validate().is_err());
        let mut c = StatsConfig::default();
        c.health.trend_samples = usize::MAX;
        assert!(
            c.validate().is_err(),
            "an overflowing window is an error, not a panic"
        );
    }

    #[test]
    fn increments_land_on_their_consumer() {
        let mut sample = Sample {
            consumers: vec![
                crate::store::stats::ConsumerGauges {
                    consumer: "a".into(),
                    ..Default::default()
                },
                crate::store::stats::ConsumerGauges {
                    consumer: "b".into(),
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let mut deltas = m::Deltas {
            published: 7,
            ..Default::default()
        };
        deltas.consumers.insert(
            "b".into(),
            m::ConsumerDeltas {
                received: 3,
                duplicates: 1,
                ..Default::default()
            },
        );
        add_deltas(&mut sample, &deltas);
        assert_eq!(sample.outbox.published, 7);
        assert_eq!(
            (sample.consumers[0].received, sample.consumers[1].received),
            (0, 3)
        );
        assert_eq!(sample.consumers[1].duplicates, 1);
    }
}
