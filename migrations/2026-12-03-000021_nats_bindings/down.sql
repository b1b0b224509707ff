DROP TABLE nats_bindings;
