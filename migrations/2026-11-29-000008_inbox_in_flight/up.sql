-- Batches in flight. A consumer batch enters the ids of its rows here, committed on a
-- connection of its own, before any handler sees them, and its entry goes once the batch has
-- committed. An entry that a later claim finds holding some of its rows was left by a batch
-- that ended without an outcome: its process died (an abort, an OOM kill, a crash in native
-- code), its connection broke, or it failed as a whole.
--   Its rows are suspects: the batch that finds them hands rows over one per call.
--   `alone`, set while such a batch hands one row over on its own: that row's attempt ended
--   without an outcome and counts as failed (INBOX_ATTEMPT_INTERRUPTED), so an event that kills
--   its process every time is dead-lettered after its attempts instead of killing every restart.
-- One row per batch, not per inbox row: a batch of a thousand rows costs one insert and one
-- delete. `lo` and `hi` (its lowest and highest inbox id) let a claim skip the entries that
-- cannot hold its rows without reading their arrays; the few it reads are compared in the
-- runtime (`&&` on two arrays compares every pair: ~2 ms for two batches of 500).
-- UNLOGGED: written for every batch, it must not cost a WAL flush. A server crash empties it;
-- the attempts in flight then go uncounted, which only repeats them.
CREATE UNLOGGED TABLE inbox_in_flight (
    id         bigserial   PRIMARY KEY,
    consumer   text        NOT NULL,
    lo         int8        NOT NULL,
    hi         int8        NOT NULL,
    inbox_ids  int8[]      NOT NULL,
    alone      int8,
    entered_at timestamptz NOT NULL DEFAULT now()
);
