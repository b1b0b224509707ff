ALTER TABLE reconcile_runs DROP COLUMN error_code;
