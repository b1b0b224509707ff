//! `ConsumerActor`: runs one consumer's batches and settles its expired leases. The mailbox carries wake-ups, not rows: the
//! rows are always claimed from the database, so a wake-up lost to a full mailbox or a restart
//! costs latency (until the next poll), never an event.

use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use tokio::sync::oneshot;

use super::batch::{self, BatchOutcome};
use super::lend::Hung;
use super::threads::{HandlerFactory, Handlers, SlotUse};
use super::{reap, replay, ConsumerConfig, Delivery, DeliveryBatch};
use crate::messages::{Drain, Wake};
use crate::store::inbox::Place;
use crate::store::scan::ScanStart;
use crate::store::PgPool;

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
    /// The handler actors, on the consumer's threads; made (again) when missing or dead.
    handlers: Handlers,
    /// This consumer's handlers parked past their timeout (see `lend.rs`).
    hung: Hung,
    /// Batch loops running now; at most `cfg.concurrency`.
    in_flight: u32,
    /// A reap of expired leases is running.
    reaping: bool,
    /// This consumer's replays are being stepped (`replay.rs`).
    replaying: bool,
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
    /// Set after a batch whose every event failed, for one poll interval: the consumer claims
    /// nothing meanwhile (see [`batch_loop`]).
    resting: bool,
    /// Where this consumer's claims start reading its due index (`store::scan`), shared by
    /// its loops.
    scan: Rc<ScanStart<Place>>,
}

impl ConsumerActor {
    pub(crate) fn new(
        cfg: Arc<ConsumerConfig>,
        pool: PgPool,
        factory: HandlerFactory,
        threads: Vec<Option<actix_rt::ArbiterHandle>>,
    ) -> Self {
        let hung = Hung::new(cfg.concurrency);
        ConsumerActor {
            cfg,
            pool,
            handlers: Handlers::new(factory, threads),
            resting: false,
            scan: Rc::new(ScanStart::new()),
            hung,
            in_flight: 0,
            reaping: false,
            replaying: false,
            want: true,
            backlog: false,
            draining: Arc::new(AtomicBool::new(false)),
            drained: Vec::new(),
            retry_timer: None,
        }
    }

    /// A live handler, on the thread the fewest loops use, and its slot, to be released when
    /// the loop ends. Handlers missing or dead are made
    /// on their threads meanwhile; each one made pumps again. A factory that panics is
    /// contained on its thread and tried again with a growing wait (up to 30 s), so that it
    /// costs this consumer only, never the supervisor.
    fn handler(&mut self, ctx: &mut Context<Self>) -> Option<(SlotUse, HandlerRef)> {
        let mut make = Vec::new();
        let found = self.handlers.pick(self.cfg.name.as_str(), &mut make);
        for i in make {
            let making = self.handlers.make(i);
            ctx.spawn(making.into_actor(self).map(|made, act, ctx| {
                if let Some((slot, wait)) = act.handlers.made(made, act.cfg.name.as_str()) {
                    ctx.run_later(wait, move |act, ctx| {
                        act.handlers.rested(slot);
                        act.want = true;
                        act.pump(ctx);
                    });
                } else {
                    act.want = true;
                    act.pump(ctx);
                    act.replay(ctx);
                }
            }));
        }
        found
    }

    fn pump(&mut self, ctx: &mut Context<Self>) {
        if self.draining.load(Ordering::Relaxed)
            || self.resting
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
        let Some((used, handler)) = self.handler(ctx) else {
            return;
        };
        self.want = false;
        self.backlog = false;
        // A loop that finds a full batch asks for another (up to `concurrency`).
        self.in_flight += 1;
        let (pool, cfg, hung) = (self.pool.clone(), self.cfg.clone(), self.hung.clone());
        let draining = self.draining.clone();
        let me = ctx.address().recipient();
        let scan = self.scan.clone();
        let run = async move {
            let looped = batch_loop(&pool, &cfg, &handler, &hung, &draining, &me, &used, &scan);
            looped.await
        };
        ctx.spawn(run.into_actor(self).map(move |outcome, act, ctx| {
            act.in_flight -= 1;
            act.after_loop(outcome, ctx);
        }));
    }

    /// Settles this consumer's expired leases, left by loops that died (anywhere). One reap
    /// at a time, on each poll.
    fn reap(&mut self, ctx: &mut Context<Self>) {
        if self.reaping {
            return;
        }
        self.reaping = true;
        let (pool, cfg) = (self.pool.clone(), self.cfg.clone());
        let run = async move { reap::reap(&pool, &cfg).await };
        ctx.spawn(run.into_actor(self).map(|reaped, act, ctx| {
            act.reaping = false;
            match reaped {
                Ok(0) => {}
                Ok(_) => {
                    act.want = true;
                    act.pump(ctx);
                }
                Err(e) => {
                    tracing::warn!(consumer = %act.cfg.name, error = %e, code = %e.code(), "could not settle expired leases");
                }
            }
        }));
    }

    /// Steps the replays asked of this consumer, if its code marks it replay-safe: one run at
    /// a time, beside the batch loops, until none is left. Looked for on each poll.
    fn replay(&mut self, ctx: &mut Context<Self>) {
        if !self.cfg.replay_safe || self.replaying || self.draining.load(Ordering::Relaxed) {
            return;
        }
        let Some((used, handler)) = self.handler(ctx) else {
            return;
        };
        self.replaying = true;
        let (pool, cfg, draining) = (self.pool.clone(), self.cfg.clone(), self.draining.clone());
        let run = async move {
            let lost = replay::run(&pool, &cfg, &handler, &used, &draining).await;
            drop(used);
            lost
        };
        ctx.spawn(run.into_actor(self).map(move |lost, act, ctx| {
            act.replaying = false;
            if lost {
                act.want = true;
                act.pump(ctx);
            }
        }));
    }

    fn after_loop(&mut self, outcome: LoopOutcome, ctx: &mut Context<Self>) {
        if let Some(delay) = outcome.next_retry {
            // Wake when the soonest retry falls due instead of waiting for the next poll.
            // At most a day ahead (the poll finds the row anyway), so the sum cannot overflow.
            let delay = delay.min(Duration::from_secs(86_400)) + Duration::from_millis(2);
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
        if outcome.failing && !self.resting {
            self.resting = true;
            ctx.run_later(self.cfg.poll_interval, |act, ctx| {
                act.resting = false;
                act.want = true;
                act.pump(ctx);
            });
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
    next_retry: Option<Duration>,
    handler_lost: bool,
    /// The last batch failed every event it handed over.
    failing: bool,
}

/// Runs batches until one whose claim read from the start comes back short (a full batch
/// means more rows are probably due, and a short one that started past the start leaves rows
/// behind it: [`ScanStart::answered`]), one fails every event it handed over, or a drain begins.
///
/// A batch that failed every event it handed over ends the loop, and its consumer then claims
/// nothing until a poll interval has passed, whatever wakes it. Such a consumer usually waits
/// on something down (a service, a credential, a bug in this build): at full speed its
/// retries would take the database's time from every other consumer and gain nothing. Its
/// events are retried all the same, a few per loop and poll (`decide::gives_up`).
#[allow(clippy::too_many_arguments)] // each a different piece of the consumer actor's state
async fn batch_loop(
    pool: &PgPool,
    cfg: &ConsumerConfig,
    handler: &HandlerRef,
    hung: &Hung,
    draining: &Arc<AtomicBool>,
    me: &Recipient<Backlog>,
    used: &SlotUse,
    scan: &ScanStart<Place>,
) -> LoopOutcome {
    let mut out = LoopOutcome::default();
    while !draining.load(Ordering::Relaxed) {
        let started = std::time::Instant::now();
        let batch = batch::run_batch(pool, cfg, handler, hung, draining, used, scan).await;
        if let (Some(rate), Ok(b)) = (cfg.rate_limit, &batch) {
            // Pace this loop to its share of the consumer's rate: a backlog after an outage
            // drains at a steady rate instead of as a storm on whatever the handler calls.
            let share = rate / f64::from(cfg.concurrency);
            let min =
                Duration::try_from_secs_f64(b.claimed as f64 / share).unwrap_or(Duration::MAX);
            let mut rest = min.saturating_sub(started.elapsed());
            // In steps, so that a drain does not wait out the pause (a batch of 32 at one
            // event a second pauses for half a minute).
            while !rest.is_zero() && !draining.load(Ordering::Relaxed) {
                let step = rest.min(Duration::from_millis(100));
                tokio::time::sleep(step).await;
                rest -= step;
            }
        }
        match batch {
            Ok(BatchOutcome {
                claimed,
                processed,
                failed,
                next_retry,
                handler_lost,
                alone,
                kept,
                more,
                ..
            }) => {
                out.next_retry = match (out.next_retry, next_retry) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                if handler_lost || kept {
                    // A new handler, or a thread not held by a parked call, for the next loop.
                    out.handler_lost = true;
                    return out;
                }
                // A short claim past the start is followed by one from it before the consumer
                // rests: rows behind the start may not fail.
                let behind = more && claimed < cfg.batch_size as usize;
                if failed > 0 && processed == 0 && !behind {
                    out.failing = true;
                    return out;
                }
                if alone {
                    // Rows claimed alone come one per batch: claim the next at once.
                    continue;
                }
                if cfg.ordered && processed > 0 {
                    // An ordered consumer's claim takes one event per aggregate: the events
                    // behind the ones just processed are due now.
                    continue;
                }
                if !more {
                    return out;
                }
                if claimed >= cfg.batch_size as usize {
                    // A full batch: more rows are probably due; let another loop help.
                    let _ = me.try_send(Backlog);
                }
            }
            Err(e) => {
                // The database is unreachable or a statement failed; the poll tries again. The
                // batch's lease, if it had one, is left to expire: the reaper settles it.
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
        // Polled only while actix drops a system that never ran it (a start-up that failed):
        // there is no runtime for timers then, and nothing to do.
        if tokio::runtime::Handle::try_current().is_err() {
            ctx.stop();
            return;
        }
        ctx.set_mailbox_capacity(self.cfg.mailbox_capacity);
        ctx.run_interval(self.cfg.poll_interval, |act, ctx| {
            act.want = true;
            act.reap(ctx);
            act.pump(ctx);
            act.replay(ctx);
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
