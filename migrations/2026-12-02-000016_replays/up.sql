-- Replays: an operator re-applies events a consumer already processed, to that one consumer
-- (`consumer/replay.rs`). A replay never writes an inbox row: it walks the consumer's
-- PROCESSED rows that match its range, in inbox order, and `cursor_id` moves in the same
-- transaction as the handler's effects. So the rows re-applied are exactly the matching rows
-- with `id <= cursor_id`, on every instance and through any crash.
CREATE TABLE replays (
    id             bigserial        PRIMARY KEY,
    consumer       text             NOT NULL,
    -- the range: NULL means "any"
    event_types    text[],
    created_from   timestamptz,
    created_until  timestamptz,
    correlation_id text,
    -- the rows it walks: matching PROCESSED rows with cursor_id < id <= upto_id, taken when
    -- it was requested
    upto_id        bigint           NOT NULL,
    cursor_id      bigint           NOT NULL,
    total          bigint           NOT NULL,
    done           bigint           NOT NULL DEFAULT 0,
    -- events per second
    rate           double precision NOT NULL CHECK (rate > 0),
    status         text             NOT NULL DEFAULT 'RUNNING'
        CHECK (status IN ('RUNNING', 'DONE', 'FAILED', 'CANCELLED')),
    -- failed attempts of the step at the cursor
    attempts       integer          NOT NULL DEFAULT 0,
    error_code     text,
    last_error     text,
    next_step_at   timestamptz      NOT NULL DEFAULT now(),
    requested_by   text             NOT NULL,
    reason         text,
    requested_at   timestamptz      NOT NULL DEFAULT now(),
    finished_at    timestamptz
);
CREATE INDEX replays_running ON replays (consumer, next_step_at) WHERE status = 'RUNNING';

-- Whether the consumer's code says its handler may see an event again (the last instance to
-- start decides, as for `ordered`). A replay is refused for any other.
ALTER TABLE consumer_states ADD COLUMN replay_safe boolean NOT NULL DEFAULT false;
