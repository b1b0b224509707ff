-- The operator API's inbox list (`admin::list_inbox`), newest first; its own file so that the
-- plan test (`tests/it/plan.rs`) explains exactly this text. A NULL filter matches everything.
--   $1 status   $2 event type   $3 consumer   $4 cursor: ids below it   $5 limit
--   $6 whether to select the payload (a redacted view is enabled)
-- Planned with its values bound, so each filter given reaches the planner as a plain equality
-- and a status one selects that status's partial index (see `docs/operations.md`).
-- A row a lease names (a batch holds it) shows as IN_FLIGHT, with its lease's claim time,
-- process and expiry; a RECEIVED or RETRY_PENDING filter leaves it out (`IN_FLIGHT` is
-- `list_inbox_in_flight.sql`). The page is found first; each of its rows then looks for its
-- lease among its consumer's (few: the batches in flight), by `inbox_leases_consumer`.
WITH page AS (
    SELECT i.* FROM actix_outbox.inbox_events i
    WHERE ($1::text IS NULL OR i.status = $1) AND ($2::text IS NULL OR i.event_type = $2)
      AND ($3::text IS NULL OR i.consumer = $3) AND ($4::int8 IS NULL OR i.id < $4)
      AND ($1::text IS NULL OR $1 NOT IN ('RECEIVED', 'RETRY_PENDING') OR NOT EXISTS (
          SELECT FROM actix_outbox.inbox_leases l WHERE l.consumer = i.consumer AND i.id = ANY (l.ids)))
    ORDER BY i.id DESC LIMIT $5
)
SELECT p.id, p.event_id, p.consumer, p.event_type, p.event_version, p.aggregate_type,
    p.aggregate_id, p.aggregate_version,
    CASE WHEN f.claimed_at IS NOT NULL AND p.status IN ('RECEIVED', 'RETRY_PENDING')
         THEN 'IN_FLIGHT' ELSE p.status END AS status,
    p.attempt_count, p.error_code, p.last_error, p.correlation_id, p.causation_id,
    p.event_created_at, p.received_at, p.next_attempt_at, p.processed_at, p.updated_at,
    CASE WHEN $6 THEN p.payload END AS payload,
    f.claimed_at AS leased_since, f.locked_by AS leased_by, f.locked_until AS leased_until
FROM page p LEFT JOIN LATERAL (
    SELECT l.claimed_at, l.locked_by, l.locked_until FROM actix_outbox.inbox_leases l
    WHERE l.consumer = p.consumer AND p.id = ANY (l.ids) LIMIT 1
) f ON true
ORDER BY p.id DESC
