//! `GET /stats`: what the demo reports, computed by PostgreSQL from the tables themselves, so
//! the numbers survive restarts and agree with what any instance would say.

use actix_web::{web, HttpResponse};
use diesel::sql_types::Text;
use diesel::QueryableByName;
use diesel_async::RunQueryDsl;

use crate::api::{conn, ApiError, AppState};

#[derive(QueryableByName)]
struct Stats {
    #[diesel(sql_type = Text)]
    stats: String,
}

/// One statement, so every number comes from one snapshot.
///
/// - `duplicates_absorbed.redeliveries`: handler calls beyond the inbox's attempt count, i.e.
///   deliveries whose transaction died (with the process) after the handler ran; their effects
///   rolled back and the event was delivered again.
/// - `duplicates_absorbed.idempotency_keys`: events whose notification already existed: each
///   processed delivery to `notification` either made a job or found its key taken.
/// - Latency is from the producer's transaction to the start of the consumer's (both `now()`).
const STATS_SQL: &str = r#"
WITH inbox_ms AS (
    SELECT consumer, extract(epoch FROM processed_at - event_created_at)::float8 * 1000 AS ms
    FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'
), latency AS (
    SELECT coalesce(consumer, 'all') AS consumer,
           round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 1) AS p50,
           round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::numeric, 1) AS p99,
           round(max(ms)::numeric, 1) AS max
    FROM inbox_ms GROUP BY ROLLUP (consumer)
)
SELECT json_build_object(
    'orders', (SELECT coalesce(json_object_agg(status, n), '{}') FROM
        (SELECT status, count(*) AS n FROM orders GROUP BY status) s),
    'orders_by_source', (SELECT coalesce(json_object_agg(source, n), '{}') FROM
        (SELECT source, count(*) AS n FROM orders GROUP BY source) s),
    'events_written', (SELECT count(*) FROM actix_outbox.outbox_events),
    'events_by_status', (SELECT coalesce(json_object_agg(status, n), '{}') FROM
        (SELECT payload->>'status' AS status, count(*) AS n FROM actix_outbox.outbox_events
         WHERE event_type = 'ORDER_STATUS_CHANGED' GROUP BY 1) s),
    'outbox', (SELECT coalesce(json_object_agg(status, n), '{}') FROM
        (SELECT status, count(*) AS n FROM actix_outbox.outbox_events GROUP BY status) s),
    'outbox_pending', (SELECT count(*) FROM actix_outbox.outbox_events
        WHERE status IN ('PENDING', 'RETRY_PENDING', 'PROCESSING')),
    'inbox', (SELECT coalesce(json_object_agg(consumer, statuses), '{}') FROM
        (SELECT consumer, json_object_agg(status, n) AS statuses FROM
            (SELECT consumer, status, count(*) AS n FROM actix_outbox.inbox_events GROUP BY consumer, status) c
         GROUP BY consumer) s),
    'inbox_open', (SELECT count(*) FROM actix_outbox.inbox_events WHERE status IN ('RECEIVED', 'RETRY_PENDING', 'PROCESSING')),
    'inbox_retries', (SELECT coalesce(json_object_agg(consumer, n), '{}') FROM
        (SELECT consumer, sum(attempt_count - 1) AS n FROM actix_outbox.inbox_events
         WHERE attempt_count > 1 GROUP BY consumer) s),
    'dead_letters', json_build_object(
        'outbox', (SELECT count(*) FROM actix_outbox.outbox_events WHERE status = 'DEAD_LETTER'),
        'inbox', (SELECT count(*) FROM actix_outbox.inbox_events WHERE status = 'DEAD_LETTER')),
    'duplicates_absorbed', json_build_object(
        'redeliveries', (SELECT coalesce(sum(h.calls - i.attempt_count), 0) FROM handler_calls h
            JOIN actix_outbox.inbox_events i ON i.event_id = h.event_id AND i.consumer = h.consumer
            WHERE i.status = 'PROCESSED' AND h.calls > i.attempt_count),
        'idempotency_keys', (SELECT count(*) FROM actix_outbox.inbox_events
            WHERE consumer = 'notification' AND status = 'PROCESSED')
            - (SELECT count(*) FROM notification_jobs WHERE created_by = 'notification')),
    'notification_jobs', (SELECT coalesce(json_object_agg(status, n), '{}') FROM
        (SELECT status, count(*) AS n FROM actix_outbox.side_effects
         WHERE kind = 'notification.send' GROUP BY status) s),
    'notification_jobs_by_creator', (SELECT coalesce(json_object_agg(created_by, n), '{}') FROM
        (SELECT created_by, count(*) AS n FROM notification_jobs GROUP BY created_by) s),
    'notification_send_retries', (SELECT coalesce(sum(attempt_count - 1), 0)
        FROM actix_outbox.side_effects WHERE kind = 'notification.send' AND attempt_count > 1),
    'analytics', (SELECT coalesce(json_object_agg(status, count), '{}') FROM order_status_counts),
    'reconcile', (SELECT json_build_object('runs', count(*), 'found', coalesce(sum(found), 0),
        'repaired', coalesce(sum(repaired), 0)) FROM actix_outbox.reconcile_runs),
    'reconcile_repairs_by_source', (SELECT coalesce(json_object_agg(source, n), '{}') FROM
        (SELECT o.source, count(*) AS n FROM notification_jobs j JOIN orders o ON o.id = j.order_id
         WHERE j.created_by <> 'notification' GROUP BY o.source) s),
    'drift', json_build_object('completed_without_notification', (SELECT count(*) FROM orders o
        WHERE o.status = 'COMPLETED' AND NOT EXISTS (SELECT 1 FROM notification_jobs j
            WHERE j.order_id = o.id AND j.status = 'COMPLETED'))),
    'latency_ms', (SELECT coalesce(json_object_agg(consumer,
        json_build_object('p50', p50, 'p99', p99, 'max', max)), '{}') FROM latency)
)::text AS stats
"#;

pub async fn stats(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let mut conn = conn(&state.pool).await?;
    let row: Stats = diesel::sql_query(STATS_SQL).get_result(&mut conn).await?;
    Ok(HttpResponse::Ok()
        .content_type("application/json")
        .body(row.stats))
}
