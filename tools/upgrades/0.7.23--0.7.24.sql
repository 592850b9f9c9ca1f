-- 0.7.23 -> 0.7.24: fairq.channels_for_producer takes a due time per name (a batch's
-- made channels are made due as they are inserted), so it is created anew.
DROP FUNCTION fairq.channels_for_producer(integer, text[], timestamptz, timestamptz, boolean);

-- @after
-- fairq.clock() now carries the test shift in its own body: a database upgraded
-- while its clock was shifted (in a test) keeps that shift.
SELECT fairq.clock_travel((extract(epoch FROM shift) * 1000)::bigint)
  FROM fairq.clock_offset WHERE shift <> interval '0';
