-- Written by hand: what tools/upgrade_script.py cannot derive from the functions.
-- Three helpers now return true instead of nothing, so that the calls made for every
-- message assign them rather than PERFORM them (validate.sql): dropped here, created
-- anew below.
DROP FUNCTION fairq.require_read_committed(text);
DROP FUNCTION fairq.refuse_isolation(text);
DROP FUNCTION fairq.policy_lock_shared(bigint, integer);
DROP FUNCTION fairq.record_history(fairq.message, text, text, timestamptz);
