-- 0.7.18 -> 0.7.19: a channel that message_create makes is made due in its insert.
-- Functions only; channels_for_producer takes two more arguments and is created anew.
DROP FUNCTION fairq.channels_for_producer(integer, text[]);
