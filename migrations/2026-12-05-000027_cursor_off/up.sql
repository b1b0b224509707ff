-- Turning a consumer's cursor off again (`cursor(false)` after `cursor(true)`). Its start sets
-- its subscriptions' `cursor` off, so claims that begin after that commit fan its events out
-- to its inbox, and then lists here the transactions open at that moment (their virtual ids,
-- from `pg_locks`): only those can still stamp an event for its cursors. The consumer goes on
-- reading its cursors, and drops them once none of those transactions is left and nothing of
-- its waits past them. NULL: the consumer is not turning its cursor off.
ALTER TABLE consumer_states ADD COLUMN IF NOT EXISTS cursor_off_vxids text[];
