-- A cursor consumer's claim (`inbox::cursor::claim`, the migrations `cursors` and `lanes`):
-- lease the events of consumer $1 among the next $2 entries past its cursors, for $3
-- milliseconds, to process $4 under token $5, by writing one `inbox_leases` row that names
-- them (`events`) and the token in the cursor of each slot it read, with where that cursor
-- goes when the batch commits. Committed before any handler sees an event. None while the
-- consumer is paused, or while other batches hold every slot with entries past its cursor.
--
-- It reads a first slot, the one whose next entry is oldest (of the LOW lane first if $6, of
-- the HIGH lane first if not, of either if $6 is NULL: a consumer with no HIGH type), then the
-- other free slots with entries past their cursors, each from at most 8 stamps: stamps are
-- read in number order, and a stamp is visible only once every smaller one is (the invariant
-- of `log_head`), so a cursor that moves forward over what it read never passes an event. The
-- entries are cut to the first $2 in the order (first slot, lane, stamp, slot, place): that
-- order takes a prefix of each slot's entries, so each slot's cursor goes past what was read
-- of it and no further. Under a backlog the first slot fills the batch, as concurrent batches
-- fill theirs from other slots; under a trickle one batch takes every slot's few new entries
-- instead of one batch per slot. Of those entries it takes the consumer's (a subscribed type,
-- and no inbox row for the event yet: one published while the consumer was switched to its
-- cursor, or off it, is in the inbox). When no entry is the consumer's, the cursors move at
-- once and nothing is leased. Entries are cut before the outbox is read: each costs a lookup
-- of its outbox row and of an inbox row.
WITH paused AS (
    SELECT FROM actix_outbox.consumer_states s WHERE s.consumer = $1 AND s.paused
        AND (s.paused_until IS NULL OR s.paused_until > now())
), first AS MATERIALIZED (
    -- The free cursor of a slot with entries past it: the lane asked for first, then the
    -- slot whose next entry has the smallest stamp. Locked, so that concurrent claims each
    -- start from a slot of their own.
    SELECT k.part, k.stamp, k.idx FROM actix_outbox.consumer_cursors k
    CROSS JOIN LATERAL (SELECT s.stamp AS next FROM actix_outbox.log_stamps s
                        WHERE s.part = k.part AND s.stamp >= k.stamp
                          AND (s.stamp, cardinality(s.events)) > (k.stamp, k.idx)
                        ORDER BY s.stamp LIMIT 1) n
    WHERE k.consumer = $1 AND k.token IS NULL AND NOT EXISTS (SELECT FROM paused)
    ORDER BY (k.part < 8) = $6::bool DESC, n.next, k.part LIMIT 1
    FOR UPDATE OF k SKIP LOCKED
), c AS MATERIALIZED (
    -- That slot, and the other free slots with entries past their cursors, read unlocked:
    -- the cut below takes the first slot's entries, then the others' (lane, stamp order).
    SELECT part, stamp, idx, true AS first FROM first
    UNION ALL
    SELECT k.part, k.stamp, k.idx, false FROM actix_outbox.consumer_cursors k
    WHERE k.consumer = $1 AND k.token IS NULL AND EXISTS (SELECT FROM first)
      AND k.part <> (SELECT part FROM first)
      AND EXISTS (SELECT FROM actix_outbox.log_stamps s
                  WHERE s.part = k.part AND s.stamp >= k.stamp
                    AND (s.stamp, cardinality(s.events)) > (k.stamp, k.idx))
), stamps AS MATERIALIZED (
    -- Of each slot's next 8 stamps, those that the first $2 unread entries (in the cut's
    -- order) reach: only these are unnested. `n`: a stamp's entries past the cursor.
    SELECT part, stamp, events FROM (
        SELECT part, stamp, events, sum(n) OVER (ORDER BY first DESC,
                   (part < 8) = $6::bool DESC, stamp, part) - n AS before
        FROM (SELECT c.part, c.first, s.stamp, s.events, cardinality(s.events)
                  - CASE WHEN s.stamp = c.stamp THEN least(c.idx, cardinality(s.events)) ELSE 0 END AS n
              FROM c CROSS JOIN LATERAL (
                  SELECT s.stamp, s.events FROM actix_outbox.log_stamps s
                  WHERE s.part = c.part AND s.stamp >= c.stamp ORDER BY s.stamp LIMIT 8) s) x
    ) w WHERE before < $2
), cut AS MATERIALIZED (
    SELECT s.part, s.stamp, u.ord, u.id FROM stamps s JOIN c USING (part)
    CROSS JOIN LATERAL unnest(s.events) WITH ORDINALITY AS u(id, ord)
    WHERE (s.stamp, u.ord) > (c.stamp, c.idx)
    ORDER BY c.first DESC, (s.part < 8) = $6::bool DESC, s.stamp, s.part, u.ord LIMIT $2
), locked AS MATERIALIZED (
    -- The other slots the cut reaches, locked now, each only if no claim or batch took or
    -- moved its cursor since it was read (a lock another claim holds: skipped, with its
    -- entries).
    SELECT k.part FROM actix_outbox.consumer_cursors k JOIN c USING (part)
    WHERE k.consumer = $1 AND NOT c.first AND k.part IN (SELECT part FROM cut)
      AND k.token IS NULL AND (k.stamp, k.idx) = (c.stamp, c.idx)
    FOR UPDATE OF k SKIP LOCKED
), entries AS MATERIALIZED (
    SELECT * FROM cut
    WHERE part = (SELECT part FROM first) OR part IN (SELECT part FROM locked)
), mine AS MATERIALIZED (
    SELECT e.part, e.stamp, e.ord, o.id, o.seq, o.event_type, o.event_version,
        o.aggregate_type, o.aggregate_id, o.aggregate_version, o.payload, o.metadata,
        o.correlation_id, o.causation_id, o.created_at
    FROM entries e
    JOIN actix_outbox.outbox_events o ON o.id = e.id
    WHERE o.event_type IN (SELECT event_type FROM actix_outbox.consumer_subscriptions
                           WHERE consumer = $1)
      AND NOT EXISTS (SELECT FROM actix_outbox.inbox_events i
                      WHERE i.event_id = o.id AND i.consumer = $1)
), upto AS (
    -- Where each slot read goes: past its last entry taken.
    SELECT DISTINCT ON (part) part, stamp, ord FROM entries ORDER BY part, stamp DESC, ord DESC
), moved AS (
    UPDATE actix_outbox.consumer_cursors k SET
        stamp = CASE WHEN n.n = 0 THEN u.stamp ELSE k.stamp END,
        idx = CASE WHEN n.n = 0 THEN u.ord ELSE k.idx END,
        token = CASE WHEN n.n > 0 THEN $5 END,
        upto_stamp = CASE WHEN n.n > 0 THEN u.stamp END,
        upto_idx = CASE WHEN n.n > 0 THEN u.ord END
    FROM upto u, (SELECT count(*) AS n FROM mine) n
    WHERE k.consumer = $1 AND k.part = u.part
), lease AS (
    INSERT INTO actix_outbox.inbox_leases (token, consumer, locked_by, backend, locked_until, ids, events)
    SELECT $5, $1, $4, pg_backend_pid(), now() + $3 * interval '1 millisecond', '{}',
        array_agg(m.id ORDER BY (m.part < 8) = $6::bool DESC, m.stamp, m.part, m.ord)
    FROM mine m HAVING count(*) > 0
)
SELECT m.seq AS id, m.id AS event_id, m.event_type, m.event_version, m.aggregate_type,
    m.aggregate_id, m.aggregate_version, m.payload, m.metadata, m.correlation_id,
    m.causation_id, m.created_at AS event_created_at, 0 AS attempt_count, $5 AS lease_token,
    false AS alone, pg_backend_pid() AS backend
FROM mine m ORDER BY (m.part < 8) = $6::bool DESC, m.stamp, m.part, m.ord
