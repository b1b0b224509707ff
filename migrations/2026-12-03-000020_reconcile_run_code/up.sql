-- A reconcile run that failed says why with a stable code beside its error text, as inbox and
-- outbox rows do: `RECONCILE_TIMEOUT` for a search stopped at its rule's time bound
-- (`ReconcileRule::time_bound`), `DATABASE_ERROR` and the rest for the others. A nullable
-- column without a default: adding it changes only the catalog.
ALTER TABLE reconcile_runs ADD COLUMN IF NOT EXISTS error_code text;
