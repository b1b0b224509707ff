ALTER TABLE inbox_events RESET (fillfactor);
ALTER TABLE outbox_events RESET (fillfactor);
