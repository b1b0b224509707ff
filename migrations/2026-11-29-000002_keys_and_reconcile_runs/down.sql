DROP TABLE reconcile_runs;
DROP TABLE idempotency_keys;
