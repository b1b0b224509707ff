//! One pass over a batch's leased rows, in one transaction: the fast pass (no savepoints; a
//! batch handler gets every row in one call) or, after a failure in it, the careful pass (one
//! row per call, each in a savepoint). How a call's end is blamed is `decide::after_call`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use actix_rt::ArbiterHandle;
use diesel_async::{AnsiTransactionManager as Tm, RunQueryDsl, TransactionManager};

use super::actor::HandlerRef;
use super::batch::BatchOutcome;
use super::decide::{self, after_call, CallEnd, Next};
use super::{lend, relay};
use super::{log, ConsumerConfig, DeliveryMode, HandlerError};
use crate::error::Result;
use crate::event::Upcast;
use crate::store::inbox::{self, Advance, InboxRow, Outcome, Settle};
use crate::store::{self, OwnedConn, DB_TIMEOUT};

/// How a pass over the batch's rows ended.
pub(super) enum PassEnd {
    /// Every row is decided: settle `outcomes` with the commit; `processed` for the log.
    Commit(OwnedConn, Vec<Outcome>, Vec<InboxRow>),
    /// The transaction rolled back: hand the undecided rows over again, carefully, after
    /// settling these with the next commit.
    Again(OwnedConn, Vec<Outcome>),
    /// The handler overran and still runs: settle the first outcomes at once on another
    /// connection, the second (the call's rows) once the handler lets go.
    /// `i32`: the database session of the handler's transaction.
    Kept(lend::Slot, i32, Vec<Outcome>, Vec<Outcome>),
}

pub(super) struct Pass<'a> {
    pub cfg: &'a ConsumerConfig,
    pub handler: &'a HandlerRef,
    pub started: Instant,
    pub careful: bool,
    /// Set by a graceful shutdown: hand no more rows over.
    pub draining: &'a Arc<AtomicBool>,
    /// The handler's thread; `None`: the runtime's own.
    pub thread: Option<&'a ArbiterHandle>,
}

impl Pass<'_> {
    pub(super) async fn run(
        &self,
        mut conn: OwnedConn,
        rows: Vec<InboxRow>,
        out: &mut BatchOutcome,
    ) -> Result<PassEnd> {
        let cfg = self.cfg;
        begin(&mut conn, cfg).await?;
        // Rows handed over in one call: a batch handler gets all of the fast pass's; a
        // handler of one delivery, up to `pipeline` of them at once; a careful pass, one.
        let limit = match self.handler {
            _ if self.careful => 1,
            HandlerRef::Batch(_) => usize::MAX,
            HandlerRef::One(_) => cfg.pipeline as usize,
        };
        let one = matches!(self.handler, HandlerRef::One(_));
        let depth = if self.careful { 2 } else { 1 };
        let mut outcomes = Vec::with_capacity(rows.len());
        let mut processed: Vec<InboxRow> = Vec::with_capacity(rows.len());
        let mut group: Vec<InboxRow> = Vec::new();
        let mut calls = 0;
        // Calls that failed, to be retried; in a careful pass, see `decide::gives_up`.
        let mut retried = 0;
        // A call already made: the one a run on the handler's thread stopped at.
        let mut pending: Option<lend::Call> = None;
        let (conn, rows) = match self.relayed(rows.len()) {
            None => (Some(conn), rows),
            Some(thread) => {
                let (handler, started) = (self.handler, self.started);
                match relay::run(thread, cfg, handler, conn, rows, started, self.draining).await {
                    Err((back, rows)) => (Some(back), rows),
                    Ok(run) => {
                        outcomes = run.outcomes;
                        processed = run.processed;
                        calls = processed.len();
                        out.handler_lost |= run.lost;
                        match run.end {
                            relay::End::Conn(back) => {
                                outcomes.extend(run.left.iter().map(|r| to(r, Settle::Release)));
                                outcomes.extend(processed.iter().map(|r| to(r, Settle::Processed)));
                                return Ok(PassEnd::Commit(back, outcomes, processed));
                            }
                            relay::End::Call(stopped) => {
                                let (row, call) = *stopped;
                                group.push(row);
                                pending = Some(call);
                                (None, run.left)
                            }
                            relay::End::GivenBack(life) => {
                                // Nothing of the run commits, and no row of it is charged:
                                // parked until the relay's task is over, since its thread may
                                // be held. Nothing parked, so no session to end (0).
                                outcomes.extend(run.left.iter().map(|r| to(r, Settle::Release)));
                                return Ok(PassEnd::Kept(life, 0, outcomes, Vec::new()));
                            }
                        }
                    }
                }
            }
        };
        let mut rows = rows.into_iter().peekable();
        // Between calls, the connection; during one, the handler's.
        let mut conn = conn;
        loop {
            let call = match pending.take() {
                Some(call) => call,
                None => {
                    let Some(row) = rows.next() else { break };
                    if !self.handler.connected()
                        || !decide::fits(self.started.elapsed(), cfg)
                        || AtomicBool::load(self.draining, Ordering::Relaxed)
                    {
                        // Never offered: no attempt is spent. The handler is replaced first,
                        // the lease is about to run out, or the runtime shuts down.
                        out.handler_lost |= !self.handler.connected();
                        let left = group
                            .drain(..)
                            .chain(std::iter::once(row))
                            .chain(rows.by_ref());
                        outcomes.extend(left.map(|r| to(&r, Settle::Release)));
                        break;
                    }
                    let lent = conn.as_mut().expect("between calls");
                    if let Some(row) = self.admit(lent, row, &mut outcomes).await? {
                        group.push(row);
                    }
                    // The call waits for more rows while there is room and the next row's
                    // aggregate has none in it: one aggregate's deliveries are never handled
                    // at once.
                    let wait = |next: &InboxRow| {
                        group.len() < limit
                            && !(one && group.iter().any(|r| r.same_aggregate(next)))
                    };
                    if group.is_empty() || rows.peek().is_some_and(wait) {
                        continue;
                    }
                    let lent = conn.take().expect("between calls");
                    let mode = DeliveryMode::Live;
                    lend::hand_over(cfg, self.handler, lent, &mut group, depth, mode).await
                }
            };
            calls += 1;
            out.handler_lost |= call.lost;
            if call.conn.is_none() || (call.timed_out && call.held) {
                // The handler overran and still runs: its transaction is gone with it, and its
                // rows stay leased until it lets go. Its row is then charged; a call of several
                // rows charges none, each to be handed over alone.
                let parked = match after_call(CallEnd::Kept, group.len(), self.careful, true) {
                    Next::ChargeAndStop => {
                        let err = call.result.err().unwrap_or_else(|| {
                            HandlerError::retry("the handler returned but kept its connection")
                        });
                        log::failed(cfg, &group[0], &err);
                        let f = decide::decide(&cfg.retry, &group[0], &err);
                        vec![to(&group[0], Settle::Failed(f))]
                    }
                    _ => group.iter().map(|r| to(r, Settle::Isolate)).collect(),
                };
                // Failures and rows given back stand; everything else of this transaction (its
                // effects roll back with the connection) is given back.
                let mut now: Vec<Outcome> = outcomes
                    .into_iter()
                    .map(|o| match o.settle {
                        Settle::Failed(_) | Settle::Release => o,
                        _ => Outcome {
                            settle: Settle::Release,
                            ..o
                        },
                    })
                    .collect();
                now.extend(processed.iter().map(|r| to(r, Settle::Release)));
                now.extend(rows.map(|r| to(&r, Settle::Release)));
                // A connection that came back (the handler runs on without it) is parked with
                // the handler: its session ending would say the handler's transaction is over,
                // and the rows would be settled while the handler may still kill the process.
                if let Some(conn) = call.conn {
                    if let Ok(mut slot) = call.slot.try_write() {
                        *slot = Some(conn);
                    }
                }
                let backend = group[0].backend;
                return Ok(PassEnd::Kept(call.slot, backend, now, parked));
            }
            let mut back = call.conn.expect("the connection came back");
            let end = match (&call.result, call.lost) {
                (Ok(()), _) => CallEnd::Done,
                (Err(_), true) => CallEnd::Lost,
                (Err(_), false) => CallEnd::Failed,
            };
            // In the fast pass, a failure is this call's own when the transaction was sound
            // before it: a handler earlier in the batch may have swallowed a failed statement
            // and returned Ok, and this handler only met the aborted transaction.
            let own = self.careful
                || call.lost
                || call.timed_out
                || calls == 1
                || end == CallEnd::Done
                || sound(&mut back).await;
            match after_call(end, group.len(), self.careful, own) {
                Next::Continue if self.careful => {
                    let released = store::bounded(&mut back, DB_TIMEOUT, async |c| {
                        Ok(Tm::commit_transaction(c).await) // RELEASE SAVEPOINT
                    })
                    .await?;
                    if let Err(e) = released {
                        if !store::answered_by_server(&e) {
                            return Err(e.into());
                        }
                        // The handler returned Ok although a statement of its transaction had
                        // failed (it swallowed the error): the transaction cannot commit. It
                        // rolls back (diesel counts the savepoint as released, so this is the
                        // whole transaction), this row is charged, and the others go again.
                        tm(&mut back, Step::Rollback).await?;
                        let err = HandlerError::retry(format!(
                            "the handler returned Ok, but a statement of its transaction had \
                             failed, so it could not commit: {e}"
                        ));
                        log::failed(cfg, &group[0], &err);
                        let f = decide::decide(&cfg.retry, &group[0], &err);
                        let charged = outcomes
                            .into_iter()
                            .filter(|o| matches!(o.settle, Settle::Failed(_)))
                            .chain(std::iter::once(to(&group[0], Settle::Failed(f))))
                            .collect();
                        return Ok(PassEnd::Again(back, charged));
                    }
                    processed.append(&mut group);
                }
                Next::Continue => processed.append(&mut group),
                Next::ChargeAndContinue => {
                    tm(&mut back, Step::Rollback).await?; // ROLLBACK TO SAVEPOINT
                    let row = group.pop().expect("a careful call holds one row");
                    let err = call.result.expect_err("the call failed");
                    log::failed(cfg, &row, &err);
                    let failure = decide::decide(&cfg.retry, &row, &err);
                    retried += usize::from(!failure.dead);
                    outcomes.push(to(&row, Settle::Failed(failure)));
                    if decide::gives_up(calls, retried) {
                        outcomes.extend(rows.by_ref().map(|r| to(&r, Settle::Release)));
                        conn = Some(back);
                        break;
                    }
                }
                Next::Carefully { charge, isolate } => {
                    // Undo the whole fast pass, the handler's partial writes with it.
                    tm(&mut back, Step::Rollback).await?;
                    let mut charged: Vec<Outcome> = outcomes
                        .into_iter()
                        .filter(|o| matches!(o.settle, Settle::Failed(_)))
                        .collect();
                    if charge {
                        let err = call.result.expect_err("the call failed");
                        log::failed(cfg, &group[0], &err);
                        let f = decide::decide(&cfg.retry, &group[0], &err);
                        charged.push(to(&group[0], Settle::Failed(f)));
                    }
                    if isolate {
                        charged.extend(group.iter().map(|r| to(r, Settle::Isolate)));
                    }
                    return Ok(PassEnd::Again(back, charged));
                }
                Next::ChargeAndStop | Next::IsolateAndStop => {
                    unreachable!("the connection came back")
                }
            }
            conn = Some(back);
        }
        outcomes.extend(processed.iter().map(|r| to(r, Settle::Processed)));
        let conn = conn.expect("no call holds it");
        Ok(PassEnd::Commit(conn, outcomes, processed))
    }
}

impl Pass<'_> {
    /// The handler's thread a fast pass of `n` rows runs its calls on, one row per call and
    /// back to back (`relay.rs`); `None`: the calls are made from here. A careful pass, a
    /// pipeline, a batch handler and a consumer that skips stale events (whose rows are
    /// admitted in the transaction, one by one) make their calls from here.
    fn relayed(&self, n: usize) -> Option<&ArbiterHandle> {
        let one = matches!(self.handler, HandlerRef::One(_));
        let plain = !self.careful && one && self.cfg.pipeline == 1 && !self.cfg.skip_stale;
        self.thread.filter(|_| plain && n > 1)
    }

    /// Readies `row` for its call, or decides it without one (returning `None`): its payload
    /// is lifted to the current version, and, for a consumer that skips stale events, its
    /// aggregate version advanced (in a careful pass, inside the row's savepoint, which is
    /// then left open for the call).
    async fn admit(
        &self,
        conn: &mut OwnedConn,
        mut row: InboxRow,
        outcomes: &mut Vec<Outcome>,
    ) -> Result<Option<InboxRow>> {
        let cfg = self.cfg;
        if let Some(failed) = lift(cfg, &mut row) {
            outcomes.push(failed);
            return Ok(None);
        }
        if self.careful {
            tm(conn, Step::Begin).await?; // SAVEPOINT
        }
        let (true, Some(version)) = (cfg.skip_stale, row.aggregate_version) else {
            return Ok(Some(row));
        };
        let name = cfg.name.as_str();
        let advanced = store::bounded(conn, DB_TIMEOUT, async |c| {
            let (kind, id) = (&row.aggregate_type, &row.aggregate_id);
            inbox::advance_version(c, name, kind, id, version).await
        })
        .await?;
        match advanced {
            Advance::Applied => return Ok(Some(row)),
            Advance::Stale(current) => {
                if self.careful {
                    tm(conn, Step::Commit).await?;
                }
                tracing::info!(consumer = %cfg.name, event_id = %row.event_id, aggregate_id = %row.aggregate_id,
                    version, current, code = "EVENT_STALE", "stale event recorded, not applied");
                outcomes.push(to(&row, Settle::Stale(current)));
            }
            Advance::Busy => {
                // Another loop holds the aggregate: given back, due again shortly.
                if self.careful {
                    tm(conn, Step::Rollback).await?;
                }
                outcomes.push(to(&row, Settle::Release));
            }
        }
        Ok(None)
    }
}

/// `row`'s settlement, fenced on the lease that holds it.
pub(super) fn to(row: &InboxRow, settle: Settle) -> Outcome {
    Outcome {
        id: row.id,
        token: row.lease_token,
        settle,
    }
}

/// A step of the connection's transaction manager.
#[derive(Clone, Copy)]
pub(super) enum Step {
    /// `BEGIN`, or `SAVEPOINT` inside a transaction.
    Begin,
    /// `COMMIT`, or `RELEASE SAVEPOINT`.
    Commit,
    /// `ROLLBACK`, or `ROLLBACK TO SAVEPOINT`.
    Rollback,
}

/// Takes `step` within [`DB_TIMEOUT`], as every statement of the engine.
pub(super) async fn tm(conn: &mut OwnedConn, step: Step) -> Result<()> {
    store::bounded(conn, DB_TIMEOUT, async |c| {
        match step {
            Step::Begin => Tm::begin_transaction(c).await?,
            Step::Commit => Tm::commit_transaction(c).await?,
            Step::Rollback => Tm::rollback_transaction(c).await?,
        }
        Ok(())
    })
    .await
}

/// Begins the transaction a handler is lent, under the consumer's
/// [`statement_timeout`](lend::statement_timeout): a statement of a hung handler (a lock wait,
/// a runaway query) is cut by the server even when this process can no longer act, and its
/// transaction, aborted, then holds no lock and no snapshot. (One left idle is the pool's
/// `idle_in_transaction_session_timeout`'s: a batch of handlers that write nothing may leave it
/// idle for as long as its lease.)
pub(super) async fn begin(conn: &mut OwnedConn, cfg: &ConsumerConfig) -> Result<()> {
    let ms = lend::statement_timeout(cfg).as_millis();
    let sql = format!("BEGIN; SET LOCAL statement_timeout = {ms}");
    store::bounded(conn, DB_TIMEOUT, async |c| {
        Tm::begin_transaction_sql(c, &sql).await?;
        Ok(())
    })
    .await
}

/// Whether the transaction on `conn` still runs statements (a handler may have left it
/// failed). A connection that does not answer is not sound either.
async fn sound(conn: &mut OwnedConn) -> bool {
    matches!(
        store::timed(DB_TIMEOUT, async {
            crate::store::sql("SELECT 1").execute(&mut **conn).await?;
            Ok(())
        })
        .await,
        Ok(Ok(()))
    )
}

/// Lifts `row`'s payload ([`upcast`]), or decides it without a call: a row no code here can
/// read is never handed over, and its failure is returned.
pub(super) fn lift(cfg: &ConsumerConfig, row: &mut InboxRow) -> Option<Outcome> {
    let err = upcast(cfg, row).err()?;
    log::failed(cfg, row, &err);
    let failure = decide::decide(&cfg.retry, row, &err);
    Some(to(row, Settle::Failed(failure)))
}

/// Lifts the row's payload to the current version of its registered type, if the runtime has
/// an [`EventRegistry`](crate::EventRegistry). An upcaster that panics fails the row as one
/// that cannot be read (its batch goes on).
pub(crate) fn upcast(cfg: &ConsumerConfig, row: &mut InboxRow) -> Result<(), HandlerError> {
    let Some(registry) = &cfg.events else {
        return Ok(());
    };
    let lifted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        registry.upcast(&row.event_type, row.event_version, &row.payload)
    }));
    let Ok(lifted) = lifted else {
        return Err(HandlerError::permanent(
            crate::error::ErrorCode::EVENT_SCHEMA_INVALID,
            format!(
                "the upcaster of {} v{} panicked",
                row.event_type, row.event_version
            ),
        ));
    };
    match lifted {
        Upcast::Unregistered => Ok(()),
        Upcast::Current(version, payload) => {
            row.event_version = version;
            row.payload = payload;
            Ok(())
        }
        Upcast::Unsupported(m) => Err(HandlerError::permanent(
            crate::error::ErrorCode::EVENT_VERSION_UNSUPPORTED,
            m,
        )),
        Upcast::Newer(message) => Err(HandlerError::Retry {
            code: crate::error::ErrorCode::EVENT_VERSION_UNSUPPORTED,
            message,
        }),
        Upcast::Invalid(m) => Err(HandlerError::permanent(
            crate::error::ErrorCode::EVENT_SCHEMA_INVALID,
            m,
        )),
    }
}
