-- Run before the runtime's statements on the outbox and inbox, in their transaction (the `true`
-- makes it `SET LOCAL`): only index paths compete, whatever the statistics say. Why: see
-- `PLAN_GUARD` in `src/store/mod.rs`. Its own file so that `tests/plan.rs` runs exactly this.
-- It must end with its select list: the publisher appends a setting of its own.
-- JIT is off too: a disabled path still costs 10^10 in the estimate, far past `jit_above_cost`,
-- so a scan of a small table with no other path (`inbox_leases`, read whole by the reaper)
-- would be JIT-compiled on every run: ~100 ms of CPU for a statement that runs in 0.1 ms.
SELECT set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true),
    set_config('jit', 'off', true)
