-- The operator API's inbox list (`admin::list_inbox`), newest first; its own file so that the
-- plan test (`tests/it/plan.rs`) explains exactly this text. A NULL filter matches everything.
--   $1 status   $2 event type   $3 consumer   $4 cursor: ids below it   $5 limit
--   $6 whether to select the payload (a redacted view is enabled)
-- Planned with its values bound, so each filter given reaches the planner as a plain equality
-- and a status one selects that status's partial index (see `docs/operations.md`).
SELECT id, event_id, consumer, event_type, event_version, aggregate_type, aggregate_id,
    aggregate_version, status, attempt_count, error_code, last_error, correlation_id,
    causation_id, event_created_at, received_at, next_attempt_at, processed_at,
    updated_at, CASE WHEN $6 THEN payload END AS payload
FROM actix_outbox.inbox_events
WHERE ($1::text IS NULL OR status = $1) AND ($2::text IS NULL OR event_type = $2)
  AND ($3::text IS NULL OR consumer = $3) AND ($4::int8 IS NULL OR id < $4)
ORDER BY id DESC LIMIT $5
