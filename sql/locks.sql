-- locks.sql — the advisory locks fairq takes, named once.
--
-- Invariants:
--   * lock order, everywhere: a message row, then the channel's advisory locks
--     (producer lock, then its queue's bulk producer lock, then policy lock), then
--     its channel row, then its channel_size row; several channels by channel id. A
--     producer transaction that went bulk takes no channel's producer lock after
--     that. The dequeue takes channel rows only with SKIP LOCKED, or by waiting while
--     it holds no other lock, and advisory locks only by trying, so fairq calls do not
--     wait for one another in a cycle (a dequeue that buries a message may still wait
--     for a bounded channel's size row). The settle lock is only ever tried, never
--     waited for, so it has no place in that order;
--   * every advisory lock is two-key: (class, key). Two-key locks never collide with
--     one-key ones, so fairq shares the advisory lock space with applications; two
--     channels (or queues) whose keys collide only cost an extra wait, a skipped
--     clean-up or an extra event, never correctness;
--   * every advisory lock is transaction-level, except a queue's doorbell, which a
--     sleeping worker holds on its own session (fairq.doorbell_hold);
--   * PostgreSQL's lock table is shared and bounded (max_locks_per_transaction ×
--     max_connections entries): a transaction's batch calls take the producer locks
--     of at most fairq.bulk_producer_channels() channels; past that it goes bulk (one
--     lock per queue). message_create, one channel per call, is not counted.

-- The producer lock of a channel, keyed by queue and name: producers hold it shared
-- while they insert; the collector tries it exclusively before it removes the
-- channel; channel_set, channel_clear and the pause calls wait for it exclusively.
-- Class 1717660018 is 'fair' in ASCII.
CREATE FUNCTION fairq.producer_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1717660018 $$;

CREATE FUNCTION fairq.producer_lock_key(p_queue_id integer, p_channel text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashtext(p_channel) # hashint4(p_queue_id) $$;

-- The bulk producer lock of a queue, keyed by its id: a producer transaction that
-- would otherwise hold the producer locks of more than fairq.bulk_producer_channels()
-- channels holds this one shared instead, for every queue it produces into from then
-- on (it "goes bulk": a Spark partition, a big batch); whoever tries or waits for a
-- channel's producer lock exclusively takes this one exclusively after it. A bulk
-- producer never relies on a channel staying due: it queues every channel's wake.
CREATE FUNCTION fairq.bulk_producer_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1717660023 $$;

CREATE FUNCTION fairq.bulk_producer_channels() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 256 $$;

-- How many channels' producer locks this transaction's batch calls took, or 'bulk':
-- a transaction-local setting (PostgreSQL resets it at commit, and with the locks
-- when a subtransaction rolls back).
CREATE FUNCTION fairq.producer_locks_setting() RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 'fairq.producer_locks' $$;

-- True when this transaction has gone bulk (it then holds the bulk producer lock of
-- every queue it produced into since).
CREATE FUNCTION fairq.gone_bulk() RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT coalesce(current_setting(fairq.producer_locks_setting(), true) = 'bulk', false) $$;

-- For a producer call about to take the producer locks of p_channels channels of
-- queue p_queue_id: true when this transaction is bulk (or goes bulk now, past the
-- bound), holding the queue's bulk producer lock shared; then the call takes no
-- channel's producer lock. With p_channels 0 it only asks (message_create's path).
CREATE FUNCTION fairq.producing_in_bulk(p_queue_id integer, p_channels integer) RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    v_held text := coalesce(current_setting(fairq.producer_locks_setting(), true), '');
    v_count integer := CASE WHEN v_held ~ '^[0-9]{1,9}$' THEN v_held::integer ELSE 0 END;
BEGIN
    IF NOT fairq.gone_bulk() AND v_count + p_channels <= fairq.bulk_producer_channels() THEN
        IF p_channels > 0 THEN
            PERFORM set_config(fairq.producer_locks_setting(), (v_count + p_channels)::text, true);
        END IF;
        RETURN false;
    END IF;
    PERFORM set_config(fairq.producer_locks_setting(), 'bulk', true);
    PERFORM pg_advisory_xact_lock_shared(fairq.bulk_producer_lock_class(), p_queue_id);
    RETURN true;
END
$$;

-- The policy lock of a channel, keyed by channel id: completions hold it shared,
-- channel_set, channel_clear and the pause calls exclusively (before they lock the
-- row), so a completion never sees max_concurrency change under it.
CREATE FUNCTION fairq.policy_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1717660019 $$;

CREATE FUNCTION fairq.policy_lock_key(p_channel_id bigint) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashint8(p_channel_id) $$;

-- The settle lock of a channel, keyed like its producer lock: a call about to make
-- the channel less eligible (nothing due now, or nothing at all) tries it
-- exclusively; a producer tries it shared (message_create for every message, the
-- batch path for each channel whose messages need no wake), and queues a wake anyway
-- when that fails (fairq.channels_wake). Nobody waits for it, so a producer never
-- waits for a dequeue.
CREATE FUNCTION fairq.settle_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1717660020 $$;

-- True when no producer is inserting into the channel right now, in bulk or not. On
-- true, holds its producer lock and its queue's bulk producer lock exclusively until
-- commit, so producers that arrive later wait for this transaction and then see what
-- it decided (the collector's test).
CREATE FUNCTION fairq.channel_quiet(p_queue_id integer, p_channel text) RETURNS boolean
LANGUAGE plpgsql
AS $$
BEGIN
    RETURN pg_try_advisory_xact_lock(fairq.producer_lock_class(),
                                     fairq.producer_lock_key(p_queue_id, p_channel))
           AND pg_try_advisory_xact_lock(fairq.bulk_producer_lock_class(), p_queue_id);
END
$$;

-- True when no producer that relies on the channel staying due holds its settle lock;
-- on true, holds it exclusively until commit (fairq.settled_due_at).
CREATE FUNCTION fairq.settle_lock_try(p_queue_id integer, p_channel text) RETURNS boolean
LANGUAGE plpgsql
AS $$
BEGIN
    RETURN pg_try_advisory_xact_lock(fairq.settle_lock_class(),
                                     fairq.producer_lock_key(p_queue_id, p_channel));
END
$$;

-- For a producer: true when no call is settling the channel right now. On true, holds
-- the settle lock shared until commit, so no call makes the channel less eligible
-- before this transaction's messages are seen.
CREATE FUNCTION fairq.settle_lock_try_shared(p_queue_id integer, p_channel text) RETURNS boolean
LANGUAGE sql
AS $$
    SELECT pg_try_advisory_xact_lock_shared(fairq.settle_lock_class(),
                                            fairq.producer_lock_key(p_queue_id, p_channel))
$$;

-- A queue's doorbell and its "producing" lock, keyed by the queue's name (a worker may
-- wait on a queue no producer has named yet): a worker about to sleep holds the
-- doorbell shared, on its session, and then tries the producing lock exclusively; a
-- call that made work available holds the producing lock shared until commit and
-- tries the doorbell exclusively, sending its event only when that fails. See
-- events.sql for why no event is lost.
CREATE FUNCTION fairq.doorbell_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1717660021 $$;

CREATE FUNCTION fairq.producing_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1717660022 $$;

CREATE FUNCTION fairq.queue_lock_key(p_queue text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashtext(p_queue) $$;
