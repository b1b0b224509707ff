//! The supervisor's end of the lifecycle: graceful shutdown (drain, then stop) and the stop of
//! a start that failed half-way, each waiting until every child has stopped.

use std::future::Future;
use std::time::Duration;

use actix::prelude::*;
use futures_util::future::join_all;

use super::{Reply, SupervisorActor, STOP_WAIT};
use crate::messages::{Drain, Stop};

impl SupervisorActor {
    /// Tells every child to stop; the future resolves once all of them have stopped (or after
    /// [`STOP_WAIT`]), with whether they all did. Dead children stay dead from here on.
    ///
    /// Stopping an actor ends its in-flight futures: a batch cut off here rolls back (its
    /// connection is dropped mid-transaction) and is claimed again later.
    fn stop_children(&mut self) -> impl Future<Output = bool> + 'static {
        self.stopping = true;
        let mut alive: Vec<Box<dyn Fn() -> bool>> = Vec::new();
        for slot in &self.consumers {
            stop(slot.addr.as_ref(), &mut alive);
        }
        stop(self.publisher.as_ref(), &mut alive);
        stop(self.registry.as_ref(), &mut alive);
        stop(self.reconciler.as_ref(), &mut alive);
        stop(self.stats.as_ref(), &mut alive);
        // The listener's connection is its own, not the pool's: stopping it closes that
        // connection, so no LISTEN outlives the runtime.
        stop(self.listener.as_ref(), &mut alive);
        for slot in &self.effects {
            stop(slot.addr.as_ref(), &mut alive);
        }
        #[cfg(feature = "nats")]
        for slot in &self.receivers {
            stop(slot.addr.as_ref(), &mut alive);
        }
        until_stopped(move || alive.iter().any(|a| a()), STOP_WAIT)
    }
}

/// Sends `Stop` to `addr`, if any, and adds to `alive` a check of whether it is still running.
fn stop<A>(addr: Option<&Addr<A>>, alive: &mut Vec<Box<dyn Fn() -> bool>>)
where
    A: Actor<Context = Context<A>> + Handler<Stop>,
{
    if let Some(a) = addr {
        a.do_send(Stop { panic: false });
        let a = a.clone();
        // An address reports disconnected once its actor's mailbox is gone, that is once the
        // actor has stopped and been dropped.
        alive.push(Box::new(move || a.connected()));
    }
}

/// Waits until `alive` says no, checking every millisecond, for at most `limit`; returns
/// whether it said no in time.
pub(crate) async fn until_stopped(alive: impl Fn() -> bool, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while alive() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    true
}

/// Stop every child and then the supervisor, now, with nothing drained: for a start that
/// failed half-way.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct StopAll;

impl Handler<StopAll> for SupervisorActor {
    type Result = ResponseActFuture<Self, ()>;
    fn handle(&mut self, _: StopAll, _: &mut Context<Self>) -> Self::Result {
        Box::pin(
            self.stop_children()
                .into_actor(self)
                .map(|_, _, ctx| ctx.stop()),
        )
    }
}

/// Graceful shutdown: stop claiming everywhere, let the work in flight finish within the
/// deadline, stop.
#[derive(Message)]
#[rtype(result = "bool")]
pub(crate) struct Shutdown;

impl Handler<Shutdown> for SupervisorActor {
    /// Whether every drain finished before the deadline.
    type Result = ResponseActFuture<Self, bool>;
    fn handle(&mut self, _: Shutdown, _: &mut Context<Self>) -> Self::Result {
        self.stopping = true;
        // Every `Drain` is queued here, before any is awaited (`send` puts the message in the
        // mailbox at once): the publisher and every consumer stop claiming together, and
        // nobody starts new work while another drains.
        let mut drains: Vec<Reply> = Vec::new();
        if let Some(p) = &self.publisher {
            drains.push(Box::pin(p.send(Drain)));
        }
        for slot in &self.consumers {
            if let Some(c) = &slot.addr {
                drains.push(Box::pin(c.send(Drain)));
            }
        }
        // A side-effect worker records the outcomes of the calls in hand and claims no more.
        for slot in &self.effects {
            if let Some(w) = &slot.addr {
                drains.push(Box::pin(w.send(Drain)));
            }
        }
        // A receiver finishes the batch in hand (committed and acknowledged) and takes no more.
        #[cfg(feature = "nats")]
        for slot in &self.receivers {
            if let Some(r) = &slot.addr {
                drains.push(Box::pin(r.send(Drain)));
            }
        }
        let timeout = self.config.shutdown_timeout;
        // Then they drain side by side, each bounded by the same deadline: a publisher stuck
        // on a hung broker costs the consumers none of their time, nor one consumer another.
        // A drain that misses the deadline is cut off by the stop below.
        let drained = async move {
            let deadline = tokio::time::Instant::now() + timeout;
            let each = drains
                .into_iter()
                .map(|d| async move { tokio::time::timeout_at(deadline, d).await.is_ok() });
            join_all(each).await.into_iter().all(|finished| finished)
        };
        Box::pin(
            drained
                .into_actor(self)
                .then(|finished, act, _| {
                    let stopped = act.stop_children();
                    async move {
                        stopped.await;
                        // The rows of batches the deadline cut off go back unspent before
                        // this returns: a process exiting right after would otherwise leave
                        // their leases to be judged a death.
                        crate::consumer::batch::given_back(crate::store::DB_TIMEOUT).await;
                        finished
                    }
                    .into_actor(act)
                })
                .map(|finished, _, ctx| {
                    ctx.stop();
                    finished
                }),
        )
    }
}
