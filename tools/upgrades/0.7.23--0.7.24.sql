-- 0.7.23 -> 0.7.24: fairq.channels_for_producer takes a due time per name (a batch's
-- made channels are made due as they are inserted), so it is created anew.
DROP FUNCTION fairq.channels_for_producer(integer, text[], timestamptz, timestamptz, boolean);
