-- What the boot-time contract check (`runtime/contract.rs`) found wrong between what a build
-- registers and what the database holds: a subscription its consumer no longer handles, a
-- stored version no upcaster lifts, a subscription to a type no producer wrote lately. Health
-- reports each row (`CONTRACT_MISMATCH`) until a start finds it fixed: each start replaces the
-- rows about its own consumers and its own registered types, so a fix deployed anywhere clears
-- them, and a finding about code this build does not run is left to the build that does.
CREATE TABLE contract_findings (
    code       text        NOT NULL,
    -- the consumer the finding is about, or '' for one about an event type
    consumer   text        NOT NULL DEFAULT '',
    event_type text        NOT NULL,
    -- e.g. the stored version, or ''
    detail     text        NOT NULL DEFAULT '',
    message    text        NOT NULL,
    found_at   timestamptz NOT NULL DEFAULT now(),
    found_by   text        NOT NULL,
    PRIMARY KEY (code, consumer, event_type, detail)
);
