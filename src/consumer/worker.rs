//! One batch of one consumer: claim due inbox rows, hand them to the handler (one per call,
//! or all in one call to a batch handler) in one transaction, mark the outcomes, commit.
//!
//! Why one transaction per batch: one commit per batch instead of per row is what lets a
//! consumer keep up with a producer that batches. When a handler fails, the batch is replayed
//! with a savepoint per row, which gives each call all-or-nothing writes (an error undoes only
//! its own effect). A crash anywhere before the commit rolls back effects and marks together,
//! so the rows are simply claimed again: at-least-once delivery, effectively-once effects. So
//! that a crash caused by a handler still counts as its attempt, the rows are recorded as in
//! flight, committed, before a handler sees them ([`InFlight`]).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use diesel_async::{AnsiTransactionManager as Tm, TransactionManager};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use tokio::sync::Mutex;

use super::actor::HandlerRef;
use super::{ConsumerConfig, Delivery, DeliveryBatch, HandlerError, RetryPolicy};
use crate::error::{Error, ErrorCode, Result};
use crate::event::Upcast;
use crate::maintenance::metrics;
use crate::store::inbox::{self, Advance, Failure, InboxRow};
use crate::store::{OwnedConn, PgPool};

/// What one batch did, for the actor's bookkeeping.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct BatchOutcome {
    pub claimed: usize,
    pub processed: usize,
    pub failed: usize,
    /// Rows left for a later batch because another batch held their aggregate.
    pub deferred: usize,
    /// The soonest retry this batch scheduled, so the actor can wake for it.
    pub next_retry: Option<Duration>,
    /// The handler actor stopped (panicked) during the batch and must be replaced.
    pub handler_lost: bool,
    /// A fast batch hit a failure and was rolled back whole, counting an attempt only against a
    /// row whose own failure it was; its other rows are due again at once, and their entry in
    /// flight makes the batch that gets them safe.
    /// Also set when a batch gave its rows back to be claimed again at once (see `exclusive`).
    pub rolled_back: bool,
    /// Rows were found that a process may have died holding: the next batch must run with no
    /// other handler running in the process ([`HANDLERS`]).
    pub exclusive: bool,
    /// The transaction was abandoned (handler kept the connection, left a nested transaction
    /// open, or timed out mid-query); the unmarked rows will be claimed again.
    pub abandoned: bool,
}

/// Every batch of every consumer in the process holds this while its handlers may run: a read
/// guard as a rule, the write guard for a batch that hands over, one per call, rows a process
/// may have died holding. Only such a batch marks the row in hand as `alone`, and a death then
/// has one cause that can be known: no other handler in the process runs meanwhile, so if the
/// process dies the row's entry marks the only handler that was running. Without this, a death
/// caused by one consumer would be counted against whatever row another consumer (or loop) was
/// handing over at that moment, and fan-out hands the same event to every consumer at once:
/// the healthy consumer's copy of an event that kills the process would be dead-lettered.
///
/// A replay of a batch whose handler returned an error (in this living process) takes the read
/// guard and marks nothing: should the process die during it, its rows are found after the
/// death and handed over alone then. So a consumer whose handlers keep failing never stalls the
/// others.
///
/// The write guard is not taken while a handler that overran its timeout may still run
/// ([`OVERRUN`]): the batch then claims nothing, and the rows wait for a later poll. Otherwise
/// it is waited for until the batches running now end; each ends within its handlers'
/// timeouts, because a handler that overran keeps only its ticket, not the guard. Taken before
/// the batch's transaction begins, so nobody waits for it holding row locks.
static HANDLERS: std::sync::LazyLock<Arc<tokio::sync::RwLock<()>>> =
    std::sync::LazyLock::new(|| Arc::new(tokio::sync::RwLock::new(())));

/// One per batch, carried by every [`Delivery`] it hands out: alive while a handler keeps its
/// delivery.
pub(crate) struct Ticket;

/// The tickets of batches whose handler overran its timeout. One still alive means a handler
/// that may still run, and may yet kill the process. (A handler that drops its delivery and
/// runs on is not seen.)
static OVERRUN: std::sync::Mutex<Vec<std::sync::Weak<Ticket>>> = std::sync::Mutex::new(Vec::new());

/// [`OVERRUN`] without the tickets of handlers that have ended.
fn overruns() -> std::sync::MutexGuard<'static, Vec<std::sync::Weak<Ticket>>> {
    let mut o = OVERRUN.lock().unwrap_or_else(|e| e.into_inner());
    o.retain(|w| w.strong_count() > 0);
    o
}

fn overran(ticket: &Arc<Ticket>) {
    overruns().push(Arc::downgrade(ticket));
}

/// Whether a handler that overran its timeout may still run in this process.
fn overrunning() -> bool {
    !overruns().is_empty()
}

/// A batch's share of [`HANDLERS`]; see there.
#[expect(
    dead_code,
    reason = "a guard is held for as long as the batch runs, never read"
)]
enum Hold {
    Shared(tokio::sync::OwnedRwLockReadGuard<()>),
    Alone(tokio::sync::OwnedRwLockWriteGuard<()>),
}

/// The batch's share of [`HANDLERS`]; `None` if it was to run alone and cannot now.
async fn hold(cfg: &ConsumerConfig, exclusive: bool) -> Option<Hold> {
    let lock = HANDLERS.clone();
    if !exclusive {
        return Some(Hold::Shared(lock.read_owned().await));
    }
    if !overrunning() {
        let alone = lock.write_owned().await;
        // A handler of the last batches may have overrun meanwhile.
        if !overrunning() {
            return Some(Hold::Alone(alone));
        }
    }
    tracing::warn!(
        consumer = %cfg.name,
        "rows a process may have died holding wait: a handler still runs past its timeout, and \
         a death now could be blamed on the wrong event"
    );
    None
}

/// Stored as `last_error` when a handler panicked or stopped while handling.
pub(crate) const HANDLER_LOST: &str = "the handler panicked or stopped while handling";

/// The failure of a handler that overran its timeout.
pub(crate) fn handler_timed_out(cfg: &ConsumerConfig) -> HandlerError {
    HandlerError::retry(format!(
        "the handler did not finish within {:?}",
        cfg.handler_timeout
    ))
}

/// When to look again at rows deferred because another batch held their aggregate.
const DEFER_DELAY: Duration = Duration::from_millis(10);

/// The consumer's connection for `inbox_in_flight`, shared by its batch loops. Outside any
/// transaction, because an entry must be committed before a handler runs; outside the pool,
/// because every batch already holds a pool connection and a second checkout per batch could
/// deadlock a small pool. Replaced after an error.
///
/// It also holds the consumer's permits for handlers that overran their timeout keeping their
/// connection ([`abandon_kept`]): one per batch loop (`concurrency`).
#[derive(Clone)]
pub(crate) struct InFlight(Arc<Mutex<InFlightConn>>, Arc<tokio::sync::Semaphore>);

#[derive(Default)]
struct InFlightConn {
    conn: Option<AsyncPgConnection>,
    book: Book,
}

/// What the consumer knows of its own entries.
#[derive(Default)]
struct Book {
    /// Entries of committed fast batches, deleted with the next `enter` instead of with a
    /// round trip of their own. Their rows are all marked, so none is due again at once; an
    /// entry found before it is deleted only makes a batch safe, and a fast batch never sets
    /// `alone`, so it never counts an attempt.
    done: Vec<i64>,
    /// Entries of this process's own fast batches that rolled back while it lived (a handler
    /// failed; nothing died). The batch that finds one replays its rows one per call, but need
    /// not run alone in the process: no death is to be traced.
    replays: HashSet<i64>,
}

/// More remembered replays than this are forgotten: a replay then runs alone, which is only
/// slower.
const REPLAYS_KEPT: usize = 10_000;

impl InFlight {
    /// Runs `f` on the connection (opened if need be); an error drops the connection, which is
    /// opened afresh next time.
    async fn with<T>(
        &self,
        pool: &PgPool,
        f: impl AsyncFnOnce(&AsyncPgConnection, &mut Book) -> Result<T>,
    ) -> Result<T> {
        let mut slot = self.0.lock().await;
        let InFlightConn { conn, book } = &mut *slot;
        if conn.is_none() {
            let opened = pool
                .dedicated_connection()
                .await
                .map_err(|e| Error::Pool(e.to_string()))?;
            *conn = Some(opened);
        }
        let r = f(conn.as_ref().expect("connected"), book).await;
        if r.is_err() {
            *conn = None;
        }
        r
    }

    /// Enters a batch's rows (and deletes the finished batches' entries on the way), and
    /// returns what the entries left behind say about them.
    async fn enter(&self, pool: &PgPool, consumer: &str, ids: &[i64]) -> Result<Entered> {
        self.with(pool, async |conn, book| {
            let done = std::mem::take(&mut book.done);
            let (entry, others) = inbox::enter_in_flight(conn, consumer, ids, &done).await?;
            let mut entered = Entered::new(entry, ids, others);
            entered.after_death = entered.holders.iter().any(|e| !book.replays.contains(e));
            Ok(entered)
        })
        .await
    }

    /// The in-flight record of a consumer with `concurrency` batch loops.
    pub(crate) fn new(concurrency: u32) -> Self {
        InFlight(
            Arc::default(),
            Arc::new(tokio::sync::Semaphore::new(concurrency as usize)),
        )
    }

    /// A permit for one more handler that overran keeping its connection, if the consumer has
    /// one left.
    fn overrun_permit(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.1.clone().try_acquire_owned().ok()
    }

    /// Remembers that the fast batch `entry` rolled back in this living process.
    async fn replay(&self, entry: i64) {
        let replays = &mut self.0.lock().await.book.replays;
        if replays.len() >= REPLAYS_KEPT {
            replays.clear();
        }
        replays.insert(entry);
    }

    /// Records the row the batch `entry` hands over on its own now, or none.
    async fn alone(&self, pool: &PgPool, entry: i64, row: Option<i64>) -> Result<()> {
        self.with(pool, async |conn, _| {
            inbox::set_alone(conn, &[entry], row).await
        })
        .await
    }

    /// Deletes `entries` now.
    async fn leave(&self, pool: &PgPool, entries: &[i64]) -> Result<()> {
        self.with(pool, async |conn, book| {
            inbox::leave_in_flight(conn, entries).await?;
            for entry in entries {
                book.replays.remove(entry);
            }
            Ok(())
        })
        .await
    }

    /// Deletes the entry of a committed fast batch with the next `enter`.
    async fn leave_later(&self, entry: i64) {
        self.0.lock().await.book.done.push(entry);
    }

    /// Deletes the entries of committed fast batches now, when the consumer goes idle or
    /// stops, so that none outlives the process that knows them.
    pub(crate) async fn flush(&self, pool: &PgPool) -> Result<()> {
        if self.0.lock().await.book.done.is_empty() {
            return Ok(());
        }
        self.with(pool, async |conn, book| {
            let entries = std::mem::take(&mut book.done);
            inbox::leave_in_flight(conn, &entries).await
        })
        .await
    }
}

/// What the entries a batch found say about its rows.
#[derive(Debug, Default)]
struct Entered {
    /// This batch's entry; `None` for a batch that claimed nothing.
    entry: Option<i64>,
    /// The entries left behind that hold some of the rows: if any, the rows are suspects,
    /// handed over one per call.
    holders: Vec<i64>,
    /// One of them was not left by a rollback in this living process: a process may have died
    /// holding the rows, so they are handed over with no other handler running.
    after_death: bool,
    /// Rows an entry left behind was handing over on their own: their last attempt ended
    /// without an outcome.
    interrupted: HashSet<i64>,
    /// The entries whose `alone` row is counted here.
    counted: Vec<i64>,
    /// The entries that hold only rows of this batch, to delete once it has decided them; the
    /// others keep marking their remaining rows.
    covered: Vec<i64>,
}

impl Entered {
    fn new(entry: i64, ids: &[i64], others: Vec<inbox::InFlightEntry>) -> Entered {
        let mut e = Entered {
            entry: Some(entry),
            ..Default::default()
        };
        if others.is_empty() {
            return e;
        }
        let claimed: HashSet<i64> = ids.iter().copied().collect();
        for other in others {
            let held = other
                .inbox_ids
                .iter()
                .filter(|id| claimed.contains(id))
                .count();
            if held == 0 {
                continue;
            }
            e.holders.push(other.id);
            if let Some(row) = other.alone.filter(|row| claimed.contains(row)) {
                e.interrupted.insert(row);
                e.counted.push(other.id);
            }
            if held == other.inbox_ids.len() {
                e.covered.push(other.id);
            }
        }
        e
    }
}

/// The failure recorded for a row whose last attempt was interrupted.
fn interrupted_attempt() -> HandlerError {
    HandlerError::Retry {
        code: ErrorCode::INBOX_ATTEMPT_INTERRUPTED,
        message: "the attempt ended without an outcome: the process handling the event died \
                  or its connection broke"
            .into(),
    }
}

pub(crate) async fn run_batch(
    pool: &PgPool,
    cfg: &ConsumerConfig,
    handler: &HandlerRef,
    in_flight: &InFlight,
    exclusive: bool,
) -> Result<BatchOutcome> {
    let Some(hold) = hold(cfg, exclusive).await else {
        return Ok(BatchOutcome {
            exclusive: true,
            ..Default::default()
        });
    };
    let ticket = Arc::new(Ticket);
    let mut conn: OwnedConn = pool.get_owned().await?;
    // Any early return below drops `conn` inside a transaction; the pool sees a broken
    // transaction manager and closes the connection, so PostgreSQL rolls back and no session
    // is left idle in transaction.
    let rows =
        inbox::begin_and_claim(&mut conn, cfg.name.as_str(), i64::from(cfg.batch_size)).await?;
    let claimed: Vec<i64> = rows.iter().map(|r| r.id).collect();
    // Committed before any handler sees a row; deleted once this batch has committed. An
    // earlier entry holding a claimed row was left by a batch that ended without an outcome.
    let entered = if claimed.is_empty() {
        Entered::default()
    } else {
        in_flight.enter(pool, cfg.name.as_str(), &claimed).await?
    };
    // How the batch isolates its rows. A fast batch runs the handlers without savepoints (two
    // round trips fewer per row), and a batch handler gets every row in one call; any failure
    // rolls the whole batch back, counting an attempt only against a row that failed on its own
    // in its call. Its entry in flight stays, so the batch that claims those rows again finds
    // it and is safe: one row per call with a savepoint each, so that only a failing row's
    // writes are undone and its attempt is recorded. A process that died holding rows leaves
    // them the same way. A row's effect commits at most once either way; a failed fast batch
    // only means that the rows handled before the failure (or, for a batch handler, all of
    // them) are handed over again.
    let safe = !entered.holders.is_empty();
    let mut out = BatchOutcome {
        claimed: rows.len(),
        ..Default::default()
    };
    if safe && ((entered.after_death && !exclusive) || !entered.interrupted.is_empty()) {
        // Give the rows back, to be claimed again at once by a batch that runs alone in the
        // process. Interrupted attempts are first counted, and committed with their entries
        // forgetting them before any handler runs: a count that waited for the batch's end
        // would be lost with the next death, and two events that kill the process would then
        // kill it for ever with neither ever counted.
        let mut failures = Vec::new();
        for row in rows.iter().filter(|r| entered.interrupted.contains(&r.id)) {
            let err = interrupted_attempt();
            log_failure(cfg, row, &err);
            failures.push(decide(&cfg.retry, row, &err));
        }
        if let Some(entry) = entered.entry {
            // The older entries still hold the rows given back; this one only adds noise.
            leave_now(pool, cfg, in_flight, &[entry]).await;
        }
        inbox::mark_and_commit(&mut conn, &[], &[], &failures, &entered.counted).await?;
        record_committed(cfg, &[], 0, &failures);
        out.failed = failures.len();
        out.next_retry = next_retry(&failures, 0);
        out.rolled_back = true;
        out.exclusive = true;
        return Ok(out);
    }
    // A batch handler gets the fast batch's rows in one call; a safe batch, one row per call.
    let together = matches!(handler, HandlerRef::Batch(_)) && !safe;
    // Only a batch alone in the process marks the row in hand (see `HANDLERS`).
    let marks = safe && exclusive;
    let mut processed = Vec::with_capacity(rows.len());
    let mut failures = Vec::new();
    let mut stale = Vec::new();
    // The mark of a row handed over alone could not be cleared after its call: stop there.
    let mut untraced = false;
    // Whether a handler was called on this batch's transaction before the one in hand.
    let mut called_before = false;
    // Rows ready for the handler, with their payloads, not yet handed over.
    let mut group: Vec<InboxRow> = Vec::new();
    let mut rows = rows.into_iter();

    loop {
        let next = rows.next();
        let last = next.is_none();
        if let Some(mut row) = next {
            if !handler.connected() {
                // The handler actor stopped itself after its last reply. This row was never
                // offered to it, so it costs no attempt: it is left for the replacement actor.
                out.handler_lost = true;
            } else {
                if let Err(err) = upcast(cfg, &mut row) {
                    // Never handed to the handler: no code here can read it, and retrying
                    // cannot help.
                    log_failure(cfg, &row, &err);
                    failures.push(decide(&cfg.retry, &row, &err));
                    continue;
                }
                if safe {
                    Tm::begin_transaction(&mut *conn).await?;
                }
                if let (true, Some(version)) = (cfg.skip_stale, row.aggregate_version) {
                    let name = cfg.name.as_str();
                    match inbox::advance_version(
                        &mut conn,
                        name,
                        &row.aggregate_type,
                        &row.aggregate_id,
                        version,
                    )
                    .await?
                    {
                        Advance::Applied => {}
                        Advance::Stale(current) => {
                            if safe {
                                Tm::commit_transaction(&mut *conn).await?;
                            }
                            tracing::info!(consumer = name, event_id = %row.event_id, aggregate_id = %row.aggregate_id,
                                version, current, code = "EVENT_STALE", "stale event recorded, not applied");
                            stale.push((row.id, current));
                            continue;
                        }
                        Advance::Busy => {
                            // Left unmarked: the row is unlocked at commit and claimed again
                            // shortly. Nothing was written (the lock was not taken), so a fast
                            // batch goes on.
                            if safe {
                                Tm::rollback_transaction(&mut *conn).await?;
                            }
                            out.deferred += 1;
                            continue;
                        }
                    }
                }
                group.push(row);
                if together {
                    continue;
                }
            }
        }
        if group.is_empty() {
            if last || out.handler_lost {
                break;
            }
            continue;
        }

        if let (true, Some(entry)) = (marks, entered.entry) {
            if let Err(e) = in_flight.alone(pool, entry, Some(group[0].id)).await {
                // Not recorded, so not handed over: a death now could not be traced to it.
                // The rows decided so far commit; the rest are claimed again.
                tracing::warn!(consumer = %cfg.name, error = %e, "could not record the row handed over on its own");
                Tm::rollback_transaction(&mut *conn).await?; // ROLLBACK TO SAVEPOINT
                group.clear();
                break;
            }
        }
        let call = hand_over(cfg, handler, conn, &mut group, safe, &ticket).await;
        let first_call = !std::mem::replace(&mut called_before, true);
        if call.timed_out {
            // The handler may run on, and may yet kill the process. Its attempt is counted as
            // timed out; until it ends, no row is handed over alone, so that its death is never
            // counted against one.
            overran(&ticket);
        }
        // The call is over: a death from now on is not this row's doing (or, for a handler that
        // overran, no longer counted against it).
        if let (true, Some(entry)) = (marks, entered.entry) {
            if let Err(e) = in_flight.alone(pool, entry, None).await {
                tracing::warn!(consumer = %cfg.name, error = %e, "could not clear the row handed over on its own");
                untraced = true;
            }
        }
        let many = group.len() > 1;
        if call.lost {
            out.handler_lost = true;
        }
        // If the handler still holds the connection (a query in flight after a timeout, a
        // guard kept alive), nothing on it can be trusted: abandon the batch.
        let Some(mut back) = call.conn else {
            if many {
                // Dropping the connection rolls the batch back (once the handler lets go of
                // it). Which row hung is unknown, so no attempt is counted; their entries in
                // flight make the next batch holding them hand them over one per call.
                out.rolled_back = true;
                if let Some(entry) = entered.entry {
                    in_flight.replay(entry).await;
                }
                return Ok(out);
            }
            let err = call.result.err().unwrap_or_else(|| {
                HandlerError::retry("the handler left the delivery's transaction in a bad state")
            });
            out.abandoned = true;
            if untraced {
                // The entry still names the row as handed over alone: it counts this attempt
                // when the row is claimed again. Counting it here too would count it twice.
                return Ok(out);
            }
            // The entry forgot the row when the call ended, so this attempt is counted here
            // only. The abandoned transaction still holds the row: nobody can claim it first.
            // Recording it waits for that transaction, in a task of its own, so the lock goes
            // first: no other batch, and not this consumer, waits on a handler that keeps its
            // connection.
            drop(hold);
            match in_flight.overrun_permit() {
                Some(permit) => abandon_kept(pool, cfg, &group[0], &err, permit),
                // As many handlers as the consumer has loops already hang holding their
                // connections (two each, with their marks): this loop waits for this one
                // instead, so that hanging handlers cannot empty the pool.
                None => {
                    abandon(pool, None, cfg, &group[0], &err).await;
                }
            }
            out.failed += 1;
            return Ok(out);
        };
        match call.result {
            Ok(()) => {
                if safe {
                    if let Err(e) = Tm::commit_transaction(&mut *back).await {
                        if !refused_by_server(&e) || untraced {
                            // A broken connection: nothing shows which row, if any, is at
                            // fault, so none is charged; the batch rolls back and its rows are
                            // claimed again. (Untraced: the entry still names this row as
                            // handed over alone, and counts the attempt on the next claim.)
                            return Err(e.into());
                        }
                        // RELEASE SAVEPOINT refused: the handler returned Ok although a
                        // statement of its transaction had failed (it swallowed the error), so
                        // the batch's transaction cannot commit. It is rolled back now, which
                        // unlocks the row before its attempt is recorded (diesel counts the
                        // savepoint as released after the failed RELEASE, so this is the
                        // batch's ROLLBACK; should it fail, the pool closes the connection).
                        // The other rows are claimed again at once, their entry in flight
                        // known as a replay.
                        let _ = Tm::rollback_transaction(&mut *back).await;
                        drop(back);
                        if let Some(entry) = entered.entry {
                            in_flight.replay(entry).await;
                        }
                        drop(hold);
                        let err = HandlerError::retry(format!(
                            "the handler returned Ok, but a statement of its transaction had \
                             failed, so it could not commit: {e}"
                        ));
                        abandon(pool, None, cfg, &group[0], &err).await;
                        out.failed += 1;
                        out.rolled_back = true;
                        return Ok(out);
                    }
                }
                processed.append(&mut group);
            }
            Err(err) if !safe => {
                // Known as a replay before the rollback frees the rows: nothing died, so the
                // batch that claims them next needs not run alone.
                if let Some(entry) = entered.entry {
                    in_flight.replay(entry).await;
                }
                // One row in the call, and a failure that is its own: the handler died or hung,
                // or it was the batch's first call, or the transaction is still sound after it.
                // A failed transaction after an earlier call may be that call's doing (its
                // handler swallowed a failed statement and returned Ok), whatever error this
                // handler made of it.
                let own = !many
                    && (call.lost
                        || call.timed_out
                        || first_call
                        || diesel::sql_query("SELECT 1")
                            .execute(&mut *back)
                            .await
                            .is_ok());
                // Undo the whole batch (the handler's partial writes with it).
                Tm::rollback_transaction(&mut *back).await?;
                if own {
                    // Its attempt is recorded now, on the batch's connection, so that the
                    // handler is called once per attempt, not again in the replay (only another
                    // loop of this consumer claiming the row between the rollback and this
                    // mark can call it first, and then this fenced mark counts nothing). The
                    // entry in flight lets go of it, so that the replay, which does not claim
                    // it, still finds all the entry's rows and deletes it.
                    let row = &group[0];
                    if let Some(failure) = abandon(pool, Some(&back), cfg, row, &err).await {
                        if let Some(entry) = entered.entry {
                            let _ = inbox::forget_in_flight(&back, entry, row.id).await;
                        }
                        out.next_retry = next_retry(std::slice::from_ref(&failure), 0);
                    }
                    out.failed += 1;
                }
                // The other rows (those handled before, rolled back with it, and those not yet
                // handed over) are claimed again; their entry in flight stays, which makes
                // that batch safe: one row per call with savepoints, so that a failing row's
                // attempt is recorded and the other rows' effects kept. At once, unless the
                // handler died or hung on its one row: that calls for a pause.
                out.rolled_back = many || !(call.lost || call.timed_out);
                return Ok(out);
            }
            Err(err) => {
                Tm::rollback_transaction(&mut *back).await?; // ROLLBACK TO SAVEPOINT
                let row = group.pop().expect("a safe group holds one row");
                log_failure(cfg, &row, &err);
                failures.push(decide(&cfg.retry, &row, &err));
            }
        }
        conn = back;
        if last || out.handler_lost || untraced || (marks && call.timed_out) {
            // Rows not yet handled stay locked by this transaction until the commit, then
            // are claimed again (once the handler is replaced).
            break;
        }
    }

    let ids: Vec<i64> = processed.iter().map(|r| r.id).collect();
    // The entries go before the commit releases their rows where another batch could claim a
    // row at once and find one: a safe batch's (its last row handed over is `alone`, which
    // would count an attempt) with the entries left over that hold only its rows (decided
    // now), and a fast batch's with rows left unmarked (deferred, or never offered to a lost
    // handler), which would only make that batch safe for nothing. A fast batch whose rows are
    // all marked leaves its entry for later: none of them is due again at once.
    // Every marked row is one of the claimed ones, in exactly one of the three lists.
    let unmarked = ids.len() + stale.len() + failures.len() < claimed.len();
    let mut later = None;
    if let Some(entry) = entered.entry {
        if safe || unmarked {
            // The older entries go only once every row they hold is decided: a row left
            // unmarked stays a suspect.
            let covered = if unmarked {
                Vec::new()
            } else {
                entered.covered
            };
            let entries: Vec<i64> = std::iter::once(entry).chain(covered).collect();
            if untraced {
                // The entry may still name a row as handed over alone, and the row may fail
                // now: committed with that mark, its attempt would be counted twice.
                in_flight.leave(pool, &entries).await?;
            } else {
                leave_now(pool, cfg, in_flight, &entries).await;
            }
        } else {
            later = Some(entry);
        }
    }
    if let Err(e) = inbox::mark_and_commit(&mut conn, &ids, &stale, &failures, &[]).await {
        // A fast batch whose handler swallowed a failed statement and returned Ok cannot
        // commit. Known as a replay (nothing died), the batch that claims these rows again runs
        // one row per call, each in a savepoint, and counts that row's attempt (above).
        if let Some(entry) = later {
            in_flight.replay(entry).await;
        }
        return Err(e);
    }
    if let Some(entry) = later {
        in_flight.leave_later(entry).await;
    }
    record_committed(cfg, &processed, stale.len(), &failures);
    out.processed = processed.len();
    out.failed += failures.len();
    out.next_retry = next_retry(&failures, out.deferred);
    Ok(out)
}

/// Whether PostgreSQL answered `e` (a statement it refused), as opposed to a connection that
/// broke or a client-side failure. A `RELEASE SAVEPOINT` it refuses means the transaction had
/// already failed: a statement of the handler's failed and the handler went on.
fn refused_by_server(e: &diesel::result::Error) -> bool {
    use diesel::result::DatabaseErrorKind as K;
    matches!(
        e,
        diesel::result::Error::DatabaseError(kind, _)
            if !matches!(kind, K::ClosedConnection | K::UnableToSendCommand)
    )
}

/// When the soonest of `failures` falls due again, or a deferred row (due as soon as the batch
/// holding its aggregate commits).
fn next_retry(failures: &[Failure], deferred: usize) -> Option<Duration> {
    let deferred = (deferred > 0).then_some(DEFER_DELAY);
    failures
        .iter()
        .filter(|f| !f.dead)
        .map(|f| Duration::from_millis(f.delay_ms.max(0) as u64))
        .chain(deferred)
        .min()
}

/// Deletes entries now. A failure is logged, not returned: the batch's outcome is already
/// decided, and an entry left behind only makes a later batch holding its rows safe.
async fn leave_now(pool: &PgPool, cfg: &ConsumerConfig, in_flight: &InFlight, entries: &[i64]) {
    if let Err(e) = in_flight.leave(pool, entries).await {
        tracing::warn!(consumer = %cfg.name, error = %e, "could not delete entries in flight");
    }
}

/// What handing rows to the handler came to.
struct Call {
    result: std::result::Result<(), HandlerError>,
    timed_out: bool,
    /// The handler actor died during the call.
    lost: bool,
    /// The connection, back at the depth it was lent at; `None` if the handler kept it or
    /// left a transaction of its own open.
    conn: Option<OwnedConn>,
}

/// Lends the connection to the handler for `group`'s rows (one row unless the handler takes
/// batches), moving their payloads into the deliveries, and takes it back.
async fn hand_over(
    cfg: &ConsumerConfig,
    handler: &HandlerRef,
    conn: OwnedConn,
    group: &mut [InboxRow],
    safe: bool,
    ticket: &Arc<Ticket>,
) -> Call {
    // Transaction depth while a handler runs: the batch transaction (plus the row's savepoint).
    let lent_depth = if safe { 2 } else { 1 };
    let slot = Arc::new(Mutex::new(Some(conn)));
    let deliveries: Vec<Delivery> = group
        .iter_mut()
        .map(|row| {
            tracing::debug!(
                name: "consumer.started",
                consumer = %cfg.name, event_id = %row.event_id, event_type = %row.event_type,
                aggregate_id = %row.aggregate_id, correlation_id = %row.correlation_id,
                causation_id = row.causation_id.as_deref(), attempt = row.attempt_count + 1,
                "consumer.started"
            );
            // The payload and metadata move into the delivery instead of being copied; what
            // stays behind (ids, attempt, aggregate) is all the marks and logs need.
            let mut handed = row.clone_without_payload();
            handed.payload = std::mem::take(&mut row.payload);
            handed.metadata = std::mem::take(&mut row.metadata);
            Delivery {
                row: handed,
                consumer: cfg.name.clone(),
                slot: slot.clone(),
                _ticket: Some(ticket.clone()),
                events: cfg.events.clone(),
            }
        })
        .collect();
    let sent = match handler {
        HandlerRef::One(h) => {
            let d = deliveries.into_iter().next().expect("one row per call");
            tokio::time::timeout(cfg.handler_timeout, h.send(d)).await
        }
        HandlerRef::Batch(h) => {
            let batch = DeliveryBatch {
                deliveries,
                slot: slot.clone(),
            };
            tokio::time::timeout(cfg.handler_timeout, h.send(batch)).await
        }
    };
    let (timed_out, mut lost) = (sent.is_err(), false);
    let result = match sent {
        Ok(Ok(result)) => result,
        Ok(Err(_)) => {
            // A panic in `handle` kills the actor; one inside a returned future only kills
            // that future's task. Either way this call failed; only a dead actor needs
            // replacing.
            lost = !handler.connected();
            Err(HandlerError::retry(HANDLER_LOST))
        }
        Err(_) => Err(handler_timed_out(cfg)),
    };
    let taken = slot.try_lock().ok().and_then(|mut g| g.take());
    let conn = taken.and_then(|mut c| (depth(&mut c) == Some(lent_depth)).then_some(c));
    Call {
        result,
        timed_out,
        lost,
        conn,
    }
}

/// Lifts the row's payload to the current version of its registered type, if the runtime has
/// an [`EventRegistry`](crate::EventRegistry).
pub(crate) fn upcast(cfg: &ConsumerConfig, row: &mut InboxRow) -> Result<(), HandlerError> {
    let Some(registry) = &cfg.events else {
        return Ok(());
    };
    match registry.upcast(&row.event_type, row.event_version, &row.payload) {
        Upcast::Unregistered => Ok(()),
        Upcast::Current(version, payload) => {
            row.event_version = version;
            row.payload = payload;
            Ok(())
        }
        Upcast::Unsupported(m) => Err(HandlerError::permanent(
            ErrorCode::EVENT_VERSION_UNSUPPORTED,
            m,
        )),
        Upcast::Newer(message) => Err(HandlerError::Retry {
            code: ErrorCode::EVENT_VERSION_UNSUPPORTED,
            message,
        }),
        Upcast::Invalid(m) => Err(HandlerError::permanent(ErrorCode::EVENT_SCHEMA_INVALID, m)),
    }
}

fn depth(conn: &mut OwnedConn) -> Option<u32> {
    Tm::transaction_manager_status_mut(&mut **conn)
        .transaction_depth()
        .ok()
        .flatten()
        .map(|d| d.get())
}

/// The retry decision for one failed attempt. The attempt is counted before deciding.
pub(crate) fn decide(policy: &RetryPolicy, row: &InboxRow, err: &HandlerError) -> Failure {
    let attempt = (row.attempt_count.max(0) as u32) + 1;
    let seed = row.event_id.as_u64_pair().0 ^ row.event_id.as_u64_pair().1;
    let (dead, delay) = match err {
        HandlerError::Permanent { .. } => (true, Duration::ZERO),
        _ if policy.exhausted(attempt) => (true, Duration::ZERO),
        HandlerError::RetryAfter { after, .. } => (false, *after),
        HandlerError::Retry { .. } => (false, policy.delay(attempt, seed)),
    };
    Failure {
        id: row.id,
        attempts_before: row.attempt_count,
        dead,
        delay_ms: super::retry::delay_ms(delay),
        code: err.code().as_str().to_owned(),
        message: err.message().to_owned(),
    }
}

/// Logs and counts what a committed batch did; nothing is reported for a batch that rolled back.
fn record_committed(
    cfg: &ConsumerConfig,
    processed: &[InboxRow],
    stale: usize,
    failures: &[Failure],
) {
    let consumer = cfg.name.as_str();
    let now = chrono::Utc::now();
    for row in processed {
        let latency = (now - row.event_created_at).num_microseconds().unwrap_or(0) as f64 / 1e6;
        metrics::delivery_latency(consumer, latency.max(0.0));
        tracing::debug!(
            name: "consumer.completed",
            consumer, event_id = %row.event_id, event_type = %row.event_type,
            aggregate_id = %row.aggregate_id, correlation_id = %row.correlation_id,
            causation_id = row.causation_id.as_deref(), attempt = row.attempt_count + 1,
            "consumer.completed"
        );
    }
    // Stale rows are marked PROCESSED too (with `EVENT_STALE`).
    metrics::inbox_processed(consumer, (processed.len() + stale) as u64);
    metrics::inbox_failed(consumer, failures.len() as u64);
    metrics::inbox_dead_lettered(consumer, failures.iter().filter(|f| f.dead).count() as u64);
}

fn log_failure(cfg: &ConsumerConfig, row: &InboxRow, err: &HandlerError) {
    tracing::warn!(
        name: "consumer.failed",
        consumer = %cfg.name, event_id = %row.event_id, event_type = %row.event_type,
        aggregate_id = %row.aggregate_id, correlation_id = %row.correlation_id,
        causation_id = row.causation_id.as_deref(), attempt = row.attempt_count + 1,
        error_code = %err.code(), error = %err.message(),
        "consumer.failed"
    );
}

/// Records a failed attempt outside the abandoned transaction: on `conn`, the batch's own
/// connection once its transaction has rolled back, or else on a fresh one. Fenced on the
/// attempt count, so if another batch has meanwhile handled the row nothing changes. Returns
/// the failure recorded when the row is decided (marked now or before), `None` when the mark
/// failed.
async fn abandon(
    pool: &PgPool,
    conn: Option<&AsyncPgConnection>,
    cfg: &ConsumerConfig,
    row: &InboxRow,
    err: &HandlerError,
) -> Option<Failure> {
    log_failure(cfg, row, err);
    let failure = decide(&cfg.retry, row, err);
    mark_abandoned(pool, conn, cfg.name.as_str(), row.event_id, &failure)
        .await
        .then_some(failure)
}

/// [`abandon`] for a row whose handler overran its timeout and keeps the connection, and with
/// it the row's lock: the mark waits for the lock in a task of its own, holding `permit` until
/// it is made, and the attempt is counted as soon as the handler lets go (its transaction then
/// rolls back). Awaited here, the wait stalled the consumer for as long as the handler hung.
fn abandon_kept(
    pool: &PgPool,
    cfg: &ConsumerConfig,
    row: &InboxRow,
    err: &HandlerError,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    log_failure(cfg, row, err);
    let failure = decide(&cfg.retry, row, err);
    let (pool, consumer, event_id) = (pool.clone(), cfg.name.as_str().to_owned(), row.event_id);
    actix_rt::spawn(async move {
        let _ = mark_abandoned(&pool, None, &consumer, event_id, &failure).await;
        drop(permit);
    });
}

/// Records `failure` outside any batch transaction: on `conn` (idle, outside a transaction)
/// if given, else on a connection of the pool's.
async fn mark_abandoned(
    pool: &PgPool,
    conn: Option<&AsyncPgConnection>,
    consumer: &str,
    event_id: uuid::Uuid,
    failure: &Failure,
) -> bool {
    let dead = failure.dead;
    let failures = std::slice::from_ref(failure);
    let marked = match conn {
        Some(conn) => inbox::mark_failed(conn, failures).await,
        None => match pool.get().await {
            Ok(conn) => inbox::mark_failed(&conn, failures).await,
            Err(e) => Err(e.into()),
        },
    };
    match marked {
        // As `record_committed` counts the failures a batch commits.
        Ok(n) if n > 0 => {
            metrics::inbox_failed(consumer, 1);
            if dead {
                metrics::inbox_dead_lettered(consumer, 1);
            }
            true
        }
        Ok(_) => true,
        // The row keeps its state and is claimed again; the attempt goes uncounted.
        Err(e) => {
            tracing::warn!(consumer, %event_id, error = %e, "could not record a failed attempt");
            false
        }
    }
}
