ALTER TABLE consumer_states DROP COLUMN paused_until;
