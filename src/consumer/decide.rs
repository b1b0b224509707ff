//! The consumer's pure decisions, with no database and no actor: retry or dead letter, who is
//! charged when a call or a lease ends without an outcome, how long a lease is and whether
//! another call still fits in it. `batch.rs` and `reap.rs` do the I/O around them.

use std::time::Duration;

use super::{ConsumerConfig, HandlerError};
use crate::error::ErrorCode;
use crate::retry::RetryPolicy;
use crate::store::inbox::{ExpiredRow, Failure, InboxRow, Outcome, Settle};

/// Stored as `last_error` when a handler panicked or stopped while handling.
pub(crate) const HANDLER_LOST: &str = "the handler panicked or stopped while handling";

/// When to look again at rows given back because another loop held their aggregate.
pub(crate) const DEFER_DELAY: Duration = Duration::from_millis(10);

/// The failure of a handler that overran its timeout.
pub(crate) fn handler_timed_out(cfg: &ConsumerConfig) -> HandlerError {
    HandlerError::retry(format!(
        "the handler did not finish within {:?}",
        cfg.handler_timeout
    ))
}

/// The failure recorded for a row whose lease expired while it alone was held: its process,
/// its database backend or its connection died during the attempt.
pub(crate) fn interrupted() -> HandlerError {
    HandlerError::Retry {
        code: ErrorCode::INBOX_ATTEMPT_INTERRUPTED,
        message: "the attempt ended without an outcome: the process or the database session \
                  handling the event died, or its connection stopped answering"
            .into(),
    }
}

/// The retry decision for one failed attempt of `row` (its `attempt_count` is the attempts
/// before this one).
pub(crate) fn decide(policy: &RetryPolicy, row: &InboxRow, err: &HandlerError) -> Failure {
    decide_attempt(policy, row.attempt_count, row.event_id, err)
}

fn decide_attempt(
    policy: &RetryPolicy,
    attempts_before: i32,
    event_id: uuid::Uuid,
    err: &HandlerError,
) -> Failure {
    let attempt = (attempts_before.max(0) as u32) + 1;
    let (a, b) = event_id.as_u64_pair();
    let (dead, delay) = match err {
        HandlerError::Permanent { .. } => (true, Duration::ZERO),
        _ if policy.exhausted(attempt) => (true, Duration::ZERO),
        HandlerError::RetryAfter { after, .. } => (false, *after),
        HandlerError::Retry { .. } => (false, policy.delay(attempt, a ^ b)),
    };
    Failure {
        dead,
        delay_ms: crate::retry::delay_ms(delay),
        code: err.code().as_str().to_owned(),
        message: err.message().to_owned(),
    }
}

/// How the rows of a process that died are settled (the reaper's rule).
///
/// - A process that held **one** row died of it: that attempt is counted, and so are the
///   deaths the row was suspected of before (up to its policy's attempts); it is retried or
///   dead-lettered by its policy.
/// - A process that held **several** rows died of one of them, unknown which. None is charged
///   the attempt; each is suspected, and claimed alone from then on, with nothing else of its
///   consumer in flight in its process, after a backoff by its suspicions. An outcome of its
///   own clears the suspicions; a death alone confirms them. A row suspected in more than `max_attempts`
///   deaths in a row, never alone in its process (another consumer there was always busy), is
///   dead-lettered all the same: the bound that keeps a process from dying for ever.
///
/// So an event that kills its process every time is dead-lettered after `max_attempts` deaths
/// when its consumer is the only one busy in its process, and an event merely in flight beside
/// it is never charged.
pub(crate) fn settle_expired(policy: &RetryPolicy, rows: &[ExpiredRow]) -> Vec<Outcome> {
    rows.iter()
        .map(|r| {
            let before = r.attempt_count.max(0);
            let suspicions = r.suspicions.max(0);
            let settle = if r.held <= 1 {
                // This death and the ones it was suspected of, but never past the policy's
                // last attempt: the suspicions may include a death it did not cause.
                let charged = before.saturating_add(suspicions);
                let cap = (policy.max_attempts as i32).max(before + 1);
                let failure = decide_attempt(policy, charged, r.event_id, &interrupted());
                Settle::Died {
                    failure,
                    attempts: charged.saturating_add(1).min(cap),
                }
            } else if suspicions + 1 > policy.max_attempts as i32 {
                Settle::Died {
                    failure: Failure {
                        dead: true,
                        delay_ms: 0,
                        code: ErrorCode::INBOX_ATTEMPT_INTERRUPTED.as_str().to_owned(),
                        message: format!(
                            "its process died {} times in a row with it in flight, each time \
                             beside other events",
                            suspicions + 1
                        ),
                    },
                    attempts: before + 1,
                }
            } else {
                let (a, b) = r.event_id.as_u64_pair();
                let next = (suspicions + 1) as u32;
                Settle::Suspect {
                    delay_ms: crate::retry::delay_ms(policy.delay(next, a ^ b)),
                }
            };
            Outcome {
                id: r.id,
                token: r.lease_token,
                settle,
            }
        })
        .collect()
}

/// How one call to the handler ended, as far as blame goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CallEnd {
    /// It returned `Ok`.
    Done,
    /// It returned an error, or overran its timeout and gave the connection back.
    Failed,
    /// The handler actor died (panicked) during the call.
    Lost,
    /// It overran its timeout and kept the connection, and with it the transaction.
    Kept,
}

/// What the batch does after a call of `rows` rows ended as `end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Go on with the next row.
    Continue,
    /// Roll back and hand the batch's undecided rows over again, one per call, each in a
    /// savepoint; first charge the call's row (`charge`), or give the call's rows back to be
    /// handed over alone (`isolate`).
    Carefully { charge: bool, isolate: bool },
    /// Roll back to the row's savepoint, charge it, go on.
    ChargeAndContinue,
    /// The transaction is gone with the handler: charge the call's row, give every other
    /// undecided row back.
    ChargeAndStop,
    /// The transaction is gone with the handler, and the call held several rows: charge none,
    /// give them back to be handed over alone, and the others as they are.
    IsolateAndStop,
}

/// Who is charged for a call's end. In the fast pass (no savepoints), a failure rolls back
/// every effect so far; a careful pass then finds the cause row by row. A call of one row is
/// that row's fault if the failure is its `own` (the transaction was sound before it: an
/// earlier handler may have swallowed a failed statement and left it aborted); a call of
/// several (a batch handler's) is nobody's in particular. A handler that died with several
/// rows cannot be asked again (its replacement gets the next batch), so those rows are handed
/// over alone from then on.
pub(crate) fn after_call(end: CallEnd, rows: usize, careful: bool, own: bool) -> Next {
    match (end, careful) {
        (CallEnd::Done, _) => Next::Continue,
        (CallEnd::Failed, false) => Next::Carefully {
            charge: rows == 1 && own,
            isolate: false,
        },
        (CallEnd::Lost, false) => Next::Carefully {
            charge: rows == 1,
            isolate: rows > 1,
        },
        (CallEnd::Failed | CallEnd::Lost, true) => Next::ChargeAndContinue,
        (CallEnd::Kept, _) if rows == 1 => Next::ChargeAndStop,
        (CallEnd::Kept, _) => Next::IsolateAndStop,
    }
}

/// How many calls in a row a careful pass lets fail, to be retried, before it gives the rest
/// of its rows back unspent (see [`gives_up`]).
pub(crate) const PROBE: usize = 3;

/// Whether a careful pass stops handing rows over: its `calls` so far all failed, each to be
/// retried (`retried`), and there are [`PROBE`] of them. A handler that fails every event
/// usually waits on something down (a service, a credential, a bug in this build); making it
/// fail each row of the batch would only spend their attempts and the database's time. The
/// rows not handed over are given back with their attempts unspent, and the consumer rests
/// until its next poll (`actor.rs`). A call that succeeded or failed for good ends the doubt:
/// the pass then goes through every row, so one poison event never costs its batch more than
/// its own attempt.
pub(crate) fn gives_up(calls: usize, retried: usize) -> bool {
    retried == calls && retried >= PROBE
}

/// Whether one more call still fits in the lease, leaving `slack` to settle the batch: a
/// batch never runs past its lease while its process lives, so the reaper only ever settles
/// the leases of loops that died.
pub(crate) fn fits(elapsed: Duration, cfg: &ConsumerConfig) -> bool {
    let lease = cfg.lease_period();
    elapsed + cfg.handler_timeout + settle_slack(lease) <= lease
}

/// How long past its expiry a lease of a process whose other leases live is given before the
/// process counts as stuck and is judged: a whole lease, and never less than one bounded
/// statement ([`DB_TIMEOUT`](crate::store::DB_TIMEOUT)), which is how long any lease whose
/// session lives is given before it counts as dead (`inbox::judge_dead`). So a live process
/// whose commit is slow settles its batch itself instead of being judged dead; a process that
/// died is judged without waiting, as its sessions end with it.
pub(crate) fn patience(cfg: &ConsumerConfig) -> Duration {
    cfg.lease_period().max(crate::store::DB_TIMEOUT)
}

/// The time kept at a lease's end for the batch's marks and commit.
pub(crate) fn settle_slack(lease: Duration) -> Duration {
    (lease / 4).min(crate::store::DB_TIMEOUT)
}

/// When the soonest of `outcomes` falls due again: a failure that will be retried, or a row
/// given back (due at once).
pub(crate) fn next_retry(outcomes: &[Outcome]) -> Option<Duration> {
    outcomes
        .iter()
        .filter_map(|o| match &o.settle {
            Settle::Failed(f) | Settle::Died { failure: f, .. } if !f.dead => {
                Some(Duration::from_millis(f.delay_ms.max(0) as u64))
            }
            Settle::Suspect { delay_ms } => Some(Duration::from_millis((*delay_ms).max(0) as u64)),
            Settle::Release | Settle::Isolate => Some(DEFER_DELAY),
            _ => None,
        })
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expired(id: i64, token: i64, attempts: i32, held: i32, suspicions: i32) -> ExpiredRow {
        ExpiredRow {
            id,
            lease_token: token,
            event_id: uuid::Uuid::nil(),
            attempt_count: attempts,
            held,
            suspicions,
        }
    }

    #[test]
    fn a_process_that_held_one_row_died_of_it() {
        let policy = RetryPolicy::fixed(3, Duration::from_secs(1));
        let out = settle_expired(&policy, &[expired(1, 7, 0, 1, 0), expired(2, 8, 2, 1, 5)]);
        let Settle::Died {
            failure: first,
            attempts: 1,
        } = &out[0].settle
        else {
            panic!("charged: {out:?}")
        };
        assert!(!first.dead);
        assert_eq!(first.delay_ms, 1000);
        assert_eq!(first.code, "INBOX_ATTEMPT_INTERRUPTED");
        let Settle::Died {
            failure: last,
            attempts: 3,
        } = &out[1].settle
        else {
            panic!("charged, up to the last attempt: {out:?}")
        };
        assert!(last.dead, "the third death is the last attempt");
        assert_eq!((out[0].token, out[1].token), (7, 8), "fenced on each lease");
    }

    #[test]
    fn a_process_that_held_several_rows_charges_none_of_them() {
        let policy = RetryPolicy::fixed(3, Duration::from_millis(50));
        let out = settle_expired(&policy, &[expired(1, 7, 2, 2, 0), expired(2, 8, 0, 2, 2)]);
        assert!(
            out.iter()
                .all(|o| o.settle == Settle::Suspect { delay_ms: 50 }),
            "{out:?}"
        );
    }

    #[test]
    fn a_row_suspected_more_often_than_its_attempts_allow_is_dead_lettered() {
        let policy = RetryPolicy::fixed(3, Duration::ZERO);
        let out = settle_expired(&policy, &[expired(1, 7, 0, 4, 2), expired(2, 8, 0, 4, 3)]);
        assert!(matches!(out[0].settle, Settle::Suspect { .. }), "{out:?}");
        let Settle::Died { failure: f, .. } = &out[1].settle else {
            panic!("dead-lettered: {out:?}")
        };
        assert!(f.dead);
        assert_eq!(f.code, "INBOX_ATTEMPT_INTERRUPTED");
    }

    #[test]
    fn a_death_alone_confirms_the_suspicions() {
        let policy = RetryPolicy::fixed(2, Duration::ZERO);
        // Suspected once in a batch's death, then dead alone: two deaths, two attempts.
        let out = settle_expired(&policy, &[expired(1, 7, 0, 1, 1)]);
        let Settle::Died { failure, attempts } = &out[0].settle else {
            panic!("charged: {out:?}")
        };
        assert_eq!(*attempts, 2);
        assert!(failure.dead);
    }

    #[test]
    fn a_call_of_one_row_is_that_rows_fault_a_call_of_several_nobodys() {
        assert_eq!(after_call(CallEnd::Done, 5, false, true), Next::Continue);
        let carefully = |charge, isolate| Next::Carefully { charge, isolate };
        assert_eq!(
            after_call(CallEnd::Failed, 1, false, true),
            carefully(true, false)
        );
        assert_eq!(
            after_call(CallEnd::Failed, 1, false, false),
            carefully(false, false),
            "it met a transaction an earlier handler had left failed"
        );
        assert_eq!(
            after_call(CallEnd::Failed, 5, false, true),
            carefully(false, false)
        );
        assert_eq!(
            after_call(CallEnd::Lost, 1, false, true),
            carefully(true, false)
        );
        assert_eq!(
            after_call(CallEnd::Lost, 5, false, true),
            carefully(false, true)
        );
        assert_eq!(
            after_call(CallEnd::Lost, 1, true, true),
            Next::ChargeAndContinue
        );
        assert_eq!(
            after_call(CallEnd::Failed, 1, true, true),
            Next::ChargeAndContinue
        );
        assert_eq!(
            after_call(CallEnd::Kept, 1, false, true),
            Next::ChargeAndStop
        );
        assert_eq!(
            after_call(CallEnd::Kept, 1, true, true),
            Next::ChargeAndStop
        );
        assert_eq!(
            after_call(CallEnd::Kept, 3, false, true),
            Next::IsolateAndStop
        );
    }

    #[test]
    fn a_permanent_error_dead_letters_at_once_and_retry_after_is_kept() {
        let policy = RetryPolicy::fixed(5, Duration::from_secs(1));
        let row = |attempts| (attempts, uuid::Uuid::nil());
        let (a, id) = row(0);
        let f = decide_attempt(
            &policy,
            a,
            id,
            &HandlerError::permanent(ErrorCode::EVENT_SCHEMA_INVALID, "bad"),
        );
        assert!(f.dead);
        assert_eq!(f.code, "EVENT_SCHEMA_INVALID");
        let f = decide_attempt(
            &policy,
            a,
            id,
            &HandlerError::retry_after(Duration::from_secs(9), "later"),
        );
        assert_eq!((f.dead, f.delay_ms), (false, 9000));
        let f = decide_attempt(&policy, 4, id, &HandlerError::retry("again"));
        assert!(f.dead, "the fifth attempt was the last");
    }

    #[test]
    fn calls_stop_before_the_lease_runs_out() {
        let cfg = ConsumerConfig::new("c")
            .handler_timeout(Duration::from_secs(1))
            .lease(Duration::from_secs(8));
        assert!(fits(Duration::ZERO, &cfg));
        assert!(fits(Duration::from_secs(5), &cfg));
        assert!(
            !fits(Duration::from_millis(5001), &cfg),
            "2 s kept to settle"
        );
    }

    #[test]
    fn the_soonest_retry_ignores_dead_letters_and_sees_rows_given_back() {
        let failed = |dead, delay_ms| {
            Settle::Failed(Failure {
                dead,
                delay_ms,
                code: String::new(),
                message: String::new(),
            })
        };
        let o = |settle| Outcome {
            id: 1,
            token: 1,
            settle,
        };
        assert_eq!(
            next_retry(&[o(failed(true, 0)), o(failed(false, 500))]),
            Some(Duration::from_millis(500))
        );
        assert_eq!(
            next_retry(&[o(failed(false, 500)), o(Settle::Release)]),
            Some(DEFER_DELAY)
        );
        assert_eq!(next_retry(&[o(Settle::Processed)]), None);
    }

    #[test]
    fn a_careful_pass_gives_up_only_after_its_first_calls_all_failed_to_be_retried() {
        assert!(!gives_up(PROBE - 1, PROBE - 1));
        assert!(gives_up(PROBE, PROBE));
        // One call that did not fail to be retried (it succeeded, or failed for good): the
        // pass goes through every row.
        assert!(!gives_up(PROBE + 1, PROBE));
        assert!(!gives_up(PROBE + 5, PROBE + 4));
    }
}
