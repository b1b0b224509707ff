DROP INDEX outbox_events_alone;
ALTER TABLE outbox_events DROP COLUMN alone;
