-- Priority lanes (`ConsumerConfig::subscribe_high`): a cursor consumer reads the events of
-- its HIGH subscriptions before the others, and gives the others one claim in five, so
-- that a LOW backlog does not hold a HIGH event up, and LOW is never starved.
--
-- An event's lane is chosen when it is stamped (`claim.sql`): HIGH when every cursor consumer
-- of its type subscribes to it as HIGH. HIGH events are stamped in slots 8 to 15, the slot of their
-- aggregate plus 8, so each consumer has a cursor per slot and lane, and a claim picks the
-- lane before the slot. No stamp lists an event in slots 8 to 15 before this migration,
-- so every cursor consumer's new cursors start at the newest stamp, as a new consumer's do.
ALTER TABLE consumer_subscriptions ADD COLUMN IF NOT EXISTS high boolean NOT NULL DEFAULT false;
INSERT INTO consumer_cursors (consumer, part, stamp, idx)
SELECT k.consumer, k.part + 8, h.last, 9223372036854775807
FROM consumer_cursors k, log_head h WHERE k.part < 8
ON CONFLICT DO NOTHING;
