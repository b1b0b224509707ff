//! The worker of one kind of side effect: claims due rows and records each call's outcome as
//! soon as it ends, fenced on the attempt it claimed. The worker and its database work run on
//! the runtime's thread; only the calls run on the effect's own thread. A call that blocks
//! that thread delays the next calls of its kind only: its timeout still fires here, and no
//! connection of the pool is driven by that thread.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use actix_rt::ArbiterHandle;
use futures_util::future::join_all;
use futures_util::FutureExt;

use super::{Effect, EffectConfig, Perform};
use crate::consumer::HandlerError;
use crate::error::{ErrorCode, Result};
use crate::event::redact::Redactor;
use crate::event::EventId;
use crate::messages::Drain;
use crate::store::effects::{self as stmt, Claimed, Failed, Outcome};
use crate::store::inbox::{error_text, truncate};
use crate::store::{self, PgPool};

/// What a worker is made of; the supervisor keeps it to start the worker again.
#[derive(Clone)]
pub(crate) struct EffectSpec {
    pub config: Arc<EffectConfig>,
    pub perform: Perform,
    pub redact: Redactor,
}

pub(crate) struct EffectWorker {
    pool: PgPool,
    spec: EffectSpec,
    /// The effect's thread, where the calls run.
    calls: ArbiterHandle,
    /// Set by `Drain`: the loop takes no new batch.
    draining: Rc<Cell<bool>>,
    /// The loop is between a claim and its last outcome.
    busy: Rc<Cell<bool>>,
}

impl EffectWorker {
    pub(crate) fn new(pool: PgPool, spec: EffectSpec, calls: ArbiterHandle) -> Self {
        EffectWorker {
            pool,
            spec,
            calls,
            draining: Rc::new(Cell::new(false)),
            busy: Rc::new(Cell::new(false)),
        }
    }
}

impl Actor for EffectWorker {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let (pool, spec, calls) = (self.pool.clone(), self.spec.clone(), self.calls.clone());
        let (draining, busy) = (self.draining.clone(), self.busy.clone());
        ctx.spawn(
            async move {
                let idle = spec.config.poll_interval;
                while !draining.get() {
                    let started = tokio::time::Instant::now();
                    busy.set(true);
                    let batch = run_batch(&pool, &spec, &calls).await;
                    busy.set(false);
                    // The pace: this batch's share of a second at the rate limit, before the
                    // next claim. Not busy meanwhile: a drain need not wait for it.
                    if let (Some(rate), Ok((_, rows))) = (spec.config.rate_limit, &batch) {
                        let share = Duration::from_secs_f64((*rows).max(1) as f64 / rate);
                        tokio::time::sleep_until(started + share).await;
                    }
                    match batch.map(|(full, _)| full) {
                        Ok(true) => {}
                        Ok(false) => tokio::time::sleep(idle).await,
                        Err(e) => {
                            tracing::warn!(
                                kind = %spec.config.kind, error = %e, code = %e.code(),
                                "side-effect claim failed; trying again"
                            );
                            tokio::time::sleep(idle).await;
                        }
                    }
                }
            }
            .into_actor(self),
        );
    }
}

impl Handler<Drain> for EffectWorker {
    type Result = ResponseFuture<()>;
    /// Takes no new batch, and resolves once every call in hand has recorded its outcome.
    fn handle(&mut self, _: Drain, _: &mut Context<Self>) -> Self::Result {
        self.draining.set(true);
        let busy = self.busy.clone();
        Box::pin(async move {
            while busy.get() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    }
}

/// Claims one batch and makes its calls, each recording its outcome as it ends. Returns
/// whether the batch was full (more are likely due), and how many rows it claimed.
async fn run_batch(
    pool: &PgPool,
    spec: &EffectSpec,
    calls: &ArbiterHandle,
) -> Result<(bool, usize)> {
    let cfg = &spec.config;
    let limit = cfg.claim_size();
    let max_attempts = i32::try_from(cfg.retry.max_attempts).unwrap_or(i32::MAX);
    let lease_ms = store::millis(cfg.lease());
    let claimed = with_conn(pool, async |c| {
        stmt::claim(c, &cfg.kind, i64::from(limit), lease_ms, max_attempts).await
    })
    .await?;
    let full = claimed.len() == limit as usize;
    let rows = claimed.len();
    join_all(
        claimed
            .into_iter()
            .map(|row| call_and_settle(pool, spec, calls, row)),
    )
    .await;
    Ok((full, rows))
}

/// Makes one call (unless the claim dead-lettered its row) and records its outcome.
async fn call_and_settle(pool: &PgPool, spec: &EffectSpec, calls: &ArbiterHandle, row: Claimed) {
    let cfg = &spec.config;
    if row.spent {
        tracing::error!(
            kind = %cfg.kind, key = %row.key, code = stmt::INTERRUPTED,
            "side effect dead-lettered: its worker stopped during its last attempt"
        );
        return;
    }
    let effect = Effect {
        id: row.id,
        kind: cfg.kind.clone(),
        key: row.key,
        payload: row.payload,
        attempt: u32::try_from(row.attempt_count).unwrap_or(0),
        event_id: row.event_id.map(EventId::from_uuid),
        correlation_id: row.correlation_id,
    };
    let (key, attempt) = (effect.key.clone(), effect.attempt);
    let result = call(spec, calls, effect).await;
    let outcome = outcome(spec, row.id, &key, attempt, result);
    match with_conn(pool, async |c| stmt::settle(c, &outcome).await).await {
        Ok(true) => {}
        Ok(false) => tracing::warn!(kind = %cfg.kind, %key, attempt,
            "side effect's outcome not recorded: its lease ran out and it was claimed again"),
        Err(e) => tracing::warn!(kind = %cfg.kind, %key, attempt, error = %e,
            "side effect's outcome not recorded; it is called again once its lease ends"),
    }
}

/// How long a claim or an outcome waits for a connection of the pool.
pub(crate) const POOL_WAIT: Duration = Duration::from_secs(5);

/// Runs `work` on a connection of `pool`, waiting at most [`POOL_WAIT`] for it and
/// [`store::DB_TIMEOUT`] for the work: together what a claimed row's lease allows for
/// recording its outcome beyond the call's timeout.
async fn with_conn<T>(
    pool: &PgPool,
    work: impl AsyncFnOnce(&mut diesel_async::AsyncPgConnection) -> Result<T>,
) -> Result<T> {
    let mut conn = tokio::time::timeout(POOL_WAIT, pool.get())
        .await
        .map_err(|_| crate::Error::DatabaseTimeout(POOL_WAIT))??;
    store::bounded(&mut conn, store::DB_TIMEOUT, work).await
}

/// Runs the call on the effect's thread, within the timeout, a panic caught as a failure.
async fn call(
    spec: &EffectSpec,
    calls: &ArbiterHandle,
    effect: Effect,
) -> std::result::Result<(), HandlerError> {
    let cfg = &spec.config;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (perform, timeout) = (spec.perform.clone(), cfg.timeout);
    let sent = calls.spawn_fn(move || {
        actix_rt::spawn(async move {
            // Bounded there too, so that a call past its timeout is dropped, not left running.
            let call = std::panic::AssertUnwindSafe(perform(effect)).catch_unwind();
            if let Ok(result) = tokio::time::timeout(timeout, call).await {
                let _ = tx.send(result);
            }
        });
    });
    if !sent {
        return Err(HandlerError::Retry {
            code: ErrorCode::EFFECT_PANICKED,
            message: "the effect's thread is gone".into(),
        });
    }
    // Here as well, for a call that blocks its thread (whose own timer then cannot fire).
    match tokio::time::timeout(cfg.timeout, rx).await {
        Ok(Ok(Ok(result))) => result,
        Ok(Ok(Err(_))) => Err(HandlerError::Retry {
            code: ErrorCode::EFFECT_PANICKED,
            message: "the call panicked".into(),
        }),
        Ok(Err(_)) | Err(_) => Err(HandlerError::Retry {
            code: ErrorCode::EFFECT_TIMEOUT,
            message: format!("the call did not finish within {:?}", cfg.timeout),
        }),
    }
}

/// A call's result as the outcome to record: done, due again after the policy's delay, or
/// dead-lettered (permanent, or out of attempts), as for a consumer.
fn outcome(
    spec: &EffectSpec,
    id: i64,
    key: &str,
    attempt: u32,
    result: std::result::Result<(), HandlerError>,
) -> Outcome {
    let cfg = &spec.config;
    let failed = result.err().map(|e| {
        let exhausted = cfg.retry.exhausted(attempt);
        let (dead, delay) = match &e {
            HandlerError::Permanent { .. } => (true, Duration::ZERO),
            HandlerError::RetryAfter { after, .. } => (exhausted, *after),
            _ => (exhausted, cfg.retry.delay(attempt, id as u64)),
        };
        let message = error_text(&spec.redact, e.message());
        if dead {
            tracing::error!(kind = %cfg.kind, key, attempt, code = %e.code(), error = %message,
                "side effect dead-lettered");
        } else {
            tracing::warn!(kind = %cfg.kind, key, attempt, code = %e.code(), error = %message,
                "side effect failed; retrying");
        }
        Failed {
            dead,
            delay_ms: crate::retry::delay_ms(delay),
            code: truncate(e.code().as_str(), 200),
            message,
        }
    });
    Outcome {
        id,
        attempt: i32::try_from(attempt).unwrap_or(i32::MAX),
        failed,
    }
}
