-- External transports. A lease that expired on several rows at once was left by a publisher
-- that died or hung in the middle of a batch (a transport that panics on one event, a process
-- killed by it). Which row caused it is unknown, so the reaper charges none of them the
-- attempt and marks each `alone`: from then on it is leased on its own, one row per claim, so
-- a death is charged to the row that causes it. Without this, one such event dead-lettered
-- every event leased with it, each time the same batch, until all their attempts ran out.
-- A constant default: adding the column rewrites nothing. The index holds only rows waiting
-- to be published alone, so it costs nothing on the hot path and is usually empty.
ALTER TABLE outbox_events ADD COLUMN alone boolean NOT NULL DEFAULT false;
CREATE INDEX outbox_events_alone ON outbox_events (seq)
    WHERE alone AND status IN ('PENDING', 'RETRY_PENDING');
