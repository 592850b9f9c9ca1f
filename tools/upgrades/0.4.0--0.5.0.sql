-- Written by hand: what tools/upgrade_script.py cannot derive from the functions.
-- A retried dead letter's max_attempts budget starts at its num_attempts, which
-- goes on counting (see tables.sql). Messages in the queue were never retried under
-- that rule: their budget starts at 0, as the default says.
ALTER TABLE fairq.message ADD COLUMN attempts_at_retry bigint NOT NULL DEFAULT 0;
-- A dequeue's wait no longer takes the caller's clock: it reads its own, after its
-- snapshot (dequeue.sql).
DROP FUNCTION fairq.wait_for_release(timestamptz, timestamptz);
