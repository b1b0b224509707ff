DROP INDEX inbox_events_correlation;
ALTER TABLE inbox_events DROP COLUMN external;
CREATE INDEX inbox_events_correlation ON inbox_events (correlation_id);
