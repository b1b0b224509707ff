DROP TABLE unrouted_events;
