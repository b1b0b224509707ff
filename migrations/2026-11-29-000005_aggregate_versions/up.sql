-- The last aggregate version each consumer applied, for stale-event detection: an event whose
-- aggregate version is not above it is recorded as stale (EVENT_STALE) and not applied, so a
-- consumer's state never moves backwards when events arrive out of order.
CREATE TABLE aggregate_versions (
    consumer       text        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    version        bigint      NOT NULL,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, aggregate_type, aggregate_id)
);
