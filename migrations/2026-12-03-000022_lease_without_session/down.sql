-- A lease that names no session is judged by its expiry as before the change: as dead.
UPDATE inbox_leases SET backend = 0 WHERE backend IS NULL;
ALTER TABLE inbox_leases ALTER COLUMN backend SET NOT NULL;
