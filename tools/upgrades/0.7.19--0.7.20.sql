-- 0.7.19 -> 0.7.20: a dequeue of one serves a channel that would join first straight
-- from where it joins. Functions only; join_rotation returns more and is created anew.
DROP FUNCTION fairq.join_rotation(integer, timestamptz, integer);
