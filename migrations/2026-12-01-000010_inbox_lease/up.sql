-- The consumer's lease. A consumer claims a batch by moving its rows to PROCESSING under one
-- lease token (a new number per claim, made by the claimer), with `locked_until` and `locked_by` (the process),
-- counting each row's attempt, and commits that before any handler runs. Its effects then
-- commit in a transaction of their own together with the rows' marks, which are fenced on the
-- token. So the attempt of a handler that kills its process or its database backend is
-- already counted, in a logged table, and nothing that decides who is charged lives in one
-- process's memory.
--
-- A lease expires only when its loop died (its process, its backend, its network); it is dead
-- as soon as the session that claimed it (`backend`) is gone. Once every lease of a process is
-- dead, the process is judged, in one statement for all its rows
-- (`held`: how many rows it held): a process that held one row died of it, and that row is
-- charged; a process that held several died of one of them, unknown which, so each is
-- refunded, suspected (`suspicions`) and claimed alone from then on (`alone`), with nothing
-- else of its consumer in flight in its process, where a death has one cause.
--
-- This replaces `inbox_in_flight` (UNLOGGED: a crash-restart emptied it, so a handler that
-- crashed the server was never counted) and the process-wide locks that decided, after a death,
-- which handler had been running.
ALTER TABLE inbox_events DROP CONSTRAINT inbox_events_status_check;
ALTER TABLE inbox_events ADD CONSTRAINT inbox_events_status_check
    CHECK (status IN ('RECEIVED', 'PROCESSING', 'PROCESSED', 'RETRY_PENDING', 'DEAD_LETTER', 'IGNORED'));
-- Constant defaults and NULLs: adding these rewrites nothing.
ALTER TABLE inbox_events
    ADD COLUMN lease_token  bigint,
    ADD COLUMN locked_until timestamptz,
    ADD COLUMN locked_by    text,
    ADD COLUMN backend      integer,
    ADD COLUMN held         integer,
    ADD COLUMN alone        boolean NOT NULL DEFAULT false,
    ADD COLUMN suspicions   integer NOT NULL DEFAULT 0;
-- Leases in progress, by process: what a process holds, for the reaper and for the claim of
-- an `alone` row. Holds only the rows of batches running now.
CREATE INDEX inbox_events_leased ON inbox_events (locked_by, consumer, locked_until)
    WHERE status = 'PROCESSING';
-- `alone` rows in progress, by process: while one runs, its consumer claims nothing else in
-- that process. Usually empty.
CREATE INDEX inbox_events_leased_alone ON inbox_events (locked_by, consumer)
    WHERE status = 'PROCESSING' AND alone;
-- Rows to be claimed on their own. Usually empty; costs nothing on the hot path.
CREATE INDEX inbox_events_alone ON inbox_events (consumer, next_attempt_at, id)
    WHERE alone AND status IN ('RECEIVED', 'RETRY_PENDING');
-- Raised by the mark that commits a batch's effects when the batch no longer holds every row
-- it marks (its lease was settled by the reaper, or an operator moved a row): the transaction
-- then fails, and the effects roll back with it instead of committing beside another
-- delivery's.
CREATE FUNCTION inbox_lease_held(held bigint, expected bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    IF expected IS NOT NULL AND held <> expected THEN
        RAISE EXCEPTION 'inbox lease lost: % of % rows still held', held, expected
            USING ERRCODE = 'AO001';
    END IF;
    RETURN held;
END
$$;
DROP TABLE inbox_in_flight;
