-- Retention's move of a cursor's old backlog into its consumer's inbox
-- (`inbox::cursor::spill`): for one free slot cursor whose first unread stamp is older than
-- $1 milliseconds, the next $2 entries of the stamps that old past it (a prefix: never past a
-- younger stamp) get inbox rows for the consumer's events (a subscribed type, no inbox row
-- yet), and the cursor moves past them in the same statement. The cursor's rule holds: an
-- event a cursor moves past is handled in the commit that moves it, or gets an inbox row in
-- that same commit. So a paused or slow cursor consumer holds the shared log back by at most
-- $1, and what it has not read waits in its own inbox rows, which retention never deletes
-- unprocessed. A cursor a batch holds (its token set) is skipped, as is one locked.
WITH c AS MATERIALIZED (
    SELECT k.consumer, k.part, k.stamp, k.idx FROM actix_outbox.consumer_cursors k
    WHERE k.token IS NULL
      AND (SELECT s.stamped_at FROM actix_outbox.log_stamps s
           WHERE s.part = k.part AND s.stamp >= k.stamp
             AND (s.stamp, cardinality(s.events)) > (k.stamp, k.idx)
           ORDER BY s.stamp LIMIT 1) < now() - $1 * interval '1 millisecond'
    ORDER BY k.stamp, k.consumer, k.part LIMIT 1
    FOR UPDATE SKIP LOCKED
), next AS MATERIALIZED (
    SELECT s.stamp, s.events, s.stamped_at FROM actix_outbox.log_stamps s, c
    WHERE s.part = c.part AND s.stamp >= c.stamp
    ORDER BY s.stamp LIMIT 8
), old AS MATERIALIZED (
    SELECT n.stamp, n.events FROM next n
    WHERE n.stamp < coalesce((SELECT min(y.stamp) FROM next y
                              WHERE y.stamped_at >= now() - $1 * interval '1 millisecond'),
                             9223372036854775807)
), entries AS MATERIALIZED (
    SELECT s.stamp, u.ord, u.id FROM old s CROSS JOIN c
    CROSS JOIN LATERAL unnest(s.events) WITH ORDINALITY AS u(id, ord)
    WHERE (s.stamp, u.ord) > (c.stamp, c.idx)
    ORDER BY s.stamp, u.ord LIMIT $2
), ins AS (
    INSERT INTO actix_outbox.inbox_events (event_id, consumer, event_type, event_version,
        aggregate_type, aggregate_id, aggregate_version, payload, metadata, correlation_id,
        causation_id, event_created_at, event_seq)
    SELECT o.id, c.consumer, o.event_type, o.event_version, o.aggregate_type, o.aggregate_id,
        o.aggregate_version, o.payload, o.metadata, o.correlation_id, o.causation_id,
        o.created_at, o.seq
    FROM entries e CROSS JOIN c
    JOIN actix_outbox.outbox_events o ON o.id = e.id
    WHERE o.event_type IN (SELECT event_type FROM actix_outbox.consumer_subscriptions
                           WHERE consumer = c.consumer)
    ON CONFLICT (event_id, consumer) DO NOTHING RETURNING 1
), upto AS (
    SELECT stamp, ord FROM entries ORDER BY stamp DESC, ord DESC LIMIT 1
), moved AS (
    UPDATE actix_outbox.consumer_cursors k SET stamp = u.stamp, idx = u.ord
    FROM upto u, c WHERE k.consumer = c.consumer AND k.part = c.part
)
SELECT (SELECT count(*) FROM entries) AS passed, (SELECT count(*) FROM ins) AS moved,
    (SELECT consumer FROM c) AS consumer
