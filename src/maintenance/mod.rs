//! Maintenance: the stats sampler with its lag health check, and retention.
//!
//! - `stats` — the `StatsActor` that samples database gauges on an interval and assesses health.
//! - `health` — the health rules, as pure functions over samples.
//! - `retention` — bounded deletes of delivered history.

pub(crate) mod health;
mod health_config;
pub(crate) mod retention;
pub(crate) mod stats;
mod trend;

pub use health::{
    ConsumerHealth, HealthConfig, HealthReason, HealthReport, HealthState, OutboxHealth, Trend,
};
pub use retention::{Retention, RetentionConfig, RetentionReport};
pub use stats::{StatsConfig, StatsSampler};
