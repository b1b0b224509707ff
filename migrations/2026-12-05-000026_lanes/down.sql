-- Refused while a HIGH event waits past a cursor: the cursors of slots 8 to 15 are the only
-- readers of those events, and dropping them would lose them. Let them drain first (or turn
-- `subscribe_high` off and wait until health shows no lag). The table lock comes first: every
-- publishing claim reads the subscriptions, so none can stamp between the check and the drop
-- (one that waits for the lock fails on the dropped column, and its events stay due).
LOCK TABLE consumer_subscriptions IN ACCESS EXCLUSIVE MODE;
DO $$
BEGIN
    IF EXISTS (SELECT FROM consumer_cursors k
               JOIN log_stamps s ON s.part = k.part AND s.stamp >= k.stamp
               WHERE k.part >= 8 AND (s.stamp, cardinality(s.events)) > (k.stamp, k.idx)) THEN
        RAISE EXCEPTION 'lanes cannot be reverted: HIGH events wait past a cursor'
            USING HINT = 'let every cursor consumer read its HIGH lane to the end first';
    END IF;
END $$;
DELETE FROM consumer_cursors WHERE part >= 8;
DELETE FROM log_stamps WHERE part >= 8;
ALTER TABLE consumer_subscriptions DROP COLUMN IF EXISTS high;
