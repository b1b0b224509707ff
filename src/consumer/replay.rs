//! Running the replays asked of this consumer ([`ops::replay`](crate::ops::replay)).
//!
//! *A step re-applies the next rows past a replay's cursor and moves the cursor in the same
//! transaction.* So each row of the range is re-applied once, whichever instance steps it and
//! whatever dies in between: a step that does not commit applied nothing. The step locks its
//! replay row (`SKIP LOCKED`), so instances take turns; it reads the consumer's inbox rows and
//! never writes them, so live deliveries neither wait for it nor see it. The rate limit is
//! the replay's `next_step_at`, also in the database.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::actor::HandlerRef;
use super::decide::{decide, handler_timed_out};
use super::pass::{begin, tm, upcast, Step};
use super::threads::SlotUse;
use super::{lend, ConsumerConfig, DeliveryMode, HandlerError};
use crate::error::Result;
use crate::store::inbox::InboxRow;
use crate::store::replay as stmt;
use crate::store::{self, OwnedConn, PgPool, DB_TIMEOUT};

/// How a step went.
enum StepEnd {
    /// A step ran (or failed and was recorded): the next may be due at once.
    Stepped,
    /// No replay is due: the soonest is due after this long (`None`: none is running).
    Wait(Option<Duration>),
    /// The handler actor died during the step.
    HandlerLost,
}

/// Steps this consumer's running replays until none is left or a drain begins; sleeps (up to
/// a poll interval at a time) while the next step waits for its rate. Returns whether the
/// handler actor was lost.
pub(crate) async fn run(
    pool: &PgPool,
    cfg: &ConsumerConfig,
    handler: &HandlerRef,
    used: &SlotUse,
    draining: &AtomicBool,
) -> bool {
    while !draining.load(Ordering::Relaxed) {
        match step(pool, cfg, handler, used).await {
            Ok(StepEnd::Stepped) => {}
            Ok(StepEnd::Wait(Some(wait))) => tokio::time::sleep(wait.min(cfg.poll_interval)).await,
            Ok(StepEnd::Wait(None)) => return false,
            Ok(StepEnd::HandlerLost) => return true,
            Err(e) => {
                // The step's transaction rolled back with its connection: nothing moved. The
                // next poll tries again.
                tracing::warn!(consumer = %cfg.name, error = %e, code = %e.code(), "replay step failed");
                return false;
            }
        }
    }
    false
}

async fn step(
    pool: &PgPool,
    cfg: &ConsumerConfig,
    handler: &HandlerRef,
    used: &SlotUse,
) -> Result<StepEnd> {
    let mut conn: OwnedConn = pool.get_owned().await?;
    let name = cfg.name.as_str();
    let wait = store::bounded(&mut conn, DB_TIMEOUT, async |c| {
        stmt::next_due(c, name).await
    })
    .await?;
    if wait != Some(Duration::ZERO) {
        return Ok(StepEnd::Wait(wait));
    }
    begin(&mut conn, cfg).await?;
    let locked = store::bounded(&mut conn, DB_TIMEOUT, async |c| {
        stmt::lock_due(c, name).await
    });
    let Some(stmt::Locked {
        id,
        attempts,
        rate,
        since,
        log,
    }) = locked.await?
    else {
        // Another instance is stepping it: look again after a poll interval.
        tm(&mut conn, Step::Rollback).await?;
        return Ok(StepEnd::Wait(Some(cfg.poll_interval)));
    };
    // A tenth of a second's worth of rows per step; one after a failure, so that the failing
    // row's attempts are its own.
    let limit = if attempts > 0 {
        1
    } else {
        (rate / 10.0).ceil().clamp(1.0, f64::from(cfg.batch_size)) as i64
    };
    // The events read through cursors first, then the inbox rows.
    let mut rows = store::bounded(&mut conn, DB_TIMEOUT, async |c| {
        stmt::rows(c, id, limit, log).await
    })
    .await?;
    let last = if log {
        Past::Log(rows.last().map(|r| r.event_id))
    } else {
        Past::Inbox(rows.last().map(|r| r.id))
    };
    if rows.is_empty() {
        // Nothing left past the cursor: on to the inbox rows, or done (failed if rows it
        // counted are gone).
        advance(&mut conn, id, last, 0).await?;
        return Ok(StepEnd::Stepped);
    }
    let walked = rows.len() as i64;
    if cfg.skip_stale {
        let stale = store::bounded(&mut conn, DB_TIMEOUT, async |c| {
            stmt::stale(c, cfg.name.as_str(), &rows).await
        })
        .await?;
        rows.retain(|r| !stale.contains(&r.event_id));
        if rows.is_empty() {
            // Walked past, as a live delivery of them would be: counted as done.
            advance(&mut conn, id, last, walked).await?;
            return Ok(StepEnd::Stepped);
        }
    }
    for row in &mut rows {
        if let Err(err) = upcast(cfg, row) {
            tm(&mut conn, Step::Rollback).await?;
            fail(&mut conn, cfg, id, row, &err).await?;
            return Ok(StepEnd::Stepped);
        }
    }
    let first = rows[0].clone_without_payload();
    let backend = first.backend;
    let call = lend::hand_over(cfg, handler, conn, &mut rows, 1, DeliveryMode::Replay).await;
    let lost = call.lost;
    let failure = match (call.result, call.conn) {
        (Ok(()), Some(mut conn)) => match advance(&mut conn, id, last, walked).await {
            Ok(()) => None,
            // A handler that swallowed a failed statement leaves a transaction that cannot
            // commit.
            Err(e) => {
                store::poison(&mut conn);
                drop(conn);
                let err = HandlerError::retry(format!("the replay step could not commit: {e}"));
                Some((pool.get_owned().await?, err))
            }
        },
        (Err(err), Some(mut conn)) => {
            tm(&mut conn, Step::Rollback).await?;
            Some((conn, err))
        }
        (result, None) => {
            // The handler still holds the connection (it overran its timeout), and with it the
            // step's transaction and the replay's lock; its thread counts as blocked. Past
            // the grace its session is ended, which lets go of both (a cancel waits for that
            // lock), and the step is recorded as failed; while the handler still runs (a
            // patience at most, as a live call's rows), the replay's next step is held off (so its rows are not applied twice
            // at once).
            // Once it lets go, the connection is closed.
            let err = result.err().unwrap_or_else(|| handler_timed_out(cfg));
            let slot = call.slot;
            let _blocked = used.blocked();
            let end_at = tokio::time::Instant::now() + lend::GRACE;
            let (mut ended, mut recorded) = (false, false);
            let mut held_off = None::<tokio::time::Instant>;
            while Arc::strong_count(&slot) > 1 {
                if !ended && tokio::time::Instant::now() >= end_at {
                    ended = lend::end_session(pool, cfg, backend, since).await;
                }
                // Held off first (for a patience at most, as a live call's rows stay leased),
                // then recorded, which never brings the next step closer.
                let holding = ended && end_at.elapsed() < super::decide::patience(cfg);
                if holding && held_off.is_none_or(|at| at.elapsed() >= HOLD_OFF / 4) {
                    held_off = Some(tokio::time::Instant::now());
                    if let Ok(mut conn) = pool.get().await {
                        let ms = store::millis(HOLD_OFF);
                        let _ = store::bounded(&mut conn, DB_TIMEOUT, async |c| {
                            stmt::hold_off(c, id, ms).await
                        })
                        .await;
                    }
                }
                if ended && !recorded {
                    recorded = async {
                        let mut conn = pool.get_owned().await?;
                        fail(&mut conn, cfg, id, &first, &err).await
                    }
                    .await
                    .inspect_err(|e| {
                        tracing::warn!(consumer = %cfg.name, replay = id, error = %e,
                            "could not record a hung replay step")
                    })
                    .is_ok();
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if let Some(mut held) = slot.write().await.take() {
                store::poison(&mut held);
            }
            if recorded {
                None
            } else {
                Some((pool.get_owned().await?, err))
            }
        }
    };
    if let Some((mut conn, err)) = failure {
        fail(&mut conn, cfg, id, &first, &err).await?;
    } else {
        tracing::debug!(consumer = %cfg.name, replay = id, walked, "replay step applied");
    }
    Ok(if lost {
        StepEnd::HandlerLost
    } else {
        StepEnd::Stepped
    })
}

/// How long a replay's next step is held off at a time while a step's handler hangs; renewed
/// until it lets go, so a process that dies meanwhile holds it off no longer than this.
const HOLD_OFF: Duration = Duration::from_secs(5);

/// Where a step leaves its walk: past this outbox event or inbox row, or (`None`) at the end
/// of that walk.
#[derive(Clone, Copy)]
enum Past {
    Log(Option<uuid::Uuid>),
    Inbox(Option<i64>),
}

/// Moves the cursor with the step's effects and commits them together.
async fn advance(conn: &mut OwnedConn, id: i64, past: Past, applied: i64) -> Result<()> {
    store::bounded(conn, DB_TIMEOUT, async |c| match past {
        Past::Log(last) => stmt::log_advance(c, id, last, applied).await,
        Past::Inbox(last) => stmt::advance(c, id, last, applied).await,
    })
    .await?;
    tm(conn, Step::Commit).await
}

/// Records a failed step, outside its (rolled back) transaction: retried by the consumer's
/// policy, or the replay ends FAILED.
async fn fail(
    conn: &mut OwnedConn,
    cfg: &ConsumerConfig,
    id: i64,
    row: &InboxRow,
    err: &HandlerError,
) -> Result<()> {
    let mut f = decide(&cfg.retry, row, err);
    tracing::warn!(consumer = %cfg.name, replay = id, event_id = %row.event_id,
        error_code = %f.code, error = %cfg.redact.apply(&f.message), ended = f.dead,
        "replay step failed");
    f.message = format!("event {}: {}", row.event_id, f.message);
    store::bounded(conn, DB_TIMEOUT, async |c| {
        stmt::failed(c, id, &f, &cfg.redact).await
    })
    .await
}
