-- 0.7.34 -> 0.7.35: vacuum no longer truncates the tables that queue traffic rewrites
-- (sql/tables.sql says why). A storage parameter: no row is rewritten.
ALTER TABLE fairq.channel SET (vacuum_truncate = false);
ALTER TABLE fairq.channel_wake SET (vacuum_truncate = false);
ALTER TABLE fairq.channel_size SET (vacuum_truncate = false);
ALTER TABLE fairq.channel_size_change SET (vacuum_truncate = false);
ALTER TABLE fairq.message SET (vacuum_truncate = false);
