DROP INDEX inbox_events_due;
CREATE INDEX inbox_events_due ON inbox_events (consumer, next_attempt_at)
    WHERE status IN ('RECEIVED', 'RETRY_PENDING');
