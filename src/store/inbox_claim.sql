-- The consumer's claim (`inbox::claim`): lease up to $2 due inbox rows of consumer $1 for $3
-- milliseconds to process $4 under token $5, counting each row's attempt. Committed before any handler sees
-- a row: should the handler kill its process or its backend, the attempt is already counted
-- (see the migration `inbox_lease`). None while the consumer is paused.
-- A due row marked `alone` (suspected in a death, see the migration `inbox_lease`) is leased on
-- its own, and only while this process holds no other row of any consumer, so that should it
-- kill the process again it is known to be the cause; the process's claims of alone rows take
-- turns on an advisory lock for that. One that has waited a whole lease for such a moment (a
-- process never idle) is leased all the same. While one is due or in flight, its consumer
-- claims nothing else here.
-- The ORDER BY is the partial index `inbox_events_due` column for column, so PostgreSQL reads
-- it in order and stops at the limit; rows are found again by primary key. Run behind the plan
-- guard; `tests/plan.rs` checks, and its own file so that the test runs exactly this text.
WITH paused AS (
    SELECT FROM consumer_states s WHERE s.consumer = $1 AND s.paused
), alone AS (
    -- An `alone` row of the consumer due, or in flight in this process.
    SELECT FROM inbox_events a
    WHERE a.consumer = $1 AND a.alone AND a.status IN ('RECEIVED', 'RETRY_PENDING')
      AND a.next_attempt_at <= now()
    UNION ALL
    SELECT FROM inbox_events b
    WHERE b.locked_by = $4 AND b.consumer = $1 AND b.status = 'PROCESSING' AND b.alone
), one AS (
    SELECT i.id FROM inbox_events i
    WHERE i.consumer = $1 AND i.alone AND i.status IN ('RECEIVED', 'RETRY_PENDING')
      AND i.next_attempt_at <= now() AND NOT EXISTS (SELECT FROM paused)
      AND (NOT EXISTS (SELECT FROM inbox_events b WHERE b.locked_by = $4
                       AND b.status = 'PROCESSING')
           OR i.next_attempt_at < now() - $3 * interval '1 millisecond')
      AND pg_try_advisory_xact_lock(hashtextextended('actix_outbox.alone:' || $4, 0))
    ORDER BY i.next_attempt_at, i.id
    LIMIT 1
    FOR UPDATE OF i SKIP LOCKED
), due AS (
    SELECT i.id FROM inbox_events i
    WHERE i.consumer = $1 AND i.status IN ('RECEIVED', 'RETRY_PENDING')
      AND i.next_attempt_at <= now()
      AND NOT EXISTS (SELECT FROM paused) AND NOT EXISTS (SELECT FROM alone)
    ORDER BY i.next_attempt_at, i.id
    LIMIT $2
    FOR UPDATE OF i SKIP LOCKED
), claimed AS (
    UPDATE inbox_events i
    SET status = 'PROCESSING', attempt_count = i.attempt_count + 1,
        lease_token = $5, locked_by = $4, backend = pg_backend_pid(), held = NULL,
        locked_until = now() + $3 * interval '1 millisecond', updated_at = now()
    WHERE i.id = ANY (ARRAY(SELECT id FROM one UNION ALL SELECT id FROM due))
    RETURNING i.*
)
-- In claim order; `attempt_count` as before this attempt; `backend`, the session the rows'
-- handlers will write in.
SELECT id, event_id, event_type, event_version, aggregate_type, aggregate_id,
    aggregate_version, payload, metadata, correlation_id, causation_id, event_created_at,
    attempt_count - 1 AS attempt_count, lease_token, alone, pg_backend_pid() AS backend
FROM claimed ORDER BY next_attempt_at, id
