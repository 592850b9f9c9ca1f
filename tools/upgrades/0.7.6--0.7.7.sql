-- 0.7.6 -> 0.7.7: dequeues and completions go bulk too (settle and policy locks).
-- Functions only; two internal ones changed their arguments and are created anew.
DROP FUNCTION fairq.gone_bulk();
DROP FUNCTION fairq.channels_wake(bigint[], timestamptz[], timestamptz);
