-- 0.7.0 -> 0.7.1: a woken channel joins the rotation in the same write that applies
-- its wakes, and a served channel that drains is written once. settled_due_at now
-- takes the channel by id, queue and name.
DROP FUNCTION fairq.settled_due_at(fairq.channel, timestamptz);
