//! Where a claim starts reading its due index.
//!
//! The publisher's claim reads `outbox_events_due` in `seq` order and a consumer's reads
//! `inbox_events_due` in `(next_attempt_at, id)` order, each from the start. A row that leaves
//! the due state leaves a dead entry behind until vacuum removes it, and a session that holds
//! a snapshot open (a long report, `pg_dump`) keeps vacuum, and every scan, from removing or
//! even marking any of them. Each claim from the start then walks every entry of what was
//! already delivered before it finds a due row: each claim slower than the last, a backlog's
//! drain quadratic in its size.
//!
//! So a claim may start past the last row the previous claim of the same actor took, which
//! PostgreSQL finds by descending the index. The rule, in one sentence: **a claim starts past
//! the previous claim's last row only while claims come back full, and one claim a second
//! still reads from the start**; so a due row that lies behind the start (rows given back, a
//! lease that expired, an event whose transaction committed after a claim passed its place)
//! waits at most a second longer, and only while a backlog lasts. When claims come back short
//! (no backlog) every claim reads from the start, as before.
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
    /// The last row the previous full claims took; `None`: read from the start.
    after: Cell<Option<K>>,
    /// When a claim last read from the start.
    from_start: Cell<Option<Instant>>,
}

impl<K: Copy + PartialOrd> ScanStart<K> {
    pub(crate) fn new() -> Self {
        ScanStart {
            after: Cell::new(None),
            from_start: Cell::new(None),
        }
    }

    /// Where the next claim starts: past `Some(k)`, or from the start (`None`), which is then
    /// recorded as done now.
    pub(crate) fn next(&self) -> Option<K> {
        let recent = self
            .from_start
            .get()
            .is_some_and(|at| at.elapsed() < FROM_START_EVERY);
        match self.after.get() {
            Some(k) if recent => Some(k),
            _ => {
                self.from_start.set(Some(Instant::now()));
                None
            }
        }
    }

    /// A claim's answer: the last row it took in index order, and whether it took as many as
    /// it asked for. A short claim sends the next back to the start.
    pub(crate) fn took(&self, last: Option<K>, full: bool) {
        self.after.set(match (full, last, self.after.get()) {
            (true, Some(k), Some(a)) if a > k => Some(a),
            (true, Some(k), _) => Some(k),
            _ => None,
        });
    }

    /// The next claim reads from the start: rows were given back, or failed, behind it.
    pub(crate) fn reset(&self) {
        self.after.set(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_start_past_the_last_full_claim_and_from_the_start_once_a_second() {
        let s = ScanStart::<i64>::new();
        assert_eq!(s.next(), None, "the first claim reads from the start");
        s.took(Some(250), true);
        assert_eq!(s.next(), Some(250));
        // An answer that comes back after a later one does not move the start back.
        s.took(Some(500), true);
        s.took(Some(400), true);
        assert_eq!(s.next(), Some(500));
        s.took(Some(600), false);
        assert_eq!(s.next(), None, "a short claim sends the next to the start");
        s.took(Some(700), true);
        s.reset();
        assert_eq!(s.next(), None, "rows given back send the next to the start");
        s.took(Some(800), true);
        s.from_start
            .set(Instant::now().checked_sub(FROM_START_EVERY + Duration::from_millis(1)));
        assert_eq!(
            s.next(),
            None,
            "a second after the last read from the start"
        );
        assert_eq!(s.next(), Some(800), "then past the last full claim again");
    }
}
