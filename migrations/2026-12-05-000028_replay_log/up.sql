-- Replaying what a cursor consumer read through its cursors (`ops::replay`). Such an event
-- has no inbox row of the consumer; what marks it is the stamp that listed it.
--
-- `outbox_events.stamp`: the stamp that listed a published event for the cursor consumers
-- (`claim.sql` sets it in the update that publishes the row); NULL when no cursor consumer
-- subscribed to its type. Stamps become visible in number order (the migration `cursors`),
-- so one number read in one snapshot divides the events stamped before it from those to
-- come. A catalog-only change: no default, no rewrite.
ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS stamp bigint;

-- A replay of a cursor consumer first walks the published events of its range that it had no
-- inbox row of (none with an id up to `log_inbox_upto`, the highest inbox id when the replay
-- was asked for) and whose stamp is below `log_below`: its oldest unread stamp then (every
-- cursor of it stood past the events of smaller stamps). It walks them by (`published_at`,
-- `id`), past (`log_at`, `log_id`), and sets `log_below` NULL once it has walked them all
-- (NULL from the start when there are none); then it walks its inbox rows.
ALTER TABLE replays ADD COLUMN IF NOT EXISTS log_below bigint;
-- ... and above `log_above`, the stamp its cursors started at (a consumer's cursors start past
-- every stamp made before them: `consumer_cursors.since`; NULL for cursors made before this
-- migration, read as 0).
ALTER TABLE replays ADD COLUMN IF NOT EXISTS log_above bigint;
ALTER TABLE consumer_cursors ADD COLUMN IF NOT EXISTS since bigint;
-- The last stamp once the subscription was committed (the largest bigint until then): its
-- consumer's cursors read its type from the next stamp on. NULL for subscriptions made before
-- this migration, read as 0 (every stamped event is younger than them).
ALTER TABLE consumer_subscriptions ADD COLUMN IF NOT EXISTS since bigint;
ALTER TABLE replays ADD COLUMN IF NOT EXISTS log_inbox_upto bigint;
ALTER TABLE replays ADD COLUMN IF NOT EXISTS log_at timestamptz;
ALTER TABLE replays ADD COLUMN IF NOT EXISTS log_id uuid;
