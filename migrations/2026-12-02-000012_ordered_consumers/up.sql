-- Ordered consumers (`ConsumerConfig::ordered`): an aggregate's events are applied in the order
-- they were enqueued, one at a time, while different aggregates run in parallel.
--
-- The rule lives in the claim (`inbox_claim.sql`) and is one sentence: an ordered consumer
-- claims a row only if it is the earliest unfinished event of its aggregate, i.e. no row of the
-- same aggregate with a lower `event_seq` is due, leased (a leased row keeps its due status) or,
-- unless the consumer skips them, dead-lettered; and no event of the aggregate with a lower
-- `seq` still waits in the outbox to be fanned out (two publishers may commit their fan-outs
-- out of order).
--
-- `event_seq` is the outbox row's `seq`, the enqueue order. `ordered` is copied from the
-- subscription when the row is fanned out, so that only ordered consumers' rows enter the
-- index the rule reads: unordered consumers pay nothing for it. Rows written by `receive` (from
-- a broker) have neither and are not ordered here.
ALTER TABLE inbox_events ADD COLUMN event_seq bigint;
ALTER TABLE inbox_events ADD COLUMN ordered boolean NOT NULL DEFAULT false;
ALTER TABLE consumer_subscriptions ADD COLUMN ordered boolean NOT NULL DEFAULT false;
CREATE INDEX inbox_events_ordered ON inbox_events (consumer, aggregate_type, aggregate_id, event_seq)
    WHERE ordered AND status IN ('RECEIVED', 'RETRY_PENDING', 'DEAD_LETTER');
