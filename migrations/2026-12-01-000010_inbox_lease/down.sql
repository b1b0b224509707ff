CREATE UNLOGGED TABLE inbox_in_flight (
    id         bigserial   PRIMARY KEY,
    consumer   text        NOT NULL,
    lo         int8        NOT NULL,
    hi         int8        NOT NULL,
    inbox_ids  int8[]      NOT NULL,
    alone      int8,
    entered_at timestamptz NOT NULL DEFAULT now()
);
DROP FUNCTION inbox_lease_held(bigint, bigint);
DROP INDEX inbox_events_alone;
DROP INDEX inbox_events_leased_alone;
DROP INDEX inbox_events_leased;
-- Rows in flight go back to be claimed again, their attempt given back.
UPDATE inbox_events SET status = CASE WHEN attempt_count > 1 THEN 'RETRY_PENDING' ELSE 'RECEIVED' END,
    attempt_count = greatest(attempt_count - 1, 0), next_attempt_at = now()
    WHERE status = 'PROCESSING';
ALTER TABLE inbox_events DROP COLUMN suspicions, DROP COLUMN alone, DROP COLUMN held,
    DROP COLUMN backend, DROP COLUMN locked_by, DROP COLUMN locked_until, DROP COLUMN lease_token;
ALTER TABLE inbox_events DROP CONSTRAINT inbox_events_status_check;
ALTER TABLE inbox_events ADD CONSTRAINT inbox_events_status_check
    CHECK (status IN ('RECEIVED', 'PROCESSED', 'RETRY_PENDING', 'DEAD_LETTER', 'IGNORED'));
