-- Retention of the history tables (`maintenance/retention.rs`): reconcile runs and stale-check
-- versions are deleted oldest first, and these indexes find them without reading the whole
-- table. (`admin_audit_at` already serves the audit trail.) The versions' index costs a
-- consumer that skips stale events one more index entry per version it records; without it,
-- each retention batch would read every version row.
CREATE INDEX CONCURRENTLY IF NOT EXISTS reconcile_runs_started ON reconcile_runs (started_at);
CREATE INDEX CONCURRENTLY IF NOT EXISTS aggregate_versions_updated ON aggregate_versions (updated_at);
