DROP TABLE aggregate_versions;
