//! Consumers: the [`Delivery`] message a consumer actor handles (or [`DeliveryBatch`], several
//! at once), the [`HandlerError`] it returns, its [`ConsumerConfig`], and the engine that feeds
//! it.
//!
//! A consumer is an ordinary actix actor implementing `Handler<Delivery>` or
//! `Handler<DeliveryBatch>`. Each delivery carries the open inbox transaction: the handler's
//! writes through [`Delivery::conn`] and the inbox row's PROCESSED mark commit together, so a
//! redelivered event never repeats an effect.
//!
//! # The engine, by file
//!
//! | file | owns |
//! |---|---|
//! | `actor.rs` | the consumer actor: batch loops (up to `concurrency`), wake-ups, retry timer, drain, the reaper's tick, the handler factory |
//! | `batch.rs` | one batch: lease rows, run its passes, settle them with the commit, expire the lease of a batch that failed |
//! | `pass.rs` | one pass over the rows in one transaction: fast (no savepoints), or careful (one row per call, a savepoint each) |
//! | `lend.rs` | lending the connection to the handler; parking the connections of handlers hung past their timeout |
//! | `reap.rs` | settling the leases that loops which died left behind |
//! | `replay.rs` | stepping the replays an operator asked of the consumer, beside its live rows |
//! | `decide.rs` | the pure decisions: retry or dead letter, who is charged, whether a call fits in the lease |
//! | `delivery.rs`, `handler_error.rs`, `config.rs` | the public types |
//! | `function.rs` | the actor behind a consumer written as an async function |
//! | `threads.rs` | the threads handlers run on, off the runtime's, and the handler actors on them |
//!
//! # One invariant
//!
//! *A row in flight is named by exactly one lease, committed before any handler sees the row,
//! and every mark of the row is fenced on that lease and takes the row out of it.* A claim
//! writes one `inbox_leases` row naming the rows it takes, and does not write the rows (they
//! keep their due status; the claims of a consumer take turns, so each sees every lease before
//! it). The effects commit later, with the marks, in a transaction of their own. So the
//! database alone says which rows each loop holds, on every instance, through any crash: there
//! is no in-flight record beside it, no process-wide lock, and no state that a restart of the
//! process or of PostgreSQL loses. An attempt is counted with its outcome, or, for a loop that
//! died, by the reaper that judges its lease.
//!
//! # Deaths, and who is charged
//!
//! A loop that dies settles nothing: its process was killed, its handler crashed the database
//! backend (PostgreSQL then restarts every session), or its connection stopped answering. Its
//! lease is dead once the session that claimed it is gone, or once it has been expired for a
//! patience (a whole lease, at least one bounded statement: `decide::patience`), so that a
//! live process whose commit is slow is never taken for dead. When every lease of its
//! process is dead, or one is dead of expiry, the consumer's reaper, on any instance, judges
//! the process and settles its rows:
//! - a process that held **one** row died of it: that row is charged, retried by the policy,
//!   and dead-lettered (`INBOX_ATTEMPT_INTERRUPTED`) once its attempts are used up;
//! - a process that held **several** rows charges none of them. Each is suspected (`alone`)
//!   and from then on leased on its own, in a lease of one row, with at most one suspect under
//!   test per process (one whose handler hung past its timeout is charged that, and tested no
//!   more); other rows are claimed beside it as usual. An outcome of its own
//!   clears the suspicions; a death while its process held nothing else confirms them, and a
//!   row suspected in more than `max_attempts` deaths in a row is dead-lettered all the same
//!   (see `decide::settle_expired`).
//!
//! So an event that kills its process every time is dead-lettered after `max_attempts` deaths
//! when nothing else is in flight in its process, and after `max_attempts + 1` at most
//! otherwise (`tests/server_crash.rs` counts them); the events in flight beside it end with
//! only the attempts they used themselves. A batch never runs past its lease while its
//! process lives (it stops handing rows over in time, `decide::fits`), so only the dead are
//! judged. A graceful shutdown gives the rows of the batches its deadline cuts off back,
//! unspent, before it returns: a deploy charges nothing.

//! # Hung handlers
//!
//! A handler that overruns [`ConsumerConfig::handler_timeout`] and gives the connection back
//! is a failure like any other. One that keeps the connection takes the batch's transaction:
//! its row is charged, the batch's other rows are given back unspent, and the connection is
//! parked until the handler lets go. A consumer parks at most `concurrency` such connections;
//! past that its loops wait, with a warning, the `outbox_consumer_stalled` gauge at 1 and
//! `outbox_consumer_hung_handlers` at its count. So a consumer holds at most
//! `2 × concurrency` connections however its handlers hang, and nothing else waits for it.

pub(crate) mod actor;
pub(crate) mod batch;
mod config;
pub(crate) mod decide;
mod delivery;
pub(crate) mod function;
mod handler_error;
mod lend;
mod log;
mod pass;
mod reap;
pub(crate) mod registry;
mod relay;
mod replay;
pub(crate) mod threads;

pub use config::ConsumerConfig;
pub use delivery::{Delivery, DeliveryBatch, DeliveryMode, SharedConn, TxConn};
pub use handler_error::HandlerError;

#[cfg(feature = "testing")]
pub(crate) use lend::{call, hand_over};
#[cfg(feature = "testing")]
pub(crate) use pass::upcast;
