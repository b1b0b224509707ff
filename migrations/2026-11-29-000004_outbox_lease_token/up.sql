-- Lease tokens for external transports: every claim takes a new, strictly increasing token,
-- and every mark is fenced on it, so a publisher whose lease expired (and whose row was
-- claimed again) cannot change the row any more.
CREATE SEQUENCE outbox_lease_token_seq AS bigint;
