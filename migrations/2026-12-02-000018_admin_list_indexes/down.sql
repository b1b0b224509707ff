DROP INDEX outbox_events_ignored;
DROP INDEX inbox_events_ignored;
