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
//! both threads lock: the rows not yet offered, those processed, and the row being handled
//! with its call's start. **A call ends once, under that lock: by the relay when the handler
//! answers (or the relay's own timeout fires), or by the runtime's thread when the call has
//! overran its timeout by [`MARGIN`] unnoticed** — the relay's timer cannot fire while the
//! handler blocks the thread it shares with it. The runtime's thread then *cuts* the run: it
//! takes the rows out of the watch and ends that call as timed out, as if it had made the call
//! itself, and the pass parks the call as any other that overran (`lend::Hung::park`). Should
//! the handler ever return, the relay finds the run cut and drops what it holds; its copy of
//! the call's connection slot is what the parked call waits to see let go.

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
use super::pass::{to, upcast};
use super::{log, ConsumerConfig, DeliveryMode};
use crate::store::inbox::{InboxRow, Outcome, Settle};
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
    /// The handler's thread stopped and dropped the run with the connection: nothing it did
    /// can commit, and no call of it was the handler's fault.
    Dropped,
}

/// A run's state, shared by the relay and the runtime's thread.
#[derive(Default)]
struct Watch {
    rows: VecDeque<InboxRow>,
    processed: Vec<InboxRow>,
    outcomes: Vec<Outcome>,
    current: Option<Current>,
    /// The runtime's thread took the run over.
    cut: bool,
    lost: bool,
}

/// The row being handled, when its call began, and its connection slot (weak: it must not
/// count as one of the slot's holders).
struct Current {
    row: InboxRow,
    since: Instant,
    slot: Weak<RwLock<Option<OwnedConn>>>,
}

/// How long past its timeout a call may run before the runtime's thread ends it itself.
pub(super) const MARGIN: Duration = Duration::from_millis(100);

fn lock(watch: &Mutex<Watch>) -> MutexGuard<'_, Watch> {
    // Nothing panics while holding it; a poisoned lock is still a consistent watch.
    watch.lock().unwrap_or_else(|e| e.into_inner())
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
        ..Default::default()
    }));
    let (give, take) = oneshot::channel::<OwnedConn>();
    let (answer, mut answered) = oneshot::channel::<End>();
    let relay = {
        let (watch, cfg, handler) = (watch.clone(), cfg.clone(), handler.clone());
        let draining = draining.clone();
        async move {
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
    let limit = cfg.handler_timeout + MARGIN;
    loop {
        let now = Instant::now();
        let deadline = match &lock(&watch).current {
            Some(c) => c.since + limit,
            None => now + limit,
        };
        if let Ok(end) = tokio::time::timeout_at(deadline.into(), &mut answered).await {
            return Ok(collect(&watch, end.unwrap_or(End::Dropped)));
        }
        let mut w = lock(&watch);
        let overran = w
            .current
            .as_ref()
            .is_some_and(|c| c.since.elapsed() >= limit);
        if !overran {
            continue;
        }
        // The handler holds the relay's thread: the call is ended here.
        w.cut = true;
        let Current { row, slot, .. } = w.current.take().expect("a call overran");
        drop(w);
        let slot: Slot = slot
            .upgrade()
            .unwrap_or_else(|| Arc::new(RwLock::new(None)));
        let call = lend::take_back(Err(handler_timed_out(cfg)), false, true, slot, 1);
        return Ok(collect(&watch, End::Call(Box::new((row, call)))));
    }
}

/// The watch's rows, by how the run ended.
fn collect(watch: &Mutex<Watch>, end: End) -> Run {
    let mut w = lock(watch);
    let mut left: Vec<InboxRow> = Vec::new();
    let processed = if matches!(end, End::Dropped) {
        // Their effects went with the connection; the call being made was cut short.
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
/// ends cleanly. `None`: the runtime's thread cut the run, and owns its rows.
async fn relay(
    watch: &Mutex<Watch>,
    cfg: &ConsumerConfig,
    handler: &HandlerRef,
    mut conn: OwnedConn,
    started: Instant,
    draining: &AtomicBool,
) -> Option<End> {
    loop {
        let (mut row, slot) = {
            let mut w = lock(watch);
            // As the pass checks before each call: never offered, no attempt spent.
            if !handler.connected()
                || !decide::fits(started.elapsed(), cfg)
                || draining.load(Ordering::Relaxed)
            {
                w.lost = !handler.connected();
                return Some(End::Conn(conn));
            }
            let Some(mut row) = w.rows.pop_front() else {
                return Some(End::Conn(conn));
            };
            if let Err(err) = upcast(cfg, &mut row) {
                log::failed(cfg, &row, &err);
                let failure = decide::decide(&cfg.retry, &row, &err);
                w.outcomes.push(to(&row, Settle::Failed(failure)));
                continue;
            }
            let slot: Slot = Arc::new(RwLock::new(Some(conn)));
            let shell = row.clone_without_payload();
            w.current = Some(Current {
                row: shell,
                since: Instant::now(),
                slot: Arc::downgrade(&slot),
            });
            (row, slot)
        };
        let deliveries = lend::deliveries(
            cfg,
            std::slice::from_mut(&mut row),
            &slot,
            DeliveryMode::Live,
        );
        let (result, lost, timed_out) = lend::call(cfg, handler, deliveries, &slot).await;
        let mut w = lock(watch);
        if w.cut {
            return None;
        }
        w.current = None;
        let call = lend::take_back(result, lost, timed_out, slot, 1);
        match call {
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
