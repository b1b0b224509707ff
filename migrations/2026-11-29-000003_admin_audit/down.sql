DROP INDEX inbox_events_processed;
DROP INDEX outbox_events_published;
DROP TABLE outbox_stats_samples;
DROP TABLE admin_audit;
