-- Written by hand: what tools/upgrade_script.py cannot derive from the functions.
-- Builds while holding off writes to fairq.message: one pass over the table.
CREATE INDEX message_locked_channel_ix ON fairq.message (channel_id)
    WHERE status = 'locked';
-- 0.2.0 counts in_flight only on capped channels (the index above keeps writers out
-- until the upgrade commits, so no settlement runs meanwhile).
UPDATE fairq.channel SET in_flight = 0 WHERE max_concurrency IS NULL AND in_flight <> 0;
