//! A fast pass's calls, run back to back on the handler's own thread.
//!
//! A handler on a thread of its own ([`ConsumerConfig::threads`]) costs two thread hops per
//! call when the batch calls it from the runtime's thread: the call, and its answer. For a
//! handler of one event per call those hops were most of what its own thread cost
//! (`docs/performance.md`, "What crossing threads costs"). So a fast pass of such a handler
//! hands the whole run of its rows to a *relay* on the handler's thread, which makes the calls
//! there, each as [`lend::hand_over`] makes one, and answers once: two hops per batch.
//!
//! The runtime's thread keeps the clock. Everything the run has decided lives in a [`Watch`]
//! both threads lock: the rows not yet offered, those processed, the row being handled, and
//! since when the relay has owed progress (from the hand-over until its first row, then from
//! each row's start). **Whatever the relay owes ends once, under that lock: by the relay when
//! the handler answers, or by the runtime's thread when the relay has owed it for the
//! handler's timeout and [`MARGIN`]** — something holds the thread the relay runs on (this
//! handler, blocking it, or another on a shared thread), and the relay's own timer cannot fire.
//! The runtime's thread then *cuts* the run: it takes the rows out of the watch and ends the
//! row being handled as a call that timed out, as if it had made the call itself (the pass
//! parks it as any other call that overran); cut before any call, every row goes back
//! uncharged. Should the relay run again, it finds the run cut and drops what it holds. The
//! relay's task holds a *life* slot, so that a cut run is parked until that task is over.
//! A run whose batch is dropped (its consumer actor died) is cut too, so that no orphaned
//! relay goes on calling the handler for rows given back to the next batch.
//!
//! No user code runs under the lock, so the runtime's thread never waits for a handler.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use actix_rt::ArbiterHandle;
use tokio::sync::{oneshot, RwLock};
use tracing::Instrument;

use super::actor::HandlerRef;
use super::decide::{self, handler_timed_out};
use super::lend::{self, Call, Slot};
use super::pass::lift;
use super::{ConsumerConfig, DeliveryMode};
use crate::store::inbox::{InboxRow, Outcome};
use crate::store::OwnedConn;

/// What a run came to.
pub(super) struct Run {
    /// Rows decided without a call (their payload could not be read).
    pub outcomes: Vec<Outcome>,
    /// Rows whose call returned Ok, in order, their effects in the pass's transaction.
    pub processed: Vec<InboxRow>,
    /// Rows never offered.
    pub left: Vec<InboxRow>,
    /// The handler actor was found dead before a call.
    pub lost: bool,
    pub end: End,
}

#[allow(clippy::large_enum_variant)] // one per batch, moved once
pub(super) enum End {
    /// The run handed over every row it could (see [`Run::left`]); the connection is back.
    Conn(OwnedConn),
    /// A call that did not end cleanly (a failure, a timeout, a connection kept), for the pass
    /// to decide as it decides its own calls.
    Call(Box<(InboxRow, Call)>),
    /// Nothing the run did can commit, and no row of it was at fault: the relay never began
    /// (its thread was held past the handler's timeout), or its thread stopped and dropped it
    /// with the connection. Every row goes back; the slot lives as long as the relay's task.
    GivenBack(Slot),
}

/// A run's state, shared by the relay and the runtime's thread.
#[derive(Default)]
struct Watch {
    rows: VecDeque<InboxRow>,
    processed: Vec<InboxRow>,
    outcomes: Vec<Outcome>,
    /// Since when the relay has owed progress; `None` between rows and once it answered.
    since: Option<Instant>,
    current: Option<Current>,
    /// The run is over for the runtime's thread (cut, or its batch dropped): the relay stops.
    cut: bool,
    lost: bool,
}

/// The row being handled, and its connection slot once its call is made (weak: it must not
/// count as one of the slot's holders).
struct Current {
    row: InboxRow,
    slot: Weak<RwLock<Option<OwnedConn>>>,
}

/// How long past its timeout the relay may owe progress before the runtime's thread ends the
/// run itself: the time a call that failed without an answer takes to learn whether the
/// handler actor died (`lend::call`), and a little more.
pub(super) const MARGIN: Duration = Duration::from_millis(600);

fn lock(watch: &Mutex<Watch>) -> MutexGuard<'_, Watch> {
    // Nothing panics while holding it; a poisoned lock is still a consistent watch.
    watch.lock().unwrap_or_else(|e| e.into_inner())
}

/// Cuts the run when the runtime's side of it ends, however it ends: a relay that has not
/// answered then stops before its next row.
struct CutOnDrop<'a>(&'a Mutex<Watch>);

impl Drop for CutOnDrop<'_> {
    fn drop(&mut self) {
        lock(self.0).cut = true;
    }
}

/// Runs the calls of `rows` (lent `conn`, in the pass's transaction) on `thread`, one row per
/// call. Gives the inputs back if the thread no longer runs anything.
pub(super) async fn run(
    thread: &ArbiterHandle,
    cfg: &ConsumerConfig,
    handler: &HandlerRef,
    conn: OwnedConn,
    rows: Vec<InboxRow>,
    started: Instant,
    draining: &Arc<AtomicBool>,
) -> Result<Run, (OwnedConn, Vec<InboxRow>)> {
    let watch = Arc::new(Mutex::new(Watch {
        rows: rows.into(),
        since: Some(Instant::now()),
        ..Default::default()
    }));
    let life: Slot = Arc::default();
    let (give, take) = oneshot::channel::<OwnedConn>();
    let (answer, mut answered) = oneshot::channel::<End>();
    let relay = {
        let (watch, cfg, handler) = (watch.clone(), cfg.clone(), handler.clone());
        let (draining, life) = (draining.clone(), life.clone());
        async move {
            let _life = life;
            let Ok(conn) = take.await else { return };
            if let Some(end) = relay(&watch, &cfg, &handler, conn, started, &draining).await {
                let _ = answer.send(end);
            }
        }
    };
    let back = |conn| (conn, std::mem::take(&mut lock(&watch).rows).into());
    if !thread.spawn(relay.instrument(tracing::Span::current())) {
        return Err(back(conn));
    }
    if let Err(conn) = give.send(conn) {
        return Err(back(conn));
    }
    let _cut_on_drop = CutOnDrop(&watch);
    let limit = cfg.handler_timeout + MARGIN;
    loop {
        let deadline = lock(&watch).since.unwrap_or_else(Instant::now) + limit;
        if let Ok(end) = tokio::time::timeout_at(deadline.into(), &mut answered).await {
            let end = end.unwrap_or_else(|_| End::GivenBack(Arc::default()));
            return Ok(collect(&watch, end));
        }
        let mut w = lock(&watch);
        if w.since.is_none_or(|since| since.elapsed() < limit) {
            continue;
        }
        // Something holds the relay's thread: the run ends here.
        w.cut = true;
        let current = w.current.take();
        drop(w);
        let end = match current {
            None => End::GivenBack(life),
            Some(Current { row, slot }) => {
                // Its call's slot, or (its payload still being read) the relay's life.
                let slot = slot.upgrade().unwrap_or(life);
                let call = lend::take_back(Err(handler_timed_out(cfg)), false, true, slot, 1);
                End::Call(Box::new((row, call)))
            }
        };
        return Ok(collect(&watch, end));
    }
}

/// The watch's rows, by how the run ended.
fn collect(watch: &Mutex<Watch>, end: End) -> Run {
    let mut w = lock(watch);
    let mut left: Vec<InboxRow> = Vec::new();
    let processed = if matches!(end, End::GivenBack(_)) {
        // Their effects go with the connection.
        left.append(&mut w.processed);
        left.extend(w.current.take().map(|c| c.row));
        Vec::new()
    } else {
        std::mem::take(&mut w.processed)
    };
    left.extend(w.rows.drain(..));
    Run {
        outcomes: std::mem::take(&mut w.outcomes),
        processed,
        left,
        lost: w.lost,
        end,
    }
}

/// The relay, on the handler's thread: calls the handler for each row in turn while each call
/// ends cleanly. `None`: the run was cut, and the runtime's thread owns its rows.
async fn relay(
    watch: &Mutex<Watch>,
    cfg: &ConsumerConfig,
    handler: &HandlerRef,
    mut conn: OwnedConn,
    started: Instant,
    draining: &AtomicBool,
) -> Option<End> {
    loop {
        let mut row = {
            let mut w = lock(watch);
            if w.cut {
                return None;
            }
            // As the pass checks before each call: never offered, no attempt spent.
            if !handler.connected()
                || !decide::fits(started.elapsed(), cfg)
                || draining.load(Ordering::Relaxed)
            {
                w.lost = !handler.connected();
                w.since = None;
                return Some(End::Conn(conn));
            }
            let Some(row) = w.rows.pop_front() else {
                w.since = None;
                return Some(End::Conn(conn));
            };
            w.since = Some(Instant::now());
            w.current = Some(Current {
                row: row.clone_without_payload(),
                slot: Weak::new(),
            });
            row
        };
        if let Some(failed) = lift(cfg, &mut row) {
            let mut w = lock(watch);
            if w.cut {
                return None;
            }
            w.outcomes.push(failed);
            (w.since, w.current) = (None, None);
            continue;
        }
        let slot: Slot = Arc::new(RwLock::new(Some(conn)));
        {
            let mut w = lock(watch);
            if w.cut {
                return None;
            }
            if let Some(current) = &mut w.current {
                current.slot = Arc::downgrade(&slot);
            }
        }
        let began = Instant::now();
        let deliveries = lend::deliveries(
            cfg,
            std::slice::from_mut(&mut row),
            &slot,
            DeliveryMode::Live,
        );
        let (mut result, lost, mut timed_out) = lend::call(cfg, handler, deliveries, &slot).await;
        if result.is_ok() && began.elapsed() > cfg.handler_timeout {
            // Returned late, having held the thread its timer runs on: timed out all the
            // same, as it would have been from the runtime's thread.
            (result, timed_out) = (Err(handler_timed_out(cfg)), true);
        }
        let mut w = lock(watch);
        if w.cut {
            return None;
        }
        (w.since, w.current) = (None, None);
        match lend::take_back(result, lost, timed_out, slot, 1) {
            Call {
                result: Ok(()),
                held: false,
                conn: Some(back),
                ..
            } => {
                w.processed.push(row);
                conn = back;
            }
            call => return Some(End::Call(Box::new((row, call)))),
        }
    }
}
