-- A consumer's lease becomes one row per claim instead of a state of each row it holds.
--
-- Under `inbox_lease` a claim moved each row to PROCESSING: a second write of every event
-- (a new row version, three index entries, a row lock), on top of the write that marks it
-- processed. That cost a quarter of the drain rate. Now a claim writes one row here, naming
-- the rows it holds (`ids`), and touches none of them; the rows keep their due status and the
-- claims skip those a lease names. The rest is as before: the lease commits before any handler
-- runs, so what a loop holds survives the loop's death, its process's, and a crash-restart of
-- PostgreSQL (a logged table); every mark of a row is fenced on the lease naming it, and takes
-- the row out of `ids` in the same statement (the lease goes when its last row does).
--
-- A claim sees every lease committed before it, because the claims of one consumer take turns
-- (an advisory lock per consumer, taken in a statement before the claim's own): with no row
-- written by a claim, nothing else would stop two of them from leasing the same row.
--
-- The attempt of a row is counted when its outcome is marked, or, for a loop that died, by the
-- reaper that judges the dead lease (see the migration `inbox_lease`, and
-- `src/consumer/reap.rs`).
CREATE TABLE inbox_leases (
    token        bigint      PRIMARY KEY,
    consumer     text        NOT NULL,
    -- the process (`store::process_id`) and the database session that claimed it
    locked_by    text        NOT NULL,
    backend      integer     NOT NULL,
    claimed_at   timestamptz NOT NULL DEFAULT now(),
    locked_until timestamptz NOT NULL,
    -- the inbox rows it still holds
    ids          bigint[]    NOT NULL,
    -- a row claimed on its own
    alone        boolean     NOT NULL DEFAULT false,
    -- set when its process is judged dead: how many rows the process held
    held         integer
);
-- A batch's ids (8 bytes each) stay in the row, compressed if need be, instead of going to
-- the TOAST table past 2 kB: a lease is written once and read by every claim of its consumer.
ALTER TABLE inbox_leases ALTER COLUMN ids SET STORAGE MAIN;
CREATE INDEX inbox_leases_consumer ON inbox_leases (consumer);
CREATE INDEX inbox_leases_process ON inbox_leases (locked_by);

-- Leases in progress carry over, their attempts uncounted again.
INSERT INTO inbox_leases (token, consumer, locked_by, backend, claimed_at, locked_until, ids,
    alone, held)
SELECT lease_token, min(consumer), min(locked_by), min(backend), min(updated_at),
    min(locked_until), array_agg(id ORDER BY id), bool_or(alone), max(held)
FROM inbox_events WHERE status = 'PROCESSING' GROUP BY lease_token;
UPDATE inbox_events
SET status = CASE WHEN attempt_count > 1 THEN 'RETRY_PENDING' ELSE 'RECEIVED' END,
    attempt_count = greatest(attempt_count - 1, 0)
WHERE status = 'PROCESSING';

DROP INDEX inbox_events_leased_alone;
DROP INDEX inbox_events_leased;
ALTER TABLE inbox_events DROP COLUMN lease_token, DROP COLUMN locked_until,
    DROP COLUMN locked_by, DROP COLUMN backend, DROP COLUMN held;
ALTER TABLE inbox_events DROP CONSTRAINT inbox_events_status_check;
ALTER TABLE inbox_events ADD CONSTRAINT inbox_events_status_check
    CHECK (status IN ('RECEIVED', 'PROCESSED', 'RETRY_PENDING', 'DEAD_LETTER', 'IGNORED'));
