-- Written by hand: what tools/upgrade_script.py cannot derive from the functions.
-- Settlements of a bounded channel record their change of its count here instead of
-- updating its channel_size row, which an open producer transaction holds (see
-- tables.sql). The counts in channel_size stay right as they are.
CREATE TABLE fairq.channel_size_change (
    channel_id bigint  NOT NULL,
    delta      integer NOT NULL
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
CREATE INDEX channel_size_change_channel_ix ON fairq.channel_size_change (channel_id);
REVOKE ALL ON fairq.channel_size_change FROM PUBLIC;
-- Queue data: pg_dump backs it up (outside an extension, `fairq upgrade`, nothing to mark).
DO $config_dump$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'fairq') THEN
        PERFORM pg_catalog.pg_extension_config_dump('fairq.channel_size_change', '');
    END IF;
END
$config_dump$;
COMMENT ON TABLE fairq.channel_size IS
    'Message count of each channel that has a max_size, in flight included, as its producers last left it (plus the rows of fairq.channel_size_change).';
COMMENT ON TABLE fairq.channel_size_change IS
    'Changes to the message count of bounded channels made outside their producers'' lock (settlements, cancels, retries), not yet folded into fairq.channel_size.';
