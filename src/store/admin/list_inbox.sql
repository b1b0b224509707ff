-- The operator API's inbox list (`admin::list_inbox`), newest first; its own file so that the
-- plan test (`tests/it/plan.rs`) explains exactly this text. A NULL filter matches everything.
--   $1 status   $2 event type   $3 consumer   $4 cursor: ids below it   $5 limit
--   $6 whether to select the payload (a redacted view is enabled)
-- Planned with its values bound, so each filter given reaches the planner as a plain equality
-- and a status one selects that status's partial index (see `docs/operations.md`).
-- A row a lease names (a batch holds it) shows as IN_FLIGHT, with its lease's claim time,
-- process and expiry; a RECEIVED or RETRY_PENDING filter leaves it out (`IN_FLIGHT` is
-- `list_inbox_in_flight.sql`). The leases are few: the batches in flight.
WITH leased AS MATERIALIZED (
    SELECT u.id, l.claimed_at, l.locked_by, l.locked_until
    FROM actix_outbox.inbox_leases l CROSS JOIN unnest(l.ids) AS u(id)
)
SELECT i.id, i.event_id, i.consumer, i.event_type, i.event_version, i.aggregate_type,
    i.aggregate_id, i.aggregate_version,
    CASE WHEN f.id IS NOT NULL AND i.status IN ('RECEIVED', 'RETRY_PENDING') THEN 'IN_FLIGHT'
         ELSE i.status END AS status,
    i.attempt_count, i.error_code, i.last_error, i.correlation_id, i.causation_id,
    i.event_created_at, i.received_at, i.next_attempt_at, i.processed_at, i.updated_at,
    CASE WHEN $6 THEN i.payload END AS payload,
    f.claimed_at AS leased_since, f.locked_by AS leased_by, f.locked_until AS leased_until
FROM actix_outbox.inbox_events i LEFT JOIN leased f ON f.id = i.id
WHERE ($1::text IS NULL OR i.status = $1) AND ($2::text IS NULL OR i.event_type = $2)
  AND ($3::text IS NULL OR i.consumer = $3) AND ($4::int8 IS NULL OR i.id < $4)
  AND ($1::text IS NULL OR $1 NOT IN ('RECEIVED', 'RETRY_PENDING') OR f.id IS NULL)
ORDER BY i.id DESC LIMIT $5
