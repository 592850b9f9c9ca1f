-- locks.sql — the advisory locks fairq takes, named once.
--
-- Invariants:
--   * lock order, everywhere: a message row, then the channel's advisory locks
--     (producer lock, then its creation lock, then its queue's bulk producer lock,
--     then policy lock, then its
--     queue's bulk policy lock), then its channel row, then (a producer of a bounded
--     channel) its channel_size row;
--     several channels by channel id, several queues by queue id. A transaction that
--     went bulk for a kind of lock takes no channel's lock of that kind after that.
--     The dequeue takes channel rows only with SKIP LOCKED, or by waiting while it
--     holds no other lock, and advisory locks only by trying, so fairq calls do not
--     wait for one another in a cycle. A worker's transaction may still complete
--     (policy lock) and then produce (producer lock) on one channel, against that
--     order: the policy calls, the only ones that take both kinds exclusively, wait
--     for the second kind briefly and then let go and take them the other way round
--     (fairq.channel_for_policy). The settle locks are only ever tried, never waited
--     for, so they have no place in that order;
--   * every advisory lock is two-key: (class, key). Two-key locks never collide with
--     one-key ones, so fairq shares the advisory lock space with applications; two
--     channels (or queues) whose keys collide only cost an extra wait, a skipped
--     clean-up or an extra event, never correctness;
--   * every advisory lock is transaction-level, except a queue's doorbell, which a
--     sleeping worker holds on its own session (fairq.doorbell_hold);
--   * PostgreSQL's lock table is shared and bounded (max_locks_per_transaction ×
--     max_connections entries): of each kind of channel lock held to commit
--     (producer, settle, policy), a transaction takes at most fairq.bulk_channels();
--     past that it goes bulk for that kind (one lock per queue instead). Every call
--     counts the channels it locks (fairq.goes_bulk), and the count never falls
--     behind the locks held. The collector is not counted: it tries at most 1,000
--     channels, once a second.

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

-- How many channels' locks of one kind a transaction takes before it goes bulk for
-- that kind: a few hundred entries of the lock table, where a lock per tenant of a
-- Spark partition or of a big batch would fill it.
CREATE FUNCTION fairq.bulk_channels() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 256 $$;

-- The transaction-local settings that count, per kind, the channels' locks this
-- transaction took, or say 'bulk' (PostgreSQL resets them at commit, and with the
-- locks when a subtransaction rolls back).
CREATE FUNCTION fairq.producer_locks_setting() RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 'fairq.producer_locks' $$;

CREATE FUNCTION fairq.settle_locks_setting() RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 'fairq.settle_locks' $$;

CREATE FUNCTION fairq.policy_locks_setting() RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 'fairq.policy_locks' $$;

-- True when this transaction has gone bulk for the locks counted in setting p_locks.
CREATE FUNCTION fairq.gone_bulk(p_locks text) RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT coalesce(current_setting(p_locks, true) = 'bulk', false) $$;

-- How many channels' locks of the kind counted in setting p_locks this transaction
-- took: NULL once it went bulk for that kind. A call counts every channel it locks,
-- again when it locks one again, so the count may run ahead of the locks held.
CREATE FUNCTION fairq.locks_counted(p_locks text) RETURNS integer
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN current_setting(p_locks, true) ~ '^[0-9]{1,9}$' THEN current_setting(p_locks, true)::integer
                WHEN fairq.gone_bulk(p_locks) THEN NULL
                ELSE 0 END
$$;

-- fairq.goes_bulk once the count reaches the bound: the locks of class p_class this
-- transaction really holds are counted in PostgreSQL's lock table (a read of the
-- whole table, so at most once per half a bound of calls). Past half the bound the
-- transaction goes bulk; below it counts on from what it holds, so that a
-- transaction that creates or completes thousands of messages in a few channels,
-- one call each, never goes bulk (and so never queues a wake per message).
CREATE FUNCTION fairq.goes_bulk_recounted(p_locks text, p_class integer, p_channels integer)
RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    v_held integer;
BEGIN
    IF fairq.gone_bulk(p_locks) THEN
        RETURN true;
    END IF;
    SELECT count(*) INTO v_held FROM pg_catalog.pg_locks l
     WHERE l.pid = pg_catalog.pg_backend_pid() AND l.locktype = 'advisory'
       AND l.classid = p_class::oid AND l.objsubid = 2;
    IF v_held + p_channels <= fairq.bulk_channels() / 2 THEN
        PERFORM set_config(p_locks, (v_held + p_channels)::text, true);
        RETURN false;
    END IF;
    PERFORM set_config(p_locks, 'bulk', true);
    RETURN true;
END
$$;

-- For a call about to take p_channels channels' locks of class p_class, the kind
-- counted in setting p_locks: true when this transaction is bulk for that kind, or
-- goes bulk now (past fairq.bulk_channels()); then the caller takes its queue's bulk
-- lock of that kind instead. Otherwise counts them and returns false. With
-- p_channels 0 it only asks. (SQL, inlined into its callers: a dequeue asks once per
-- channel it settles, and a plpgsql call cost more than the lock. set_config returns
-- the value it set, never NULL.)
CREATE FUNCTION fairq.goes_bulk(p_locks text, p_class integer, p_channels integer) RETURNS boolean
LANGUAGE sql
AS $$
    SELECT CASE WHEN fairq.locks_counted(p_locks) + p_channels <= fairq.bulk_channels()
                THEN p_channels > 0
                     AND set_config(p_locks, (fairq.locks_counted(p_locks) + p_channels)::text, true) IS NULL
                ELSE fairq.goes_bulk_recounted(p_locks, p_class, p_channels) END
$$;

-- The bulk producer lock of a queue, keyed by its id: a producer transaction that
-- would otherwise hold the producer locks of more than fairq.bulk_channels()
-- channels holds this one shared instead, for every queue it produces into from then
-- on (it "goes bulk": a Spark partition, a big batch); whoever tries or waits for a
-- channel's producer lock exclusively takes this one exclusively after it. A bulk
-- producer never relies on a channel staying due: it queues every channel's wake,
-- once per transaction (fairq.woken_here).
CREATE FUNCTION fairq.bulk_producer_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1717660023 $$;

-- The creation lock of a channel name, keyed like its producer lock: a producer
-- about to make a channel that has no committed row yet holds it exclusively, so
-- that one producer makes the row and the others wait for its commit and then use
-- that row (fairq.channels_for_producer). A transaction takes it only along with
-- the channel's producer lock, never in bulk, so it holds no more of them than of
-- those.
CREATE FUNCTION fairq.creation_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1717660026 $$;

-- For a producer call about to take the producer locks of p_channels channels of
-- queue p_queue_id: true when this transaction is bulk (or goes bulk now), holding
-- the queue's bulk producer lock shared; then the call takes no channel's producer
-- lock.
CREATE FUNCTION fairq.producing_in_bulk(p_queue_id integer, p_channels integer) RETURNS boolean
LANGUAGE sql
AS $$
    SELECT CASE WHEN fairq.goes_bulk(fairq.producer_locks_setting(), fairq.producer_lock_class(), p_channels)
                THEN pg_advisory_xact_lock_shared(fairq.bulk_producer_lock_class(), p_queue_id) IS NOT NULL
                ELSE false END
$$;

-- The policy lock of a channel, keyed by channel id: completions of an uncapped
-- channel hold it shared, channel_set, channel_clear and the pause calls
-- exclusively (before they lock the row), so a completion never sees
-- max_concurrency change under it. A capped channel's completion holds the row
-- instead (the policy calls lock it last), and takes no policy lock: holding one
-- while it waited for the row, it deadlocked with a transaction that had written the
-- row (a defer) and then waited for the policy lock (a pause).
CREATE FUNCTION fairq.policy_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1717660019 $$;

CREATE FUNCTION fairq.policy_lock_key(p_channel_id bigint) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashint8(p_channel_id) $$;

-- The bulk policy lock of a queue, keyed by its id: a transaction whose completions
-- would hold the policy locks of more than fairq.bulk_channels() channels holds
-- this one shared instead, for every queue it completes in from then on; channel_set,
-- channel_clear and the pause calls wait for it exclusively after the channel's
-- policy lock.
CREATE FUNCTION fairq.bulk_policy_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1717660025 $$;

-- For a completion: holds the policy locks of channels p_channel_ids (distinct, in id
-- order) shared, or, in a transaction bulk for policy locks (or going bulk with
-- these), the bulk policy locks of their queues p_queue_ids (in queue id order).
CREATE FUNCTION fairq.policy_locks_shared(p_channel_ids bigint[], p_queue_ids integer[]) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF fairq.goes_bulk(fairq.policy_locks_setting(), fairq.policy_lock_class(), cardinality(p_channel_ids)) THEN
        PERFORM pg_advisory_xact_lock_shared(fairq.bulk_policy_lock_class(), q.id)
           FROM (SELECT DISTINCT u.id FROM unnest(p_queue_ids) AS u(id) ORDER BY u.id) q;
    ELSE
        PERFORM pg_advisory_xact_lock_shared(fairq.policy_lock_class(), fairq.policy_lock_key(u.id))
           FROM unnest(p_channel_ids) AS u(id);
    END IF;
END
$$;

-- fairq.policy_locks_shared for one channel p_channel_id of queue p_queue_id (SQL,
-- inlined: a completion of one message is the common case, and a plpgsql call cost
-- more than the lock). True once taken, for an assignment (validate.sql).
CREATE FUNCTION fairq.policy_lock_shared(p_channel_id bigint, p_queue_id integer) RETURNS boolean
LANGUAGE sql
AS $$
    SELECT CASE WHEN fairq.goes_bulk(fairq.policy_locks_setting(), fairq.policy_lock_class(), 1)
                THEN pg_advisory_xact_lock_shared(fairq.bulk_policy_lock_class(), p_queue_id)
                ELSE pg_advisory_xact_lock_shared(fairq.policy_lock_class(), fairq.policy_lock_key(p_channel_id))
           END IS NOT NULL
$$;

-- The settle lock of a channel, keyed like its producer lock: a call about to make
-- the channel less eligible (nothing due now, or nothing at all) tries it
-- exclusively; a producer tries it shared (message_create for every message, the
-- batch path for each channel whose messages need no wake), and queues a wake anyway
-- when that fails (fairq.channels_wake). Nobody waits for it, so a producer never
-- waits for a dequeue.
CREATE FUNCTION fairq.settle_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1717660020 $$;

-- The bulk settle lock of a queue, keyed by its id. A transaction past
-- fairq.bulk_channels() settle locks (a dequeue of thousands of sparse tenants) holds
-- it shared, and from then on only tests a channel's settle lock (fairq.lock_free)
-- instead of holding it to commit. A producer that took a channel's settle lock
-- shared tests this one after (fairq.bulk_settling) and queues its wake when it is
-- held: a settler tests the channel's lock after taking the queue's, so one that found
-- the channel free either holds the queue's lock when the producer tests it, or has
-- committed, and the producer's look at the channel (after the test) sees what it did.
CREATE FUNCTION fairq.bulk_settle_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1717660024 $$;

-- True when nobody holds lock (p_class, p_key) right now, in any mode; holds nothing
-- after. (A session-level lock taken and released in one expression: a transaction-
-- level one would stay in the lock table until commit.) Two callers testing the same
-- lock at the same instant may both see it taken: callers treat "taken" as the safe
-- answer.
CREATE FUNCTION fairq.lock_free(p_class integer, p_key integer) RETURNS boolean
LANGUAGE sql
AS $$
    SELECT CASE WHEN pg_try_advisory_lock(p_class, p_key) THEN pg_advisory_unlock(p_class, p_key)
                ELSE false END
$$;

-- True when no producer is inserting into the channel right now, in bulk or not. On
-- true, holds its producer lock and its queue's bulk producer lock exclusively until
-- commit, so producers that arrive later wait for this transaction and then see what
-- it decided (the collector's test). On false, holds neither: a transaction-level
-- lock cannot be let go but by rolling back the subtransaction that took it (0.7.32
-- kept the channel's producer lock when the bulk lock was refused, and the channel's
-- producers waited for the dequeue that ran the collector). The subtransaction writes
-- nothing, so it takes no transaction id.
CREATE FUNCTION fairq.channel_quiet(p_queue_id integer, p_channel text) RETURNS boolean
LANGUAGE plpgsql
AS $$
BEGIN
    IF pg_try_advisory_xact_lock(fairq.producer_lock_class(),
                                 fairq.producer_lock_key(p_queue_id, p_channel))
       AND pg_try_advisory_xact_lock(fairq.bulk_producer_lock_class(), p_queue_id) THEN
        RETURN true;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'FQ001';  -- lets go of what was taken
EXCEPTION WHEN SQLSTATE 'FQ001' THEN
    RETURN false;
END
$$;

-- True when no producer that relies on the channel staying due holds its settle lock;
-- on true, until commit, holds it exclusively or, in a transaction bulk for settle
-- locks, holds the queue's bulk settle lock (fairq.settled_due_ats). In bulk, the
-- queue's lock is taken before the channel's is tested (fairq.bulk_settle_lock_class);
-- failing to take it means a producer is testing it this instant.
CREATE FUNCTION fairq.settle_lock_try(p_queue_id integer, p_channel text) RETURNS boolean
LANGUAGE sql
AS $$
    SELECT CASE WHEN NOT fairq.goes_bulk(fairq.settle_locks_setting(), fairq.settle_lock_class(), 1)
                THEN pg_try_advisory_xact_lock(fairq.settle_lock_class(),
                                               fairq.producer_lock_key(p_queue_id, p_channel))
                WHEN pg_try_advisory_xact_lock_shared(fairq.bulk_settle_lock_class(), p_queue_id)
                THEN fairq.lock_free(fairq.settle_lock_class(), fairq.producer_lock_key(p_queue_id, p_channel))
                ELSE false END
$$;

-- For a producer: true when no call is settling the channel right now. On true, holds
-- the settle lock shared until commit, so no call makes the channel less eligible
-- before this transaction's messages are seen, except one settling in bulk, which the
-- producer asks about next (fairq.bulk_settling).
CREATE FUNCTION fairq.settle_lock_try_shared(p_queue_id integer, p_channel text) RETURNS boolean
LANGUAGE sql
AS $$
    SELECT pg_try_advisory_xact_lock_shared(fairq.settle_lock_class(),
                                            fairq.producer_lock_key(p_queue_id, p_channel))
$$;

-- For a producer that holds settle locks of queue p_queue_id's channels: true when a
-- transaction settling in bulk may be making them less eligible without their locks,
-- so the producer must queue their wakes. Asked after taking those locks, never
-- before (fairq.bulk_settle_lock_class).
CREATE FUNCTION fairq.bulk_settling(p_queue_id integer) RETURNS boolean
LANGUAGE sql
AS $$
    SELECT NOT fairq.lock_free(fairq.bulk_settle_lock_class(), p_queue_id)
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
