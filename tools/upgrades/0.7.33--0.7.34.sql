-- 0.7.33 -> 0.7.34: a producer's message wakes a channel that a dequeue put off for a
-- message another transaction holds (fairq.due_for_producers). fairq.wake_candidates
-- reads the channels as of the producer's clock, so it takes p_now: created anew.
DROP FUNCTION fairq.wake_candidates(bigint[], timestamptz[]);
