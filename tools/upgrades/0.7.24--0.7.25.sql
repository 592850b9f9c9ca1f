-- 0.7.24 -> 0.7.25: fairq.join_rotation also answers, for the channel it finds first,
-- whether it has queued wakes or a scheduled message due (two OUT parameters more),
-- so it is created anew.
DROP FUNCTION fairq.join_rotation(integer, timestamptz, integer, boolean);
