-- The in-process claim (`claim_and_fan_out`): claim due outbox rows, fan them out to the inbox of
-- every subscribed consumer and mark them PUBLISHED, in one statement. Its own file so that the
-- plan test and the benchmark run exactly this text.
--   $1  batch size
--   $2  NOTIFY channel for other instances, or NULL when none listen
--   $3  this instance's id, the payload's prefix (its own listener ignores it)
--   $4  whether to answer a row per event and per inbox row written, for the per-event log
--       lines (`debug`); off, those branches are skipped whole (a one-time filter)
--
-- The answer, one row per `kind`: `count` per subscribed consumer (rows wanted, rows written),
-- one `total` (rows published; notifications sent), `duplicate` per inbox row that already
-- existed (always: rare, and logged at `info`), and with $4 `event` per event published and
-- `received` per inbox row written. `last_seq`, on the `total` row: the highest seq published.
WITH due AS (
    SELECT * FROM actix_outbox.outbox_events
    WHERE status IN ('PENDING', 'RETRY_PENDING') AND next_attempt_at <= now() AND seq > $5
    ORDER BY seq LIMIT (SELECT $1::int8)
    FOR UPDATE SKIP LOCKED
), delivered AS (
    INSERT INTO actix_outbox.inbox_events (event_id, consumer, event_type, event_version,
        aggregate_type, aggregate_id, aggregate_version, payload, metadata,
        correlation_id, causation_id, event_created_at, event_seq, ordered)
    SELECT d.id, s.consumer, d.event_type, d.event_version, d.aggregate_type,
        d.aggregate_id, d.aggregate_version, d.payload, d.metadata,
        d.correlation_id, d.causation_id, d.created_at, d.seq, s.ordered
    FROM due d JOIN actix_outbox.consumer_subscriptions s ON s.event_type = d.event_type
    WHERE NOT s.cursor
    ORDER BY d.seq, s.consumer
    ON CONFLICT (event_id, consumer) DO NOTHING
    RETURNING consumer, event_id
), head AS (
    -- Events a cursor consumer subscribes to get no inbox row of it: they are listed in one
    -- stamp (`stamped`), numbered by this update of `log_head`, whose lock the claim holds to
    -- its commit (the migration `cursors`), and each keeps its stamp's number (`stamp`, the
    -- migration `replay_log`). It runs after the fan-out (counting `delivered` makes it so),
    -- so that concurrent claims wait for each other through the update of their rows only,
    -- not their inbox rows too. Costs nothing when no consumer reads through a cursor.
    UPDATE actix_outbox.log_head SET last = last + 1
    WHERE EXISTS (SELECT FROM due d JOIN actix_outbox.consumer_subscriptions s
                  ON s.event_type = d.event_type AND s.cursor)
      AND (SELECT count(*) FROM delivered) >= 0
    RETURNING last
), published AS (
    UPDATE actix_outbox.outbox_events o
    SET status = 'PUBLISHED', published_at = now(), updated_at = now(),
        attempt_count = o.attempt_count + 1, locked_by = NULL, locked_until = NULL,
        stamp = CASE WHEN EXISTS (SELECT FROM actix_outbox.consumer_subscriptions s
                                  WHERE s.event_type = o.event_type AND s.cursor)
                THEN (SELECT last FROM head) END
    WHERE o.id = ANY (ARRAY(SELECT id FROM due))
    RETURNING o.*
), to_stamp AS (
    -- The stamp has a row per slot of 8, by aggregate, and lane. An event is HIGH, in slots
    -- 8 to 15, when every cursor consumer of its type subscribes to it as HIGH (the migration
    -- `lanes`), so no consumer reads an aggregate in two slots unless it asked to.
    SELECT p.id, p.seq, abs(hashtext(p.aggregate_type || chr(31) || p.aggregate_id) % 8)
        + CASE WHEN NOT EXISTS (SELECT FROM actix_outbox.consumer_subscriptions s
                                WHERE s.event_type = p.event_type AND s.cursor AND NOT s.high)
          THEN 8 ELSE 0 END AS part
    FROM published p
    WHERE p.stamp IS NOT NULL
), stamped AS (
    INSERT INTO actix_outbox.log_stamps (part, stamp, events)
    SELECT t.part, head.last, array_agg(t.id ORDER BY t.seq) FROM head, to_stamp t
    GROUP BY t.part, head.last
), unrouted AS (
    -- Events no consumer is subscribed to: recorded, so that health can say so (the migration
    -- `unrouted_events`). Costs a row only for such an event.
    INSERT INTO actix_outbox.unrouted_events (event_id, event_type)
    SELECT p.id, p.event_type FROM published p
    WHERE NOT EXISTS (SELECT FROM actix_outbox.consumer_subscriptions s WHERE s.event_type = p.event_type)
    ON CONFLICT DO NOTHING
), notified AS (
    -- One notification per claim, naming the consumers that got rows. Part of the statement,
    -- so it goes out with the commit that makes the rows visible and costs no round trip.
    -- PostgreSQL refuses a payload of 8000 bytes or more, and a refusal would fail the whole
    -- claim, every time: past 7000 bytes of names it says `*`, every consumer.
    SELECT pg_notify($2, $3 || '|' || CASE WHEN octet_length(n) > 7000 THEN '*' ELSE n END)
    FROM (SELECT string_agg(DISTINCT consumer, ',') AS n
          FROM (SELECT consumer FROM delivered
                UNION ALL SELECT s.consumer FROM published p
                JOIN actix_outbox.consumer_subscriptions s ON s.event_type = p.event_type
                WHERE s.cursor) d
          WHERE $2 IS NOT NULL HAVING count(*) > 0) names
), wanted AS (
    SELECT s.consumer, count(*) AS n, bool_and(s.cursor) AS cursor
    FROM published p JOIN actix_outbox.consumer_subscriptions s ON s.event_type = p.event_type
    GROUP BY s.consumer
), counted AS (
    -- A cursor consumer's events count as delivered: stamped, they wait for its cursor.
    SELECT w.consumer, w.n AS wanted, CASE WHEN w.cursor THEN w.n ELSE coalesce(d.n, 0) END AS rows
    FROM wanted w
    LEFT JOIN (SELECT consumer, count(*) AS n FROM delivered GROUP BY consumer) d
    USING (consumer)
)
SELECT 'count' AS kind, consumer, NULL::uuid AS event_id, wanted, rows,
       NULL::text AS event_type, NULL::text AS aggregate_id, NULL::text AS correlation_id,
       NULL::text AS causation_id, NULL::int8 AS last_seq
FROM counted
-- The `total` row: rows published, and (as `wanted`) notifications sent; naming `notified` here
-- is what makes PostgreSQL run it.
UNION ALL SELECT 'total', NULL, NULL, (SELECT count(*) FROM notified), count(*),
       NULL, NULL, NULL, NULL, max(seq) FROM published
UNION ALL SELECT 'duplicate', s.consumer, p.id, p.attempt_count, 0, p.event_type,
       p.aggregate_id, p.correlation_id, p.causation_id, NULL
    FROM published p JOIN actix_outbox.consumer_subscriptions s ON s.event_type = p.event_type
    WHERE EXISTS (SELECT FROM counted WHERE wanted > rows)
      AND NOT EXISTS (SELECT FROM delivered d WHERE d.event_id = p.id AND d.consumer = s.consumer)
UNION ALL SELECT 'event', NULL, p.id, p.attempt_count, 0, p.event_type, p.aggregate_id,
       p.correlation_id, p.causation_id, NULL
    FROM published p WHERE $4::bool
UNION ALL SELECT 'received', d.consumer, d.event_id, 0, 0, NULL, NULL, NULL, NULL, NULL
    FROM delivered d WHERE $4::bool
