-- The consumer's claim (`begin_and_claim`): lock up to $2 due inbox rows of consumer $1 in the
-- batch's transaction, oldest due first; none while the consumer is paused. The ORDER BY is the
-- partial index `inbox_events_due` column for column, so PostgreSQL reads it in order and stops
-- at the limit, even in a generic plan made while the table was empty (no plan guard needed;
-- `tests/plan.rs` checks). Its own file so that the plan test runs exactly this text.
SELECT i.id, i.event_id, i.event_type, i.event_version, i.aggregate_type,
    i.aggregate_id, i.aggregate_version, i.payload, i.metadata, i.correlation_id,
    i.causation_id, i.event_created_at, i.attempt_count
FROM inbox_events i
WHERE i.consumer = $1 AND i.status IN ('RECEIVED', 'RETRY_PENDING')
  AND i.next_attempt_at <= now()
  AND NOT EXISTS (SELECT 1 FROM consumer_states s WHERE s.consumer = $1 AND s.paused)
ORDER BY i.next_attempt_at, i.id
LIMIT $2
FOR UPDATE OF i SKIP LOCKED
