DROP INDEX inbox_events_ordered;
ALTER TABLE consumer_subscriptions DROP COLUMN ordered;
ALTER TABLE inbox_events DROP COLUMN ordered;
ALTER TABLE inbox_events DROP COLUMN event_seq;
