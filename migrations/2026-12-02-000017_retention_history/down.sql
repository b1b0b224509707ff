DROP INDEX aggregate_versions_updated;
DROP INDEX reconcile_runs_started;
