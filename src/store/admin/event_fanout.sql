-- What became of one event for each consumer (`admin::event_fanout`): the consumers that have
-- an inbox row for it (by the inbox's unique `(event_id, consumer)` index) and those
-- subscribed to its type now. A row a lease names shows as IN_FLIGHT.
--
-- A consumer that reads the type through its cursor (the migration `cursors`), or still has
-- cursors it is turning off, has an inbox row only for an exception; without one, its status
-- comes from its cursor (`cursor_status.sql`, included where the marker stands).
--   $1 event id
WITH r AS (SELECT * FROM actix_outbox.inbox_events WHERE event_id = $1),
     o AS (SELECT id, event_type, status, published_at, aggregate_type, aggregate_id
           FROM actix_outbox.outbox_events WHERE id = $1),
     t AS (SELECT coalesce((SELECT event_type FROM o), (SELECT event_type FROM r LIMIT 1)) AS event_type),
     s AS (SELECT consumer, cursor, created_at FROM actix_outbox.consumer_subscriptions
           WHERE event_type = (SELECT event_type FROM t)),
     k AS (
    SELECT s.consumer, /* cursor_status */ AS status
    FROM s CROSS JOIN o WHERE s.consumer NOT IN (SELECT consumer FROM r)
      AND (s.cursor OR EXISTS (SELECT FROM actix_outbox.consumer_cursors kc
                               WHERE kc.consumer = s.consumer))
)
SELECT c.consumer, c.consumer IN (SELECT consumer FROM s) AS subscribed,
    r.id IS NOT NULL OR k.status IS NOT NULL AS got, r.id AS inbox_id,
    coalesce(k.status, CASE WHEN r.status IN ('RECEIVED', 'RETRY_PENDING') AND EXISTS (
             SELECT FROM actix_outbox.inbox_leases l
             WHERE l.consumer = r.consumer AND r.id = ANY (l.ids))
         THEN 'IN_FLIGHT' ELSE r.status END) AS status,
    coalesce((SELECT cursor FROM s WHERE s.consumer = c.consumer), false) AS cursor,
    r.attempt_count, r.error_code,
    r.last_error, r.received_at, r.processed_at, r.external
FROM (SELECT consumer FROM r UNION SELECT consumer FROM s) c
LEFT JOIN r USING (consumer) LEFT JOIN k USING (consumer) ORDER BY c.consumer
