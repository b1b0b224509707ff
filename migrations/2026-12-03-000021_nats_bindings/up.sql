-- The durable JetStream consumers the NATS receivers of this database have bound, by stream.
-- A durable consumer found missing that is listed here was lost (deleted by an operator, by
-- a stream's recreation, by its inactivity threshold): recreating it as new would deliver the
-- whole stream again into an inbox whose processed rows retention may have deleted, applying
-- those events a second time. The receiver refuses instead and says so (`NATS_CONSUMER_LOST`).
CREATE TABLE IF NOT EXISTS nats_bindings (
    stream         text        NOT NULL,
    durable        text        NOT NULL,
    first_bound_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, durable)
);
