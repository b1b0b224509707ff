DELETE FROM consumer_cursors WHERE part >= 8;
ALTER TABLE consumer_subscriptions DROP COLUMN IF EXISTS high;
