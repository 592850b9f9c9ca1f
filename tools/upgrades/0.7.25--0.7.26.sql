-- 0.7.25 -> 0.7.26: fairq.rotation_after also returns when the place it finds was
-- given (fairq.channels_join carries it from one joining channel to the next), so it
-- is created anew.
DROP FUNCTION fairq.rotation_after(integer, timestamptz);
