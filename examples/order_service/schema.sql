-- The order service's own tables. Applied at every start-up in one transaction holding an
-- advisory lock (see main.rs), so it must stay idempotent: IF NOT EXISTS everywhere.

CREATE TABLE IF NOT EXISTS orders (
    id              text        PRIMARY KEY,
    customer_id     text        NOT NULL,
    total_cents     bigint      NOT NULL CHECK (total_cents >= 0),
    status          text        NOT NULL
        CHECK (status IN ('WAITING', 'PAID', 'COMPLETED', 'CANCELLED')),
    version         bigint      NOT NULL CHECK (version >= 1),
    -- 'api' for orders made through POST /orders; anything else was written around the
    -- service (an import, a manual fix) and so has no events: the reconciler's business.
    source          text        NOT NULL DEFAULT 'api',
    -- a client's Idempotency-Key: a retried POST /orders returns the order it already made
    idempotency_key text        UNIQUE,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);
-- The reconcile rule pages through completed orders by (updated_at, id): each run reads one
-- page of this index, however many orders there are.
CREATE INDEX IF NOT EXISTS orders_completed_page ON orders (updated_at, id)
    WHERE status = 'COMPLETED';
DROP INDEX IF EXISTS orders_completed_updated;

CREATE TABLE IF NOT EXISTS audit_logs (
    id             bigserial   PRIMARY KEY,
    order_id       text        NOT NULL,
    action         text        NOT NULL,
    from_status    text,
    to_status      text        NOT NULL,
    version        bigint      NOT NULL,
    correlation_id text,
    created_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS audit_logs_order ON audit_logs (order_id);

-- The notifications owed, one per (order, status), each with its business key. Sending one is
-- a side effect (the library's `side_effects`, kind `notification.send`, same key). Deliberately
-- no UNIQUE (order_id, status): the business idempotency key is what must keep the effect
-- single, and a constraint would turn a duplicate into an error the demo's invariant check
-- could no longer see.
CREATE TABLE IF NOT EXISTS notification_jobs (
    id              bigserial   PRIMARY KEY,
    order_id        text        NOT NULL,
    status          text        NOT NULL,
    key             text        NOT NULL,
    created_by      text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS notification_jobs_order ON notification_jobs (order_id, status);

CREATE TABLE IF NOT EXISTS order_status_counts (
    status text   PRIMARY KEY,
    count  bigint NOT NULL
);

-- Observability only: how often a handler was called per (consumer, event). Written outside
-- the inbox transaction so that calls whose transaction died with the process still count;
-- calls beyond the inbox's attempt count are redeliveries whose effects were rolled back.
CREATE TABLE IF NOT EXISTS handler_calls (
    consumer text    NOT NULL,
    event_id uuid    NOT NULL,
    calls    integer NOT NULL DEFAULT 1,
    PRIMARY KEY (consumer, event_id)
);
