DROP TABLE inbox_in_flight;
