-- A cursor consumer's status for an event it has no inbox row of, from the cursor's rule (an
-- event a cursor moves past is handled in the commit that moves it, or gets an inbox row in
-- that commit): IN_FLIGHT when a lease names the event, RECEIVED while a stamp past the
-- cursor of the event's slot (claim.sql's hash, in either lane) lists it, read from the cursor on by the
-- stamps' primary key, and PROCESSED once it is published, since the subscription, and
-- neither; NULL otherwise. Included in `event_fanout.sql` and `timeline.sql`, where `s` is the
-- subscription (consumer, created_at) and `o` the outbox row (id, status, published_at,
-- aggregate_type, aggregate_id).
CASE
    WHEN EXISTS (SELECT FROM actix_outbox.inbox_leases l
                 WHERE l.consumer = s.consumer AND o.id = ANY (l.events)) THEN 'IN_FLIGHT'
    WHEN EXISTS (SELECT FROM actix_outbox.consumer_cursors c
                 JOIN actix_outbox.log_stamps st ON st.part = c.part AND st.stamp >= c.stamp
                 WHERE c.consumer = s.consumer
                   AND c.part IN (abs(hashtext(o.aggregate_type || chr(31) || o.aggregate_id) % 8),
                                  abs(hashtext(o.aggregate_type || chr(31) || o.aggregate_id) % 8) + 8)
                   AND o.id = ANY (st.events)
                   AND (st.stamp, array_position(st.events, o.id)) > (c.stamp, c.idx))
        THEN 'RECEIVED'
    WHEN o.status = 'PUBLISHED' AND o.published_at >= s.created_at THEN 'PROCESSED'
END
