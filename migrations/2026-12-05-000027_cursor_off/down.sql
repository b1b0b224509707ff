ALTER TABLE consumer_states DROP COLUMN IF EXISTS cursor_off_vxids;
