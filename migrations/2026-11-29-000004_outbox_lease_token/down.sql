DROP SEQUENCE outbox_lease_token_seq;
