-- Attempts in flight. A consumer batch enters its rows here, committed on a connection of its
-- own, before any handler sees them, and removes them just before its own commit (while it
-- still holds the rows). An entry found by a later claim was left by an attempt that ended
-- without an outcome: its process died (an abort, an OOM kill, a crash in native code) or its
-- connection broke.
--   alone = false: the row was one of a batch handed over together; which row was to blame
--                  is unknown, so the next batch holding it hands rows over one per call.
--   alone = true:  the row was being handled on its own; that counts as a failed attempt
--                  (INBOX_ATTEMPT_INTERRUPTED), so an event that kills its process every time
--                  is dead-lettered after its attempts instead of killing every restart.
-- UNLOGGED: written for every batch, it must not cost a WAL flush. A server crash empties it;
-- the attempts in flight then go uncounted, which only repeats them.
CREATE UNLOGGED TABLE inbox_in_flight (
    inbox_id   bigint      PRIMARY KEY,
    alone      boolean     NOT NULL DEFAULT false,
    entered_at timestamptz NOT NULL DEFAULT now()
);
