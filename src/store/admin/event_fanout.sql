-- What became of one event for each consumer (`admin::event_fanout`): the consumers that have
-- an inbox row for it (by the inbox's unique `(event_id, consumer)` index) and those
-- subscribed to its type now. A row a lease names shows as IN_FLIGHT.
--   $1 event id
WITH r AS (SELECT * FROM actix_outbox.inbox_events WHERE event_id = $1),
     t AS (SELECT coalesce((SELECT event_type FROM actix_outbox.outbox_events WHERE id = $1),
                           (SELECT event_type FROM r LIMIT 1)) AS event_type),
     s AS (SELECT consumer FROM actix_outbox.consumer_subscriptions
           WHERE event_type = (SELECT event_type FROM t))
SELECT c.consumer, c.consumer IN (SELECT consumer FROM s) AS subscribed,
    r.id IS NOT NULL AS got, r.id AS inbox_id,
    CASE WHEN r.status IN ('RECEIVED', 'RETRY_PENDING') AND EXISTS (
             SELECT FROM actix_outbox.inbox_leases l
             WHERE l.consumer = r.consumer AND r.id = ANY (l.ids))
         THEN 'IN_FLIGHT' ELSE r.status END AS status,
    r.attempt_count, r.error_code,
    r.last_error, r.received_at, r.processed_at, r.external
FROM (SELECT consumer FROM r UNION SELECT consumer FROM s) c
LEFT JOIN r USING (consumer) ORDER BY c.consumer
