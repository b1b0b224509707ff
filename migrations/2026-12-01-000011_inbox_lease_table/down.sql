ALTER TABLE inbox_events DROP CONSTRAINT inbox_events_status_check;
ALTER TABLE inbox_events ADD CONSTRAINT inbox_events_status_check
    CHECK (status IN ('RECEIVED', 'PROCESSING', 'PROCESSED', 'RETRY_PENDING', 'DEAD_LETTER', 'IGNORED'));
ALTER TABLE inbox_events
    ADD COLUMN lease_token  bigint,
    ADD COLUMN locked_until timestamptz,
    ADD COLUMN locked_by    text,
    ADD COLUMN backend      integer,
    ADD COLUMN held         integer;
CREATE INDEX inbox_events_leased ON inbox_events (locked_by, consumer, locked_until)
    WHERE status = 'PROCESSING';
CREATE INDEX inbox_events_leased_alone ON inbox_events (locked_by, consumer)
    WHERE status = 'PROCESSING' AND alone;
UPDATE inbox_events i
SET status = 'PROCESSING', attempt_count = i.attempt_count + 1, lease_token = l.token,
    locked_by = l.locked_by, backend = l.backend, locked_until = l.locked_until, held = l.held
FROM inbox_leases l
WHERE i.id = ANY (l.ids) AND i.status IN ('RECEIVED', 'RETRY_PENDING');
DROP TABLE inbox_leases;
