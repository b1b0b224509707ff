DROP TABLE IF EXISTS side_effects;
