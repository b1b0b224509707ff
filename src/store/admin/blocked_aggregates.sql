-- The aggregates ordered consumers are held up on (`admin::blocked_aggregates`), read through
-- `inbox_events_ordered`, which holds only ordered consumers' unfinished rows.
--   $1 consumer, or NULL for all   $2 limit
WITH a AS (
    SELECT consumer, aggregate_type, aggregate_id, count(*) - 1 AS waiting,
        min(event_seq) AS head_seq
    FROM actix_outbox.inbox_events
    WHERE ordered AND status IN ('RECEIVED', 'RETRY_PENDING', 'DEAD_LETTER')
      AND ($1::text IS NULL OR consumer = $1)
    GROUP BY consumer, aggregate_type, aggregate_id HAVING count(*) > 1)
SELECT a.consumer, a.aggregate_type, a.aggregate_id, a.waiting, i.id AS head_id,
    i.event_id, i.event_type, i.status, i.attempt_count, i.error_code, i.last_error,
    i.next_attempt_at
FROM a JOIN actix_outbox.inbox_events i ON i.consumer = a.consumer AND i.ordered
    AND i.aggregate_type = a.aggregate_type AND i.aggregate_id = a.aggregate_id
    AND i.event_seq = a.head_seq
WHERE i.status IN ('RETRY_PENDING', 'DEAD_LETTER')
ORDER BY a.waiting DESC, i.id LIMIT $2
