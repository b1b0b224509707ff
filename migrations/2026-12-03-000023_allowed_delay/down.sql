ALTER TABLE consumer_states DROP COLUMN allowed_delay_ms, DROP COLUMN critical_delay_ms;
