-- 0.7.16 -> 0.7.17: a producer writes the wake of a channel it made into the row,
-- and a dequeue locks only the waiting channels that join. Functions only; three
-- internal ones changed their arguments or result and are created anew.
DROP FUNCTION fairq.channels_for_producer(integer, text[]);
DROP FUNCTION fairq.channels_wake(integer, bigint[], timestamptz[], timestamptz);
DROP FUNCTION fairq.woken_to_take(integer, timestamptz, integer, bigint[]);
