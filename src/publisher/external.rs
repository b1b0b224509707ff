//! The external-transport claim loop: lease a batch, publish each event with a timeout outside
//! any transaction, mark each outcome fenced on the lease token.

use std::time::Duration;

use super::transport::{ExternalConfig, Transport, TransportError};
use crate::error::{ErrorCode, Result};
use crate::event::OutboxEvent;
use crate::store::inbox::Failure;
use crate::store::lease::{self, LeasedRow};
use crate::store::scan::ScanStart;
use crate::store::{self, PgPool};
use crate::telemetry::metrics;
use futures_util::future::join_all;

/// Leases and publishes one batch. Returns whether to claim again at once: the batch was full,
/// or started past the start of the due index and came back short ([`ScanStart::answered`]), or
/// it was a row leased alone (others may be waiting to be published alone too).
pub(crate) async fn publish_batch(
    pool: &PgPool,
    transport: &dyn Transport,
    cfg: &ExternalConfig,
    scan: &ScanStart<i64>,
) -> Result<bool> {
    let lease_ms = crate::store::millis(cfg.lease);
    let started = tokio::time::Instant::now();
    let after = scan.next();
    let rows = {
        let mut conn = pool.get().await?;
        let limit = i64::from(cfg.claim_size());
        // On time-out the claim may have committed: its rows are then PROCESSING under a lease
        // nobody will mark, and the reaper returns them once it expires.
        let claimed = store::bounded(&mut conn, store::DB_TIMEOUT, async |c| {
            lease::claim_leased(c, &cfg.owner, limit, lease_ms, after).await
        })
        .await;
        if claimed.as_ref().is_err_and(timed_out) {
            drop(conn);
            store::sweep_idle(pool).await;
        }
        claimed?
    };
    let full = rows.len() == cfg.claim_size() as usize;
    let alone = rows.iter().any(|r| r.alone);
    let last = rows.iter().map(|r| r.seq).max();
    let more = scan.answered(after, last, full, alone) || alone;
    let published = rows.len();
    // Concurrently, so a whole batch finishes within one publish timeout and so within the
    // lease (validated to be longer); one at a time, a slow broker would make later rows of
    // the batch outlive their lease and be published twice.
    let results = join_all(
        rows.into_iter()
            .map(|row| publish_one(pool, transport, cfg, row)),
    )
    .await;
    if results.iter().any(|r| r.as_ref().is_err_and(timed_out)) {
        store::sweep_idle(pool).await;
    }
    // The pace: this batch's share of a second at the rate limit, before the next claim
    // (after a failed batch too, or each failure would make an unpaced one).
    if let Some(rate) = cfg.rate_limit {
        let share = Duration::from_secs_f64(published as f64 / rate);
        tokio::time::sleep_until(started + share).await;
    }
    for r in results {
        r?;
    }
    Ok(more)
}

fn timed_out(e: &crate::Error) -> bool {
    matches!(e, crate::Error::DatabaseTimeout(_))
}

async fn publish_one(
    pool: &PgPool,
    transport: &dyn Transport,
    cfg: &ExternalConfig,
    row: LeasedRow,
) -> Result<()> {
    let token = row.lease_token;
    let event = OutboxEvent::from(row);
    if event.attempt == 1 {
        // First seen committed: the claim reads only committed rows.
        crate::telemetry::event!(debug, "outbox.created", (&event).into());
    }
    crate::telemetry::event!(debug, "outbox.publish.started", (&event).into());
    // (error, whether it was our timeout): the code differs, the retry decision does not.
    let failure = match tokio::time::timeout(cfg.publish_timeout, transport.publish(&event)).await {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some((e, false)),
        Err(_) => Some((
            TransportError::Retryable(format!("no answer within {:?}", cfg.publish_timeout)),
            true,
        )),
    };
    let mut conn = pool.get().await?;
    // Bounded: a mark that never returns would keep the claim loop, and so the publisher, busy
    // for ever. A mark that timed out is left to the lease: once it expires the reaper returns
    // the row, and it is published again (a duplicate the inbox absorbs).
    let marked = store::bounded(&mut conn, store::DB_TIMEOUT, async |conn| match &failure {
        None => lease::mark_published(conn, event.id.as_uuid(), token).await,
        Some((err, timed_out)) => {
            let (dead, delay, code) = decide(cfg, &event, err, *timed_out);
            crate::telemetry::event!(warn, "outbox.publish.failed", (&event).into(),
                error_code = %code, error = %cfg.redact.apply(&err.to_string()), dead);
            let failure = Failure {
                dead,
                delay_ms: crate::retry::delay_ms(delay),
                code: code.as_str().to_owned(),
                message: err.to_string(),
            };
            lease::mark_failed(conn, event.id.as_uuid(), token, &failure, &cfg.redact).await
        }
    })
    .await?;
    // Counted once the mark is made: a publish whose lease was lost is made again by the row's
    // next owner, which counts it then.
    if !marked {
        // The lease expired and the row was reaped or claimed again: the newer owner
        // decides its fate. A publish we made meanwhile is a duplicate the inbox absorbs.
        tracing::warn!(event_id = %event.id, owner = %cfg.owner, "lease lost before the mark; nothing changed");
    } else if failure.is_none() {
        metrics::outbox_published(1);
        crate::telemetry::event!(debug, "outbox.published", (&event).into());
    } else {
        metrics::outbox_publish_failed(1);
    }
    Ok(())
}

/// Retry or dead letter, by error type and the attempt count already incremented at claim.
fn decide(
    cfg: &ExternalConfig,
    event: &OutboxEvent,
    err: &TransportError,
    timed_out: bool,
) -> (bool, Duration, ErrorCode) {
    match err {
        TransportError::Permanent { code, .. } => (true, Duration::ZERO, code.clone()),
        TransportError::Retryable(_) | TransportError::Timeout(_) => {
            let code = if timed_out || matches!(err, TransportError::Timeout(_)) {
                ErrorCode::OUTBOX_PUBLISH_TIMEOUT
            } else {
                ErrorCode::OUTBOX_PUBLISH_FAILED
            };
            if cfg.retry.exhausted(event.attempt) {
                (true, Duration::ZERO, code)
            } else {
                let (a, b) = event.id.as_uuid().as_u64_pair();
                (false, cfg.retry.delay(event.attempt, a ^ b), code)
            }
        }
    }
}
