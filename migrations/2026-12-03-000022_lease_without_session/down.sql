-- Stop every runtime of the newer version first: one still running would fail to renew the
-- leases of its hung handlers. A lease that names no session gets pid 0, which is never live:
-- the reaper judges it dead at once.
UPDATE inbox_leases SET backend = 0 WHERE backend IS NULL;
ALTER TABLE inbox_leases ALTER COLUMN backend SET NOT NULL;
