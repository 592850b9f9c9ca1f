-- locks.sql — the advisory locks fairq takes, named once.
--
-- Invariants:
--   * lock order, everywhere: a message row, then the channel's advisory locks
--     (producer lock, then policy lock), then its channel row, then its
--     channel_size row; several channels by channel id. The dequeue takes channel
--     rows only with SKIP LOCKED, or by waiting while it holds no other lock, and
--     advisory locks only by trying, so fairq calls do not wait for one another in a
--     cycle (a dequeue that buries a message may still wait for a bounded channel's
--     size row);
--   * every advisory lock is transaction-level and two-key: (class, key). Two-key
--     locks never collide with one-key ones, so fairq shares the advisory lock
--     space with applications; two channels whose keys collide only cost an extra
--     wait or a skipped clean-up, never correctness.

-- The producer lock of a channel, keyed by queue and name: producers hold it shared
-- while they insert; a call about to make the channel less eligible (going idle,
-- collection) tries it exclusively; channel_set and channel_clear wait for it
-- exclusively. Class 1717660018 is 'fair' in ASCII.
CREATE FUNCTION fairq.producer_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1717660018 $$;

CREATE FUNCTION fairq.producer_lock_key(p_queue_id integer, p_channel text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashtext(p_channel) # hashint4(p_queue_id) $$;

-- The policy lock of a channel, keyed by channel id: completions hold it shared,
-- channel_set, channel_clear and the pause calls exclusively (before they lock the
-- row), so a completion never sees max_concurrency change under it.
CREATE FUNCTION fairq.policy_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1717660019 $$;

CREATE FUNCTION fairq.policy_lock_key(p_channel_id bigint) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashint8(p_channel_id) $$;

-- True when no producer is inserting into the channel right now. On true, holds the
-- producer lock exclusively until commit, so producers that arrive later wait for
-- this transaction and then see what it decided.
CREATE FUNCTION fairq.channel_quiet(p_queue_id integer, p_channel text) RETURNS boolean
LANGUAGE plpgsql
AS $$
BEGIN
    RETURN pg_try_advisory_xact_lock(fairq.producer_lock_class(),
                                     fairq.producer_lock_key(p_queue_id, p_channel));
END
$$;
