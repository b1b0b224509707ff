//! A cheap, thread-safe source of randomness for fault injection: a splitmix64 sequence over
//! one atomic counter. Not for anything that needs unpredictability.

use std::sync::atomic::{AtomicU64, Ordering};

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

static STATE: AtomicU64 = AtomicU64::new(GOLDEN);

/// Seeds from the clock and the process id, so a restarted service does not replay the
/// failure pattern of the one it replaced.
pub fn seed() {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    STATE.store(
        nanos ^ (u64::from(std::process::id()) << 32),
        Ordering::Relaxed,
    );
}

pub fn next_u64() -> u64 {
    let mut z = STATE
        .fetch_add(GOLDEN, Ordering::Relaxed)
        .wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// True with probability `p`.
pub fn chance(p: f64) -> bool {
    p > 0.0 && ((next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
}

/// A value within `lo..=hi`.
pub fn between(lo: u64, hi: u64) -> u64 {
    lo + next_u64() % (hi - lo + 1)
}
