-- Run before the runtime's statements on the outbox and inbox, in their transaction (the `true`
-- makes it `SET LOCAL`): only index paths compete, whatever the statistics say. Why: see
-- `PLAN_GUARD` in `src/store/mod.rs`. Its own file so that `tests/plan.rs` runs exactly this.
-- It must end with its select list: the publisher appends a setting of its own.
SELECT set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true)
