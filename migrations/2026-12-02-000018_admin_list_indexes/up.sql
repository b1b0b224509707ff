-- The operator API's lists (`src/store/admin/`) read every status through an index. Each
-- other status already has its partial index (due rows, PROCESSING, dead letters); IGNORED had
-- none, so listing it read the whole history backwards. These hold only rows an operator
-- ignored: nothing on the hot path enters them.
CREATE INDEX CONCURRENTLY IF NOT EXISTS inbox_events_ignored ON inbox_events (consumer, id) WHERE status = 'IGNORED';
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_events_ignored ON outbox_events (id) WHERE status = 'IGNORED';
