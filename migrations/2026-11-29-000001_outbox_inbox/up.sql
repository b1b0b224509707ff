-- actix-outbox: the outbox, the inbox and the per-consumer state they need.
-- Status columns are text with CHECK constraints so that operators can read
-- them in psql and a later version can add a state without an enum migration.

CREATE TABLE outbox_events (
    id                uuid        PRIMARY KEY,
    -- claim order; uuid v7 ids from several producers are not strictly ordered
    seq               bigserial   NOT NULL,
    event_type        text        NOT NULL CHECK (event_type <> ''),
    event_version     integer     NOT NULL DEFAULT 1 CHECK (event_version > 0),
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_version bigint,
    payload           jsonb       NOT NULL,
    metadata          jsonb       NOT NULL DEFAULT '{}'::jsonb,
    correlation_id    text        NOT NULL,
    causation_id      text,
    status            text        NOT NULL DEFAULT 'PENDING'
        CHECK (status IN ('PENDING', 'PROCESSING', 'PUBLISHED', 'RETRY_PENDING', 'DEAD_LETTER', 'IGNORED')),
    attempt_count     integer     NOT NULL DEFAULT 0 CHECK (attempt_count >= 0),
    next_attempt_at   timestamptz NOT NULL DEFAULT now(),
    locked_by         text,
    locked_until      timestamptz,
    lease_token       bigint,
    published_at      timestamptz,
    last_error        text,
    error_code        text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now()
);

-- Only due rows are indexed, so the claim costs the same with 0 or 50 million
-- PUBLISHED rows in the table.
CREATE INDEX outbox_events_due ON outbox_events (seq)
    WHERE status IN ('PENDING', 'RETRY_PENDING');
CREATE INDEX outbox_events_processing ON outbox_events (locked_until)
    WHERE status = 'PROCESSING';
CREATE INDEX outbox_events_correlation ON outbox_events (correlation_id);
CREATE INDEX outbox_events_dead ON outbox_events (created_at)
    WHERE status = 'DEAD_LETTER';

CREATE TABLE inbox_events (
    id                bigserial   PRIMARY KEY,
    -- no foreign key: outbox rows are removed by retention, and external
    -- transports deliver events whose outbox lives in another database
    event_id          uuid        NOT NULL,
    consumer          text        NOT NULL,
    event_type        text        NOT NULL,
    event_version     integer     NOT NULL,
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_version bigint,
    payload           jsonb       NOT NULL,
    metadata          jsonb       NOT NULL DEFAULT '{}'::jsonb,
    correlation_id    text        NOT NULL,
    causation_id      text,
    event_created_at  timestamptz NOT NULL,
    status            text        NOT NULL DEFAULT 'RECEIVED'
        CHECK (status IN ('RECEIVED', 'PROCESSED', 'RETRY_PENDING', 'DEAD_LETTER', 'IGNORED')),
    attempt_count     integer     NOT NULL DEFAULT 0 CHECK (attempt_count >= 0),
    next_attempt_at   timestamptz NOT NULL DEFAULT now(),
    last_error        text,
    error_code        text,
    received_at       timestamptz NOT NULL DEFAULT now(),
    processed_at      timestamptz,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    -- the inbox guarantee: one row, hence one effect, per (event, consumer)
    CONSTRAINT inbox_events_event_consumer UNIQUE (event_id, consumer)
);

CREATE INDEX inbox_events_due ON inbox_events (consumer, next_attempt_at)
    WHERE status IN ('RECEIVED', 'RETRY_PENDING');
CREATE INDEX inbox_events_correlation ON inbox_events (correlation_id);
CREATE INDEX inbox_events_dead ON inbox_events (consumer, received_at)
    WHERE status = 'DEAD_LETTER';

-- One row per consumer known to any instance. The pause switch lives here so
-- that it survives restarts and holds for every instance at once.
CREATE TABLE consumer_states (
    consumer   text        PRIMARY KEY,
    paused     boolean     NOT NULL DEFAULT false,
    paused_by  text,
    reason     text,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Which consumer receives which event type. Fan-out reads this table, not the
-- publishing process's memory, so an instance that does not run a consumer
-- still creates its inbox rows (rolling deploys lose nothing).
CREATE TABLE consumer_subscriptions (
    consumer   text        NOT NULL REFERENCES consumer_states (consumer) ON DELETE CASCADE,
    event_type text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_type)
);
CREATE INDEX consumer_subscriptions_type ON consumer_subscriptions (event_type);
