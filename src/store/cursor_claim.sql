-- A cursor consumer's claim (`inbox::cursor::claim`, the migration `cursors`): lease the
-- events of consumer $1 among the next $2 entries of one slot past its cursor, for $3
-- milliseconds, to process $4 under token $5, a slot of the LOW lane first if $6 (else of
-- the HIGH lane; the migration `lanes`), by writing one `inbox_leases` row that names
-- them (`events`) and the token in the slot's cursor, with where the cursor goes when the
-- batch commits. Committed before any handler
-- sees an event. None while the consumer is paused, or while other batches hold every slot
-- with entries past its cursor.
--
-- It reads the next $2 entries past the cursor, from at most 8 stamps: stamps are read in
-- number order, and a stamp is visible only once every smaller one is (the invariant of
-- `log_head`), so a cursor that moves forward over what it read never passes an event. Of
-- those entries it takes the consumer's (a subscribed type, and no inbox row for the event
-- yet: one published while the consumer was switched to its cursor is in the inbox), and the
-- cursor goes past every entry read. When no entry is the consumer's, the cursor moves there
-- at once and nothing is leased. Entries are cut to $2 before the outbox is read: each costs
-- a lookup of its outbox row and of an inbox row.
WITH paused AS (
    SELECT FROM actix_outbox.consumer_states s WHERE s.consumer = $1 AND s.paused
        AND (s.paused_until IS NULL OR s.paused_until > now())
), c AS MATERIALIZED (
    -- The free cursor of a slot with entries past it: the lane asked for first, then the
    -- furthest behind.
    SELECT k.part, k.stamp, k.idx FROM actix_outbox.consumer_cursors k
    WHERE k.consumer = $1 AND k.token IS NULL AND NOT EXISTS (SELECT FROM paused)
      AND EXISTS (SELECT FROM actix_outbox.log_stamps s
                  WHERE s.part = k.part AND s.stamp >= k.stamp
                    AND (s.stamp, cardinality(s.events)) > (k.stamp, k.idx))
    ORDER BY (k.part < 8) = $6::bool DESC, k.stamp, k.part LIMIT 1
    FOR UPDATE SKIP LOCKED
), stamps AS MATERIALIZED (
    SELECT s.stamp, s.events FROM actix_outbox.log_stamps s
    WHERE s.part = (SELECT part FROM c) AND s.stamp >= (SELECT stamp FROM c)
    ORDER BY s.stamp LIMIT 8
), entries AS MATERIALIZED (
    SELECT s.stamp, u.ord, u.id FROM stamps s CROSS JOIN c
    CROSS JOIN LATERAL unnest(s.events) WITH ORDINALITY AS u(id, ord)
    WHERE (s.stamp, u.ord) > (c.stamp, c.idx)
    ORDER BY s.stamp, u.ord LIMIT $2
), mine AS MATERIALIZED (
    SELECT e.stamp, e.ord, o.* FROM entries e
    JOIN actix_outbox.outbox_events o ON o.id = e.id
    WHERE o.event_type IN (SELECT event_type FROM actix_outbox.consumer_subscriptions
                           WHERE consumer = $1 AND cursor)
      AND NOT EXISTS (SELECT FROM actix_outbox.inbox_events i
                      WHERE i.event_id = o.id AND i.consumer = $1)
), upto AS (
    SELECT stamp, ord FROM entries ORDER BY stamp DESC, ord DESC LIMIT 1
), moved AS (
    UPDATE actix_outbox.consumer_cursors k SET
        stamp = CASE WHEN n.n = 0 THEN u.stamp ELSE k.stamp END,
        idx = CASE WHEN n.n = 0 THEN u.ord ELSE k.idx END,
        token = CASE WHEN n.n > 0 THEN $5 END,
        upto_stamp = CASE WHEN n.n > 0 THEN u.stamp END,
        upto_idx = CASE WHEN n.n > 0 THEN u.ord END
    FROM upto u, (SELECT count(*) AS n FROM mine) n, c
    WHERE k.consumer = $1 AND k.part = c.part
), lease AS (
    INSERT INTO actix_outbox.inbox_leases (token, consumer, locked_by, backend, locked_until, ids, events)
    SELECT $5, $1, $4, pg_backend_pid(), now() + $3 * interval '1 millisecond', '{}',
        array_agg(m.id ORDER BY m.stamp, m.ord)
    FROM mine m HAVING count(*) > 0
)
SELECT m.seq AS id, m.id AS event_id, m.event_type, m.event_version, m.aggregate_type,
    m.aggregate_id, m.aggregate_version, m.payload, m.metadata, m.correlation_id,
    m.causation_id, m.created_at AS event_created_at, 0 AS attempt_count, $5 AS lease_token,
    false AS alone, pg_backend_pid() AS backend
FROM mine m ORDER BY m.stamp, m.ord
