ALTER TABLE inbox_leases DROP COLUMN IF EXISTS events;
ALTER TABLE consumer_subscriptions DROP COLUMN IF EXISTS cursor;
DROP TABLE IF EXISTS consumer_cursors;
DROP TABLE IF EXISTS log_stamps;
DROP TABLE IF EXISTS log_head;
