-- The consumer's claim orders by (next_attempt_at, id). With `id` in the partial index the
-- index yields rows in exactly that order, so a claim reads `batch_size` entries and stops;
-- without it PostgreSQL sorted every due row of the consumer for each batch, which made a
-- large backlog drain slower the larger it was.
DROP INDEX inbox_events_due;
CREATE INDEX inbox_events_due ON inbox_events (consumer, next_attempt_at, id)
    WHERE status IN ('RECEIVED', 'RETRY_PENDING');
