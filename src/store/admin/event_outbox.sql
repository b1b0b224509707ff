-- One event's outbox row (`admin::event_fanout`), by primary key.
--   $1 event id   $2 whether to select the payload (a redacted view is enabled)
SELECT id, event_type, event_version, aggregate_type, aggregate_id, aggregate_version, status,
    attempt_count, error_code, last_error, correlation_id, causation_id, created_at,
    next_attempt_at, published_at, updated_at, CASE WHEN $2 THEN payload END AS payload
FROM actix_outbox.outbox_events WHERE id = $1
