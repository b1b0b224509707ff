//! Retention's statements: the bounded deletes of delivered history
//! ([`maintenance::retention`](crate::maintenance)).

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Nullable, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use std::time::Duration;

use crate::error::Result;
use crate::store;

/// What a retention batch deletes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expired {
    /// PUBLISHED outbox rows, by `published_at`.
    PublishedOutbox,
    /// PROCESSED inbox rows, by `processed_at`.
    ProcessedInbox,
    /// Business idempotency keys, by `created_at`.
    IdempotencyKeys,
    /// Operator audit rows, by `at`.
    AdminAudit,
    /// Reconcile runs, by `started_at`; never one still running.
    ReconcileRuns,
    /// Stale-check versions (`aggregate_versions`), by `updated_at`, once no event that could
    /// be compared with them is left (see the statement).
    AggregateVersions,
    /// DONE side effects, by `done_at`.
    DoneEffects,
}

/// Rows one [`delete_expired`] batch found expired, and those it deleted.
#[derive(QueryableByName)]
pub(crate) struct Expiry {
    /// Expired rows the batch took (at most `batch`): fewer means none is left.
    #[diesel(sql_type = BigInt)]
    pub seen: i64,
    /// Rows deleted: for the outbox, fewer than `seen` when some events were left for later.
    #[diesel(sql_type = BigInt)]
    pub deleted: i64,
    /// The outbox only: where the next batch of this run starts, `(published_at, id)` of the
    /// last row this one took, so that events left for later are not taken again and again.
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub last_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<diesel::sql_types::Uuid>)]
    pub last_id: Option<uuid::Uuid>,
}

impl Expiry {
    /// The cursor for the next batch of the run.
    pub fn after(&self) -> Option<(DateTime<Utc>, uuid::Uuid)> {
        self.last_at.zip(self.last_id)
    }
}

/// Deletes at most `batch` rows of `what` older than `older_than`, oldest first. Rows locked
/// by someone else are skipped, never waited for. Dead letters and IGNORED rows never match:
/// they are an operator's to decide about.
///
/// Expected plans: index scans of `outbox_events_published`, `inbox_events_processed`,
/// `idempotency_keys_created`, `admin_audit_at`, `reconcile_runs_started`,
/// `aggregate_versions_updated` and `side_effects_done`.
/// For the outbox, `after` is the previous batch's [`Expiry::after`] in this run: the batch
/// takes rows past it, in `(published_at, id)` order.
pub(crate) async fn delete_expired(
    conn: &mut AsyncPgConnection,
    what: Expired,
    older_than: Duration,
    batch: i64,
    after: Option<(DateTime<Utc>, uuid::Uuid)>,
) -> Result<Expiry> {
    let sql: std::borrow::Cow<'static, str> = match what {
        // The event's inbox rows that stay (dead letters, retries, rows not yet expired) are
        // found by correlation through their outbox row; with it gone, they are marked
        // `external` (no outbox row here), which puts them in the inbox's own correlation index
        // and keeps them in the timeline. An event one of whose inbox rows is locked (a batch
        // holds it; a hung handler may hold it for long) is left for a later run: waiting
        // for it would stall retention behind that handler. The unrouted record of an event
        // received from a broker (no outbox row here) goes once it is as old. No event a
        // cursor has yet to pass goes (none at or past the least seq of the stamps from the
        // slowest cursor's on, among cursors with entries past them: a slot with none would
        // hold the floor for ever), and the stamps every such cursor passed go with the run.
        // Nor does an event a running replay has yet to walk through its stamp
        // (`replays.log_below`): it would end short (`REPLAY_GAP`).
        Expired::PublishedOutbox => {
            "WITH slowest AS ( \
                 SELECT min(k.stamp) AS stamp FROM actix_outbox.consumer_cursors k \
                 WHERE EXISTS (SELECT FROM actix_outbox.log_stamps s \
                     WHERE s.part = k.part AND s.stamp >= k.stamp \
                       AND (s.stamp, cardinality(s.events)) > (k.stamp, k.idx))), \
             cursors AS ( \
                 SELECT coalesce(min(o.seq), 9223372036854775807) AS floor \
                 FROM actix_outbox.log_stamps s \
                 CROSS JOIN LATERAL unnest(s.events) AS u(id) \
                 JOIN actix_outbox.outbox_events o ON o.id = u.id \
                 WHERE s.stamp >= (SELECT stamp FROM slowest)), \
             stamps AS (DELETE FROM actix_outbox.log_stamps \
                 WHERE stamp < coalesce((SELECT stamp FROM slowest), \
                                        (SELECT last + 1 FROM actix_outbox.log_head))), \
             expired AS ( \
                 SELECT id, published_at FROM actix_outbox.outbox_events o \
                 WHERE status = 'PUBLISHED' AND published_at < now() - $1 * interval '1 millisecond' \
                   AND published_at >= coalesce($3, '-infinity') \
                   AND (published_at, id) > (coalesce($3, '-infinity'), coalesce($4, '00000000-0000-0000-0000-000000000000')) \
                   AND seq < (SELECT floor FROM cursors) \
                   AND NOT EXISTS (SELECT FROM actix_outbox.replays r \
                       WHERE r.status = 'RUNNING' AND o.stamp < r.log_below \
                         AND (o.published_at, o.id) > (r.log_at, r.log_id) \
                         AND (r.event_types IS NULL OR o.event_type = ANY (r.event_types)) \
                         AND (r.created_from IS NULL OR o.created_at >= r.created_from) \
                         AND (r.created_until IS NULL OR o.created_at < r.created_until) \
                         AND (r.correlation_id IS NULL OR o.correlation_id = r.correlation_id) \
                         AND EXISTS (SELECT FROM actix_outbox.consumer_subscriptions s \
                             WHERE s.consumer = r.consumer AND s.event_type = o.event_type)) \
                 ORDER BY published_at, id LIMIT $2 FOR UPDATE SKIP LOCKED), \
             locked AS ( \
                 SELECT id, event_id FROM actix_outbox.inbox_events \
                 WHERE event_id IN (SELECT id FROM expired) AND NOT external \
                 FOR UPDATE SKIP LOCKED), \
             busy AS ( \
                 SELECT event_id FROM actix_outbox.inbox_events \
                 WHERE event_id IN (SELECT id FROM expired) AND NOT external \
                   AND id NOT IN (SELECT id FROM locked)), \
             gone AS (SELECT id FROM expired WHERE id NOT IN (SELECT event_id FROM busy)), \
             kept AS (UPDATE actix_outbox.inbox_events SET external = true \
                 WHERE id IN (SELECT id FROM locked WHERE event_id IN (SELECT id FROM gone))), \
             deleted AS (DELETE FROM actix_outbox.outbox_events WHERE id IN (SELECT id FROM gone) RETURNING 1), \
             unrouted AS (DELETE FROM actix_outbox.unrouted_events WHERE event_id IN (SELECT id FROM gone)), \
             received AS (DELETE FROM actix_outbox.unrouted_events WHERE event_id IN ( \
                 SELECT u.event_id FROM actix_outbox.unrouted_events u \
                 WHERE u.published_at < now() - $1 * interval '1 millisecond' \
                   AND NOT EXISTS (SELECT FROM actix_outbox.outbox_events o WHERE o.id = u.event_id) \
                 ORDER BY u.published_at LIMIT $2)), \
             last AS (SELECT published_at, id FROM expired ORDER BY published_at DESC, id DESC LIMIT 1) \
             SELECT (SELECT count(*) FROM expired) AS seen, (SELECT count(*) FROM deleted) AS deleted, \
                    (SELECT published_at FROM last) AS last_at, (SELECT id FROM last) AS last_id"
                .into()
        }
        Expired::ProcessedInbox => {
            // Never a row a running replay has yet to reach: it would end short (`REPLAY_GAP`);
            // nor, while a replay walks the outbox, a row of its range that its consumer had
            // when it was asked for, while the event's outbox row is there: the event would
            // join the walk (`replays.log_inbox_upto`). A mark of an event never applied (a
            // stale one: `error_code`) stays while its outbox row does, so that a replay
            // asked for later never takes that event for one its consumer applied.
            by_age(
                "actix_outbox.inbox_events i",
                "id",
                "processed_at",
                "AND status = 'PROCESSED' \
                 AND (i.error_code IS NULL OR NOT EXISTS (SELECT FROM actix_outbox.outbox_events o \
                      WHERE o.id = i.event_id)) \
                 AND NOT EXISTS (SELECT FROM actix_outbox.replays r \
                 WHERE r.status = 'RUNNING' AND r.consumer = i.consumer \
                   AND ((i.id > r.cursor_id AND i.id <= r.upto_id) \
                        OR (r.log_below IS NOT NULL AND i.id <= r.log_inbox_upto \
                            AND (r.event_types IS NULL OR i.event_type = ANY (r.event_types)) \
                            AND (r.created_from IS NULL OR i.event_created_at >= r.created_from) \
                            AND (r.created_until IS NULL OR i.event_created_at < r.created_until) \
                            AND (r.correlation_id IS NULL OR i.correlation_id = r.correlation_id) \
                            AND EXISTS (SELECT FROM actix_outbox.outbox_events o \
                                        WHERE o.id = i.event_id))))",
            )
            .into()
        }
        Expired::IdempotencyKeys => by_age("actix_outbox.idempotency_keys", "key", "created_at", "").into(),
        Expired::AdminAudit => by_age("actix_outbox.admin_audit", "id", "at", "").into(),
        Expired::DoneEffects => {
            by_age("actix_outbox.side_effects", "id", "done_at", "AND status = 'DONE'").into()
        }
        // Never a run still going.
        Expired::ReconcileRuns => {
            by_age("actix_outbox.reconcile_runs", "id", "started_at", "AND finished_at IS NOT NULL").into()
        }
        // A version is what an event of its aggregate is compared with, so it goes only when
        // no such event can still come: the consumer has no row of the aggregate that may yet
        // be applied (received, waiting for a retry, or a dead letter an operator may retry),
        // and the outbox no event of it still to be fanned out. Those rows are the work in
        // flight and the dead letters, read once per batch through their partial indexes.
        Expired::AggregateVersions => {
            "WITH expired AS ( \
                 SELECT consumer, aggregate_type, aggregate_id FROM actix_outbox.aggregate_versions v \
                 WHERE updated_at < now() - $1 * interval '1 millisecond' \
                   AND (consumer, aggregate_type, aggregate_id) NOT IN ( \
                       SELECT consumer, aggregate_type, aggregate_id FROM actix_outbox.inbox_events \
                       WHERE status IN ('RECEIVED', 'RETRY_PENDING', 'DEAD_LETTER')) \
                   AND (aggregate_type, aggregate_id) NOT IN ( \
                       SELECT aggregate_type, aggregate_id FROM actix_outbox.outbox_events \
                       WHERE status IN ('PENDING', 'RETRY_PENDING', 'PROCESSING', 'DEAD_LETTER')) \
                 ORDER BY updated_at LIMIT $2 FOR UPDATE SKIP LOCKED), \
             deleted AS (DELETE FROM actix_outbox.aggregate_versions v USING expired e \
                 WHERE (v.consumer, v.aggregate_type, v.aggregate_id) \
                     = (e.consumer, e.aggregate_type, e.aggregate_id) RETURNING 1) \
             SELECT (SELECT count(*) FROM expired) AS seen, (SELECT count(*) FROM deleted) AS deleted, \
                    NULL::timestamptz AS last_at, NULL::uuid AS last_id"
                .into()
        }
    };
    let query = crate::store::sql(&sql)
        .bind::<BigInt, _>(store::millis(older_than))
        .bind::<BigInt, _>(batch);
    let expiry = if what == Expired::PublishedOutbox {
        query
            .bind::<Nullable<Timestamptz>, _>(after.map(|a| a.0))
            .bind::<Nullable<diesel::sql_types::Uuid>, _>(after.map(|a| a.1))
            .get_result(conn)
            .await?
    } else {
        query.get_result(conn).await?
    };
    Ok(expiry)
}

/// The delete of the tables whose rows simply age out: the oldest `$2` rows of `table` whose
/// `at` is older than `$1` ms (and that match `also`), by their key, skipping locked ones.
fn by_age(table: &str, key: &str, at: &str, also: &str) -> String {
    format!(
        "WITH expired AS ( \
             SELECT {key} FROM {table} WHERE {at} < now() - $1 * interval '1 millisecond' {also} \
             ORDER BY {at} LIMIT $2 FOR UPDATE SKIP LOCKED), \
         deleted AS (DELETE FROM {table} WHERE {key} IN (SELECT {key} FROM expired) RETURNING 1) \
         SELECT (SELECT count(*) FROM expired) AS seen, (SELECT count(*) FROM deleted) AS deleted, \
                NULL::timestamptz AS last_at, NULL::uuid AS last_id"
    )
}
