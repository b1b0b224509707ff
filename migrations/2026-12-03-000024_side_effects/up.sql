-- Side effects: calls to the world outside the database (a provider's API, an e-mail) that a
-- consumer asks for in its inbox transaction, and that a supervised worker of the runtime
-- makes, at least once, passing the row's key as the provider's idempotency key.
--
-- The one rule: a row is due when PENDING and next_attempt_at has passed. A claim counts the
-- attempt, marks the row in flight and moves next_attempt_at past its lease, so a worker that
-- dies mid-call leaves a row that comes due again once the lease ends, already charged and
-- still marked; an outcome is recorded only by the claim whose attempt is still the row's
-- (attempt_count). A due row still marked in flight (its worker died) is claimed alone, so a
-- call that kills its process charges no other row.
CREATE TABLE IF NOT EXISTS side_effects (
    id              bigserial   PRIMARY KEY,
    -- which worker makes the call (`EffectConfig::new(kind)`)
    kind            text        NOT NULL CHECK (kind <> ''),
    -- the provider's idempotency key: one row, and so one call's outcome, per (kind, key)
    key             text        NOT NULL CHECK (key <> ''),
    payload         jsonb       NOT NULL,
    -- what asked for it, for operators: the event and the consumer that handled it
    event_id        uuid,
    consumer        text,
    correlation_id  text,
    status          text        NOT NULL DEFAULT 'PENDING'
                    CHECK (status IN ('PENDING', 'DONE', 'DEAD_LETTER', 'IGNORED')),
    attempt_count   integer     NOT NULL DEFAULT 0,
    -- claimed and not yet settled: while due, its worker died during the call
    in_flight       boolean     NOT NULL DEFAULT false,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    error_code      text,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    done_at         timestamptz,
    UNIQUE (kind, key)
);

CREATE INDEX CONCURRENTLY IF NOT EXISTS side_effects_due ON side_effects (kind, next_attempt_at)
    WHERE status = 'PENDING';

-- The rows whose worker died mid-call, found without walking a backlog of due rows.
CREATE INDEX CONCURRENTLY IF NOT EXISTS side_effects_interrupted ON side_effects (kind, next_attempt_at)
    WHERE status = 'PENDING' AND in_flight;

-- Retention deletes DONE effects by age (`processed_inbox_after`).
CREATE INDEX CONCURRENTLY IF NOT EXISTS side_effects_done ON side_effects (done_at) WHERE status = 'DONE';

-- Health counts the dead letters per kind.
CREATE INDEX CONCURRENTLY IF NOT EXISTS side_effects_dead ON side_effects (kind)
    WHERE status = 'DEAD_LETTER';
