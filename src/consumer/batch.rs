//! One batch of one consumer: lease due inbox rows, hand them to the handler in one
//! transaction, settle every row in that transaction's commit.
//!
//! 1. **Claim.** Up to `batch_size` rows move to PROCESSING under one lease token, each
//!    attempt counted, committed before any handler sees a row (`inbox_claim.sql`).
//! 2. **Fast pass.** One transaction, no savepoints: each row's handler in turn (or one call
//!    with every row, for a batch handler). One commit per batch, not per row, is what lets a
//!    consumer keep up with a producer that batches.
//! 3. **Careful pass**, only after a failure in the fast pass: the fast transaction rolls back,
//!    and the rows not yet decided are handed over again one per call, each in a savepoint, so
//!    that a failing row's writes and attempt are its own and the others' effects still commit.
//! 4. **Settle.** The marks of every row (PROCESSED, failed, given back) are fenced on the
//!    lease and pipelined with the `COMMIT`; a row the lease no longer holds fails the
//!    transaction, so an effect never commits beside another delivery's.
//!
//! A handler that overruns its timeout keeping the connection takes the transaction with it:
//! its row is charged (or, for a call of several rows, each is given back to be handed over
//! alone), every other row is given back, and the connection is parked (`lend.rs`). A loop
//! that dies, or whose connection breaks, settles nothing: its lease expires and the reaper
//! settles it (`reap.rs`), which is what makes a handler that kills its process or its
//! database backend count.

use std::time::Instant;

use diesel_async::{AnsiTransactionManager as Tm, RunQueryDsl, TransactionManager};

use super::actor::HandlerRef;
use super::decide::{self, after_call, CallEnd, Next};
use super::lend::{self, Hung};
use super::{log, ConsumerConfig, HandlerError};
use crate::error::Result;
use crate::event::Upcast;
use crate::maintenance::metrics;
use crate::store::inbox::{self, Advance, InboxRow, Outcome, Settle};
use crate::store::{self, OwnedConn, PgPool, DB_TIMEOUT};

/// What one batch did, for the actor's bookkeeping.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct BatchOutcome {
    pub claimed: usize,
    pub processed: usize,
    pub failed: usize,
    /// The soonest retry this batch scheduled (or a row it gave back), so the actor can wake
    /// for it.
    pub next_retry: Option<std::time::Duration>,
    /// The handler actor stopped (panicked) during the batch and must be replaced.
    pub handler_lost: bool,
    /// The batch was a row claimed alone: the next may be too, and is claimed at once.
    pub alone: bool,
}

pub(crate) async fn run_batch(
    pool: &PgPool,
    cfg: &ConsumerConfig,
    handler: &HandlerRef,
    hung: &Hung,
) -> Result<BatchOutcome> {
    // Before the claim: the lease starts at the claim's `now()`, not after its answer.
    let started = Instant::now();
    let mut conn: OwnedConn = pool.get_owned().await?;
    let lease_ms = store::millis(cfg.lease_period());
    let token = inbox::new_token();
    let claim = inbox::claim(
        &mut conn,
        cfg.name.as_str(),
        i64::from(cfg.batch_size),
        lease_ms,
        token,
    );
    let rows = match bounded!(conn, claim) {
        Ok(rows) => rows,
        Err(e) => {
            // The claim may have committed with its answer lost.
            expire(pool, cfg, token).await;
            return Err(e);
        }
    };
    if rows.is_empty() {
        return Ok(BatchOutcome::default());
    }
    let alone = rows.iter().any(|r| r.alone);
    let mut unsettled = Unsettled {
        pool: pool.clone(),
        rows: rows.iter().map(|r| (r.id, r.lease_token)).collect(),
    };
    let batch = Batch {
        cfg,
        handler,
        started,
    };
    let out = batch
        .run(pool, hung, conn, rows)
        .await
        .map(|o| BatchOutcome { alone, ..o });
    // Settled, or left to the reaper on purpose.
    unsettled.rows.clear();
    if let Err(e) = &out {
        // The batch failed (its connection broke, its backend crashed, a statement timed out)
        // with rows still leased. It settles nothing itself: its own handler may have caused
        // the failure.
        if matches!(e, crate::Error::DatabaseTimeout(_)) {
            // What silenced this connection has most likely silenced the idle ones too.
            store::sweep_idle(pool).await;
        }
        expire(pool, cfg, token).await;
    }
    out
}

/// Makes lease `token` look expired, so that the next reap judges it as a death now rather
/// than a lease from now; should that fail too, it expires anyway. The pool may lend idle
/// connections that died with the batch's (a server restart, a terminated session): each is
/// closed as it fails, and the next one tried, up to the pool's size.
async fn expire(pool: &PgPool, cfg: &ConsumerConfig, token: i64) {
    let patience = store::millis(cfg.lease_period());
    for _ in 0..=pool.state().connections {
        let Ok(mut conn) = pool.get().await else {
            return;
        };
        if bounded!(conn, inbox::expire(&mut conn, token, patience)).is_ok() {
            return;
        }
        // A statement this small fails only with its connection (a terminated session's
        // first error is the server's, with its own code): not lent again.
        store::poison(&mut conn);
    }
}

/// A lease whose batch was dropped before it returned (its consumer actor stopped or panicked
/// mid-batch; the process lives): its rows are given back at once rather than when the lease
/// expires. A handler still running with one of them writes into a transaction that nobody
/// will commit.
struct Unsettled {
    pool: PgPool,
    rows: Vec<(i64, i64)>,
}

impl Drop for Unsettled {
    fn drop(&mut self) {
        if self.rows.is_empty() {
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
            arbiter.spawn(async move {
                if let Ok(mut conn) = pool.get().await {
                    let _ = bounded!(conn, inbox::settle_now(&mut conn, &outcomes));
                }
            });
        }
    }
}

struct Batch<'a> {
    cfg: &'a ConsumerConfig,
    handler: &'a HandlerRef,
    started: Instant,
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
            };
            let again = match pass.run(conn, rows, &mut out).await? {
                PassEnd::Commit(mut back, outcomes, processed) => {
                    let all: Vec<Outcome> = decided.iter().cloned().chain(outcomes).collect();
                    match bounded!(back, inbox::settle_and_commit(&mut back, &all)) {
                        Ok(()) => {
                            record(cfg, &processed, &all, &mut out);
                            return Ok(out);
                        }
                        // A handler returned Ok from a transaction it had left failed (it
                        // swallowed a failed statement): the commit rolled back. A careful
                        // pass finds which, by its savepoint.
                        Err(crate::Error::Database(e))
                            if !careful && refused_by_server(&e) && !in_transaction(&mut back) =>
                        {
                            back
                        }
                        Err(e) => return Err(e),
                    }
                }
                PassEnd::Again(back, charged) => {
                    decided.extend(charged);
                    back
                }
                PassEnd::Kept(slot, backend, outcomes, parked) => {
                    decided.extend(outcomes);
                    // The place first: a consumer holds at most `concurrency` parked handlers
                    // beside its loops' own connections.
                    hung.park(cfg, pool, slot, backend, parked).await;
                    let mut conn = pool.get_owned().await?;
                    bounded!(conn, inbox::settle_now(&mut conn, &decided))?;
                    record(cfg, &[], &decided, &mut out);
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
            rows = bounded!(conn, inbox::reload(&mut conn, &left, token))?;
        }
    }
}

fn in_transaction(conn: &mut OwnedConn) -> bool {
    Tm::transaction_manager_status_mut(&mut **conn)
        .transaction_depth()
        .map_or(true, |d| d.is_some())
}

/// How a pass over the batch's rows ended.
enum PassEnd {
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

struct Pass<'a> {
    cfg: &'a ConsumerConfig,
    handler: &'a HandlerRef,
    started: Instant,
    careful: bool,
}

impl Pass<'_> {
    async fn run(
        &self,
        mut conn: OwnedConn,
        rows: Vec<InboxRow>,
        out: &mut BatchOutcome,
    ) -> Result<PassEnd> {
        let cfg = self.cfg;
        let to = |row: &InboxRow, settle| Outcome {
            id: row.id,
            token: row.lease_token,
            settle,
        };
        bounded!(conn, async {
            Tm::begin_transaction(&mut *conn).await?;
            Ok(())
        })?;
        // A batch handler gets the fast pass's rows in one call; a careful pass, one per call.
        let together = matches!(self.handler, HandlerRef::Batch(_)) && !self.careful;
        let depth = if self.careful { 2 } else { 1 };
        let mut outcomes = Vec::with_capacity(rows.len());
        let mut processed: Vec<InboxRow> = Vec::with_capacity(rows.len());
        let mut group: Vec<InboxRow> = Vec::new();
        let mut calls = 0;
        let mut rows = rows.into_iter().peekable();
        while let Some(mut row) = rows.next() {
            if !self.handler.connected() || !decide::fits(self.started.elapsed(), cfg) {
                // Never offered: no attempt is spent. The handler is replaced first, or the
                // lease is about to run out.
                out.handler_lost |= !self.handler.connected();
                outcomes.push(to(&row, Settle::Release));
                outcomes.extend(rows.by_ref().map(|r| to(&r, Settle::Release)));
                break;
            }
            if let Err(err) = upcast(cfg, &mut row) {
                // Never handed over: no code here can read it, and retrying cannot help.
                log::failed(cfg, &row, &err);
                outcomes.push(to(
                    &row,
                    Settle::Failed(decide::decide(&cfg.retry, &row, &err)),
                ));
                continue;
            }
            if self.careful {
                bounded!(conn, async {
                    Tm::begin_transaction(&mut *conn).await?; // SAVEPOINT
                    Ok(())
                })?;
            }
            if let (true, Some(version)) = (cfg.skip_stale, row.aggregate_version) {
                let advanced = bounded!(
                    conn,
                    inbox::advance_version(
                        &mut conn,
                        cfg.name.as_str(),
                        &row.aggregate_type,
                        &row.aggregate_id,
                        version,
                    )
                )?;
                match advanced {
                    Advance::Applied => {}
                    Advance::Stale(current) => {
                        if self.careful {
                            bounded!(conn, async {
                                Tm::commit_transaction(&mut *conn).await?;
                                Ok(())
                            })?;
                        }
                        tracing::info!(consumer = %cfg.name, event_id = %row.event_id, aggregate_id = %row.aggregate_id,
                            version, current, code = "EVENT_STALE", "stale event recorded, not applied");
                        outcomes.push(to(&row, Settle::Stale(current)));
                        continue;
                    }
                    Advance::Busy => {
                        // Another loop holds the aggregate: given back, due again shortly.
                        if self.careful {
                            bounded!(conn, async {
                                Tm::rollback_transaction(&mut *conn).await?;
                                Ok(())
                            })?;
                        }
                        outcomes.push(to(&row, Settle::Release));
                        continue;
                    }
                }
            }
            group.push(row);
            if together && rows.peek().is_some() {
                continue;
            }
            calls += 1;
            let call = lend::hand_over(cfg, self.handler, conn, &mut group, depth).await;
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
                // A connection that came back mid-transaction is dropped: the pool closes it.
                drop(call.conn);
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
                    let released = bounded!(back, async {
                        Ok(Tm::commit_transaction(&mut *back).await) // RELEASE SAVEPOINT
                    })?;
                    if let Err(e) = released {
                        if !refused_by_server(&e) {
                            return Err(e.into());
                        }
                        // The handler returned Ok although a statement of its transaction had
                        // failed (it swallowed the error): the transaction cannot commit. It
                        // rolls back (diesel counts the savepoint as released, so this is the
                        // whole transaction), this row is charged, and the others go again.
                        bounded!(back, async {
                            Tm::rollback_transaction(&mut *back).await?;
                            Ok(())
                        })?;
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
                    bounded!(back, async {
                        Tm::rollback_transaction(&mut *back).await?; // ROLLBACK TO SAVEPOINT
                        Ok(())
                    })?;
                    let row = group.pop().expect("a careful call holds one row");
                    let err = call.result.expect_err("the call failed");
                    log::failed(cfg, &row, &err);
                    outcomes.push(to(
                        &row,
                        Settle::Failed(decide::decide(&cfg.retry, &row, &err)),
                    ));
                }
                Next::Carefully { charge, isolate } => {
                    // Undo the whole fast pass, the handler's partial writes with it.
                    bounded!(back, async {
                        Tm::rollback_transaction(&mut *back).await?;
                        Ok(())
                    })?;
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
            conn = back;
        }
        outcomes.extend(processed.iter().map(|r| to(r, Settle::Processed)));
        Ok(PassEnd::Commit(conn, outcomes, processed))
    }
}

/// Whether the transaction on `conn` still runs statements (a handler may have left it
/// failed). A connection that does not answer is not sound either.
async fn sound(conn: &mut OwnedConn) -> bool {
    matches!(
        store::timed(DB_TIMEOUT, async {
            diesel::sql_query("SELECT 1").execute(&mut **conn).await?;
            Ok(())
        })
        .await,
        Ok(Ok(()))
    )
}

/// Whether PostgreSQL answered `e` (a statement it refused), as opposed to a connection that
/// broke or a client-side failure.
fn refused_by_server(e: &diesel::result::Error) -> bool {
    use diesel::result::DatabaseErrorKind as K;
    matches!(
        e,
        diesel::result::Error::DatabaseError(kind, _)
            if !matches!(kind, K::ClosedConnection | K::UnableToSendCommand)
    )
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

/// Logs and counts what a settled batch did; nothing is reported for one that rolled back.
fn record(
    cfg: &ConsumerConfig,
    processed: &[InboxRow],
    settled: &[Outcome],
    out: &mut BatchOutcome,
) {
    let consumer = cfg.name.as_str();
    let now = chrono::Utc::now();
    for row in processed {
        let latency = (now - row.event_created_at).num_microseconds().unwrap_or(0) as f64 / 1e6;
        metrics::delivery_latency(consumer, latency.max(0.0));
        log::completed(cfg, row);
    }
    let count = |f: fn(&Settle) -> bool| settled.iter().filter(|o| f(&o.settle)).count();
    let done = count(|s| matches!(s, Settle::Processed | Settle::Stale(_)));
    let failed = count(|s| matches!(s, Settle::Failed(_)));
    let dead = count(|s| matches!(s, Settle::Failed(f) if f.dead));
    // Stale rows are marked PROCESSED too (with `EVENT_STALE`).
    metrics::inbox_processed(consumer, done as u64);
    metrics::inbox_failed(consumer, failed as u64);
    metrics::inbox_dead_lettered(consumer, dead as u64);
    out.processed = processed.len();
    out.failed = failed;
    out.next_retry = decide::next_retry(settled);
}
