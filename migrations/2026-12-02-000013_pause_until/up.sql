-- A pause may carry its own end: a consumer is paused while `paused` and `now()` is before
-- `paused_until` (when set). Nothing has to lift it: every reader of the switch (the claim,
-- the stats sampler, the operator API) applies that rule, so the pause ends on time on every
-- instance at once.
ALTER TABLE consumer_states ADD COLUMN paused_until timestamptz;
