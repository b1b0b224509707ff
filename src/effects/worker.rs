//! The worker of one kind of side effect: claims due rows, makes each call outside any
//! transaction, records the outcomes fenced on the attempt. It runs on a thread of its own,
//! so a call that blocks its thread stops only this worker.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use futures_util::future::join_all;

use super::{Effect, EffectConfig, Perform};
use crate::consumer::HandlerError;
use crate::error::{ErrorCode, Result};
use crate::event::redact::Redactor;
use crate::event::EventId;
use crate::messages::Drain;
use crate::store::effects::{self as stmt, Failed, Outcome};
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
    /// Set by `Drain`: the loop takes no new batch.
    draining: Rc<Cell<bool>>,
    /// The loop is between a claim and its outcomes.
    busy: Rc<Cell<bool>>,
}

impl EffectWorker {
    pub(crate) fn new(pool: PgPool, spec: EffectSpec) -> Self {
        EffectWorker {
            pool,
            spec,
            draining: Rc::new(Cell::new(false)),
            busy: Rc::new(Cell::new(false)),
        }
    }
}

impl Actor for EffectWorker {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let (pool, spec) = (self.pool.clone(), self.spec.clone());
        let (draining, busy) = (self.draining.clone(), self.busy.clone());
        ctx.spawn(
            async move {
                let idle = spec.config.poll_interval;
                while !draining.get() {
                    busy.set(true);
                    let full = run_batch(&pool, &spec).await;
                    busy.set(false);
                    match full {
                        Ok(true) => {}
                        Ok(false) => tokio::time::sleep(idle).await,
                        Err(e) => {
                            tracing::warn!(
                                kind = %spec.config.kind, error = %e, code = %e.code(),
                                "side-effect batch failed; trying again"
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
    /// Takes no new batch, and resolves once the batch in hand has recorded its outcomes.
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

/// Claims, calls and records one batch. Returns whether the batch was full (more are likely
/// due).
async fn run_batch(pool: &PgPool, spec: &EffectSpec) -> Result<bool> {
    let cfg = &spec.config;
    let started = tokio::time::Instant::now();
    let limit = cfg.claim_size();
    let max_attempts = i32::try_from(cfg.retry.max_attempts).unwrap_or(i32::MAX);
    let claimed = {
        let mut conn = pool.get().await?;
        let lease_ms = store::millis(cfg.lease());
        store::bounded(&mut conn, store::DB_TIMEOUT, async |c| {
            stmt::claim(c, &cfg.kind, i64::from(limit), lease_ms, max_attempts).await
        })
        .await?
    };
    let full = claimed.len() == limit as usize;
    let (spent, calls): (Vec<_>, Vec<_>) = claimed.into_iter().partition(|c| c.spent);
    for s in &spent {
        tracing::error!(
            kind = %cfg.kind, key = %s.key, code = stmt::INTERRUPTED,
            "side effect dead-lettered: its worker stopped during its last attempt"
        );
    }
    let calls = calls.into_iter().map(|c| {
        let effect = Effect {
            id: c.id,
            kind: cfg.kind.clone(),
            key: c.key,
            payload: c.payload,
            attempt: u32::try_from(c.attempt_count).unwrap_or(0),
            event_id: c.event_id.map(EventId::from_uuid),
            correlation_id: c.correlation_id,
        };
        call(spec, effect)
    });
    let outcomes = join_all(calls).await;
    if !outcomes.is_empty() {
        let mut conn = pool.get().await?;
        store::bounded(&mut conn, store::DB_TIMEOUT, async |c| {
            stmt::settle(c, &outcomes).await
        })
        .await?;
    }
    // The pace: this batch's share of a second at the rate limit, before the next claim.
    if let Some(rate) = cfg.rate_limit {
        let share = Duration::from_secs_f64(limit as f64 / rate);
        tokio::time::sleep_until(started + share).await;
    }
    Ok(full)
}

/// Makes one call within the timeout and turns its result into an outcome.
async fn call(spec: &EffectSpec, effect: Effect) -> Outcome {
    let cfg = &spec.config;
    let (id, attempt, key) = (effect.id, effect.attempt, effect.key.clone());
    let seed = id as u64;
    let result = match tokio::time::timeout(cfg.timeout, (spec.perform)(effect)).await {
        Ok(r) => r,
        Err(_) => Err(HandlerError::Retry {
            code: ErrorCode::EFFECT_TIMEOUT,
            message: format!("the call did not finish within {:?}", cfg.timeout),
        }),
    };
    let failed = result.err().map(|e| {
        let exhausted = cfg.retry.exhausted(attempt);
        let (dead, delay) = match &e {
            HandlerError::Permanent { .. } => (true, Duration::ZERO),
            HandlerError::RetryAfter { after, .. } => (exhausted, *after),
            _ => (exhausted, cfg.retry.delay(attempt, seed)),
        };
        let message = crate::store::inbox::error_text(&spec.redact, e.message());
        if dead {
            tracing::error!(kind = %cfg.kind, %key, attempt, code = %e.code(), error = %message,
                "side effect dead-lettered");
        } else {
            tracing::warn!(kind = %cfg.kind, %key, attempt, code = %e.code(), error = %message,
                "side effect failed; retrying");
        }
        Failed {
            dead,
            delay_ms: crate::retry::delay_ms(delay),
            code: e.code().to_string(),
            message,
        }
    });
    Outcome {
        id,
        attempt: i32::try_from(attempt).unwrap_or(i32::MAX),
        failed,
    }
}
