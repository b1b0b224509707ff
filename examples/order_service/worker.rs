//! The notifications' side effect: sending one to the (fake) provider.
//!
//! The consumer and the reconciler record the intent (`effects::record`) in the transaction
//! that claims the notification's business key and writes its `notification_jobs` row; the
//! library's worker (`OutboxBuilder::effect`) makes the call outside any transaction, with
//! retries, and calls again after a crash. Each call carries the notification's key, which a
//! real provider takes as its idempotency key, so a notification sent twice (its DONE mark
//! was lost) reaches the customer once.

use std::time::Duration;

use actix_outbox::effects::{self, Effect, EffectConfig, NewEffect};
use actix_outbox::{HandlerError, RetryPolicy};
use diesel_async::AsyncPgConnection;

use crate::rng;

/// The kind of the notifications' side effect.
pub const SEND: &str = "notification.send";

/// How notifications are sent: 50 calls at once per instance, ten attempts at most (200 ms,
/// then doubling to 5 s) before a notification is dead-lettered for an operator.
pub fn config() -> EffectConfig {
    EffectConfig::new(SEND)
        .concurrency(50)
        .timeout(Duration::from_secs(5))
        .poll_interval(Duration::from_millis(100))
        .retry(
            RetryPolicy::default()
                .max_attempts(10)
                .base(Duration::from_millis(200))
                .factor(2.0)
                .cap(Duration::from_secs(5))
                .jitter(0.2),
        )
}

/// Records the intent to send the notification `key`, in the caller's transaction.
pub async fn record(
    conn: &mut AsyncPgConnection,
    order_id: &str,
    status: &str,
    key: &str,
) -> actix_outbox::Result<()> {
    let payload = serde_json::json!({ "order_id": order_id, "status": status });
    effects::record(conn, &NewEffect::new(SEND, key, payload)).await?;
    Ok(())
}

/// The fake provider: a few milliseconds of latency, then success or a failure at
/// `PROVIDER_FAIL_RATE`. A real one would get `effect.key()` as its idempotency key.
pub async fn send(effect: Effect, fail_rate: f64) -> Result<(), HandlerError> {
    let (latency, fail) = (rng::between(1, 8), rng::chance(fail_rate));
    actix_rt::time::sleep(Duration::from_millis(latency)).await;
    if fail {
        return Err(HandlerError::retry(format!(
            "provider refused {} (PROVIDER_FAIL_RATE)",
            effect.key()
        )));
    }
    Ok(())
}
