//! `ConsumerActor`: runs one consumer's batches. The mailbox carries wake-ups, not rows: the
//! rows are always claimed from the database, so a wake-up lost to a full mailbox or a restart
//! costs latency (until the next poll), never an event.

use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use actix::prelude::*;
use tokio::sync::oneshot;

use super::worker::{self, BatchOutcome, InFlight};
use super::{ConsumerConfig, Delivery, DeliveryBatch};
use crate::runtime::{Drain, Stop, Wake};
use crate::store::PgPool;

/// Builds the user's handler actor. Called again whenever that actor has died (a panic in its
/// `handle` stops it, and so does the actor stopping itself; the next delivery goes to a fresh
/// one).
pub(crate) type HandlerFactory = Rc<dyn Fn() -> HandlerRef>;

/// The user's handler actor, by the message it handles.
#[derive(Clone)]
pub(crate) enum HandlerRef {
    /// `Handler<Delivery>`: one event per call.
    One(Recipient<Delivery>),
    /// `Handler<DeliveryBatch>`: a batch's events in one call.
    Batch(Recipient<DeliveryBatch>),
}

impl HandlerRef {
    pub(crate) fn connected(&self) -> bool {
        match self {
            HandlerRef::One(r) => r.connected(),
            HandlerRef::Batch(r) => r.connected(),
        }
    }
}

pub(crate) struct ConsumerActor {
    /// Shared with the batch futures, which outlive a borrow of the actor.
    cfg: Arc<ConsumerConfig>,
    pool: PgPool,
    factory: HandlerFactory,
    /// The live handler; replaced through `factory` once it is found disconnected.
    handler: HandlerRef,
    /// The connection recording rows in flight; shared with the loops.
    rows_in_flight: InFlight,
    /// Batch loops running now; at most `cfg.concurrency`.
    in_flight: u32,
    /// A wake-up arrived that no running loop has answered yet: there may be due rows.
    want: bool,
    /// A running loop found a full batch: more rows are due than one loop takes at a time.
    backlog: bool,
    /// Set by `Drain`: start nothing new (graceful shutdown). Shared with the running loops so
    /// that they stop after their current batch instead of draining the whole backlog.
    draining: Arc<AtomicBool>,
    /// Who waits for the running loops to end.
    drained: Vec<oneshot::Sender<()>>,
    /// The one timer set for the soonest retry, and when it fires. One, not one per loop: a
    /// consumer failing every event at hundreds of loops a second would otherwise hold a timer
    /// per loop for as long as its retry delay (an hour, for `RetryAfter(1h)`).
    retry_timer: Option<(tokio::time::Instant, SpawnHandle)>,
}

impl ConsumerActor {
    pub(crate) fn new(cfg: Arc<ConsumerConfig>, pool: PgPool, factory: HandlerFactory) -> Self {
        let handler = factory();
        let rows_in_flight = InFlight::new(cfg.concurrency);
        ConsumerActor {
            cfg,
            pool,
            factory,
            handler,
            rows_in_flight,
            in_flight: 0,
            want: true,
            backlog: false,
            draining: Arc::new(AtomicBool::new(false)),
            drained: Vec::new(),
            retry_timer: None,
        }
    }

    fn pump(&mut self, ctx: &mut Context<Self>) {
        if self.draining.load(Ordering::Relaxed)
            || !self.want
            || self.in_flight >= self.cfg.concurrency
        {
            return;
        }
        // While a loop runs, a wake-up is folded into that loop's next batch (its end pumps
        // again): rows that trickle in share one transaction instead of each costing its own.
        // Only a backlog, a full batch, is worth another connection in parallel.
        if self.in_flight > 0 && !self.backlog {
            return;
        }
        self.want = false;
        self.backlog = false;
        if !self.handler.connected() {
            tracing::warn!(consumer = %self.cfg.name, "handler actor stopped; starting a new one");
            self.handler = (self.factory)();
        }
        // A loop that finds a full batch asks for another (up to `concurrency`).
        self.in_flight += 1;
        let (pool, cfg, handler) = (self.pool.clone(), self.cfg.clone(), self.handler.clone());
        let draining = self.draining.clone();
        let me = ctx.address().recipient();
        let rows = self.rows_in_flight.clone();
        let run = async move {
            let out = batch_loop(&pool, &cfg, &handler, &rows, &draining, &me).await;
            // Idle or stopping: no next batch will delete the finished batches' entries.
            if let Err(e) = rows.flush(&pool).await {
                tracing::debug!(consumer = %cfg.name, error = %e, "could not delete entries of finished batches");
            }
            out
        };
        ctx.spawn(run.into_actor(self).map(|outcome, act, ctx| {
            act.in_flight -= 1;
            act.after_loop(outcome, ctx);
        }));
    }

    fn after_loop(&mut self, outcome: LoopOutcome, ctx: &mut Context<Self>) {
        if let Some(delay) = outcome.next_retry {
            // Wake when the soonest retry falls due instead of waiting for the next poll.
            // At most a day ahead (the poll finds the row anyway), so the sum cannot overflow.
            let delay = delay.min(std::time::Duration::from_secs(86_400))
                + std::time::Duration::from_millis(2);
            let due = tokio::time::Instant::now() + delay;
            let sooner = match self.retry_timer {
                Some((at, _)) if at <= due => false,
                Some((_, handle)) => {
                    ctx.cancel_future(handle);
                    true
                }
                None => true,
            };
            if sooner {
                let handle = ctx.run_later(delay, |act, ctx| {
                    act.retry_timer = None;
                    act.want = true;
                    act.pump(ctx);
                });
                self.retry_timer = Some((due, handle));
            }
        }
        if outcome.handler_lost {
            self.want = true;
        }
        if self.in_flight == 0 && self.draining.load(Ordering::Relaxed) {
            for tx in self.drained.drain(..) {
                let _ = tx.send(());
            }
        }
        self.pump(ctx);
    }
}

#[derive(Debug, Default)]
struct LoopOutcome {
    next_retry: Option<std::time::Duration>,
    handler_lost: bool,
}

/// Runs batches until one comes back short (a full batch means more rows are probably due)
/// or a drain begins.
async fn batch_loop(
    pool: &PgPool,
    cfg: &ConsumerConfig,
    handler: &HandlerRef,
    in_flight: &InFlight,
    draining: &AtomicBool,
    me: &Recipient<Backlog>,
) -> LoopOutcome {
    let mut out = LoopOutcome::default();
    // Whether the next batch runs alone in the process (it hands over rows that an entry in
    // flight left behind).
    let mut exclusive = false;
    while !draining.load(Ordering::Relaxed) {
        let started = std::time::Instant::now();
        let batch = worker::run_batch(pool, cfg, handler, in_flight, exclusive).await;
        exclusive = batch.as_ref().is_ok_and(|b| b.exclusive);
        if let (Some(rate), Ok(b)) = (cfg.rate_limit, &batch) {
            // Pace this loop to its share of the consumer's rate: a backlog after an outage
            // drains at a steady rate instead of as a storm on whatever the handler calls.
            let share = rate / f64::from(cfg.concurrency);
            let min = std::time::Duration::try_from_secs_f64(b.claimed as f64 / share)
                .unwrap_or(std::time::Duration::MAX);
            let mut rest = min.saturating_sub(started.elapsed());
            // In steps, so that a drain does not wait out the pause (a batch of 32 at one
            // event a second pauses for half a minute).
            while !rest.is_zero() && !draining.load(Ordering::Relaxed) {
                let step = rest.min(std::time::Duration::from_millis(100));
                tokio::time::sleep(step).await;
                rest -= step;
            }
        }
        match batch {
            Ok(BatchOutcome {
                claimed,
                next_retry,
                handler_lost,
                abandoned,
                rolled_back,
                ..
            }) => {
                out.next_retry = match (out.next_retry, next_retry) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                if rolled_back && !handler_lost {
                    // Claim again at once: the rows' entry in flight makes the batch that gets
                    // them safe. A lost handler is replaced first.
                    continue;
                }
                if handler_lost {
                    out.handler_lost = true;
                    return out;
                }
                if claimed < cfg.batch_size as usize && !abandoned {
                    return out;
                }
                // A full batch: more rows are probably due; let another loop help.
                let _ = me.try_send(Backlog);
            }
            Err(e) => {
                // The database is unreachable or a statement failed; the poll tries again.
                tracing::warn!(consumer = %cfg.name, error = %e, code = %e.code(), "inbox batch failed");
                return out;
            }
        }
    }
    out
}

impl Actor for ConsumerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.set_mailbox_capacity(self.cfg.mailbox_capacity);
        ctx.run_interval(self.cfg.poll_interval, |act, ctx| {
            act.want = true;
            act.pump(ctx);
        });
        self.pump(ctx);
    }
}

impl Handler<Wake> for ConsumerActor {
    type Result = ();
    fn handle(&mut self, _: Wake, ctx: &mut Context<Self>) {
        self.want = true;
        self.pump(ctx);
    }
}

/// From a running loop that found a full batch: start another loop, up to `concurrency`.
#[derive(Message)]
#[rtype(result = "()")]
struct Backlog;

impl Handler<Backlog> for ConsumerActor {
    type Result = ();
    fn handle(&mut self, _: Backlog, ctx: &mut Context<Self>) {
        self.want = true;
        self.backlog = true;
        self.pump(ctx);
    }
}

impl Handler<Drain> for ConsumerActor {
    type Result = ResponseFuture<()>;
    fn handle(&mut self, _: Drain, _: &mut Context<Self>) -> Self::Result {
        self.draining.store(true, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        if self.in_flight == 0 {
            let _ = tx.send(());
        } else {
            self.drained.push(tx);
        }
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}

impl Handler<Stop> for ConsumerActor {
    type Result = ();
    fn handle(&mut self, stop: Stop, ctx: &mut Context<Self>) {
        if stop.panic {
            panic!("fault injection: consumer {} panicked", self.cfg.name);
        }
        ctx.stop();
    }
}
