-- The operator API's inbox list filtered on IN_FLIGHT (`admin::list_inbox`): the rows a lease
-- names (a batch, or a hung handler's call, holds them), newest first, read from the leases
-- (few: the batches in flight) and then by primary key. Same parameters as `list_inbox.sql`;
-- $1 is IN_FLIGHT. A row a lease names is RECEIVED or RETRY_PENDING (its mark takes it out of
-- the lease), so the rows are looked up by primary key alone.
WITH leased AS MATERIALIZED (
    SELECT u.id, l.claimed_at, l.locked_by, l.locked_until
    FROM actix_outbox.inbox_leases l CROSS JOIN unnest(l.ids) AS u(id)
    WHERE ($3::text IS NULL OR l.consumer = $3) AND $1::text = 'IN_FLIGHT'
)
SELECT i.id, i.event_id, i.consumer, i.event_type, i.event_version, i.aggregate_type,
    i.aggregate_id, i.aggregate_version, 'IN_FLIGHT' AS status,
    i.attempt_count, i.error_code, i.last_error, i.correlation_id, i.causation_id,
    i.event_created_at, i.received_at, i.next_attempt_at, i.processed_at, i.updated_at,
    CASE WHEN $6 THEN i.payload END AS payload,
    f.claimed_at AS leased_since, f.locked_by AS leased_by, f.locked_until AS leased_until
FROM leased f JOIN actix_outbox.inbox_events i ON i.id = f.id
WHERE ($2::text IS NULL OR i.event_type = $2)
  AND ($4::int8 IS NULL OR i.id < $4)
ORDER BY i.id DESC LIMIT $5
