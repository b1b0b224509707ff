-- The external route's claim (`lease::claim_leased`): lease up to $1 due outbox rows to $2 for
-- $3 ms, counting the attempt. A due row marked `alone` by the reaper is claimed on its own,
-- before any other (the migration `outbox_alone`). `due` reads `outbox_events_due` past seq
-- $4 (`store::scan`; the least int8 reads from the start). Its own file so that the plan test
-- runs exactly this text.
WITH one AS (
    SELECT id FROM actix_outbox.outbox_events
    WHERE alone AND status IN ('PENDING', 'RETRY_PENDING') AND next_attempt_at <= now()
    ORDER BY seq LIMIT 1
    FOR UPDATE SKIP LOCKED
), due AS (
    SELECT id FROM actix_outbox.outbox_events
    WHERE status IN ('PENDING', 'RETRY_PENDING') AND next_attempt_at <= now() AND seq > $4
      AND NOT alone AND NOT EXISTS (SELECT FROM one)
    ORDER BY seq LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE actix_outbox.outbox_events o
SET status = 'PROCESSING', locked_by = $2,
    locked_until = now() + $3 * interval '1 millisecond',
    lease_token = nextval('actix_outbox.outbox_lease_token_seq'),
    attempt_count = o.attempt_count + 1, updated_at = now()
FROM (SELECT id FROM one UNION ALL SELECT id FROM due) c WHERE o.id = c.id
RETURNING o.id, o.lease_token, o.event_type, o.event_version, o.aggregate_type,
    o.aggregate_id, o.aggregate_version, o.payload, o.metadata, o.correlation_id,
    o.causation_id, o.created_at, o.attempt_count, o.alone, o.seq
