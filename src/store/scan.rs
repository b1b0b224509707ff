//! Where a claim starts reading its due index.
//!
//! The publisher's claim (either route's) reads `outbox_events_due` in `seq` order and a
//! consumer's reads
//! `inbox_events_due` in `(next_attempt_at, id)` order, each from the start. A row that leaves
//! the due state leaves a dead entry behind until vacuum removes it, and a session that holds
//! a snapshot open (a long report, `pg_dump`) keeps vacuum, and every scan, from removing or
//! even marking any of them. Each claim from the start then walks every entry of what was
//! already delivered before it finds a due row: each claim slower than the last, a backlog's
//! drain quadratic in its size.
//!
//! So a claim may start past the last row the previous claim of the same actor took, which
//! PostgreSQL finds by descending the index. The rule, in one sentence: **a claim starts past
//! the last row the latest claim took only when that claim came back full and a claim read
//! from the start less than a second ago; every other claim reads from the start, and a short
//! claim that started past it is followed by one that does not** ([`ScanStart::answered`]). So a
//! due row that lies behind the start (an event whose transaction committed after a claim
//! passed its place, a lease that expired) waits at most a second longer, and only while a
//! backlog lasts; rows given back by the actor itself send its next claim to the start
//! ([`ScanStart::reset`]; with several loops, another loop's full claim may set a start
//! again first, and the second bounds that wait too). When claims come back short (no backlog) every claim reads from
//! the start, as before. A consumer's claim that took a row under the ordering test names no
//! last row (the events it holds back lie behind it), so an ordered consumer's claims always
//! read from the start.
//!
//! Nothing rests on it but speed: every test of what a claim may take is in its statement,
//! and the start only narrows where the statement looks.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// How often a claim reads from the start while claims come back full.
const FROM_START_EVERY: Duration = Duration::from_secs(1);

/// The start of one actor's claims, in the order of the index they read. Its claims run on
/// the actor's thread.
pub(crate) struct ScanStart<K: Copy> {
    /// The last row the latest claim took, when it came back full; `None`: read from the start.
    after: Cell<Option<K>>,
    /// When a claim last read from the start.
    from_start: Cell<Option<Instant>>,
}

impl<K: Copy> ScanStart<K> {
    pub(crate) fn new() -> Self {
        ScanStart {
            after: Cell::new(None),
            from_start: Cell::new(None),
        }
    }

    /// Where the next claim starts: past `Some(k)`, or from the start (`None`), which is then
    /// recorded as done now.
    pub(crate) fn next(&self) -> Option<K> {
        self.next_at(Instant::now())
    }

    fn next_at(&self, now: Instant) -> Option<K> {
        let recent = self
            .from_start
            .get()
            .is_some_and(|at| now.saturating_duration_since(at) < FROM_START_EVERY);
        match self.after.get() {
            Some(k) if recent => Some(k),
            _ => {
                self.from_start.set(Some(now));
                None
            }
        }
    }

    /// Records the answer of a claim that started at `after` (from [`ScanStart::next`]): the
    /// last row it took in index order, whether it took as many as it asked for, and whether
    /// it was a row claimed alone (a suspect, taken from no place in the index: its answer
    /// says nothing about the rows past the start, and a crash's many suspects would each
    /// send the other loops back to it). Returns whether to claim again at once: when full
    /// (more rows are probably due), and after a short claim that started past the start, so
    /// that rows behind it are found now rather than at the next poll.
    pub(crate) fn answered(
        &self,
        after: Option<K>,
        last: Option<K>,
        full: bool,
        alone: bool,
    ) -> bool {
        if !alone {
            self.took(last, full);
        }
        Self::more(after, full)
    }

    /// A claim's answer: the last row it took in index order, and whether it took as many as
    /// it asked for. The next claim starts past that row when it did, from the start when not.
    /// An answer that overtook a concurrent claim's moves the start back, at most over the
    /// rows those claims took: a bounded walk, where keeping the furthest start would leave a
    /// backlog found behind it to the once-a-second claims.
    fn took(&self, last: Option<K>, full: bool) {
        self.after.set(if full { last } else { None });
    }

    /// The next claim reads from the start: rows were given back behind it.
    pub(crate) fn reset(&self) {
        self.after.set(None);
    }

    /// Whether to claim again at once after a claim that started at `after` and came back
    /// `full` or not ([`ScanStart::answered`]).
    fn more(after: Option<K>, full: bool) -> bool {
        full || after.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_start_past_the_last_full_claim_and_from_the_start_once_a_second() {
        let s = ScanStart::<i64>::new();
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        assert_eq!(
            s.next_at(at(0)),
            None,
            "the first claim reads from the start"
        );
        s.took(Some(250), true);
        assert_eq!(s.next_at(at(10)), Some(250));
        s.took(Some(500), true);
        assert_eq!(s.next_at(at(20)), Some(500));
        s.took(Some(600), false);
        assert_eq!(
            s.next_at(at(30)),
            None,
            "a short claim sends the next to the start"
        );
        s.took(Some(700), true);
        s.reset();
        assert_eq!(
            s.next_at(at(40)),
            None,
            "rows given back send the next to the start"
        );
        s.took(Some(800), true);
        assert_eq!(s.next_at(at(50)), Some(800));
        s.took(Some(900), true);
        assert_eq!(
            s.next_at(at(1040)),
            None,
            "a second after the last read from the start"
        );
        // That claim found a backlog behind the start: the next claims walk it, rather than
        // return to where the start was and leave it to one claim a second.
        s.took(Some(100), true);
        assert_eq!(s.next_at(at(1050)), Some(100));
    }

    #[test]
    fn a_short_claim_past_the_start_is_followed_by_one_from_it() {
        assert!(ScanStart::<i64>::more(None, true));
        assert!(ScanStart::more(Some(1), true));
        assert!(
            ScanStart::more(Some(1), false),
            "rows may lie behind the start"
        );
        assert!(
            !ScanStart::<i64>::more(None, false),
            "the claim read everything due"
        );
    }
}
