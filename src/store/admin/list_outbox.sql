-- The operator API's outbox list (`admin::list_outbox`), newest first (UUID v7 ids are
-- time-ordered, so the primary key serves the order and the cursor); its own file so that the
-- plan test (`tests/it/plan.rs`) explains exactly this text. A NULL filter matches everything.
--   $1 status   $2 event type   $3 cursor: ids below it   $4 limit
--   $5 whether to select the payload (a redacted view is enabled)
SELECT id, event_type, event_version, aggregate_type, aggregate_id, aggregate_version, status,
    attempt_count, error_code, last_error, correlation_id, causation_id, created_at,
    next_attempt_at, published_at, updated_at, CASE WHEN $5 THEN payload END AS payload
FROM actix_outbox.outbox_events
WHERE ($1::text IS NULL OR status = $1) AND ($2::text IS NULL OR event_type = $2)
  AND ($3::uuid IS NULL OR id < $3)
ORDER BY id DESC LIMIT $4
