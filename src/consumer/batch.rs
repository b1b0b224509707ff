//! One batch of one consumer: lease due inbox rows, hand them to the handler in one
//! transaction, settle every row in that transaction's commit.
//!
//! 1. **Claim.** Up to `batch_size` due rows are leased under one token: one `inbox_leases`
//!    row names them, committed before any handler sees a row (`inbox_claim.sql`).
//! 2. **Fast pass.** One transaction, no savepoints: each row's handler in turn (or one call
//!    with every row, for a batch handler). One commit per batch, not per row, is what lets a
//!    consumer keep up with a producer that batches.
//! 3. **Careful pass**, only after a failure in the fast pass: the fast transaction rolls back,
//!    and the rows not yet decided are handed over again one per call, each in a savepoint, so
//!    that a failing row's writes and attempt are its own and the others' effects still commit.
//!    A careful pass whose first calls all fail, to be retried, gives the rest back unspent
//!    (`decide::gives_up`): its handler is failing everything, not one event.
//! 4. **Settle.** The marks of every row (PROCESSED, failed, given back) are fenced on the
//!    lease and pipelined with the `COMMIT`; a row the lease no longer holds fails the
//!    transaction, so an effect never commits beside another delivery's.
//!
//! A handler that overruns its timeout and still runs takes the transaction with it: every
//! other row is given back, and its call's rows stay leased until it lets go (`lend.rs`); then
//! its row is charged (or, for a call of several rows, each is handed over alone). A loop
//! that dies, or whose connection breaks, settles nothing: its lease expires (or is made to
//! look expired) and the reaper judges it (`reap.rs`), which is what makes a handler that
//! kills its process or its database backend count.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel_async::{AnsiTransactionManager as Tm, TransactionManager};

use super::actor::HandlerRef;
use super::lend::Hung;
use super::pass::{Pass, PassEnd};
use super::threads::SlotUse;
use super::{decide, log, ConsumerConfig};
use crate::error::Result;
use crate::event::redact::Redactor;
use crate::store::inbox::{self, InboxRow, Outcome, Place, Settle};
use crate::store::scan::ScanStart;
use crate::store::{self, OwnedConn, PgPool, DB_TIMEOUT};
use crate::telemetry::metrics;

/// What one batch did, for the actor's bookkeeping.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct BatchOutcome {
    pub claimed: usize,
    pub processed: usize,
    pub failed: usize,
    /// Rows given back unhandled, due again in their place: behind the next claim's start.
    pub given_back: usize,
    /// Claim again at once, whatever the batch held ([`ScanStart::answered`]).
    pub more: bool,
    /// The soonest retry this batch scheduled (or a row it gave back), for the actor's wake.
    pub next_retry: Option<std::time::Duration>,
    /// The handler actor stopped (panicked) during the batch and must be replaced.
    pub handler_lost: bool,
    /// The batch was a row claimed alone: the next may be too, and is claimed at once.
    pub alone: bool,
    /// A call overran its timeout and was parked: its handler may still hold its thread, so
    /// the loop ends and the next is given a handler on another thread.
    pub kept: bool,
}

pub(crate) async fn run_batch(
    pool: &PgPool,
    cfg: &ConsumerConfig,
    handler: &HandlerRef,
    hung: &Hung,
    draining: &Arc<AtomicBool>,
    used: &SlotUse,
    scan: &ScanStart<Place>,
) -> Result<BatchOutcome> {
    // A cursor consumer reads its cursor first, and its inbox (its exceptions) first one turn
    // in eight and whenever the cursor has nothing, so retries never wait long. With a HIGH
    // type, its LOW lane goes first one turn in five; with none, both lanes in stamp order.
    let turn = cfg.turn.fetch_add(1, Ordering::Relaxed);
    let cursor_first = cfg.reads_cursor() && !turn.is_multiple_of(8);
    let low_first = (!cfg.high.is_empty()).then_some(turn.is_multiple_of(5));
    let cursor = || run_cursor(pool, cfg, handler, hung, draining, used, low_first);
    if cursor_first {
        if let Some(out) = cursor().await? {
            return Ok(out);
        }
    }
    // Before the claim: the lease starts at the claim's `now()`, not after its answer.
    let started = Instant::now();
    let mut conn: OwnedConn = pool.get_owned().await?;
    let lease_ms = store::millis(cfg.lease_period());
    let token = inbox::new_token();
    let limit = i64::from(cfg.batch_size);
    let name = cfg.name.as_str();
    let after = scan.next();
    let claimed = store::bounded(&mut conn, DB_TIMEOUT, async |c| {
        inbox::claim(
            c,
            name,
            limit,
            lease_ms,
            token,
            !cfg.skip_dead_letters,
            after,
        )
        .await
    })
    .await;
    let (rows, alone, more) = match claimed {
        Ok(claimed) => {
            let full = claimed.rows.len() as i64 >= limit;
            let alone = claimed.rows.iter().any(|r| r.alone);
            let more = scan.answered(after, claimed.last, full, alone);
            (claimed.rows, alone, more)
        }
        Err(e) => {
            // The claim may have committed with its answer lost.
            expire(pool, cfg, token).await;
            return Err(e);
        }
    };
    if rows.is_empty() {
        if cfg.reads_cursor() && !cursor_first {
            drop(conn);
            if let Some(out) = cursor().await? {
                return Ok(out);
            }
        }
        return Ok(BatchOutcome {
            more,
            ..Default::default()
        });
    }
    let mut unsettled = Unsettled {
        pool: pool.clone(),
        rows: rows.iter().map(|r| (r.id, r.lease_token)).collect(),
        cursor: None,
    };
    let batch = Batch {
        cfg,
        handler,
        started,
        draining,
        used,
        cursor: false,
    };
    let out = batch
        .run(pool, hung, conn, rows)
        .await
        .map(|o| BatchOutcome { alone, more, ..o });
    if !matches!(&out, Ok(o) if o.given_back == 0 && !o.kept) {
        // Rows were given back, or will be, behind the next claim's start (failed ones later).
        scan.reset();
    }
    // Settled, or left to the reaper on purpose.
    unsettled.rows.clear();
    if let Err(e) = &out {
        // The batch failed (its connection broke, its backend crashed, a statement timed out)
        // with rows still leased. It settles nothing: its own handler may have caused it.
        if matches!(e, crate::Error::DatabaseTimeout(_)) {
            // What silenced this connection has most likely silenced the idle ones too.
            store::sweep_idle(pool).await;
        }
        expire(pool, cfg, token).await;
    }
    out
}

/// A cursor consumer's batch of the events past its cursor (`inbox::cursor`): `None` when
/// the cursor has nothing for it. Its rows are handed over as the inbox's are; one commit
/// moves the cursor past them all with the processed ones' effects, and gives the others
/// inbox rows (promotes its lease).
async fn run_cursor(
    pool: &PgPool,
    cfg: &ConsumerConfig,
    handler: &HandlerRef,
    hung: &Hung,
    draining: &Arc<AtomicBool>,
    used: &SlotUse,
    low_first: Option<bool>,
) -> Result<Option<BatchOutcome>> {
    let started = Instant::now();
    let mut conn: OwnedConn = pool.get_owned().await?;
    let lease_ms = store::millis(cfg.lease_period());
    let token = inbox::new_token();
    let limit = i64::from(cfg.batch_size);
    let claimed = store::bounded(&mut conn, DB_TIMEOUT, async |c| {
        inbox::cursor::claim(c, cfg.name.as_str(), limit, lease_ms, token, low_first).await
    })
    .await;
    let claimed = match claimed {
        Ok(claimed) => claimed,
        Err(e) => {
            expire(pool, cfg, token).await;
            return Err(e);
        }
    };
    if claimed.rows.is_empty() {
        // Turning its cursors off: dropped once nothing is left for it there.
        let retire = async |c: &mut _| inbox::cursor::retire(c, cfg.name.as_str()).await;
        if !cfg.cursor && !claimed.more && store::bounded(&mut conn, DB_TIMEOUT, retire).await? {
            cfg.retiring.store(false, Ordering::Relaxed);
        }
        return Ok(claimed.more.then(|| BatchOutcome {
            more: true,
            ..Default::default()
        }));
    }
    let mut unsettled = Unsettled {
        pool: pool.clone(),
        rows: Vec::new(),
        cursor: Some((cfg.name.as_str().to_owned(), token)),
    };
    let batch = Batch {
        cfg,
        handler,
        started,
        draining,
        used,
        cursor: true,
    };
    let out = batch
        .run(pool, hung, conn, claimed.rows)
        .await
        .map(|o| BatchOutcome {
            more: claimed.more,
            ..o
        });
    unsettled.cursor = None;
    if out.is_err() {
        expire(pool, cfg, token).await;
    }
    out.map(Some)
}

/// Makes lease `token` look expired, so that the next reap judges it as a death now rather
/// than a lease from now; should that fail too, it expires anyway. The pool may lend idle
/// connections that died with the batch's (a server restart, a terminated session): each is
/// closed as it fails, and the next one tried, up to the pool's size.
async fn expire(pool: &PgPool, cfg: &ConsumerConfig, token: i64) {
    let patience = store::millis(decide::patience(cfg));
    for _ in 0..=pool.state().connections {
        let Ok(mut conn) = pool.get().await else {
            return;
        };
        let expired = store::bounded(&mut conn, DB_TIMEOUT, async |c| {
            inbox::expire(c, token, patience).await
        });
        if expired.await.is_ok() {
            return;
        }
        // A statement this small fails only with its connection: not lent again.
        store::poison(&mut conn);
    }
}

/// A lease whose batch was dropped before it returned (its consumer actor stopped or panicked
/// mid-batch, or a graceful shutdown cut it off; the process lives): its rows are given back
/// at once, unspent, rather than when the lease expires. A handler still running with one of
/// them writes into a transaction that nobody will commit. A graceful shutdown waits for these
/// ([`given_back`]): a process that exits first would leave leases that look like a death.
struct Unsettled {
    pool: PgPool,
    rows: Vec<(i64, i64)>,
    /// A cursor batch's consumer and lease, given back whole.
    cursor: Option<(String, i64)>,
}

/// Give-backs of cut-off batches not yet written, in this process.
static GIVING_BACK: AtomicUsize = AtomicUsize::new(0);

/// Waits, for at most `limit`, until the rows of every batch cut off so far are given back.
pub(crate) async fn given_back(limit: Duration) {
    let deadline = tokio::time::Instant::now() + limit;
    while GIVING_BACK.load(Ordering::SeqCst) > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

impl Drop for Unsettled {
    fn drop(&mut self) {
        let cursor = self.cursor.take();
        if self.rows.is_empty() && cursor.is_none() {
            return;
        }
        let outcomes: Vec<Outcome> = self
            .rows
            .iter()
            .map(|&(id, token)| Outcome {
                id,
                token,
                settle: Settle::Release,
            })
            .collect();
        let pool = self.pool.clone();
        if let Some(arbiter) = actix_rt::Arbiter::try_current() {
            // Counted until the task ends or is dropped unrun (its arbiter stopped).
            struct Counted;
            impl Drop for Counted {
                fn drop(&mut self) {
                    GIVING_BACK.fetch_sub(1, Ordering::SeqCst);
                }
            }
            GIVING_BACK.fetch_add(1, Ordering::SeqCst);
            let counted = Counted;
            arbiter.spawn(async move {
                let _counted = counted;
                if let Ok(mut conn) = pool.get().await {
                    let _ = store::bounded(&mut conn, DB_TIMEOUT, async |c| match &cursor {
                        Some((consumer, token)) => {
                            inbox::cursor::give_back(c, consumer, *token).await
                        }
                        // Rows given back store no message: nothing to redact.
                        None => inbox::settle_now(c, &outcomes, &Redactor::default())
                            .await
                            .map(drop),
                    })
                    .await;
                }
            });
        }
    }
}

struct Batch<'a> {
    cfg: &'a ConsumerConfig,
    handler: &'a HandlerRef,
    started: Instant,
    draining: &'a Arc<AtomicBool>,
    /// The handler slot the loop uses; a parked call keeps a use of it until it lets go.
    used: &'a SlotUse,
    /// A cursor batch: its rows' ids are event seqs, no inbox statement's; its promotion names
    /// the inbox rows its outcomes settle.
    cursor: bool,
}

impl Batch<'_> {
    async fn run(
        &self,
        pool: &PgPool,
        hung: &Hung,
        mut conn: OwnedConn,
        mut rows: Vec<InboxRow>,
    ) -> Result<BatchOutcome> {
        let cfg = self.cfg;
        let mut out = BatchOutcome {
            claimed: rows.len(),
            ..Default::default()
        };
        let token = rows[0].lease_token;
        let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
        let cursor = self.cursor;
        // Outcomes decided outside the transaction they will commit with (a row charged
        // before a careful pass), settled with the next commit.
        let mut decided: Vec<Outcome> = Vec::new();
        let mut careful = false;
        loop {
            let pass = Pass {
                cfg,
                handler: self.handler,
                started: self.started,
                careful,
                draining: self.draining,
                thread: self.used.thread.as_ref(),
            };
            let again = match pass.run(conn, rows, &mut out).await? {
                PassEnd::Commit(mut back, outcomes, processed) => {
                    let all: Vec<Outcome> = decided.iter().cloned().chain(outcomes).collect();
                    // The rows to settle: `None` to go careful, `Some(None)` every outcome.
                    let settle = if cursor {
                        let end = cursor_commit(cfg, &mut back, token, &all, ids.len(), careful);
                        match end.await? {
                            CursorEnd::Committed => {
                                record(cfg, &processed, &all, &mut out);
                                return Ok(out);
                            }
                            // Still a cursor batch until this commit: one refused rolls the
                            // promotion back with it.
                            CursorEnd::Promoted(settle) => Some(Some(settle)),
                            // A handler left the transaction failed: a careful pass finds which.
                            CursorEnd::Refused => None,
                        }
                    } else {
                        Some(None)
                    };
                    match settle {
                        None => back,
                        Some(settle) => {
                            let rows = settle.as_deref().unwrap_or(&all);
                            let committed = store::bounded(&mut back, DB_TIMEOUT, async |c| {
                                inbox::settle_and_commit(c, rows, &cfg.redact).await
                            });
                            match committed.await {
                                Ok(()) => {
                                    record(cfg, &processed, &all, &mut out);
                                    return Ok(out);
                                }
                                // A handler returned Ok from a transaction it had left failed (it
                                // swallowed a failed statement): the commit rolled back. A careful
                                // pass finds which, by its savepoint.
                                Err(crate::Error::Database(e))
                                    if !careful
                                        && store::answered_by_server(&e)
                                        && !in_transaction(&mut back) =>
                                {
                                    back
                                }
                                Err(e) => return Err(e),
                            }
                        }
                    }
                }
                PassEnd::Again(back, charged) => {
                    decided.extend(charged);
                    back
                }
                PassEnd::Kept(slot, backend, outcomes, mut parked) => {
                    decided.extend(outcomes);
                    // A cursor lease that could not be promoted is left to the reaper whole.
                    let mut to_reaper = false;
                    if cursor {
                        // The events get inbox rows, and the hung call's stay leased to it.
                        let promoted = async {
                            let mut conn = pool.get_owned().await?;
                            store::bounded(&mut conn, DB_TIMEOUT, async |c| {
                                inbox::cursor::promote(c, token, true, true, &[]).await
                            })
                            .await
                        };
                        match promoted.await {
                            Ok(p) => {
                                decided = p.remap(decided);
                                parked = p.remap(parked);
                            }
                            Err(e) => {
                                // Nothing is settled here: the lease expires, and the reaper
                                // promotes and judges it.
                                tracing::warn!(consumer = %cfg.name, error = %e,
                                    "could not give a hung cursor batch's events inbox rows");
                                decided.clear();
                                parked.clear();
                                expire(pool, cfg, token).await;
                                to_reaper = true;
                            }
                        }
                    }
                    // First the lease is taken off the handler's session (which may end from
                    // now on: the engine ends it past the grace) and renewed. Then the batch's
                    // other rows, given back (or charged) at once: they must not wait, leased,
                    // for a place to park the handler in.
                    let lease_ms = store::millis(cfg.lease_period());
                    let settled = async {
                        if to_reaper {
                            return Ok(0);
                        }
                        let mut conn = pool.get_owned().await?;
                        store::bounded(&mut conn, DB_TIMEOUT, async |c| {
                            inbox::extend(c, token, lease_ms).await?;
                            inbox::settle_now(c, &decided, &cfg.redact).await
                        })
                        .await
                    };
                    let settled = settled.await;
                    if let Err(e) = &settled {
                        // No error past this point: the batch's would expire the lease the
                        // parked call still holds. Its other rows go with the parked call's.
                        tracing::warn!(consumer = %cfg.name, error = %e,
                            "could not settle a batch's rows beside a hung handler: they wait \
                             for it");
                        parked.append(&mut decided);
                    }
                    // Then the place: a consumer holds at most `concurrency` parked handlers
                    // beside its loops' own connections.
                    hung.park(cfg, pool, slot, backend, parked, self.used.blocked())
                        .await;
                    record(cfg, &[], &decided, &mut out);
                    out.kept = true;
                    return Ok(out);
                }
            };
            careful = true;
            conn = again;
            let left: Vec<i64> = ids
                .iter()
                .copied()
                .filter(|id| !decided.iter().any(|o| o.id == *id))
                .collect();
            // A cursor batch stays one through its careful pass: only the events that end
            // unprocessed get inbox rows, with its commit.
            rows = store::bounded(&mut conn, DB_TIMEOUT, async |c| match cursor {
                true => inbox::cursor::reload(c, &left, token).await,
                false => inbox::reload(c, &left, token).await,
            })
            .await?;
        }
    }
}

/// How a cursor batch's pass ended ([`cursor_commit`]).
enum CursorEnd {
    /// Every event processed, committed with the cursor's move.
    Committed,
    /// Exceptions: the events not processed got inbox rows in the open transaction, which
    /// moves the cursor past every event when it commits; the outcomes to settle, naming
    /// those rows.
    Promoted(Vec<Outcome>),
    /// A fast pass's commit, or promotion, was refused (a handler left the transaction
    /// failed) and rolled back.
    Refused,
}

/// Commits a cursor batch whose every event was processed (`all`, its outcomes, of `leased`),
/// moving its cursor; else gives the others inbox rows in the transaction, for the settle.
async fn cursor_commit(
    cfg: &ConsumerConfig,
    conn: &mut OwnedConn,
    token: i64,
    all: &[Outcome],
    leased: usize,
    careful: bool,
) -> Result<CursorEnd> {
    let handled: Vec<i64> = all
        .iter()
        .filter(|o| o.settle == Settle::Processed)
        .map(|o| o.id)
        .collect();
    if handled.len() < leased {
        let promoted = store::bounded(conn, DB_TIMEOUT, async |c| {
            inbox::cursor::promote(c, token, false, true, &handled).await
        });
        return match promoted.await {
            Ok(p) => Ok(CursorEnd::Promoted(p.remap(all.to_vec()))),
            // Refused in a transaction a handler left failed: rolled back, as a refused commit.
            Err(crate::Error::Database(e)) if !careful && store::answered_by_server(&e) => {
                let rolled =
                    store::bounded(conn, DB_TIMEOUT, async |c| store::run(c, "ROLLBACK").await)
                        .await;
                store::after_commit(conn, rolled)?;
                Ok(CursorEnd::Refused)
            }
            Err(e) => Err(e),
        };
    }
    let committed = store::bounded(conn, DB_TIMEOUT, async |c| {
        inbox::cursor::commit(c, cfg.name.as_str(), token).await
    });
    match committed.await {
        Ok(()) => Ok(CursorEnd::Committed),
        Err(crate::Error::Database(e))
            if !careful && store::answered_by_server(&e) && !in_transaction(conn) =>
        {
            Ok(CursorEnd::Refused)
        }
        Err(e) => Err(e),
    }
}

fn in_transaction(conn: &mut OwnedConn) -> bool {
    Tm::transaction_manager_status_mut(&mut **conn)
        .transaction_depth()
        .map_or(true, |d| d.is_some())
}

/// Logs and counts what a settled batch did; nothing is reported for one that rolled back.
fn record(
    cfg: &ConsumerConfig,
    processed: &[InboxRow],
    settled: &[Outcome],
    out: &mut BatchOutcome,
) {
    let consumer = cfg.name.as_str();
    let now = chrono::Utc::now();
    let mut in_time = 0;
    for row in processed {
        let latency = (now - row.event_created_at).num_microseconds().unwrap_or(0) as f64 / 1e6;
        metrics::delivery_latency(consumer, latency.max(0.0));
        in_time += u64::from(
            cfg.allowed_delay
                .is_some_and(|d| latency <= d.as_secs_f64()),
        );
        log::completed(cfg, row);
    }
    if cfg.allowed_delay.is_some() {
        metrics::processed_within_allowed_delay(consumer, in_time);
    }
    let count = |f: fn(&Settle) -> bool| settled.iter().filter(|o| f(&o.settle)).count();
    let done = count(|s| matches!(s, Settle::Processed | Settle::Stale(_)));
    let failed = count(|s| matches!(s, Settle::Failed(_)));
    out.given_back = count(|s| matches!(s, Settle::Release));
    let dead = count(|s| matches!(s, Settle::Failed(f) if f.dead));
    // Stale rows are marked PROCESSED too (with `EVENT_STALE`).
    metrics::inbox_processed(consumer, done as u64);
    metrics::inbox_failed(consumer, failed as u64);
    metrics::inbox_dead_lettered(consumer, dead as u64);
    if !settled.is_empty() {
        // The batch's line; each event's own are at `debug` (`log.rs`).
        tracing::info!(name: "consumer.completed", consumer, processed = done, failed, dead,
            "consumer.completed");
    }
    out.processed = processed.len();
    out.failed = failed;
    out.next_retry = decide::next_retry(settled);
}
