-- The consumer's claim (`inbox::claim`): lease up to $2 due rows of consumer $1 for $3
-- milliseconds to process $4 under token $5 ($6: dead letters block an ordered consumer's
-- aggregate), by writing one `inbox_leases` row that names them;
-- the rows themselves are not written (see the migration `inbox_lease_table`). Committed before
-- any handler sees a row. Run after the consumer's claim lock (`inbox::claim`), so the leases
-- this reads are every lease committed before it. None while the consumer is paused (until its
-- `paused_until`, if it has one).
-- A due row marked `alone` (suspected in a death, see the migration `inbox_lease`) is leased on
-- its own, in a lease of one row, and only while this process has no other suspect under test
-- (of any consumer; the process's claims take turns on an advisory lock for that: only a claim
-- whose transaction took it, in a statement before this one so that this one's snapshot holds
-- every suspect lease committed before, may take a suspect; that statement says so in the
-- transaction's setting `actix_outbox.alone_turn`; `inbox::claim`),
-- so that a death has at most one suspect among its causes. A suspect whose handler hung past
-- its timeout is under test no more: it was charged the timeout, and its lease is marked so
-- (`inbox::extend`). It never holds up other rows: they are claimed beside it as usual, by
-- this claim when no suspect is taken, and by every other.
-- An ordered consumer's row (`ordered`, see the migration `ordered_consumers`) is claimed only
-- when it is the earliest unfinished event of its aggregate: no row of the aggregate with a
-- lower `event_seq` is due, leased or ($6) dead-lettered, and no event of the aggregate with a
-- lower seq waits in the outbox to be fanned out (read along `outbox_events_due`: rows are
-- fanned out in seq order, so few due rows lie below a row already in the inbox). So a claim
-- takes at most one row per aggregate, and the next only after this one's outcome has
-- committed. The same test is written in `one` and in `due`.
-- The ORDER BY is the partial index `inbox_events_due` column for column, so PostgreSQL reads
-- it in order and stops at the limit, skipping rows a lease names. `due` reads it past
-- ($7, $8), the last row the latest claim took, or from the start ($8 the least int8)
-- (`store::scan`); a claim that took a row under the ordering test names no last row (rows
-- the test skipped lie behind it), so the next reads from the start. Run behind the plan
-- guard; `tests/plan.rs` checks, and its own file so that the test runs exactly this text.
WITH paused AS (
    SELECT FROM actix_outbox.consumer_states s WHERE s.consumer = $1 AND s.paused
        AND (s.paused_until IS NULL OR s.paused_until > now())
), leased AS MATERIALIZED (
    SELECT unnest(l.ids) AS id FROM actix_outbox.inbox_leases l WHERE l.consumer = $1
), one AS (
    SELECT i.* FROM actix_outbox.inbox_events i
    WHERE i.consumer = $1 AND i.alone AND i.status IN ('RECEIVED', 'RETRY_PENDING')
      AND i.next_attempt_at <= now() AND i.id NOT IN (SELECT id FROM leased)
      AND NOT EXISTS (SELECT FROM paused)
      AND NOT EXISTS (SELECT FROM actix_outbox.inbox_leases b WHERE b.locked_by = $4 AND b.alone)
      AND (NOT i.ordered OR (
          NOT EXISTS (
              SELECT FROM actix_outbox.outbox_events o
              WHERE o.status IN ('PENDING', 'RETRY_PENDING') AND o.seq < i.event_seq
                AND o.aggregate_type = i.aggregate_type AND o.aggregate_id = i.aggregate_id)
          AND NOT EXISTS (
              SELECT FROM actix_outbox.inbox_events e
              WHERE e.consumer = $1 AND e.ordered AND e.aggregate_type = i.aggregate_type
                AND e.aggregate_id = i.aggregate_id AND e.event_seq < i.event_seq
                AND e.status IN ('RECEIVED', 'RETRY_PENDING', 'DEAD_LETTER')
                AND (e.status <> 'DEAD_LETTER' OR $6))))
      AND current_setting('actix_outbox.alone_turn', true) = 'true'
    ORDER BY i.next_attempt_at, i.id
    LIMIT 1
), due AS MATERIALIZED (
    SELECT i.* FROM actix_outbox.inbox_events i
    WHERE i.consumer = $1 AND i.status IN ('RECEIVED', 'RETRY_PENDING')
      AND i.next_attempt_at <= now() AND i.id NOT IN (SELECT id FROM leased)
      AND (i.next_attempt_at, i.id) > (coalesce($7, '-infinity'), $8)
      AND NOT i.alone AND NOT EXISTS (SELECT FROM paused) AND NOT EXISTS (SELECT FROM one)
      AND (NOT i.ordered OR (
          NOT EXISTS (
              SELECT FROM actix_outbox.outbox_events o
              WHERE o.status IN ('PENDING', 'RETRY_PENDING') AND o.seq < i.event_seq
                AND o.aggregate_type = i.aggregate_type AND o.aggregate_id = i.aggregate_id)
          AND NOT EXISTS (
              SELECT FROM actix_outbox.inbox_events e
              WHERE e.consumer = $1 AND e.ordered AND e.aggregate_type = i.aggregate_type
                AND e.aggregate_id = i.aggregate_id AND e.event_seq < i.event_seq
                AND e.status IN ('RECEIVED', 'RETRY_PENDING', 'DEAD_LETTER')
                AND (e.status <> 'DEAD_LETTER' OR $6))))
    ORDER BY i.next_attempt_at, i.id
    LIMIT $2
), lease AS (
    INSERT INTO actix_outbox.inbox_leases (token, consumer, locked_by, backend, locked_until, ids, alone)
    SELECT $5, $1, $4, pg_backend_pid(), now() + $3 * interval '1 millisecond',
        array_agg(p.id), EXISTS (SELECT FROM one)
    FROM (SELECT id FROM one UNION ALL SELECT id FROM due) p HAVING count(*) > 0
)
-- In claim order; `attempt_count`: the attempts before this one; `backend`, the session the
-- rows' handlers will write in; `place_at`, with the id where the next claim may start: its
-- `next_attempt_at`, NULL for '-infinity' (which `$7` reads back as such); `ordered`, whether
-- the ordering test applied to it.
SELECT p.id, p.event_id, p.event_type, p.event_version, p.aggregate_type, p.aggregate_id,
    p.aggregate_version, p.payload, p.metadata, p.correlation_id, p.causation_id,
    p.event_created_at, p.attempt_count, $5 AS lease_token, p.alone,
    pg_backend_pid() AS backend, p.ordered,
    CASE WHEN p.next_attempt_at > '-infinity' THEN p.next_attempt_at END AS place_at
FROM (SELECT * FROM one UNION ALL SELECT * FROM due) p ORDER BY p.next_attempt_at, p.id
