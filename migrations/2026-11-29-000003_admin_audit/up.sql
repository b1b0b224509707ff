-- Operations: the operators' audit trail, the stats sampler's history, and the indexes that
-- let retention find expired rows without scanning the whole history.

-- One row per operator action (retry, ignore, pause, ...), written in the same transaction as
-- the change it records: an action without its audit row cannot commit, and vice versa.
CREATE TABLE admin_audit (
    id      bigserial   PRIMARY KEY,
    -- the operator, as named by the admin credentials or the application's guard
    who     text        NOT NULL CHECK (who <> ''),
    -- e.g. inbox.retry, outbox.ignore, consumer.pause
    action  text        NOT NULL,
    -- e.g. inbox:42, outbox:<uuid>, consumer:notification, inbox:[3 rows]
    target  text        NOT NULL,
    reason  text,
    -- the rows' state before the action, the ids of a bulk action
    details jsonb       NOT NULL DEFAULT '{}'::jsonb,
    at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX admin_audit_at ON admin_audit (at);

-- One row per stats sample of one runtime instance: the gauges read from the database, the
-- counter increments since the instance's previous sample, and the health report made from
-- them. The operator API of any instance reads the newest one; the sampler deletes rows past
-- its history window.
CREATE TABLE outbox_stats_samples (
    id          bigserial   PRIMARY KEY,
    instance    text        NOT NULL,
    sampled_at  timestamptz NOT NULL DEFAULT now(),
    interval_ms bigint      NOT NULL CHECK (interval_ms > 0),
    sample      jsonb       NOT NULL,
    health      jsonb       NOT NULL
);
CREATE INDEX outbox_stats_samples_at ON outbox_stats_samples (sampled_at);

-- Retention deletes delivered rows oldest first. Partial, so the due-row indexes that the
-- claims use stay as small as before.
CREATE INDEX outbox_events_published ON outbox_events (published_at)
    WHERE status = 'PUBLISHED';
CREATE INDEX inbox_events_processed ON inbox_events (processed_at)
    WHERE status = 'PROCESSED';
