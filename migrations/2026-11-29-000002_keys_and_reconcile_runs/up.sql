-- Business idempotency keys: one row per effect that must happen at most once, whichever
-- event (or reconciler repair) causes it. Kept until retention removes them; the retention
-- must outlive any redelivery or repair that could still arrive (default: 30 days).
CREATE TABLE idempotency_keys (
    key        text        PRIMARY KEY CHECK (key <> ''),
    -- who claimed it: a consumer name or a reconcile rule, for operators
    claimed_by text,
    event_id   uuid,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idempotency_keys_created ON idempotency_keys (created_at);

-- One row per reconciler run of one rule.
CREATE TABLE reconcile_runs (
    id          bigserial   PRIMARY KEY,
    rule        text        NOT NULL,
    dry_run     boolean     NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    found       integer     NOT NULL DEFAULT 0,
    repaired    integer     NOT NULL DEFAULT 0,
    error       text
);
CREATE INDEX reconcile_runs_rule ON reconcile_runs (rule, started_at DESC);
