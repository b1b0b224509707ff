-- A lease may name no database session. A call hung past its handler's timeout keeps its rows
-- leased until its handler lets go (so an event is never handled twice at once), while the
-- engine ends its session after a grace to release its locks and its hold on vacuum. Such a
-- lease is set to name no session (`backend` NULL) before that: it then lives by its expiry
-- alone, which its live process renews, instead of being judged dead with the session. A
-- catalog-only change.
ALTER TABLE inbox_leases ALTER COLUMN backend DROP NOT NULL;
