DROP TABLE consumer_subscriptions;
DROP TABLE consumer_states;
DROP TABLE inbox_events;
DROP TABLE outbox_events;
