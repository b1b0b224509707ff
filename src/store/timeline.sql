-- The correlation timeline (`timeline`): every outbox and inbox record one request caused, in
-- order. Inbox rows are found two ways, each through an index: those of events published from
-- this database through their outbox rows (`outbox_events_correlation`, then the inbox's
-- unique `(event_id, consumer)` index), those whose event has no outbox row here (`external`:
-- received from another database, or its outbox row deleted by retention) through the inbox's
-- partial correlation index. A consumer that reads an event's type through its cursor has an
-- inbox row only for an exception; for an event of this database with none, its record comes
-- from its cursor (`cursor_status.sql`, included where the marker stands), with no attempts
-- and no finishing time, at the event's publication.
--   $1 correlation id   $2 limit
WITH o AS MATERIALIZED (
    SELECT id, event_type, aggregate_type, aggregate_id, status, attempt_count, error_code,
        causation_id, created_at, published_at, seq
    FROM actix_outbox.outbox_events WHERE correlation_id = $1
)
SELECT * FROM (
    SELECT 'outbox' AS kind, id AS event_id, event_type, aggregate_id, NULL::text AS consumer,
        status, attempt_count AS attempts, error_code, causation_id, created_at AS at,
        published_at AS finished_at, seq AS ord
    FROM o
    UNION ALL
    SELECT 'inbox', event_id, event_type, aggregate_id, consumer, status, attempt_count,
        error_code, causation_id, received_at, processed_at, id
    FROM actix_outbox.inbox_events WHERE event_id IN (SELECT id FROM o)
    UNION ALL
    SELECT 'inbox', o.id, o.event_type, o.aggregate_id, s.consumer, k.status, 0, NULL,
        o.causation_id, coalesce(o.published_at, o.created_at), NULL, o.seq
    FROM o JOIN actix_outbox.consumer_subscriptions s ON s.event_type = o.event_type
        AND (s.cursor OR EXISTS (SELECT FROM actix_outbox.consumer_cursors kc
                                 WHERE kc.consumer = s.consumer))
    CROSS JOIN LATERAL (SELECT /* cursor_status */ AS status) k
    WHERE k.status IS NOT NULL AND NOT EXISTS (SELECT FROM actix_outbox.inbox_events i
                                               WHERE i.event_id = o.id AND i.consumer = s.consumer)
    UNION ALL
    SELECT 'inbox', event_id, event_type, aggregate_id, consumer, status, attempt_count,
        error_code, causation_id, received_at, processed_at, id
    FROM actix_outbox.inbox_events
    WHERE external AND correlation_id = $1 AND event_id NOT IN (SELECT id FROM o)
) t ORDER BY at, kind DESC, ord LIMIT $2
