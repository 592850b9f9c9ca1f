-- 0.7.22 -> 0.7.23: a dequeue of one serves a lone woken channel that would be first
-- in the rotation without writing it into the rotation. The dequeue's join folds the
-- woken channels' wakes itself and hands them to channels_join, so folded_wakes
-- returns a named row type and channels_join takes it; both are created anew.
CREATE TYPE fairq.folded_turn AS (id bigint, woken boolean, due_at timestamptz, turn_at timestamptz,
                                  turn_seq bigint, turn_pass bigint, turn_given_at timestamptz);
REVOKE ALL ON TYPE fairq.folded_turn FROM PUBLIC;
DROP FUNCTION fairq.channels_join(bigint[], bigint[], integer, timestamptz, integer);
DROP FUNCTION fairq.folded_wakes(bigint[]);
