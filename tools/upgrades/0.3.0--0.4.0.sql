-- Written by hand: what tools/upgrade_script.py cannot derive from the functions.
-- The queue of channel wakes that producers no longer wait for (see tables.sql).
CREATE TABLE fairq.channel_wake (
    channel_id bigint      NOT NULL,
    due_at     timestamptz NOT NULL,
    woken_at   timestamptz NOT NULL,
    turn_seq   bigint      NOT NULL
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_cost_delay = 0);
CREATE INDEX channel_wake_channel_ix ON fairq.channel_wake (channel_id);
REVOKE ALL ON fairq.channel_wake FROM PUBLIC;
DO $config_dump$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'fairq') THEN
        PERFORM pg_catalog.pg_extension_config_dump('fairq.channel_wake', '');
    END IF;
END
$config_dump$;
COMMENT ON TABLE fairq.channel_wake IS
    'Channel wakes that producers queued because another transaction held the channel row; the next dequeue applies them. Usually empty.';
