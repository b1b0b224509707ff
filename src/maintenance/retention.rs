//! Retention: deletes delivered history in bounded batches, so the tables stay the size of the
//! work in flight plus a week.
//!
//! What goes, by default: PUBLISHED outbox rows after 7 days; PROCESSED inbox rows, business
//! idempotency keys, stale-check versions and reconcile runs after 30 days; the operators'
//! audit trail after a year. What never goes: dead letters and IGNORED rows (an operator's
//! decision), anything not yet delivered, and a stale-check version an event still on its way
//! could be compared with.
//!
//! Why the inbox rows live at least as long as the keys: the keys' period is the window in
//! which you expect an effect could be asked for again. A redelivered event inside that
//! window must still find its PROCESSED row, because only the row stops an effect that no key
//! guards (most handlers write through the inbox alone). So a processed-inbox period shorter
//! than the keys' is refused (`CONFIG_INVALID`). Keep both longer than any redelivery you may
//! see — a broker's, an operator's re-publish, or a retry of a dead letter: dead letters are
//! kept for ever, and one retried after the key its effect needs was deleted applies that
//! effect again.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::store::retention::{self as stmt, Expired};
use crate::store::{self, PgPool};

/// What retention keeps. Every setting has a setter that documents its default. An age over a
/// century counts as a century: `Duration::MAX` keeps rows for ever in practice, and is not
/// an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetentionConfig {
    pub(crate) published_outbox_after: Duration,
    pub(crate) processed_inbox_after: Duration,
    pub(crate) idempotency_keys_after: Duration,
    pub(crate) audit_after: Duration,
    pub(crate) reconcile_runs_after: Duration,
    pub(crate) aggregate_versions_after: Duration,
    pub(crate) cursor_backlog_after: Option<Duration>,
    pub(crate) batch_size: u32,
    pub(crate) max_batches: u32,
}

/// Setters, one per setting: start from the default and chain them; the runtime checks the
/// whole at start.
impl RetentionConfig {
    /// PUBLISHED outbox rows older than this (by `published_at`) are deleted. Default 7 days.
    pub fn published_outbox_after(mut self, published_outbox_after: Duration) -> Self {
        self.published_outbox_after = published_outbox_after;
        self
    }

    /// PROCESSED inbox rows older than this (by `processed_at`) are deleted, and DONE side
    /// effects (by `done_at`). Default 30 days.
    /// At least `idempotency_keys_after` (checked at start): while the row exists, a
    /// redelivered event is absorbed without its handler running.
    pub fn processed_inbox_after(mut self, processed_inbox_after: Duration) -> Self {
        self.processed_inbox_after = processed_inbox_after;
        self
    }

    /// Idempotency keys older than this are deleted. Default 30 days; at most
    /// `processed_inbox_after`.
    pub fn idempotency_keys_after(mut self, idempotency_keys_after: Duration) -> Self {
        self.idempotency_keys_after = idempotency_keys_after;
        self
    }

    /// Operator audit rows (`admin_audit`) older than this (by `at`) are deleted. Default 365
    /// days: the longest of all, since it answers "who did that" after the fact.
    pub fn audit_after(mut self, audit_after: Duration) -> Self {
        self.audit_after = audit_after;
        self
    }

    /// Finished reconcile runs older than this (by `started_at`) are deleted. Default 30 days.
    pub fn reconcile_runs_after(mut self, reconcile_runs_after: Duration) -> Self {
        self.reconcile_runs_after = reconcile_runs_after;
        self
    }

    /// The versions a consumer that skips stale events keeps per aggregate
    /// (`aggregate_versions`) are deleted when not updated for this long (by `updated_at`)
    /// and no event of the aggregate is left that could be compared with them: none waiting
    /// in the outbox, and none of that consumer's received, retrying or dead-lettered. Default
    /// 30 days. Past it, an event of the aggregate that arrives later anyway (a broker
    /// redelivering an old message) is applied as if first: keep it longer than any such
    /// delay.
    pub fn aggregate_versions_after(mut self, aggregate_versions_after: Duration) -> Self {
        self.aggregate_versions_after = aggregate_versions_after;
        self
    }

    /// A [cursor consumer](crate::ConsumerConfig::cursor)'s events left unread past its cursor
    /// for longer than this (by when they were published) move into its inbox, as rows
    /// waiting for it, and its cursor past them. Default: `published_outbox_after`.
    ///
    /// Why: the outbox is the cursors' shared log, so retention keeps every event a cursor has
    /// yet to read, for every consumer. A paused or slow cursor consumer would hold the log,
    /// and outbox retention for everyone, back without bound; moved, its backlog is rows of
    /// its own, handled as usual once it resumes (retention never deletes an unprocessed
    /// inbox row). `Duration::MAX` keeps the events in the log instead, however long it holds
    /// it back (health then warns with `LOG_HELD`).
    pub fn cursor_backlog_after(mut self, cursor_backlog_after: Duration) -> Self {
        self.cursor_backlog_after = Some(cursor_backlog_after);
        self
    }

    /// Rows per delete statement: each batch is its own short transaction. Default 1000.
    pub fn batch_size(mut self, batch_size: u32) -> Self {
        self.batch_size = batch_size;
        self
    }

    /// Batches per table and run, so one run has a bounded cost; the rest waits for the next
    /// run. Default 100.
    pub fn max_batches(mut self, max_batches: u32) -> Self {
        self.max_batches = max_batches;
        self
    }
}

impl Default for RetentionConfig {
    fn default() -> Self {
        const DAY: u64 = 24 * 3600;
        RetentionConfig {
            published_outbox_after: Duration::from_secs(7 * DAY),
            processed_inbox_after: Duration::from_secs(30 * DAY),
            idempotency_keys_after: Duration::from_secs(30 * DAY),
            audit_after: Duration::from_secs(365 * DAY),
            reconcile_runs_after: Duration::from_secs(30 * DAY),
            aggregate_versions_after: Duration::from_secs(30 * DAY),
            cursor_backlog_after: None,
            batch_size: 1000,
            max_batches: 100,
        }
    }
}

impl RetentionConfig {
    pub(crate) fn validate(&self) -> Result<()> {
        if self.batch_size == 0 || self.batch_size > 100_000 || self.max_batches == 0 {
            return Err(Error::Config(
                "retention batch_size must be within 1..=100000 and max_batches positive".into(),
            ));
        }
        if self.processed_inbox_after < self.idempotency_keys_after {
            return Err(Error::Config(format!(
                "retention would delete processed inbox rows after {:?}, before the idempotency \
                 keys ({:?}): an event redelivered in between would run its handler again, and \
                 an effect no key guards would repeat. Keep processed_inbox_after at least \
                 idempotency_keys_after",
                self.processed_inbox_after, self.idempotency_keys_after
            )));
        }
        Ok(())
    }
}

/// Rows one [`Retention::run_once`] deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetentionReport {
    /// PUBLISHED outbox rows.
    pub outbox_deleted: u64,
    /// PROCESSED inbox rows.
    pub inbox_deleted: u64,
    /// Idempotency keys.
    pub keys_deleted: u64,
    /// Operator audit rows.
    pub audit_deleted: u64,
    /// Reconcile runs.
    pub reconcile_runs_deleted: u64,
    /// Stale-check versions.
    pub aggregate_versions_deleted: u64,
    /// DONE side effects.
    pub effects_deleted: u64,
    /// Events a cursor consumer left unread past `cursor_backlog_after`, moved into its inbox.
    pub cursor_events_moved: u64,
    /// A table had more expired rows than `max_batches` allowed: run again soon.
    pub more_left: bool,
}

/// The retention service. Call [`Retention::run_once`] on a schedule (hourly is plenty); it
/// is safe to run from several instances at once (they skip each other's locked rows).
pub struct Retention {
    pool: PgPool,
    config: RetentionConfig,
}

impl Retention {
    /// A retention service on `pool`.
    ///
    /// # Errors
    /// [`Error::Config`] for a zero or huge batch size or zero batches, or processed inbox rows
    /// kept for less time than idempotency keys.
    pub fn new(pool: PgPool, config: RetentionConfig) -> Result<Self> {
        config.validate()?;
        Ok(Retention { pool, config })
    }

    /// Deletes expired rows, table by table, in batches, and returns how many.
    ///
    /// # Errors
    /// [`Error::Database`] or [`Error::Pool`]; [`Error::DatabaseTimeout`] when a batch got no
    /// answer in time (its connection is then closed). Batches already committed stay deleted.
    ///
    /// # Cancel safety
    /// Dropping the future stops after the batch in flight, which commits or rolls back whole.
    pub async fn run_once(&self) -> Result<RetentionReport> {
        let mut report = RetentionReport::default();
        let c = &self.config;
        // Inbox rows first: the outbox rows' deletion then marks only the inbox rows that stay.
        let plan = [
            (Expired::ProcessedInbox, c.processed_inbox_after),
            (Expired::PublishedOutbox, c.published_outbox_after),
            (Expired::IdempotencyKeys, c.idempotency_keys_after),
            (Expired::AdminAudit, c.audit_after),
            (Expired::ReconcileRuns, c.reconcile_runs_after),
            (Expired::AggregateVersions, c.aggregate_versions_after),
            // As long as the processed inbox rows: a redelivered event past both records its
            // effect again, and its call is made again.
            (Expired::DoneEffects, c.processed_inbox_after),
        ];
        for (what, older_than) in plan {
            if what == Expired::PublishedOutbox {
                // First the cursors' old backlog moves out of the log, which it would hold.
                let (moved, more) = self.spill().await?;
                report.cursor_events_moved = moved;
                report.more_left |= more;
            }
            let (deleted, more) = self.drain(what, older_than).await?;
            match what {
                Expired::PublishedOutbox => report.outbox_deleted = deleted,
                Expired::ProcessedInbox => report.inbox_deleted = deleted,
                Expired::IdempotencyKeys => report.keys_deleted = deleted,
                Expired::AdminAudit => report.audit_deleted = deleted,
                Expired::ReconcileRuns => report.reconcile_runs_deleted = deleted,
                Expired::AggregateVersions => report.aggregate_versions_deleted = deleted,
                Expired::DoneEffects => report.effects_deleted = deleted,
            }
            report.more_left |= more;
        }
        tracing::info!(
            name: "retention.completed",
            outbox_deleted = report.outbox_deleted,
            inbox_deleted = report.inbox_deleted,
            keys_deleted = report.keys_deleted,
            audit_deleted = report.audit_deleted,
            reconcile_runs_deleted = report.reconcile_runs_deleted,
            aggregate_versions_deleted = report.aggregate_versions_deleted,
            effects_deleted = report.effects_deleted,
            cursor_events_moved = report.cursor_events_moved,
            more_left = report.more_left,
            "retention.completed"
        );
        Ok(report)
    }

    /// How long one delete batch may take before its connection is taken for dead: the
    /// runtime's bound for a round trip, plus a millisecond per row, since a large batch does
    /// real work (index entries, the inbox rows it unmarks).
    fn batch_timeout(&self) -> Duration {
        store::DB_TIMEOUT + Duration::from_millis(u64::from(self.config.batch_size))
    }

    /// Moves cursors' backlogs older than `cursor_backlog_after` into their inboxes, a batch
    /// at a time (`inbox::cursor::spill`).
    async fn spill(&self) -> Result<(u64, bool)> {
        let c = &self.config;
        let older_than = c.cursor_backlog_after.unwrap_or(c.published_outbox_after);
        let batch = i64::from(c.batch_size);
        let mut moved = 0u64;
        for _ in 0..c.max_batches {
            let mut conn = self.pool.get().await?;
            let spilled = store::bounded(&mut conn, self.batch_timeout(), async |conn| {
                store::inbox::cursor::spill(conn, older_than, batch).await
            })
            .await?;
            if spilled.passed == 0 {
                return Ok((moved, false));
            }
            moved += spilled.moved as u64;
            tracing::warn!(
                consumer = spilled.consumer.as_deref().unwrap_or_default(),
                events = spilled.moved,
                older_than = ?older_than,
                code = "LOG_HELD",
                "a cursor consumer left events unread past retention: they moved into its inbox"
            );
        }
        Ok((moved, true))
    }

    async fn drain(&self, what: Expired, older_than: Duration) -> Result<(u64, bool)> {
        let batch = i64::from(self.config.batch_size);
        let mut deleted = 0u64;
        let mut after = None;
        for _ in 0..self.config.max_batches {
            // A connection per batch: a long run does not pin one away from the runtime.
            let mut conn = self.pool.get().await?;
            let expiry = store::bounded(&mut conn, self.batch_timeout(), async |c| {
                stmt::delete_expired(c, what, older_than, batch, after).await
            })
            .await?;
            deleted += expiry.deleted as u64;
            // Fewer than a batch expired: none is left (past the events left for later).
            if expiry.seen < batch {
                return Ok((deleted, false));
            }
            after = expiry.after();
        }
        Ok((deleted, true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    #[test]
    fn processed_rows_kept_for_less_time_than_keys_are_refused() {
        assert!(RetentionConfig::default().validate().is_ok(), "the default");
        let day = Duration::from_secs(24 * 3600);
        let short = RetentionConfig::default().processed_inbox_after(7 * day);
        let err = short.validate().unwrap_err();
        assert_eq!(err.code(), ErrorCode::CONFIG_INVALID);
        assert!(err.to_string().contains("idempotency_keys_after"), "{err}");
        let equal = short.clone().idempotency_keys_after(7 * day);
        assert!(equal.validate().is_ok());
        let forever = RetentionConfig::default().idempotency_keys_after(Duration::MAX);
        assert!(forever.clone().validate().is_err());
        assert!(forever
            .processed_inbox_after(Duration::MAX)
            .validate()
            .is_ok());
    }
}
