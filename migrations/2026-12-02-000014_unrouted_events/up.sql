-- Events the publisher fanned out to no consumer: no consumer was subscribed to their type when
-- they were published. A consumer deployed later never sees them, which was silent. The fan-out
-- statement (`claim.sql`) records them here, so only such events cost a row; the stats sampler
-- counts the last hour's into the health report (`EVENTS_UNROUTED`) and a gauge, and retention
-- deletes a row with its outbox row.
CREATE TABLE unrouted_events (
    event_id     uuid        PRIMARY KEY,
    event_type   text        NOT NULL,
    published_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX unrouted_events_published ON unrouted_events (published_at);
