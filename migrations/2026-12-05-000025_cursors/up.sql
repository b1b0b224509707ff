-- Cursor delivery (storage v2, first step; `ConsumerConfig::cursor`): a consumer reads the
-- events it subscribes to through a cursor over positions given in commit order, and gets an
-- inbox row only for an exception (a failure, a row given back, a death, a hung handler).
--
-- Positions. The in-process publisher's claim (`claim.sql`) lists the events it publishes
-- that some cursor consumer subscribes to in `log_stamps` rows, numbered by an update of
-- the one `log_head` row. The invariant: a stamp's number comes from that update, whose row
-- lock is held until the claim commits; so whenever a stamp is visible, every stamp with a
-- smaller number is visible too, and a cursor that reads forward never passes one that
-- commits late.
--
-- Cursors. One `consumer_cursors` row per cursor consumer and slot (`part`, 0 to 7): every
-- entry of the slot's stamps up to (`stamp`, `idx`), the entry's place in its stamp's list,
-- is done. A stamp writes one row per slot it has events of. A batch leases the entries it
-- reads under an `inbox_leases` row (`events`, the events' outbox ids, instead of `ids`) and
-- names the lease in the cursor (`token`, and where the cursor goes when the batch commits:
-- `upto_stamp`, `upto_idx`). The rule: *an
-- event a cursor moves past is either handled in the commit that moves it, or gets an inbox
-- row in that same commit*; every exception then follows the inbox's rules.
CREATE TABLE IF NOT EXISTS log_head (
    one  boolean PRIMARY KEY DEFAULT true CHECK (one),
    last bigint  NOT NULL
);
INSERT INTO log_head (one, last) VALUES (true, 0) ON CONFLICT DO NOTHING;

CREATE TABLE IF NOT EXISTS log_stamps (
    -- the events' slot, 0 to 7, from a hash of their aggregate (`claim.sql`), so that one
    -- aggregate's events share a slot and eight batches of a consumer can read at once
    part       integer     NOT NULL,
    stamp      bigint      NOT NULL,
    -- outbox event ids, in seq order
    events     uuid[]      NOT NULL,
    stamped_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (part, stamp)
);
-- A stamp's ids are read by every cursor consumer's claim: kept in the row.
ALTER TABLE log_stamps ALTER COLUMN events SET STORAGE MAIN;

CREATE TABLE IF NOT EXISTS consumer_cursors (
    consumer   text   NOT NULL,
    part       integer NOT NULL,
    stamp      bigint NOT NULL,
    idx        bigint NOT NULL,
    -- the lease of the batch that reads past it, and where that batch moves it
    token      bigint,
    upto_stamp bigint,
    upto_idx   bigint,
    PRIMARY KEY (consumer, part)
);

-- Whether the consumer reads this type through its cursor (no inbox row when published).
ALTER TABLE consumer_subscriptions ADD COLUMN IF NOT EXISTS cursor boolean NOT NULL DEFAULT false;
-- A cursor batch's events, by outbox id, until they are handled or given inbox rows.
ALTER TABLE inbox_leases ADD COLUMN IF NOT EXISTS events uuid[] NOT NULL DEFAULT '{}';
