-- 0.7.21 -> 0.7.22: a dequeue's serve does not read a channel's pending due time
-- twice before it settles it. Functions only; settled_due_at takes one more argument
-- and is created anew.
DROP FUNCTION fairq.settled_due_at(bigint, integer, text, timestamptz);
