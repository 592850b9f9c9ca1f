-- 0.7.20 -> 0.7.21: the channel a dequeue of one serves first is looked up once, and
-- message_create does not ask twice whether it produces in bulk. Functions only;
-- join_rotation returns more and channels_for_producer takes one more argument: both
-- are created anew.
DROP FUNCTION fairq.join_rotation(integer, timestamptz, integer, boolean);
DROP FUNCTION fairq.channels_for_producer(integer, text[], timestamptz, timestamptz);
