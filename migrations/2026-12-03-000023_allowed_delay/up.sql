-- How long an event may wait for each consumer (`ConsumerConfig::allowed_delay`), as its
-- runtime registers it: health judges each consumer's lateness by its own, wherever the stats
-- sampler runs, instead of by one threshold for every consumer. NULL: the global inbox
-- thresholds. Nullable columns without defaults: adding them changes only the catalog.
ALTER TABLE consumer_states ADD COLUMN IF NOT EXISTS allowed_delay_ms bigint;
ALTER TABLE consumer_states ADD COLUMN IF NOT EXISTS critical_delay_ms bigint;
