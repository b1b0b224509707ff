//! The threads handlers run on, and a consumer's handler actors on them.
//!
//! The engine (consumer actors, the publisher, the reapers, maintenance) runs on the runtime's
//! thread and never waits for a handler's: each consumer's handler actors live on threads of
//! their own ([`ConsumerConfig::threads`](super::ConsumerConfig::threads)), one actor per
//! thread, each made on its thread by the consumer's factory. A handler that blocks its
//! thread delays the handlers on that thread only; the engine sees a call that takes long,
//! bounded by the handler's timeout as any other.
//!
//! The connection lent to a handler is driven by the runtime's thread, where the pool opened
//! it, and so is every connection a handler's thread asks the pool for itself
//! (`ConnectionConfig::manager` opens those on the runtime's thread): a blocked handler cannot
//! stall the statements of anyone the pool lends one of them to next.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use actix_rt::ArbiterHandle;
use tokio::sync::oneshot;

use super::actor::HandlerRef;
use super::ConsumerConfig;
use crate::error::{Error, Result};

/// Builds the user's handler actor on the thread it is called on. Called again whenever that
/// actor has died (a panic in its `handle` stops it, and so does the actor stopping itself).
pub(crate) type HandlerFactory = Arc<dyn Fn() -> HandlerRef + Send + Sync>;

/// The handler threads of one runtime, by group. Stopped when dropped (with the supervisor
/// that owns them): a thread stops once the handler running on it returns.
pub(crate) struct HandlerThreads(Vec<Arbiter>);

impl HandlerThreads {
    /// Starts the threads of every group `consumers` name, and returns each consumer's share:
    /// its group's threads, or for a consumer of `threads(0)` one place on the runtime's own
    /// thread (`None`).
    pub(crate) fn start(
        consumers: &[&ConsumerConfig],
    ) -> Result<(Self, Vec<Vec<Option<ArbiterHandle>>>)> {
        let mut sizes: BTreeMap<String, u32> = BTreeMap::new();
        for cfg in consumers.iter().filter(|c| c.thread_count() > 0) {
            let n = sizes.entry(cfg.group()).or_default();
            *n = (*n).max(cfg.thread_count());
        }
        let mut threads = HandlerThreads(Vec::new());
        let mut groups: BTreeMap<String, Vec<ArbiterHandle>> = BTreeMap::new();
        for (group, n) in sizes {
            let mut handles = Vec::with_capacity(n as usize);
            for _ in 0..n {
                let arbiter = Arbiter::try_new().map_err(|e| {
                    Error::Config(format!("could not start a handler thread for {group}: {e}"))
                })?;
                crate::store::open_connections_here_for(&arbiter.handle());
                handles.push(arbiter.handle());
                threads.0.push(arbiter);
            }
            groups.insert(group, handles);
        }
        let shares = consumers
            .iter()
            .map(|c| match groups.get(&c.group()) {
                Some(threads) if c.thread_count() > 0 => {
                    threads.iter().cloned().map(Some).collect()
                }
                _ => vec![None],
            })
            .collect();
        Ok((threads, shares))
    }
}

impl Drop for HandlerThreads {
    fn drop(&mut self) {
        for arbiter in &self.0 {
            arbiter.stop();
        }
    }
}

/// One consumer's handler actors, one per thread of its share. Each batch loop (and a replay)
/// is given the live actor whose thread the fewest loops use, so that with as many threads
/// as loops each loop has a thread of its own: a call never queues behind another loop's call
/// that blocks its thread, where its timeout would run out before the handler even began.
pub(crate) struct Handlers {
    factory: HandlerFactory,
    slots: Vec<Slot>,
    /// Where the search for the least used slot starts, so that ties are taken in turn.
    next: usize,
}

struct Slot {
    /// `None`: the runtime's own thread (`threads(0)`).
    thread: Option<ArbiterHandle>,
    state: State,
    /// The wait after the factory's next panic on this slot.
    backoff: Duration,
    /// Loops (and replays) using this slot's actor now, and calls of it parked past their
    /// timeout whose handler has not let go (its thread may be blocked by it).
    users: Rc<Cell<u32>>,
}

enum State {
    /// No actor: make one when asked.
    Empty,
    /// The factory runs on the thread.
    Making,
    /// The factory panicked: waiting to try it again.
    Resting,
    Ready(HandlerRef),
}

/// What a slot's making came to, for the consumer actor to apply ([`Handlers::made`]).
pub(crate) struct Made {
    slot: usize,
    handler: Option<HandlerRef>,
}

impl Handlers {
    pub(crate) fn new(factory: HandlerFactory, threads: Vec<Option<ArbiterHandle>>) -> Self {
        let slots = threads
            .into_iter()
            .map(|thread| Slot {
                thread,
                state: State::Empty,
                backoff: FIRST_BACKOFF,
                users: Rc::default(),
            })
            .collect();
        Handlers {
            factory,
            slots,
            next: 0,
        }
    }

    /// The live handler whose thread the fewest loops use (a thread a parked call may be
    /// blocking counts as used by many), and a use of its slot, counted until it is dropped. Slots whose actor is missing or died are returned in
    /// `make`, to be made on their threads ([`Handlers::make`]).
    pub(crate) fn pick(
        &mut self,
        consumer: &str,
        make: &mut Vec<usize>,
    ) -> Option<(SlotUse, HandlerRef)> {
        let n = self.slots.len();
        let mut best: Option<(usize, u32)> = None;
        for k in 0..n {
            let i = (self.next + k) % n;
            let slot = &mut self.slots[i];
            match &slot.state {
                State::Ready(h) if h.connected() => {
                    let users = slot.users.get();
                    if best.is_none_or(|(_, fewest)| users < fewest) {
                        best = Some((i, users));
                    }
                }
                State::Ready(_) => {
                    tracing::warn!(consumer, "handler actor stopped; starting a new one");
                    slot.state = State::Making;
                    make.push(i);
                }
                State::Empty => {
                    slot.state = State::Making;
                    make.push(i);
                }
                State::Making | State::Resting => {}
            }
        }
        let (i, _) = best?;
        self.next = (i + 1) % n;
        let slot = &self.slots[i];
        match &slot.state {
            State::Ready(h) => Some((SlotUse::new(&slot.users, 1, &slot.thread), h.clone())),
            _ => unreachable!("picked a live handler"),
        }
    }

    /// Runs the factory on slot `i`'s thread. A factory that panics is contained there; the
    /// answer says so.
    pub(crate) fn make(&self, i: usize) -> impl std::future::Future<Output = Made> + 'static {
        let (tx, rx) = oneshot::channel();
        let factory = self.factory.clone();
        let make = move || {
            let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| factory()));
            let _ = tx.send(made.ok());
        };
        let sent = match &self.slots[i].thread {
            Some(thread) => thread.spawn_fn(make),
            None => {
                make();
                true
            }
        };
        async move {
            let handler = if sent { rx.await.ok().flatten() } else { None };
            Made { slot: i, handler }
        }
    }

    /// Applies a making's answer. Returns the wait before slot `made.slot` may be tried again
    /// when the factory panicked (up to 30 s, growing), after which [`Handlers::rested`].
    pub(crate) fn made(&mut self, made: Made, consumer: &str) -> Option<(usize, Duration)> {
        let slot = &mut self.slots[made.slot];
        match made.handler {
            Some(h) => {
                slot.state = State::Ready(h);
                slot.backoff = FIRST_BACKOFF;
                None
            }
            None => {
                let wait = slot.backoff.min(Duration::from_secs(30));
                slot.backoff = (wait * 2).max(FIRST_BACKOFF);
                slot.state = State::Resting;
                tracing::error!(consumer, retry_in = ?wait,
                    "the handler factory panicked; the consumer tries it again later");
                Some((made.slot, wait))
            }
        }
    }

    /// Slot `i` may be made again.
    pub(crate) fn rested(&mut self, i: usize) {
        self.slots[i].state = State::Empty;
    }
}

const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// One use of a handler slot: by a batch loop (or a replay) while it runs, and by a call
/// parked past its timeout until its handler lets go (`lend::Hung::park` holds one made by
/// [`SlotUse::blocked`]). Counted while it lives; a parked call counts as [`BLOCKED`] uses,
/// since its handler may be blocking the slot's thread, so that a loop is given such a thread
/// only when every thread is blocked.
pub(crate) struct SlotUse {
    users: Rc<Cell<u32>>,
    weight: u32,
    /// The slot's thread; `None`: the runtime's own.
    pub(crate) thread: Option<ArbiterHandle>,
}

/// What a call parked past its timeout counts for on its slot.
const BLOCKED: u32 = 1 << 16;

impl SlotUse {
    fn new(users: &Rc<Cell<u32>>, weight: u32, thread: &Option<ArbiterHandle>) -> Self {
        users.set(users.get().saturating_add(weight));
        SlotUse {
            users: users.clone(),
            weight,
            thread: thread.clone(),
        }
    }

    /// A use of the same slot by a call parked past its timeout.
    pub(crate) fn blocked(&self) -> SlotUse {
        SlotUse::new(&self.users, BLOCKED, &self.thread)
    }
}

impl Drop for SlotUse {
    fn drop(&mut self) {
        self.users.set(self.users.get().saturating_sub(self.weight));
    }
}
