ALTER TABLE consumer_states DROP COLUMN replay_safe;
DROP TABLE replays;
