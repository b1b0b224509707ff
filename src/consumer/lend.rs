//! Lending the batch's connection to the handler, and taking it back.
//!
//! A handler gets the connection through its [`Delivery`]s, for one call bounded by
//! [`ConsumerConfig::handler_timeout`]. One that overruns may still hold it (a lock wait, a
//! stuck downstream call): its connection and its transaction are then lost to the batch. Such
//! a connection is *parked* ([`Hung::park`]) until the handler lets go, and each consumer parks
//! at most `concurrency` of them. Past that its loops wait before they take another connection,
//! and say so: a consumer whose handlers hang holds at most `2 × concurrency` connections (one
//! per batch loop, one per parked handler), and no other consumer, the publisher or the admin
//! API waits for it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use diesel_async::{AnsiTransactionManager as Tm, TransactionManager};
use tokio::sync::{RwLock, Semaphore};
use tracing::Instrument;

use super::actor::HandlerRef;
use super::decide::{handler_timed_out, HANDLER_LOST};
use super::{ConsumerConfig, Delivery, DeliveryBatch, DeliveryMode, HandlerError};
use crate::event::redact::Redactor;
use crate::event::ConsumerName;
use crate::store::inbox::{self, InboxRow, Outcome};
use crate::store::{self, OwnedConn, PgPool, DB_TIMEOUT};

/// A delivery's connection slot: the handler locks it to use the connection (alone, or shared
/// with the deliveries handled at the same time); the batch takes the connection back out when
/// the call is over.
pub(crate) type Slot = Arc<RwLock<Option<OwnedConn>>>;

/// How a call to the handler went.
pub(crate) struct Call {
    pub result: Result<(), HandlerError>,
    /// The handler actor died during the call and must be replaced.
    pub lost: bool,
    /// The call overran the handler's timeout.
    pub timed_out: bool,
    /// The handler still holds a delivery (or the connection) after the call: it may still
    /// run.
    pub held: bool,
    /// The connection, back at the depth it was lent at; `None` if the handler still holds it
    /// (or left a transaction of its own open): it is then parked with `slot`.
    pub conn: Option<OwnedConn>,
    pub slot: Slot,
}

/// Lends `conn` to the handler for `rows`, moving their payloads into the deliveries, and takes
/// it back. A batch handler gets them in one call; a handler of one delivery gets one call per
/// row, all at once when there are several ([`ConsumerConfig::pipeline`]), and the call ends
/// when the last of them does. `depth` is the transaction depth the connection is lent at (the
/// batch's transaction, plus a row's savepoint).
pub(crate) async fn hand_over(
    cfg: &ConsumerConfig,
    handler: &HandlerRef,
    conn: OwnedConn,
    rows: &mut [InboxRow],
    depth: u32,
    mode: DeliveryMode,
) -> Call {
    let slot: Slot = Arc::new(RwLock::new(Some(conn)));
    let deliveries = deliveries(cfg, rows, &slot, mode);
    let (result, lost, timed_out) = call(cfg, handler, deliveries, &slot).await;
    take_back(result, lost, timed_out, slot, depth)
}

/// The deliveries of `rows`, sharing `slot`; their payloads and metadata move into them.
pub(crate) fn deliveries(
    cfg: &ConsumerConfig,
    rows: &mut [InboxRow],
    slot: &Slot,
    mode: DeliveryMode,
) -> Vec<Delivery> {
    rows.iter_mut()
        .map(|row| {
            super::log::started(cfg, row);
            #[cfg(feature = "otel")]
            let span =
                crate::telemetry::otel::delivery_span(super::log::fields(cfg, row), &row.metadata);
            #[cfg(not(feature = "otel"))]
            let span = tracing::Span::none();
            // The payload and metadata move into the delivery instead of being copied; what
            // stays behind (ids, attempt, aggregate) is all the marks and logs need.
            let mut handed = row.clone_without_payload();
            handed.payload = std::mem::take(&mut row.payload);
            handed.metadata = std::mem::take(&mut row.metadata);
            Delivery {
                row: handed,
                consumer: cfg.name.clone(),
                slot: slot.clone(),
                events: cfg.events.clone(),
                mode,
                span,
            }
        })
        .collect()
}

/// The call's end, with the connection taken back out of `slot` if the handler let go of it
/// at the transaction depth it was lent at.
pub(crate) fn take_back(
    result: Result<(), HandlerError>,
    lost: bool,
    timed_out: bool,
    slot: Slot,
    depth: u32,
) -> Call {
    let taken = slot.try_write().ok().and_then(|mut g| g.take());
    let conn = taken.and_then(|mut c| (depth_of(&mut c) == Some(depth)).then_some(c));
    let held = Arc::strong_count(&slot) > 1;
    Call {
        result,
        lost,
        timed_out,
        held,
        conn,
        slot,
    }
}

/// Calls the handler with `deliveries` (sharing `slot`) within its timeout: a batch handler
/// once, a handler of one delivery once per delivery, all at once. Returns how the call ended,
/// whether the handler actor died in it, and whether it timed out.
pub(crate) async fn call(
    cfg: &ConsumerConfig,
    handler: &HandlerRef,
    deliveries: Vec<Delivery>,
    slot: &Slot,
) -> (Result<(), HandlerError>, bool, bool) {
    let sent = match handler {
        HandlerRef::One(h) => {
            let calls = deliveries.into_iter().map(|d| {
                let span = d.span.clone();
                h.send(d).instrument(span)
            });
            let all = futures_util::future::join_all(calls);
            // The first failure stands for the call (for several rows it charges none).
            tokio::time::timeout(cfg.handler_timeout, all)
                .await
                .map(|ends| {
                    ends.into_iter()
                        .find(|e| !matches!(e, Ok(Ok(()))))
                        .unwrap_or(Ok(Ok(())))
                })
        }
        HandlerRef::Batch(h) => {
            let batch = DeliveryBatch {
                deliveries,
                slot: slot.clone(),
            };
            tokio::time::timeout(cfg.handler_timeout, h.send(batch)).await
        }
    };
    match sent {
        Ok(Ok(result)) => (result, false, false),
        // A panic in `handle` kills the actor; one inside a returned future only kills that
        // future's task. Either way this call failed; only a dead actor needs replacing.
        Ok(Err(_)) => (
            Err(HandlerError::retry(HANDLER_LOST)),
            gone(handler).await,
            false,
        ),
        Err(_) => (Err(handler_timed_out(cfg)), false, true),
    }
}

/// Whether the handler actor whose call just failed without an answer is dead. It runs on
/// another thread: its answer is dropped as the panic unwinds through `handle`, and its
/// mailbox a few frames later, so it is watched for [`UNWIND`] before being judged alive.
/// Judged alive too soon, the next row would be sent to a dying actor and charged for it.
async fn gone(handler: &HandlerRef) -> bool {
    let deadline = tokio::time::Instant::now() + UNWIND;
    while handler.connected() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    true
}

/// How long a handler actor's thread is given to finish unwinding a panic.
const UNWIND: std::time::Duration = std::time::Duration::from_millis(500);

fn depth_of(conn: &mut OwnedConn) -> Option<u32> {
    Tm::transaction_manager_status_mut(&mut **conn)
        .transaction_depth()
        .ok()
        .flatten()
        .map(|d| d.get())
}

/// The consumer's handlers that overran their timeout holding a connection. Per consumer
/// (never shared with another consumer or runtime), with `concurrency` places.
#[derive(Clone)]
pub(crate) struct Hung {
    places: Arc<Semaphore>,
    parked: Arc<AtomicUsize>,
}

impl Hung {
    pub(crate) fn new(concurrency: u32) -> Self {
        Hung {
            places: Arc::new(Semaphore::new(concurrency as usize)),
            parked: Arc::default(),
        }
    }

    /// Parks the call whose handler overran its timeout and still runs (it holds a delivery
    /// or the connection). *Its rows stay leased until its handler lets go, for at most a
    /// patience* (its lease, and at least 20 s): so an event is not handled twice at once
    /// (unless one call hangs longer), and should the handler kill the process they are
    /// counted among what the process held.
    ///
    /// A task watches the handler from this moment. It renews the rows' lease, naming no
    /// session any more (the lease lives by its process), and [`GRACE`] later ends the
    /// handler's database session, so that the call holds no lock and no snapshot however
    /// long it hangs (its writes could never commit anyway). Once the handler lets go it drops
    /// the connection if it got it (the pool closes a connection left in a transaction), then
    /// settles the rows with `outcomes`; should it hang a whole patience, it settles them then
    /// (a handler stuck on a black-holed connection may never return).
    ///
    /// Returns once the task holds one of the consumer's places, or the handler let go first:
    /// while every place is taken the consumer stalls, alone, until one of its handlers lets go.
    pub(crate) async fn park(
        &self,
        cfg: &ConsumerConfig,
        pool: &PgPool,
        slot: Slot,
        backend: i32,
        outcomes: Vec<Outcome>,
        used: super::threads::SlotUse,
    ) {
        let (placed, wait) = tokio::sync::oneshot::channel::<()>();
        let (places, parked) = (self.places.clone(), self.parked.clone());
        let cfg = cfg.clone();
        let pool = pool.clone();
        let lease = cfg.lease_period();
        let token = outcomes.first().map(|o| o.token);
        actix_rt::spawn(async move {
            // The handler holds the slot through its deliveries and its `TxConn`. Meanwhile its
            // rows stay leased, renewed from the first moment, a wait for a place included.
            let (consumer, redact) = (cfg.name.clone(), cfg.redact.clone());
            let mut placed = Some(placed);
            let mut place = None;
            let mut waited = false;
            let mut renewed: Option<tokio::time::Instant> = None;
            // When the lease was claimed, learnt at its first renewal: it tells the
            // handler's session from a later one given the same pid.
            let mut claimed = None;
            let (end_at, mut ended) = (tokio::time::Instant::now() + GRACE, false);
            let give_up_at = tokio::time::Instant::now() + super::decide::patience(&cfg);
            let mut outcomes = Some(outcomes);
            while Arc::strong_count(&slot) > 1 {
                if place.is_none() {
                    if let Ok(p) = places.clone().try_acquire_owned() {
                        place = Some(p);
                        parked.fetch_add(1, Ordering::Relaxed);
                        super::log::hung(&cfg, parked.load(Ordering::Relaxed));
                        if let Some(tx) = placed.take() {
                            let _ = tx.send(());
                        }
                        if waited {
                            super::log::waiting_for_hung(&cfg, false);
                        }
                    } else if !waited {
                        waited = true;
                        tracing::warn!(
                            consumer = %consumer, hung = parked.load(Ordering::Relaxed),
                            "every place for a hung handler is taken: the consumer waits until \
                             one of its handlers lets go"
                        );
                        super::log::waiting_for_hung(&cfg, true);
                    }
                }
                if outcomes.is_some() && tokio::time::Instant::now() >= give_up_at {
                    // Hung a patience past its timeout, as long as the reaper waits for a live
                    // process's lease: perhaps for ever (a statement on a connection the
                    // network black-holed never returns). Its database work can no longer
                    // commit, so its rows are settled now, the handler still running.
                    tracing::warn!(
                        consumer = %consumer, waited = ?super::decide::patience(&cfg),
                        "a handler hung far past its timeout: its events are settled while it \
                         still runs"
                    );
                    let left = outcomes.take().unwrap_or_default();
                    settle(&pool, &consumer, &redact, left).await;
                }
                let renew =
                    outcomes.is_some() && renewed.is_none_or(|at| at.elapsed() >= lease / 3);
                let ending = !ended && claimed.is_some() && tokio::time::Instant::now() >= end_at;
                if let (Some(token), true) = (token, renew || ending) {
                    if let Ok(mut conn) = pool.get().await {
                        if renew {
                            // Renewed, and named by no session: ending the handler's session
                            // (below, or on its own) does not make the process look dead.
                            let lease_ms = crate::store::millis(lease);
                            let extended = store::bounded(&mut conn, DB_TIMEOUT, async |c| {
                                inbox::extend(c, token, lease_ms).await
                            });
                            match extended.await {
                                Ok(Some(at)) => {
                                    renewed = Some(tokio::time::Instant::now());
                                    claimed = claimed.or(Some(at));
                                }
                                Ok(None) => {
                                    // Judged (its process was taken for dead) or settled by
                                    // an operator: its rows are no longer this call's.
                                    tracing::warn!(consumer = %consumer,
                                        "a hung handler's lease was taken from it");
                                    outcomes = None;
                                }
                                Err(_) => {}
                            }
                        }
                        if let (true, Some(since)) = (ending, claimed) {
                            drop(conn);
                            ended = end_session(&pool, &cfg, backend, since).await;
                        }
                    }
                }
                tokio::time::sleep(LET_GO_POLL).await;
            }
            drop(slot.write().await.take());
            drop(slot);
            // The handler's thread is free again for the consumer's loops.
            drop(used);
            if place.take().is_some() {
                let left = parked.fetch_sub(1, Ordering::Relaxed) - 1;
                crate::telemetry::metrics::consumer_hung(consumer.as_str(), left);
                tracing::info!(consumer = %consumer, hung = left, "a hung handler let go");
            } else if waited {
                super::log::waiting_for_hung(&cfg, false);
            }
            if let Some(outcomes) = outcomes {
                settle(&pool, &consumer, &redact, outcomes).await;
            }
            // Let the loop go on, if it still waits (its handler let go before a place freed).
            drop(placed);
        });
        let _ = wait.await;
    }
}

/// Settles a parked call's rows. On failure they stay leased, and the reaper settles them once
/// their lease expires.
async fn settle(pool: &PgPool, consumer: &ConsumerName, redact: &Redactor, outcomes: Vec<Outcome>) {
    // Three tries, 1 s and 2 s apart: the marks are fenced on the lease, so one that went
    // through unseen is not applied twice.
    for wait in [1, 2, 0] {
        let settled = match pool.get().await {
            Ok(mut conn) => {
                store::bounded(&mut conn, DB_TIMEOUT, async |c| {
                    inbox::settle_now(c, &outcomes, redact).await
                })
                .await
            }
            Err(e) => Err(e.into()),
        };
        match settled {
            Ok(_) => return,
            Err(e) if wait == 0 => tracing::warn!(consumer = %consumer, error = %e,
                "could not settle a hung handler's rows"),
            Err(_) => tokio::time::sleep(std::time::Duration::from_secs(wait)).await,
        }
    }
}

/// Ends the database session of a call hung past its timeout and [`GRACE`]: its transaction
/// could never commit, and while it lasts it holds its row locks and the vacuum horizon. The
/// handler keeps its thread (and its place) until it lets go. `claimed_at`: a time the session
/// was the call's. Returns false when that could not be done (to be tried again).
pub(crate) async fn end_session(
    pool: &PgPool,
    cfg: &ConsumerConfig,
    backend: i32,
    claimed_at: Since,
) -> bool {
    let ended = match pool.get().await {
        Ok(mut conn) => {
            store::bounded(&mut conn, DB_TIMEOUT, async |c| {
                inbox::end_session(c, backend, claimed_at).await
            })
            .await
        }
        Err(e) => Err(e.into()),
    };
    match ended {
        Ok(true) => {
            crate::telemetry::metrics::handler_session_ended(cfg.name.as_str());
            tracing::warn!(
                consumer = %cfg.name, backend, timeout = ?cfg.handler_timeout, grace = ?GRACE,
                code = %crate::error::ErrorCode::HANDLER_SESSION_ENDED,
                "a handler hung past its timeout and the grace: its database session was ended, \
                 releasing its locks and its snapshot; its events stay in flight until it \
                 lets go"
            );
            true
        }
        // Gone already.
        Ok(false) => true,
        Err(e) => {
            tracing::warn!(consumer = %cfg.name, backend, error = %e,
                "could not end a hung handler's database session");
            false
        }
    }
}

type Since = chrono::DateTime<chrono::Utc>;

/// How long past its timeout a hung call keeps its database session: then the session is ended
/// (see [`Hung::park`]).
pub(crate) const GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// The `statement_timeout` a handler's transaction runs under: its timeout and the [`GRACE`],
/// but never less than [`DB_TIMEOUT`], so that the server never cuts one of the engine's own
/// statements (its settle and commit share the transaction) sooner than the engine itself
/// would give up on it. It counts from a statement's start, not from the call's: the bound
/// that holds when this process can no longer act (frozen, cut off), where [`Hung::park`]
/// cannot.
pub(crate) fn statement_timeout(cfg: &ConsumerConfig) -> std::time::Duration {
    (cfg.handler_timeout + GRACE).max(DB_TIMEOUT)
}

/// How often a parked call looks whether its handler has let go.
const LET_GO_POLL: std::time::Duration = std::time::Duration::from_millis(50);
