//! Maintenance: metrics, the stats sampler, lag health, retention.

pub(crate) mod metrics;
