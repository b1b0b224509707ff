-- Replays, newest first (`replay::list`): one consumer's, or all (`$1` NULL), through the
-- primary key. The table holds one row per operator request.
--   $1 consumer   $2 limit
SELECT id, consumer, event_types, created_from, created_until, correlation_id, total, done,
    rate, status, attempts, error_code, last_error, requested_by, reason, requested_at,
    finished_at
FROM actix_outbox.replays WHERE $1::text IS NULL OR consumer = $1
ORDER BY id DESC LIMIT $2
