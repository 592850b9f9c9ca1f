-- fairq 0.7.40 — generated from sql/ by `make script`; do not edit.
\echo Use "CREATE EXTENSION fairq" to load this file. \quit

-- ==== sql/tables.sql ====

-- tables.sql — where fairq keeps its state.
--
-- Invariants kept by every function in this schema:
--   * one queue row per name, created on first use and kept (queues are few: job
--     kinds); every channel, message, wake, dead letter and history row belongs to
--     one queue, and a message or wake carries its channel's queue_id, so that every
--     index a dequeue reads starts with the queue;
--   * one channel row per (queue, name), created on first use; a channel with no
--     explicit policy and nothing in it is kept idle for a while (a tenant that
--     comes back finds it), then collected in bulk (fairq.collect_idle_channels);
--   * channel.in_flight = number of its messages with status 'locked' when it has a
--     max_concurrency, else 0: only a capped channel's settlements touch its row;
--   * channel.due_at is NULL only when the channel has no pending ('ready' or
--     'scheduled') message, and is never later than the earliest time one of its
--     pending messages becomes due (it may be earlier: a dequeue then finds nothing
--     and recomputes it);
--   * channel.turn_at is NULL when the channel cannot be served (nothing pending or
--     at max_concurrency); '-infinity' when it is in its queue's rotation (ordered
--     by turn_pass, then turn_seq); else the time from which it may be served (see
--     turns.sql for the whole rule). Outside the rotation turn_pass is NULL but for
--     a kept place: a channel full with work due, or freed from that and servable
--     now, keeps its pass (turns.sql, since 0.7.37);
--   * channel.idle_since is NULL exactly when due_at is not: since when the channel
--     has had nothing pending;
--   * channel_size exists exactly for channels with a max_size; its size plus its
--     channel's rows in channel_size_change counts all their messages, in flight
--     included; channel_size_change has rows only for such channels.
-- Messages move scheduled -> ready -> locked -> (deleted | ready | scheduled).
-- Only 'ready' messages are ordered by priority; a 'scheduled' message becomes
-- 'ready' in the dequeue that finds it due, so no daemon is needed.

CREATE TYPE fairq.message_status AS ENUM ('scheduled', 'ready', 'locked');

CREATE SEQUENCE fairq.queue_id_seq AS integer;
CREATE SEQUENCE fairq.channel_id_seq;
-- Round-robin tie-breaker: a served or newly eligible channel takes the next value,
-- so channels whose turns fall in the same microsecond still take strict turns.
CREATE SEQUENCE fairq.turn_seq;
CREATE SEQUENCE fairq.message_id_seq;

-- A queue: its own channels and round-robin, served by its own workers. Rows are
-- created by the first call that names the queue.
CREATE TABLE fairq.queue (
    id           integer     NOT NULL DEFAULT nextval('fairq.queue_id_seq') PRIMARY KEY,
    name         text        NOT NULL UNIQUE,
    paused_until timestamptz
);
ALTER SEQUENCE fairq.queue_id_seq OWNED BY fairq.queue.id;

-- Every dequeue rewrites its channel's turn (an indexed column), so channel updates
-- cannot be HOT: leave room on each page and vacuum the small, hot table often.
-- Vacuum never truncates the tables that queue traffic rewrites all the time (this
-- one, channel_wake, channel_size, channel_size_change, message): a truncation needs
-- the table's exclusive lock, which traffic never lets it have, and autovacuum's
-- worker waited up to 5 s for it at many visits, then gave up, while dead rows piled up
-- in the tables it had not reached yet. The pages stay, and are filled again.
CREATE TABLE fairq.channel (
    id                  bigint      NOT NULL DEFAULT nextval('fairq.channel_id_seq') PRIMARY KEY,
    name                text        NOT NULL,
    has_policy          boolean     NOT NULL DEFAULT false,
    max_concurrency     integer,
    release_interval_ms bigint      NOT NULL DEFAULT 0,
    max_size            integer,
    max_attempts        integer,
    in_flight           integer     NOT NULL DEFAULT 0,
    last_release_at     timestamptz,
    due_at              timestamptz,
    turn_at             timestamptz,
    turn_seq            bigint,
    idle_since          timestamptz,
    queue_id            integer     NOT NULL,
    weight              integer     NOT NULL DEFAULT 1,
    paused_until        timestamptz,
    -- Its place in the rotation while turn_at is '-infinity', and when it was given
    -- (turns.sql).
    turn_pass           bigint,
    turn_given_at       timestamptz,
    CONSTRAINT channel_queue_id_name_key UNIQUE (queue_id, name)
) WITH (fillfactor = 50,
        autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
        autovacuum_analyze_scale_factor = 0.05, autovacuum_vacuum_cost_delay = 0,
        vacuum_truncate = false);
ALTER SEQUENCE fairq.channel_id_seq OWNED BY fairq.channel.id;

-- The dequeue's lookups, within one queue: the rotation ('-infinity', by pass), then
-- the channels whose time to join it has come (by that time).
CREATE INDEX channel_turn_ix ON fairq.channel (queue_id, turn_at, turn_pass, turn_seq)
    WHERE turn_at IS NOT NULL;
-- The rotation by when each place was given: where a channel joining late belongs.
CREATE INDEX channel_turn_given_ix ON fairq.channel (queue_id, turn_given_at, turn_pass)
    WHERE turn_at = '-infinity';
-- Channels the collector may remove, longest idle (and unpaused) first.
CREATE INDEX channel_idle_ix ON fairq.channel ((GREATEST(idle_since, paused_until)))
    WHERE idle_since IS NOT NULL AND NOT has_policy;

-- When idle channels were last collected: dequeues take turns at it, at most one at
-- a time and once a second (fairq.collect_idle_channels).
CREATE TABLE fairq.channel_collection (
    singleton    boolean     NOT NULL DEFAULT true PRIMARY KEY CHECK (singleton),
    collected_at timestamptz NOT NULL DEFAULT '-infinity'
);
INSERT INTO fairq.channel_collection DEFAULT VALUES;

-- Wakes of idle channels, queued by producers (fairq.channels_wake), who never lock
-- a channel row: the channel's turn is due no later than due_at, from woken_at, with
-- turn_seq. Committed with the producer's messages and applied, then deleted, by the
-- next dequeues (fairq.join_rotation, earliest turn first).
CREATE TABLE fairq.channel_wake (
    channel_id bigint      NOT NULL,
    due_at     timestamptz NOT NULL,
    woken_at   timestamptz NOT NULL,
    turn_seq   bigint      NOT NULL,
    queue_id   integer     NOT NULL
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_cost_delay = 0, vacuum_truncate = false);
-- A channel's wakes, earliest due first: a producer asks for the earliest, and for
-- the latest due by its message's time, in one probe however many are queued (a
-- producer gone bulk queues one per channel per transaction, and until dequeues
-- apply them they add up: with the channel alone, each call read them all).
CREATE INDEX channel_wake_channel_ix ON fairq.channel_wake (channel_id, due_at);
-- Wakes by the turn they give (rate limits aside): dequeues apply the earliest first.
CREATE INDEX channel_wake_turn_ix ON fairq.channel_wake (queue_id, (GREATEST(due_at, woken_at)), turn_seq);

-- Producers of a bounded channel serialise on this row, not on the channel row that
-- dequeues lock, so an open producer transaction never hides a channel from workers.
CREATE TABLE fairq.channel_size (
    channel_id bigint  NOT NULL PRIMARY KEY,
    size       integer NOT NULL
) WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
        vacuum_truncate = false);

-- What left a bounded channel (or came back to it) outside its producers' lock:
-- completions, failures, cancels, burials and retries insert their change here
-- instead of updating channel_size, whose row a producer holds until it commits, so
-- an open producer transaction never makes them wait. The next producer of the
-- channel folds the changes into channel_size under that lock.
CREATE TABLE fairq.channel_size_change (
    channel_id bigint  NOT NULL,
    delta      integer NOT NULL
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000, vacuum_truncate = false);
CREATE INDEX channel_size_change_channel_ix ON fairq.channel_size_change (channel_id);

CREATE TABLE fairq.message (
    id                bigint               NOT NULL DEFAULT nextval('fairq.message_id_seq') PRIMARY KEY,
    channel_id        bigint               NOT NULL,
    status            fairq.message_status NOT NULL,
    priority          integer              NOT NULL DEFAULT 0,
    dequeue_at        timestamptz          NOT NULL,
    locked_until      timestamptz,
    num_attempts      bigint               NOT NULL DEFAULT 0,
    recovered         boolean              NOT NULL DEFAULT false,
    created_at        timestamptz          NOT NULL,
    first_dequeued_at timestamptz,
    dedup_key         text,
    content           bytea                NOT NULL,
    state             bytea,
    -- num_attempts when the message was last retried from the dead letters (0 if
    -- never): max_attempts counts the deliveries since (fairq.attempts_exhausted).
    attempts_at_retry bigint               NOT NULL DEFAULT 0,
    queue_id          integer              NOT NULL
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
        autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0,
        vacuum_truncate = false);
ALTER SEQUENCE fairq.message_id_seq OWNED BY fairq.message.id;

-- A channel's best ready message: priority first, then schedule, then arrival.
CREATE INDEX message_ready_ix ON fairq.message (channel_id, priority DESC, dequeue_at, id)
    WHERE status = 'ready';
-- A channel's scheduled messages, by the time they become due.
CREATE INDEX message_scheduled_ix ON fairq.message (channel_id, dequeue_at, id)
    WHERE status = 'scheduled';
-- The same, in the order they will be handed out once due: a dequeue that finds more
-- come due than it promotes at once promotes the first in this order (dequeue.sql,
-- step 3), reading past the channel's messages of higher priority not yet due.
CREATE INDEX message_scheduled_priority_ix ON fairq.message (channel_id, priority DESC, dequeue_at, id)
    WHERE status = 'scheduled';
-- A queue's locks that may have expired, oldest expiry first. Only locked messages
-- have a locked_until; the index says so by that column, not by status, so that a
-- statement looking for a channel's locked messages cannot be planned through it
-- (a plan cached while nothing was locked read every lock of the queue for each
-- channel) and has message_locked_channel_ix alone to go by.
CREATE INDEX message_locked_ix ON fairq.message (queue_id, locked_until)
    WHERE locked_until IS NOT NULL;
-- A channel's locked messages: is an uncapped channel empty, how many are in flight.
CREATE INDEX message_locked_channel_ix ON fairq.message (channel_id)
    WHERE status = 'locked';
CREATE UNIQUE INDEX message_dedup_ix ON fairq.message (channel_id, dedup_key)
    WHERE dedup_key IS NOT NULL;
-- Messages whose lock expired unsettled (the dashboard's "Recovered" list, newest
-- first): few, and no other index finds them. Only a recovery adds an entry; every
-- other write of a message either writes its indexes anyway (no update of a message
-- is HOT) or deletes it.
CREATE INDEX message_recovered_ix ON fairq.message (id) WHERE recovered;

CREATE TABLE fairq.dead_letter (
    id           bigint      NOT NULL PRIMARY KEY,
    channel      text        NOT NULL,
    priority     integer     NOT NULL,
    content      bytea       NOT NULL,
    state        bytea,
    num_attempts bigint      NOT NULL,
    error        text,
    created_at   timestamptz NOT NULL,
    died_at      timestamptz NOT NULL,
    queue        text        NOT NULL
);
CREATE INDEX dead_letter_died_at_ix ON fairq.dead_letter (died_at);
CREATE INDEX dead_letter_queue_died_at_ix ON fairq.dead_letter (queue, died_at);

-- Filled only while the setting fairq.history is on.
CREATE TABLE fairq.message_history (
    id                bigint      NOT NULL,
    queue             text        NOT NULL,
    channel           text        NOT NULL,
    priority          integer     NOT NULL,
    created_at        timestamptz NOT NULL,
    first_dequeued_at timestamptz,
    settled_at        timestamptz NOT NULL,
    num_attempts      bigint      NOT NULL,
    outcome           text        NOT NULL CHECK (outcome IN ('completed', 'dead', 'cancelled'))
);
CREATE INDEX message_history_settled_at_ix ON fairq.message_history (settled_at);
CREATE INDEX message_history_id_ix ON fairq.message_history (id);

-- Queue data is user data: pg_dump must back it up although the tables belong to
-- the extension. (Outside CREATE EXTENSION, e.g. `fairq install`, nothing to mark.)
DO $config_dump$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'fairq') THEN
        PERFORM pg_catalog.pg_extension_config_dump('fairq.queue', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.channel', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.channel_size', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.channel_size_change', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.channel_wake', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.message', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.dead_letter', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.message_history', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.queue_id_seq', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.channel_id_seq', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.message_id_seq', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.turn_seq', '');
    END IF;
END
$config_dump$;

COMMENT ON TYPE fairq.message_status IS
    'Where a message is: scheduled (not yet due), ready (due, ordered by priority), locked (handed out, in flight).';
COMMENT ON TABLE fairq.queue IS
    'One row per named queue (created on first use): its id and, while it is paused, until when.';
COMMENT ON TABLE fairq.channel IS
    'One row per channel (tenant): its policy, in-flight count and round-robin turn. Rows without a policy disappear when the channel is empty.';
COMMENT ON TABLE fairq.channel_wake IS
    'Wakes of idle channels that producers queued (producers never lock a channel row); the next dequeues apply them, oldest first.';
COMMENT ON TABLE fairq.channel_collection IS
    'When idle channels (no policy, nothing in them) were last collected; dequeues collect them once a second.';
COMMENT ON TABLE fairq.channel_size IS
    'Message count of each channel that has a max_size, in flight included, as its producers last left it (plus the rows of fairq.channel_size_change).';
COMMENT ON TABLE fairq.channel_size_change IS
    'Changes to the message count of bounded channels made outside their producers'' lock (settlements, cancels, retries), not yet folded into fairq.channel_size.';
COMMENT ON TABLE fairq.message IS
    'Every message not yet completed, cancelled or dead: scheduled, ready or locked (in flight).';
COMMENT ON TABLE fairq.dead_letter IS
    'Messages that failed or ran out of attempts; fairq.dead_letter_retry puts one back.';
COMMENT ON TABLE fairq.message_history IS
    'One row per settled message (completed, dead, cancelled) while the setting fairq.history is on; read by the Spark report, trimmed by fairq.history_prune.';

-- ==== sql/clock.sql ====

-- clock.sql — the one clock every fairq function reads.
--
-- Invariants:
--   * time is the server's clock at the moment of the call (clock_timestamp()),
--     read once per call, never the transaction's start time: a producer inside a
--     long transaction still schedules against real time. One exception: a dequeue
--     whose pick finds nothing eligible reads it again before it answers "empty"
--     (dequeue.sql, step 2), since other calls give turns at their own clocks;
--   * durations are whole milliseconds (bigint) turned into intervals exactly,
--     never through a hand-rolled epoch;
--   * tests may shift the clock forward or back with fairq.clock_travel(); only the
--     extension's owner can, so no caller can bend the queue's time. The shift is
--     written twice, in one transaction: as a constant in fairq.clock()'s own body,
--     so the clock is a SQL function of one expression, inlined into every
--     statement and plpgsql expression that reads it (read from a table, the shift
--     cost each call a statement of its own: some 19 µs in a fresh transaction, and
--     every call reads the clock); and in fairq.clock_offset, for the views, which
--     may not call fairq.clock() (their readers have no EXECUTE on it). PostgreSQL
--     replans what inlined the clock when the function changes; sessions see the
--     change from their next transaction on.

CREATE TABLE fairq.clock_offset (
    singleton boolean  NOT NULL DEFAULT true PRIMARY KEY CHECK (singleton),
    shift     interval NOT NULL DEFAULT interval '0'
);
INSERT INTO fairq.clock_offset DEFAULT VALUES;

-- The queue's clock with no shift: clock_travel(0) writes exactly this. (Qualified
-- throughout: an inlined body is parsed with its caller's search_path.)
CREATE FUNCTION fairq.clock() RETURNS timestamptz
LANGUAGE sql VOLATILE
AS $$ SELECT pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) '0 milliseconds'::pg_catalog.interval $$;

CREATE FUNCTION fairq.ms(p_milliseconds bigint) RETURNS interval
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$ SELECT p_milliseconds * interval '1 millisecond' $$;

-- For tests only (not granted to anyone): moves the queue's clock by p_shift_ms
-- relative to real time (in fairq.clock() and fairq.clock_offset). fairq.clock_travel(0)
-- returns to real time.
CREATE FUNCTION fairq.clock_travel(p_shift_ms bigint) RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_shift_ms IS NULL THEN
        RAISE EXCEPTION 'p_shift_ms must not be NULL' USING ERRCODE = '22004';
    END IF;
    -- A shift the clock cannot take is refused naming it: one past what an interval
    -- holds failed in the statement that rewrites fairq.clock() (22015), one past
    -- PostgreSQL's timestamps in the reading of the clock below (22008).
    BEGIN
        PERFORM clock_timestamp() + fairq.ms(p_shift_ms);
    EXCEPTION WHEN datetime_field_overflow OR interval_field_overflow THEN
        RAISE EXCEPTION 'p_shift_ms must keep the clock within PostgreSQL''s timestamps'
                        ' (4713 BC to 294276 AD), got %', p_shift_ms USING ERRCODE = '22023';
    END;
    -- (The shift in milliseconds, as text the interval type reads the same way
    -- whatever the session's IntervalStyle.)
    EXECUTE format('CREATE OR REPLACE FUNCTION fairq.clock() RETURNS timestamptz LANGUAGE sql VOLATILE AS %L',
                   format(' SELECT pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) %L::pg_catalog.interval ',
                          p_shift_ms || ' milliseconds'));
    UPDATE fairq.clock_offset SET shift = fairq.ms(p_shift_ms);
    RETURN fairq.clock();
END
$$;

COMMENT ON TABLE fairq.clock_offset IS 'Shift of the queue''s clock from real time; zero except in tests.';
COMMENT ON FUNCTION fairq.clock() IS
    'The queue''s clock: the server''s clock_timestamp() at the moment of the call (plus the shift fairq.clock_travel wrote, normally zero).';
COMMENT ON FUNCTION fairq.clock_travel(bigint) IS
    'Tests only, owner only: sets the queue''s clock to real time plus p_shift_ms and returns it.';

-- ==== sql/validate.sql ====

-- validate.sql — argument checks shared by every public function.
--
-- Invariant: a call with a bad argument raises before it changes anything, with
-- SQLSTATE 22004 for a missing (NULL) required value and 22023 for an invalid one,
-- and a message that starts with the parameter's name.
--
-- Each check that every create, dequeue or completion makes is a SQL function,
-- inlined into the statement that asks, that tests the value and calls the plpgsql
-- check (fairq.checked_*, which raises) only for a value that fails: a plpgsql call
-- per argument cost more than the rest of a completion's checks. (The checks are
-- IMMUTABLE: planned with a constant argument, the plpgsql check runs at plan time,
-- and raises only where it would have raised at run time.)
--
-- The calls made for every message (message_create, message_dequeue,
-- message_complete) assign what their checks (and the locks and records they make
-- for their effect) return to a variable, v_done, instead of PERFORMing them:
-- plpgsql evaluates the assignment of a plain expression itself, where a PERFORM
-- runs a query through the executor (in a loop, 1.37 µs for a PERFORM of the checks
-- against 0.12 for their assignment, 3.5 against 0.9 for a lock; a call in a
-- transaction of its own also prepares each expression once, and saved 3-5 % of a
-- cycle). So the checks that only raise return true, and several are joined by AND
-- (each returns true or its non-NULL value, so none is skipped).

CREATE FUNCTION fairq.checked_not_null(p_value anyelement, p_name text) RETURNS anyelement
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_value IS NULL THEN
        RAISE EXCEPTION '% must not be NULL', p_name USING ERRCODE = '22004';
    END IF;
    RETURN p_value;
END
$$;

CREATE FUNCTION fairq.require(p_value anyelement, p_name text) RETURNS anyelement
LANGUAGE sql IMMUTABLE
AS $$
    SELECT CASE WHEN p_value IS NULL
                THEN fairq.checked_not_null(p_value, p_name) ELSE p_value END
$$;

CREATE FUNCTION fairq.checked_at_least(p_value bigint, p_minimum bigint, p_name text) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_value IS NULL THEN
        RAISE EXCEPTION '% must not be NULL', p_name USING ERRCODE = '22004';
    END IF;
    IF p_value < p_minimum THEN
        RAISE EXCEPTION '% must be at least %, got %', p_name, p_minimum, p_value
            USING ERRCODE = '22023';
    END IF;
    RETURN p_value;
END
$$;

CREATE FUNCTION fairq.require_at_least(p_value bigint, p_minimum bigint, p_name text) RETURNS bigint
LANGUAGE sql IMMUTABLE
AS $$
    SELECT CASE WHEN (p_value < p_minimum) IS NOT FALSE
                THEN fairq.checked_at_least(p_value, p_minimum, p_name) ELSE p_value END
$$;

-- A time a message becomes due. NULL is allowed and means now; 'infinity' and
-- '-infinity' are refused: no message could ever be due at the one, and the other is
-- a value many clients cannot read back.
CREATE FUNCTION fairq.checked_finite(p_value timestamptz, p_name text) RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF NOT isfinite(p_value) THEN
        RAISE EXCEPTION '% must be a finite timestamp or NULL (now), got %', p_name, p_value
            USING ERRCODE = '22023';
    END IF;
    RETURN p_value;
END
$$;

CREATE FUNCTION fairq.require_finite(p_value timestamptz, p_name text) RETURNS timestamptz
LANGUAGE sql IMMUTABLE
AS $$
    SELECT CASE WHEN NOT isfinite(p_value)
                THEN fairq.checked_finite(p_value, p_name) ELSE p_value END
$$;

-- NULL is allowed and means "unlimited".
CREATE FUNCTION fairq.require_limit(p_value bigint, p_name text) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_value < 1 THEN
        RAISE EXCEPTION '% must be at least 1 or NULL (unlimited), got %', p_name, p_value
            USING ERRCODE = '22023';
    END IF;
    RETURN p_value;
END
$$;

CREATE FUNCTION fairq.checked_channel_name(p_channel text, p_name text) RETURNS text
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_channel IS NULL THEN
        RAISE EXCEPTION '% must not be NULL', p_name USING ERRCODE = '22004';
    END IF;
    IF p_channel = '' OR octet_length(p_channel) > 255 THEN
        RAISE EXCEPTION '% must be non-empty text of at most 255 bytes, got % bytes',
            p_name, octet_length(p_channel) USING ERRCODE = '22023';
    END IF;
    RETURN p_channel;
END
$$;

CREATE FUNCTION fairq.require_channel_name(p_channel text, p_name text) RETURNS text
LANGUAGE sql IMMUTABLE
AS $$
    SELECT CASE WHEN (octet_length(p_channel) NOT BETWEEN 1 AND 255) IS NOT FALSE
                THEN fairq.checked_channel_name(p_channel, p_name) ELSE p_channel END
$$;

-- Durations (locks, release intervals) are whole milliseconds of at most ten years:
-- enough for any lease or rate limit, and far from timestamp overflow.
CREATE FUNCTION fairq.max_duration_ms() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 315360000000 $$;

CREATE FUNCTION fairq.checked_duration(p_value bigint, p_minimum bigint, p_name text) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF fairq.require_at_least(p_value, p_minimum, p_name) > fairq.max_duration_ms() THEN
        RAISE EXCEPTION '% must be at most % (ten years in milliseconds), got %',
            p_name, fairq.max_duration_ms(), p_value USING ERRCODE = '22023';
    END IF;
    RETURN p_value;
END
$$;

CREATE FUNCTION fairq.require_duration(p_value bigint, p_minimum bigint, p_name text) RETURNS bigint
LANGUAGE sql IMMUTABLE
AS $$
    SELECT CASE WHEN (p_value NOT BETWEEN p_minimum AND fairq.max_duration_ms()) IS NOT FALSE
                THEN fairq.checked_duration(p_value, p_minimum, p_name) ELSE p_value END
$$;

-- Dedup keys live in a unique B-tree index, whose entries must stay small.
CREATE FUNCTION fairq.checked_dedup_key(p_dedup_key text, p_name text) RETURNS text
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF octet_length(p_dedup_key) > 1024 THEN
        RAISE EXCEPTION '% must be at most 1024 bytes, got %', p_name, octet_length(p_dedup_key)
            USING ERRCODE = '22023';
    END IF;
    RETURN p_dedup_key;
END
$$;

CREATE FUNCTION fairq.require_dedup_key(p_dedup_key text, p_name text) RETURNS text
LANGUAGE sql IMMUTABLE
AS $$
    SELECT CASE WHEN octet_length(p_dedup_key) > 1024
                THEN fairq.checked_dedup_key(p_dedup_key, p_name) ELSE p_dedup_key END
$$;

-- A batch argument: NULL (whether that is allowed is the caller's business), or a
-- one-dimensional array whose subscripts are its positions, as long as p_length
-- (when given, the length of p_length_of). Batches read their arrays in parallel and
-- name a bad element by its subscript, so an array that starts anywhere but 1 (which
-- no client sends unless asked to) is refused rather than misread. Returns the
-- array's length.
CREATE FUNCTION fairq.require_batch_array(p_value anyarray, p_name text,
                                          p_length integer DEFAULT NULL,
                                          p_length_of text DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_value IS NULL THEN
        RETURN NULL;
    END IF;
    IF array_ndims(p_value) > 1 THEN
        RAISE EXCEPTION '% must be a one-dimensional array, got % dimensions', p_name, array_ndims(p_value)
            USING ERRCODE = '22023';
    END IF;
    IF array_lower(p_value, 1) <> 1 THEN
        RAISE EXCEPTION '% must have lower bound 1 (elements are read by position), got lower bound %',
            p_name, array_lower(p_value, 1) USING ERRCODE = '22023';
    END IF;
    IF cardinality(p_value) <> p_length THEN
        RAISE EXCEPTION '% must be as long as % (%), got % elements',
            p_name, p_length_of, p_length, cardinality(p_value) USING ERRCODE = '22023';
    END IF;
    RETURN cardinality(p_value);
END
$$;

CREATE FUNCTION fairq.require_weight(p_value integer, p_name text) RETURNS integer
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_value IS NULL THEN
        RAISE EXCEPTION '% must not be NULL', p_name USING ERRCODE = '22004';
    END IF;
    IF p_value NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION '% must be between 1 and 1000, got %', p_name, p_value USING ERRCODE = '22023';
    END IF;
    RETURN p_value;
END
$$;

-- The end of a pause: later than now ('infinity': until resumed).
CREATE FUNCTION fairq.require_future(p_value timestamptz, p_now timestamptz, p_name text) RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_value IS NULL THEN
        RAISE EXCEPTION '% must not be NULL', p_name USING ERRCODE = '22004';
    END IF;
    IF p_value <= p_now THEN
        RAISE EXCEPTION '% must be in the future, got % (now is %)', p_name, p_value, p_now
            USING ERRCODE = '22023';
    END IF;
    RETURN p_value;
END
$$;

-- Every call that creates, hands out, settles or changes the eligibility of messages
-- reads in snapshots taken after the locks it holds: a channel's row after its
-- producer lock (the collector may have removed it), whether a channel has anything
-- pending after its settle lock (a producer may have committed), an eligible channel
-- after a wait. Under REPEATABLE READ or SERIALIZABLE every statement of the
-- transaction reads in its first snapshot, and those reads could be stale: a message
-- was created on a channel the collector had removed, and never handed out. So these
-- calls refuse them (0A000), before anything is changed. (The test is a SQL function
-- inlined into the statement that calls it: every dequeue, create and completion asks,
-- and only a refusal calls plpgsql.)
CREATE FUNCTION fairq.refuse_isolation(p_call text) RETURNS boolean
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RAISE EXCEPTION '% needs READ COMMITTED isolation, and this transaction is %', p_call,
                    upper(current_setting('transaction_isolation'))
        USING ERRCODE = '0A000',
              HINT = 'Call it in a READ COMMITTED transaction, PostgreSQL''s default'
                     ' (see default_transaction_isolation).';
END
$$;

CREATE FUNCTION fairq.require_read_committed(p_call text) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT CASE WHEN current_setting('transaction_isolation') <> 'read committed'
                THEN fairq.refuse_isolation(p_call) ELSE true END
$$;

-- A setting that holds a duration (fairq.idle_channel_ttl, fairq.dequeue_busy_wait):
-- unset or empty means p_default. Anything else must read as an interval from 0 to
-- 1,000 years (far enough to mean "never", near enough that now minus it is still a
-- timestamp); a bad value fails the call that reads it with 22023 naming the
-- setting, not with an error from deep inside the dequeue.
-- (Read where rarely needed: the block that catches the cast costs a subtransaction.)
CREATE FUNCTION fairq.setting_duration(p_setting text, p_default interval) RETURNS interval
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    v_text text := nullif(current_setting(p_setting, true), '');
    v_value interval;
BEGIN
    IF v_text IS NULL THEN
        RETURN p_default;
    END IF;
    BEGIN
        v_value := v_text::interval;
    EXCEPTION WHEN data_exception THEN
        v_value := NULL;
    END;
    IF v_value IS NULL OR v_value < interval '0' OR v_value > interval '1000 years' THEN
        RAISE EXCEPTION 'setting % must be an interval from 0 to 1000 years, got %', p_setting, quote_literal(v_text)
            USING ERRCODE = '22023';
    END IF;
    RETURN v_value;
END
$$;

-- A setting that holds a boolean (fairq.history), read as PostgreSQL reads its own:
-- on/off, true/false, yes/no, 1/0 in any case, or a unique prefix of one; unset or
-- empty means off. Anything else fails the call that reads it with 22023 naming the
-- setting: 'enabled' must not quietly mean off. (The usual spellings are decided
-- here, in a SQL function inlined into its callers; only others pay for the cast
-- in fairq.setting_boolean's subtransaction.)
CREATE FUNCTION fairq.setting_boolean(p_setting text) RETURNS boolean
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    v_text text := current_setting(p_setting, true);
BEGIN
    BEGIN
        RETURN v_text::boolean;
    EXCEPTION WHEN invalid_text_representation THEN
        RAISE EXCEPTION 'setting % must be a boolean (on or off), got %', p_setting, quote_literal(v_text)
            USING ERRCODE = '22023';
    END;
END
$$;

CREATE FUNCTION fairq.setting_on(p_setting text) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT CASE lower(coalesce(current_setting(p_setting, true), ''))
               WHEN '' THEN false WHEN 'off' THEN false WHEN 'false' THEN false WHEN '0' THEN false
               WHEN 'on' THEN true WHEN 'true' THEN true WHEN '1' THEN true
               ELSE fairq.setting_boolean(p_setting)
           END
$$;

-- The setting fairq.events (events.sql says what each value sends): doorbell (also
-- when unset or empty), wake, all or off, in any case; a boolean spelling is taken
-- as wake (on) or off. Anything else fails the call that reads it with 22023 naming
-- the setting: a mistyped value must not quietly change which events are sent.
CREATE FUNCTION fairq.events_setting_spelled() RETURNS text
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    v_text text := current_setting('fairq.events', true);
BEGIN
    BEGIN
        RETURN CASE WHEN v_text::boolean THEN 'wake' ELSE 'off' END;
    EXCEPTION WHEN invalid_text_representation THEN
        RAISE EXCEPTION 'setting fairq.events must be doorbell, wake, all or off, got %', quote_literal(v_text)
            USING ERRCODE = '22023';
    END;
END
$$;

CREATE FUNCTION fairq.events_setting() RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT CASE lower(coalesce(current_setting('fairq.events', true), ''))
               WHEN '' THEN 'doorbell' WHEN 'doorbell' THEN 'doorbell' WHEN 'wake' THEN 'wake'
               WHEN 'all' THEN 'all' WHEN 'off' THEN 'off' WHEN 'on' THEN 'wake'
               ELSE fairq.events_setting_spelled()
           END
$$;

-- ==== sql/locks.sql ====

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

-- ==== sql/queues.sql ====

-- queues.sql — named queues: independent sets of channels, each with its own
-- round-robin, served by its own workers.
--
-- Invariants:
--   * a queue exists from the first call that names it (a producer, a policy or a
--     pause); a call that only reads or undoes (dequeue, resume, clear, purge), or
--     creates no message (an empty batch), never creates one: for an unknown queue
--     there is nothing to do;
--   * a queue's name follows the channel-name rules (fairq.require_channel_name);
--   * a paused queue hands nothing out until the pause ends; creates, settlements,
--     heartbeats and the recovery of expired locks go on (the dequeue checks the
--     pause after recovering, and again after each wait for a busy channel), so a
--     pause never loses or strands a message. A dequeue already past its check hands
--     out what it picks in that statement: a pause does not wait for dequeues.

-- The queue named p_queue (validated as argument p_name), or a row of NULLs.
CREATE FUNCTION fairq.queue_lookup(p_queue text, p_name text) RETURNS fairq.queue
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    v_queue fairq.queue;
BEGIN
    SELECT * INTO v_queue FROM fairq.queue q WHERE q.name = fairq.require_channel_name(p_queue, p_name);
    RETURN v_queue;
END
$$;

-- Whether queue p_queue_id is paused at p_now: for a dequeue that read the pause once
-- and then waited (fairq.wait_for_release), during which a pause may have committed.
CREATE FUNCTION fairq.queue_paused(p_queue_id integer, p_now timestamptz) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT coalesce((SELECT q.paused_until > p_now FROM fairq.queue q WHERE q.id = p_queue_id), false)
$$;

-- The id of queue p_queue, created on first use. Every producer call asks, so a known
-- name is one lookup: it needs no check (only valid names are stored); an unknown one
-- is checked (as argument p_name) before it is created.
CREATE FUNCTION fairq.queue_for_producer(p_queue text, p_name text) RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    v_id integer;
BEGIN
    SELECT q.id INTO v_id FROM fairq.queue q WHERE q.name = p_queue;
    IF NOT FOUND THEN
        PERFORM fairq.require_channel_name(p_queue, p_name);
        INSERT INTO fairq.queue (name) VALUES (p_queue) ON CONFLICT (name) DO NOTHING;
        SELECT q.id INTO v_id FROM fairq.queue q WHERE q.name = p_queue;
    END IF;
    RETURN v_id;
END
$$;

CREATE FUNCTION fairq.queue_pause(p_queue text, p_until timestamptz DEFAULT 'infinity') RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_queue_id integer;
BEGIN
    PERFORM fairq.require_future(p_until, fairq.clock(), 'p_until');
    -- (Created, if new, before the UPDATE's snapshot is taken.)
    v_queue_id := fairq.queue_for_producer(p_queue, 'p_queue');
    UPDATE fairq.queue SET paused_until = p_until WHERE id = v_queue_id;
END
$$;

CREATE FUNCTION fairq.queue_resume(p_queue text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_was_paused boolean;
BEGIN
    UPDATE fairq.queue q SET paused_until = NULL
      FROM (SELECT q.id, q.paused_until FROM fairq.queue q
             WHERE q.name = fairq.require_channel_name(p_queue, 'p_queue') FOR UPDATE) old
     WHERE q.id = old.id AND old.paused_until IS NOT NULL
    RETURNING old.paused_until > fairq.clock() INTO v_was_paused;
    -- Sleeping workers had no time to wake at while it was paused until resumed.
    IF v_was_paused AND fairq.events_wanted(true) THEN
        IF fairq.worker_may_sleep(p_queue) THEN
            PERFORM fairq.notify_event('policy', q.id, NULL, NULL, NULL)
               FROM fairq.queue q WHERE q.name = p_queue;
        END IF;
    END IF;
    RETURN coalesce(v_was_paused, false);
END
$$;

COMMENT ON FUNCTION fairq.queue_pause(text, timestamptz) IS
    'Hands out no message of the queue before p_until (default: until resumed); everything else goes on.';
COMMENT ON FUNCTION fairq.queue_resume(text) IS
    'Ends a queue''s pause (true if it was paused).';

-- ==== sql/events.sql ====

-- events.sql — what fairq tells the outside world: NOTIFY events and history.
--
-- Invariants:
--   * events are hints sent from inside the caller's transaction, so listeners hear
--     of a message only once it is committed; by default only calls that make work
--     available send one (see fairq.events_wanted): creates, defers, dead-letter
--     retries, completions that free a full channel's slot, and resumes and policies
--     that bring a turn earlier (event 'policy'), and only while a worker of the
--     queue sleeps (the doorbell, below); payloads stay small, and
--     `SET fairq.events = off` silences them;
--   * the doorbell (fairq.events = doorbell, the default) loses no wake: a worker
--     about to sleep holds its queue's doorbell (shared, on its own session:
--     fairq.doorbell_hold), then asks whether a call is between making work
--     available and committing (fairq.doorbell_quiet tries the producing lock
--     exclusively), and only after a quiet answer looks for work one last time and
--     sleeps. A call that made work available takes the producing lock shared, held
--     until it commits, then tries the doorbell exclusively and sends its event only
--     when that fails (fairq.worker_may_sleep; it also sends it when the producing lock
--     is refused, which only a worker holding the doorbell does, for an instant). So
--     either it tried after the worker took the doorbell, and its event wakes the
--     worker, or it tried before and held the producing lock since, so the worker's
--     quiet answer came after its commit and the last look sees its work. Both locks
--     are only ever tried: nobody waits for them;
--   * with `fairq.history = on`, every message that leaves the queue (completed,
--     dead, cancelled) leaves exactly one row in fairq.message_history;
--   * a dead letter keeps everything needed to put the message back.

-- Whether a call should send its event. fairq.events (read by fairq.events_setting)
-- = 'doorbell' (the default) and 'wake' ('on' too) send only the events that may
-- wake a sleeping worker: the call made work available that was not (p_wakes); with
-- 'doorbell' the caller then also asks fairq.worker_may_sleep. 'all' sends every event, 'off' none. Every NOTIFY holds
-- a database-wide lock from commit until its WAL is flushed, so events that wake
-- nobody are what serialises a busy queue's commits.
CREATE FUNCTION fairq.events_wanted(p_wakes boolean) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT CASE fairq.events_setting() WHEN 'all' THEN true WHEN 'off' THEN false ELSE p_wakes END
$$;

-- How many events a call sends for each queue it touched, at most (NULL: one for
-- each channel it woke, or touched with 'all'). With fairq.events = 'doorbell' the
-- events are for the package's sleeping workers alone, and one wakes every worker of
-- the queue (each listener hears it), who then find all the call made available: a
-- batch that woke 4,000 channels sent 4,000 until 0.7.37. The event kept is the
-- one due first, so a worker that sleeps until an event's dequeue_at wakes in time.
CREATE FUNCTION fairq.events_per_queue() RETURNS integer
LANGUAGE sql STABLE
AS $$
    SELECT CASE fairq.events_setting() WHEN 'doorbell' THEN 1 END
$$;

-- For a call about to send wake events of queue p_queue (fairq.events_wanted said
-- yes): whether a worker of the queue may be asleep. With fairq.events = 'doorbell'
-- (or unset) that is whether a worker holds the queue's doorbell; the producing lock
-- taken first is held until commit (see this file's header), and is refused only
-- while a worker that holds the doorbell asks whether it is quiet: then that worker
-- listens, and the event is for it. Other settings: true. (The doorbell is tried at
-- session level and let go at once, fairq.lock_free: held to commit, it would make
-- concurrent producers take each other for sleeping workers. SQL, inlined: every
-- create that wakes a channel asks.)
CREATE FUNCTION fairq.worker_may_sleep(p_queue text) RETURNS boolean
LANGUAGE sql
AS $$
    SELECT CASE WHEN fairq.events_setting() <> 'doorbell' THEN true
                WHEN NOT pg_try_advisory_xact_lock_shared(fairq.producing_lock_class(),
                                                          fairq.queue_lock_key(p_queue)) THEN true
                ELSE NOT fairq.lock_free(fairq.doorbell_lock_class(), fairq.queue_lock_key(p_queue)) END
$$;

-- fairq.worker_may_sleep for a caller that knows the queue by its id.
CREATE FUNCTION fairq.worker_sleeps(p_queue_id integer) RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    v_queue text := (SELECT q.name FROM fairq.queue q WHERE q.id = p_queue_id);
BEGIN
    RETURN fairq.worker_may_sleep(v_queue);
END
$$;

-- For a worker of queue p_queue about to sleep, holding the doorbell
-- (fairq.doorbell_hold): quiet is true when no call is between making work available
-- and committing, so one more dequeue sees everything no event will announce; when
-- false, ask again shortly. next_turn_at: the earliest time a channel of the queue
-- waits for (a scheduled message, a rate limit, a pause's end) or a lock expires (a
-- dequeue then recovers the message: until 0.7.36 a worker slept through it, up to
-- its poll interval), which may come with no event at all: the worker sleeps no
-- longer than that.
CREATE FUNCTION fairq.doorbell_quiet(p_queue text DEFAULT 'default')
RETURNS TABLE(quiet boolean, next_turn_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_key integer := fairq.queue_lock_key(fairq.require_channel_name(p_queue, 'p_queue'));
BEGIN
    -- (Held to the end of the caller's transaction, so a cancel cannot leave it
    -- behind; producers only try it, and while it is held they send their events.)
    quiet := pg_try_advisory_xact_lock(fairq.producing_lock_class(), v_key);
    -- (A new snapshot: after the producing lock was tried.) Nothing is served before
    -- the queue's pause ends; a pause until resumed ('infinity') sets no time.
    SELECT nullif(GREATEST(LEAST((SELECT min(c.turn_at) FROM fairq.channel c
                                   WHERE c.queue_id = q.id AND c.turn_at > fairq.in_rotation()),
                                 (SELECT min(GREATEST(w.due_at, w.woken_at)) FROM fairq.channel_wake w
                                   WHERE w.queue_id = q.id),
                                 (SELECT m.locked_until FROM fairq.message m
                                   WHERE m.queue_id = q.id AND m.locked_until IS NOT NULL
                                   ORDER BY m.locked_until LIMIT 1)),
                           q.paused_until), 'infinity')
      INTO next_turn_at
      FROM fairq.queue q WHERE q.name = p_queue;
    RETURN NEXT;
END
$$;

-- A worker of queue p_queue about to sleep holds the queue's doorbell on its session,
-- so that calls making work available send their events, and asks
-- fairq.doorbell_quiet. It only tries, never waits: held is false while a producer
-- has the doorbell for the instant of its own try (then quiet is false too: ask
-- again shortly). Hold it once per sleep; fairq.doorbell_release lets go.
CREATE FUNCTION fairq.doorbell_hold(p_queue text DEFAULT 'default')
RETURNS TABLE(held boolean, quiet boolean, next_turn_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    held := pg_try_advisory_lock_shared(fairq.doorbell_lock_class(),
                                        fairq.queue_lock_key(fairq.require_channel_name(p_queue, 'p_queue')));
    SELECT d.quiet AND held, d.next_turn_at INTO quiet, next_turn_at FROM fairq.doorbell_quiet(p_queue) AS d;
    RETURN NEXT;
END
$$;

-- The worker is busy again: calls stop sending it events. False (and PostgreSQL's
-- warning) if it held nothing.
CREATE FUNCTION fairq.doorbell_release(p_queue text DEFAULT 'default') RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN pg_advisory_unlock_shared(fairq.doorbell_lock_class(),
                                     fairq.queue_lock_key(fairq.require_channel_name(p_queue, 'p_queue')));
END
$$;

-- Sends one event; callers ask fairq.events_wanted (and fairq.worker_may_sleep) first. Workers filter by queue.
CREATE FUNCTION fairq.notify_event(p_event text, p_queue_id integer, p_channel text, p_id bigint,
                                   p_dequeue_at timestamptz)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM pg_notify('fairq', json_build_object(
        'event', p_event, 'queue', (SELECT q.name FROM fairq.queue q WHERE q.id = p_queue_id),
        'channel', p_channel, 'id', p_id, 'dequeue_at', p_dequeue_at)::text);
END
$$;

CREATE FUNCTION fairq.history_insert(p_message fairq.message, p_channel text, p_outcome text,
                                     p_now timestamptz)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    INSERT INTO fairq.message_history
        (id, channel, priority, created_at, first_dequeued_at, settled_at, num_attempts, outcome, queue)
    VALUES (p_message.id, p_channel, p_message.priority, p_message.created_at,
            p_message.first_dequeued_at, p_now, p_message.num_attempts, p_outcome,
            (SELECT q.name FROM fairq.queue q WHERE q.id = p_message.queue_id));
END
$$;

-- Records a settled message in fairq.message_history while the setting fairq.history
-- is on. (SQL, inlined into its callers: with history off, the common case, a
-- settlement asks the setting and calls nothing.) True, for an assignment
-- (validate.sql).
CREATE FUNCTION fairq.record_history(p_message fairq.message, p_channel text, p_outcome text,
                                     p_now timestamptz)
RETURNS boolean
LANGUAGE sql
AS $$
    SELECT CASE WHEN fairq.setting_on('fairq.history')
                THEN fairq.history_insert(p_message, p_channel, p_outcome, p_now) IS NOT NULL
                ELSE true END
$$;

-- Moves a message its caller has already deleted (under the channel lock) to the
-- dead letters.
CREATE FUNCTION fairq.bury(p_message fairq.message, p_channel fairq.channel, p_error text,
                           p_now timestamptz)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    INSERT INTO fairq.dead_letter
        (id, channel, priority, content, state, num_attempts, error, created_at, died_at, queue)
    VALUES (p_message.id, p_channel.name, p_message.priority, p_message.content, p_message.state,
            p_message.num_attempts, p_error, p_message.created_at, p_now,
            (SELECT q.name FROM fairq.queue q WHERE q.id = p_channel.queue_id));
    PERFORM fairq.record_history(p_message, p_channel.name, 'dead', p_now);
    PERFORM fairq.channel_resize(p_channel, -1, false);
END
$$;

COMMENT ON FUNCTION fairq.doorbell_hold(text) IS
    'For a worker of queue p_queue about to sleep: holds the queue''s doorbell on this session (held), so that calls making work available send their events, and says whether no such call is mid-transaction (quiet: then dequeue once more before sleeping) and when the earliest waiting channel may be served (next_turn_at).';
COMMENT ON FUNCTION fairq.doorbell_quiet(text) IS
    'For a worker holding the doorbell of queue p_queue whose last answer was not quiet: asks again (quiet, next_turn_at).';
COMMENT ON FUNCTION fairq.doorbell_release(text) IS
    'For a worker that is busy again: lets go of the doorbell of queue p_queue taken by fairq.doorbell_hold.';

-- ==== sql/turns.sql ====

-- turns.sql — when a channel may be served, and in what order: the round-robin.
--
-- *When* and *in what order* are kept apart. A channel's turn_at says when:
--   * NULL: it cannot be served (nothing pending, or at max_concurrency);
--   * a time: it may be served from then on (its earliest pending message is due,
--     its release interval has passed since its last release, its pause is over):
--     it waits to join the rotation;
--   * '-infinity' (fairq.in_rotation()): it is in its queue's rotation now, and
--     turn_pass (then turn_seq) says where.
-- Invariants:
--   * order is a pass, never a clock: serving a channel moves it on by its stride,
--     1,000,000 / weight (fairq.turn_stride), so between two turns of a channel of
--     weight 1 every other backlogged channel of its queue takes w turns, spread out
--     (stride scheduling); with weight 1 everywhere that is strict round-robin;
--   * a channel joins the rotation where it would have been had it joined the
--     moment its wait ended (at turn_at): behind every channel whose place was given
--     before that moment, ahead of every channel given its place after it
--     (turn_given_at: when it was served or joined). So it does not matter which
--     dequeue lets it join, or how late; with weight 1 everywhere the rotation is
--     exactly "earliest turn first", as if every turn were a time. turn_seq, taken
--     when a channel joins or moves, keeps the order among equal passes;
--   * only a dequeue puts a channel into the rotation (fairq.join_rotation, at its
--     start, earliest time first, no more than it may serve): every other call that
--     makes a channel servable gives it a time, so no call but the dequeue reads
--     the rotation. One that would be first there and is served at once is written
--     by the serve alone, with the place it joins at;
--   * a channel stays in the rotation, moved on by its stride, while it is served
--     and still servable at once; anything that makes it wait (rate limit, a future
--     message, a pause, a full channel) takes it out, and it joins again at the
--     back once the wait is over;
--   * except a full one (since 0.7.37): a channel served from the rotation that
--     reaches its max_concurrency with work due keeps its pass, moved on by its
--     stride, while turn_at is NULL (a kept place: turn_pass without turn_at), and
--     keeps it when a freed slot makes it servable at once (turn_at a time, at most
--     now, with turn_pass). It then joins at fairq.kept_join_pass: its kept pass,
--     but no more than one round of its weight behind the front (a channel full
--     for an hour does not burst ahead) and never behind the back (where any other
--     wait joins). Its weight so holds when its cap is reached between dequeues (a
--     weight-5 channel with max_concurrency 1 whose worker completes before it
--     dequeues again takes 5 turns in 6, not 1 in 2). Anything else that makes it
--     wait (a slot freed but a rate limit, pause or future message left, a new
--     policy or pause, nothing due) drops the kept pass: it joins at the back;
--   * keep-turn rule (fairq.channel_store with p_keep_turn, wakes, completions): a
--     change that makes a channel *more* eligible never moves it later: a channel in
--     the rotation keeps its place, a waiting one keeps the earlier time. turn_seq
--     and turn_pass change only when turn_at does (fairq.kept_turn_seq,
--     fairq.kept_place), but for a kept place (fairq.kept_pass).

-- The turn_at of a channel in its queue's rotation.
CREATE FUNCTION fairq.in_rotation() RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT '-infinity'::timestamptz $$;

-- How far one turn moves a channel of weight p_weight on (1..1000): 1,000,000 / weight.
CREATE FUNCTION fairq.turn_stride(p_weight integer) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1000000 / p_weight $$;

-- When a channel may next be served (NULL: it cannot be). With p_turn_at set, an
-- earlier turn (or the rotation) is kept: a new message never delays a channel that
-- already waits for its turn. STABLE, not IMMUTABLE, because timestamptz + interval
-- is: a SQL function is inlined into the statements that call it only when it claims
-- no more than its body does.
CREATE FUNCTION fairq.next_turn(
    p_turn_at timestamptz, p_due_at timestamptz, p_last_release_at timestamptz,
    p_release_interval_ms bigint, p_in_flight integer, p_max_concurrency integer,
    p_paused_until timestamptz, p_now timestamptz
) RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN p_due_at IS NULL THEN NULL
        WHEN p_max_concurrency IS NOT NULL AND p_in_flight >= p_max_concurrency THEN NULL
        ELSE LEAST(p_turn_at,
                   GREATEST(p_due_at, p_now, p_paused_until,
                            p_last_release_at + fairq.ms(p_release_interval_ms)))
    END
$$;

-- The keep-turn rule: a channel whose turn_at did not move keeps its turn_seq and
-- pass; one whose turn moved takes p_new_seq, and (waiting, not in the rotation) no
-- pass.
CREATE FUNCTION fairq.kept_turn_seq(p_old_turn_at timestamptz, p_new_turn_at timestamptz,
                                    p_old_seq bigint, p_new_seq bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN p_new_turn_at IS NULL THEN NULL
                WHEN p_new_turn_at = p_old_turn_at THEN p_old_seq
                ELSE p_new_seq END
$$;

CREATE FUNCTION fairq.kept_place(p_old_turn_at timestamptz, p_new_turn_at timestamptz,
                                 p_old_value anyelement) RETURNS anyelement
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT CASE WHEN p_new_turn_at = p_old_turn_at THEN p_old_value END $$;

-- The keep-turn rule for turn_pass: kept while turn_at does not move (in the
-- rotation), and a full channel's kept place (turn_pass without turn_at) is kept
-- while it stays full (turn_at still NULL) and when a freed slot makes it servable
-- by p_now (a turn at most p_now: the channel waited only for the slot). Else none.
-- (p_now NULL: the slot is not what changed.)
CREATE FUNCTION fairq.kept_pass(p_old_turn_at timestamptz, p_new_turn_at timestamptz,
                                p_old_pass bigint, p_now timestamptz) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN p_new_turn_at IS NOT DISTINCT FROM p_old_turn_at
                     OR (p_old_turn_at IS NULL AND p_new_turn_at <= p_now)
                THEN p_old_pass END
$$;

-- The pass at which a channel joins the rotation whose front and back passes are
-- p_front and p_back (NULL: empty) with its kept place p_kept (turns.sql): that
-- pass, but at most one round of its weight behind the front and never behind the
-- back (one past the highest pass, as any other channel joining at the back).
CREATE FUNCTION fairq.kept_join_pass(p_kept bigint, p_front bigint, p_back bigint, p_weight integer)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT LEAST(GREATEST(p_kept, p_front - 1000000 + fairq.turn_stride(p_weight)), p_back + 1)
$$;

-- A served channel's next turn: it stays in the rotation, moved on by its stride,
-- when it was there and may be served again at once (p_next_turn, from next_turn
-- without p_turn_at, is now); else it waits for p_next_turn.
CREATE FUNCTION fairq.served_turn_at(p_turn_at timestamptz, p_next_turn timestamptz,
                                     p_now timestamptz) RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN p_turn_at = fairq.in_rotation() AND p_next_turn <= p_now
                THEN fairq.in_rotation() ELSE p_next_turn END
$$;

-- Its pass: moved on by its stride while it stays in the rotation, and kept so as
-- its kept place when it was served from the rotation (p_turn_at) and is now full
-- (p_served_turn_at NULL) with work due by p_now (p_due_at).
CREATE FUNCTION fairq.served_pass(p_turn_at timestamptz, p_served_turn_at timestamptz,
                                  p_due_at timestamptz, p_now timestamptz,
                                  p_turn_pass bigint, p_weight integer) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN p_served_turn_at = fairq.in_rotation()
                     OR (p_turn_at = fairq.in_rotation() AND p_served_turn_at IS NULL
                         AND p_due_at <= p_now)
                THEN p_turn_pass + fairq.turn_stride(p_weight) END
$$;

-- Since when a channel with pending work due at p_due_at has been idle: NULL while it
-- has pending work, else the earlier idle time, or now.
CREATE FUNCTION fairq.idle_since(p_due_at timestamptz, p_idle_since timestamptz, p_now timestamptz)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT CASE WHEN p_due_at IS NULL THEN coalesce(p_idle_since, p_now) END $$;

-- Writes back a channel row its caller has locked and changed. p_keep_turn keeps an
-- earlier turn (create, defer, settle); without it the turn is recomputed from
-- scratch (a new policy or pause, or the channel was found to have nothing due): it
-- then waits, and joins the rotation at the back. A new turn takes p_turn_seq, or
-- the next value of fairq.turn_seq.
CREATE FUNCTION fairq.channel_store(p_channel fairq.channel, p_now timestamptz, p_keep_turn boolean,
                                    p_turn_seq bigint DEFAULT NULL)
RETURNS fairq.channel
LANGUAGE plpgsql
AS $$
DECLARE
    v_turn_at timestamptz := fairq.next_turn(
        CASE WHEN p_keep_turn THEN p_channel.turn_at END, p_channel.due_at,
        p_channel.last_release_at, p_channel.release_interval_ms,
        p_channel.in_flight, p_channel.max_concurrency, p_channel.paused_until, p_now);
BEGIN
    -- (The keep-turn rule of fairq.kept_turn_seq, without taking a value for nothing.)
    IF v_turn_at IS NULL OR NOT p_keep_turn OR v_turn_at IS DISTINCT FROM p_channel.turn_at THEN
        -- A new turn is a time: the channel waits to join; at the back, unless it
        -- keeps its place (fairq.kept_pass: full, or freed and servable now).
        p_channel.turn_pass := CASE WHEN p_keep_turn
                                    THEN fairq.kept_pass(p_channel.turn_at, v_turn_at,
                                                         p_channel.turn_pass, p_now) END;
        p_channel.turn_given_at := NULL;
        p_channel.turn_seq := CASE WHEN v_turn_at IS NOT NULL
                                   THEN coalesce(p_turn_seq, nextval('fairq.turn_seq')) END;
    END IF;
    p_channel.turn_at := v_turn_at;
    UPDATE fairq.channel
       SET in_flight = p_channel.in_flight,
           last_release_at = p_channel.last_release_at,
           due_at = p_channel.due_at,
           turn_at = p_channel.turn_at,
           turn_pass = p_channel.turn_pass,
           turn_given_at = p_channel.turn_given_at,
           turn_seq = p_channel.turn_seq,
           idle_since = fairq.idle_since(p_channel.due_at, p_channel.idle_since, p_now)
     WHERE id = p_channel.id;
    RETURN p_channel;
END
$$;

-- Where a channel joins the rotation of queue p_queue_id (fairq.channels_join, and
-- fairq.join_rotation for one channel): just ahead of the first
-- channel given its place after its turn (rotation_after: when that place was given,
-- and its pass), or else behind the last (rotation_back: the highest pass); whether
-- that is ahead of every channel there (rotation_front: the lowest pass). Table
-- functions of one row, inlined into the statements that read them.
CREATE FUNCTION fairq.rotation_after(p_queue_id integer, p_turn_at timestamptz)
RETURNS TABLE(turn_given_at timestamptz, turn_pass bigint)
LANGUAGE sql STABLE
AS $$
    SELECT r.turn_given_at, r.turn_pass FROM fairq.channel r
     WHERE r.queue_id = p_queue_id AND r.turn_at = fairq.in_rotation() AND r.turn_given_at > p_turn_at
     ORDER BY r.turn_given_at, r.turn_pass LIMIT 1
$$;

-- The front and the back are the ends of the rotation's range of channel_turn_ix,
-- read by one lookup each. (turn_at <= '-infinity' is turn_at = '-infinity', but
-- does not let channel_turn_given_ix, whose rows are those of the rotation, serve
-- them: planned while statistics said the rotation was short, as a session that
-- starts on a prefilled queue plans it, 0.7.24 read and sorted the whole rotation
-- through that index at each lookup.)
CREATE FUNCTION fairq.rotation_back(p_queue_id integer) RETURNS TABLE(turn_pass bigint)
LANGUAGE sql STABLE
AS $$
    SELECT r.turn_pass FROM fairq.channel r
     WHERE r.queue_id = p_queue_id AND r.turn_at <= fairq.in_rotation()
     ORDER BY r.turn_at DESC, r.turn_pass DESC LIMIT 1
$$;

CREATE FUNCTION fairq.rotation_front(p_queue_id integer) RETURNS TABLE(turn_pass bigint)
LANGUAGE sql STABLE
AS $$
    SELECT r.turn_pass FROM fairq.channel r
     WHERE r.queue_id = p_queue_id AND r.turn_at <= fairq.in_rotation()
     ORDER BY r.turn_at, r.turn_pass LIMIT 1
$$;

-- A channel's turn as its queued wakes leave it (fairq.folded_wakes, in channels.sql),
-- not yet written.
CREATE TYPE fairq.folded_turn AS (id bigint, woken boolean, due_at timestamptz, turn_at timestamptz,
                                  turn_seq bigint, turn_pass bigint, turn_given_at timestamptz);

-- For a dequeue of queue p_queue_id, before it picks: the channels whose wait is over
-- (turn_at <= p_now, or made so by the wakes producers queued: fairq.woken_to_take),
-- earliest first and at most p_limit, join the rotation (fairq.channels_join). Taking
-- the earliest first makes their places exact for whoever picks next: a channel left
-- waiting belongs behind every channel joined now. Rows other calls hold are skipped
-- (their holders will give them their turns). The caller then holds these rows, and
-- no channel waiting to join that it does not let join. took: it took any.
-- The woken channels' wakes are folded here (fairq.folded_wakes) and written by the
-- join. When one channel joins, as in the sparse steady state, its place is found
-- here by the same rule and written by a plain update, not by channels_join's
-- statement for many. With p_serve_first (a dequeue of one message), that channel,
-- waiting or woken, when it would be first in the rotation (ahead of every channel
-- there, held or not, or alone) is not written at all: first_id and first_pass say
-- which it is and the pass it joins at (and first_name and first_capped its name and
-- whether it has max_attempts), and the dequeue serves it from there, writing its
-- row once instead of twice (a woken one's wakes are spent by then). That is what
-- joining it and then picking would do: the pick takes the first of the rotation.
CREATE FUNCTION fairq.join_rotation(p_queue_id integer, p_now timestamptz, p_limit integer,
                                    p_serve_first boolean DEFAULT false,
                                    OUT took boolean, OUT first_id bigint, OUT first_pass bigint,
                                    OUT first_name text, OUT first_capped boolean)
LANGUAGE plpgsql
AS $$
DECLARE
    v_first_wake timestamptz;  -- the earliest due and woken time of the queue's wakes
    v_waiting bigint[];
    v_woken bigint[] := '{}';
    v_folded fairq.folded_turn[];  -- the woken channels as their wakes leave them
    v_joined bigint[];         -- waiting channels that the wakes let join
    v_wanted integer;          -- places left
    v_lone record;             -- the one channel joining, when it is one, and its place
BEGIN
    -- A woken channel's turn is never before its wake's due and woken time, so the
    -- channels waiting since before the earliest wake's join ahead of every woken one:
    -- those are locked at once (SKIP LOCKED: concurrent calls take different ones).
    -- The next waiting channels are compared with the woken ones and locked only if
    -- they come first (fairq.woken_to_take); any places still left go to the
    -- waiting channels after them (their places, by turn, are theirs however late
    -- they join).
    -- (One statement: the earliest wake, read once, and the channels before it.)
    SELECT f.wake_at,
           ARRAY(SELECT c.id FROM fairq.channel c
                  WHERE c.queue_id = p_queue_id
                    AND c.turn_at > fairq.in_rotation() AND c.turn_at <= p_now
                    AND c.turn_at < coalesce(f.wake_at, 'infinity')
                  ORDER BY c.turn_at, c.turn_pass, c.turn_seq
                  LIMIT p_limit
                    FOR NO KEY UPDATE SKIP LOCKED)
      INTO v_first_wake, v_waiting
      FROM (SELECT (SELECT GREATEST(w.due_at, w.woken_at) FROM fairq.channel_wake w
                     WHERE w.queue_id = p_queue_id
                     ORDER BY GREATEST(w.due_at, w.woken_at), w.turn_seq LIMIT 1) AS wake_at
            OFFSET 0) f;
    IF v_first_wake IS NOT NULL AND cardinality(v_waiting) < p_limit THEN
        SELECT w.taken, w.waiting, w.wanted INTO v_woken, v_joined, v_wanted
          FROM fairq.woken_to_take(p_queue_id, p_now, p_limit - cardinality(v_waiting),
                                   ARRAY(SELECT c.id FROM fairq.channel c
                                          WHERE c.queue_id = p_queue_id
                                            AND c.turn_at >= v_first_wake AND c.turn_at <= p_now
                                          ORDER BY c.turn_at, c.turn_pass, c.turn_seq
                                          LIMIT p_limit - cardinality(v_waiting))) AS w;
        v_waiting := v_waiting || v_joined;
        IF v_wanted > 0 THEN
            v_waiting := v_waiting || ARRAY(SELECT c.id FROM fairq.channel c
                                             WHERE c.queue_id = p_queue_id
                                               AND c.turn_at > fairq.in_rotation() AND c.turn_at <= p_now
                                               AND c.id <> ALL (v_waiting || v_woken)
                                             ORDER BY c.turn_at, c.turn_pass, c.turn_seq
                                             LIMIT v_wanted
                                               FOR NO KEY UPDATE SKIP LOCKED);
        END IF;
    END IF;
    took := cardinality(v_woken) > 0 OR cardinality(v_waiting) > 0;
    IF NOT took THEN
        RETURN;
    END IF;
    IF cardinality(v_woken) > 0 THEN
        v_folded := ARRAY(SELECT w FROM fairq.folded_wakes(v_woken) AS w);
    END IF;
    IF cardinality(v_woken) + cardinality(v_waiting) = 1 THEN
        -- One channel joins, as in the sparse steady state: its place is found here
        -- (channels_join's rule for one channel) and, unless it is served first, written
        -- in a plain update rather than channels_join's statement for many.
        -- A channel with a kept place (turns.sql) joins at fairq.kept_join_pass.
        SELECT j.id, j.turn_at, j.name, j.capped,
               CASE WHEN j.kept IS NOT NULL
                    THEN fairq.kept_join_pass(j.kept, j.front_pass, j.back_pass, j.weight)
                    ELSE coalesce(j.after_pass - 1, coalesce(j.back_pass, 0) + 1) END AS pass,
               -- First: ahead of a channel that is itself first (on an equal pass the
               -- channel already there goes first), or into an empty rotation. (So the
               -- front is looked up only when it can decide.)
               p_serve_first
               AND CASE WHEN j.kept IS NOT NULL
                        THEN j.front_pass IS NULL
                             OR fairq.kept_join_pass(j.kept, j.front_pass, j.back_pass, j.weight) < j.front_pass
                        WHEN j.after_pass IS NULL
                        THEN j.back_pass IS NULL
                        ELSE j.after_pass - 1 < (SELECT f.turn_pass
                                                   FROM fairq.rotation_front(p_queue_id) AS f) END AS first
          INTO v_lone
          FROM (SELECT c.id, t.turn_at, c.name, c.max_attempts IS NOT NULL AS capped, t.kept, c.weight,
                       a.turn_pass AS after_pass,
                       CASE WHEN a.turn_pass IS NULL  -- (read only when needed)
                            THEN (SELECT b.turn_pass FROM fairq.rotation_back(p_queue_id) AS b) END AS back_pass,
                       CASE WHEN t.kept IS NOT NULL
                            THEN (SELECT f.turn_pass FROM fairq.rotation_front(p_queue_id) AS f) END AS front_pass
                  FROM fairq.channel c
                 CROSS JOIN LATERAL (SELECT CASE WHEN cardinality(v_woken) = 0 THEN c.turn_at
                                                 ELSE (v_folded[1]).turn_at END AS turn_at,
                                            CASE WHEN cardinality(v_woken) = 0 THEN c.turn_pass
                                                 ELSE (v_folded[1]).turn_pass END AS kept) t
                  LEFT JOIN LATERAL (SELECT a.turn_pass FROM fairq.rotation_after(p_queue_id, t.turn_at) AS a
                                      WHERE t.kept IS NULL) a ON true
                 WHERE c.id = coalesce(v_woken[1], v_waiting[1])
                   AND t.turn_at > fairq.in_rotation() AND t.turn_at <= p_now  -- (a woken one may not be due)
                OFFSET 0) j;  -- (its place found once, not once for each use)
        IF v_lone.first THEN
            first_id := v_lone.id;
            first_pass := v_lone.pass;
            first_name := v_lone.name;
            first_capped := v_lone.capped;
            RETURN;
        ELSIF FOUND THEN
            UPDATE fairq.channel c
               SET due_at = CASE WHEN cardinality(v_woken) = 0 THEN c.due_at ELSE (v_folded[1]).due_at END,
                   idle_since = NULL,  -- (it has work)
                   turn_at = fairq.in_rotation(), turn_pass = v_lone.pass, turn_given_at = v_lone.turn_at,
                   turn_seq = nextval('fairq.turn_seq')
             WHERE c.id = v_lone.id;
            RETURN;
        END IF;
    END IF;
    PERFORM fairq.channels_join(v_woken, v_folded, v_waiting, p_queue_id, p_now, p_limit);
END
$$;

-- Writes, in one update per channel, what happens to channels whose rows the caller
-- holds (all of queue p_queue_id):
--   * the queued wakes of p_woken are applied: p_folded holds them as
--     fairq.folded_wakes left them (the caller folded them, spending the wakes);
--   * then, of p_woken and p_waiting, the first p_limit (earliest turn first) whose
--     wait is over by p_now join the rotation, each just ahead of the first channel
--     given its place after its wait ended (its pass less one), or else at the back
--     (one past the highest pass), whatever its weight: the weight counts from its
--     first turn on; one with a kept place (turns.sql) at fairq.kept_join_pass.
--     Those that join are given their places at their turn times.
-- A woken channel that joins is so written once, not once for its wakes and once
-- for its place.
CREATE FUNCTION fairq.channels_join(p_woken bigint[], p_folded fairq.folded_turn[], p_waiting bigint[],
                                    p_queue_id integer, p_now timestamptz, p_limit integer)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    -- (Each node of this statement's plan costs its start-up at every call, rows or
    -- not, so it has as few as placing needs.)
    WITH RECURSIVE ranked AS (  -- pos: the rank of each channel whose wait is over
        SELECT h.*,
               CASE WHEN h.waited
                    THEN row_number() OVER (PARTITION BY h.waited
                                            ORDER BY h.turn_at, h.turn_pass, h.turn_seq) END AS pos
          FROM (SELECT h.*, h.turn_at > fairq.in_rotation() AND h.turn_at <= p_now AS waited
                  FROM (SELECT c.id, false AS woken, c.due_at, c.turn_at, c.turn_seq,
                               c.turn_pass, c.turn_given_at
                          FROM fairq.channel c
                         WHERE c.id = ANY (p_waiting) AND NOT c.id = ANY (p_woken)
                        UNION ALL
                        SELECT f.* FROM unnest(p_folded) AS f) h) h
    ), joining AS MATERIALIZED (  -- (read once, not at each step of the recursion)
        -- The turns of those that join, by rank, and the latest place given.
        SELECT array_agg(r.turn_at ORDER BY r.pos) AS turn_ats,
               (SELECT max(g.turn_given_at) FROM fairq.channel g
                 WHERE g.queue_id = p_queue_id AND g.turn_at = fairq.in_rotation()) AS latest_given
          FROM ranked r WHERE r.pos <= p_limit
    ), after AS (
        -- By rank: the first place given after each one's turn (rotation_after), when
        -- some place was given later than that turn. Turns rise with rank, so a place
        -- found for one is the next one's too while its turn is earlier than that
        -- place was given; only then is it looked up again, from its own turn. (A
        -- lookup per channel walked the same entries each time: under load, those of
        -- the places served since, which only vacuum removes.) None found: none for
        -- those after it either, and the recursion ends.
        SELECT 0::bigint AS pos, '-infinity'::timestamptz AS given_at, NULL::bigint AS pass
        UNION ALL
        SELECT a.pos + 1, n.turn_given_at, n.turn_pass
          FROM after a
         CROSS JOIN joining j
         CROSS JOIN LATERAL (
               SELECT a.given_at, a.pass WHERE j.turn_ats[a.pos + 1] < a.given_at
               UNION ALL
               SELECT f.turn_given_at, f.turn_pass
                 FROM fairq.rotation_after(p_queue_id, j.turn_ats[a.pos + 1]) AS f
                WHERE j.turn_ats[a.pos + 1] >= a.given_at
                  AND j.turn_ats[a.pos + 1] < j.latest_given) n(turn_given_at, turn_pass)
         WHERE a.pos < cardinality(j.turn_ats)
    ), placed AS (
        SELECT p.*, count(*) FILTER (WHERE p.joins AND p.next_pass IS NULL AND p.turn_pass IS NULL)
                        OVER (ORDER BY p.pos) AS back_rank
          FROM (SELECT h.*, (h.pos <= p_limit) IS TRUE AS joins,
                       CASE WHEN h.pos <= p_limit THEN nextval('fairq.turn_seq') END AS joined_seq,
                       CASE WHEN h.pos <= p_limit THEN n.passes[h.pos] END AS next_pass
                  FROM (SELECT * FROM ranked ORDER BY pos OFFSET 0) h
                 CROSS JOIN (SELECT array_agg(a.pass ORDER BY a.pos) FILTER (WHERE a.pos > 0) AS passes
                               FROM after a) n) p
    )
    UPDATE fairq.channel c
       SET due_at = p.due_at,
           idle_since = CASE WHEN NOT p.woken THEN c.idle_since END,  -- a wake brings a due time
           turn_at = CASE WHEN p.joins THEN fairq.in_rotation() ELSE p.turn_at END,
           turn_pass = CASE WHEN NOT p.joins THEN p.turn_pass
                            WHEN p.turn_pass IS NOT NULL  -- a kept place
                            THEN fairq.kept_join_pass(
                                     p.turn_pass, (SELECT f.turn_pass FROM fairq.rotation_front(p_queue_id) AS f),
                                     (SELECT b.turn_pass FROM fairq.rotation_back(p_queue_id) AS b), c.weight)
                            -- (An empty rotation starts anywhere: passes are only
                            -- compared within it.)
                            ELSE coalesce(p.next_pass - 1,
                                          coalesce((SELECT b.turn_pass FROM fairq.rotation_back(p_queue_id) AS b), 0)
                                          + p.back_rank) END,
           turn_given_at = CASE WHEN p.joins THEN p.turn_at ELSE p.turn_given_at END,
           turn_seq = coalesce(p.joined_seq, p.turn_seq)
      FROM placed p
     WHERE c.id = ANY (p_woken || p_waiting) AND c.id = p.id
       AND (p.woken OR p.joins);
END
$$;

COMMENT ON FUNCTION fairq.in_rotation() IS
    'The turn_at of a channel in its queue''s rotation (''-infinity''); its place there is (turn_pass, turn_seq).';

-- ==== sql/channels.sql ====

-- channels.sql — channel policy, pauses and lifecycle (turns: turns.sql; locks:
-- locks.sql).
--
-- Invariants:
--   * producers never lock a channel row: they hold the channel's producer lock (a
--     transaction-level advisory lock on the queue and channel name, shared among
--     producers), which dequeues and settlements never wait for, and an idle
--     channel's wake is queued (fairq.channels_wake), so an open producer
--     transaction never hides or blocks its channel. Only a change that would make a
--     channel *less* eligible needs to know that no producer is mid-insert, and it
--     learns that by trying a lock exclusively, never by waiting: removal tries the
--     producer lock; going idle (or waiting for a later message) tries the settle
--     lock, which a producer only tries, shared, and when it finds it taken queues a
--     wake instead: so producers never wait for dequeues either (locks.sql). (Row
--     share locks would do the same job, but the MultiXacts they create make even
--     SKIP LOCKED wait, and deadlock, when it follows a row's update chain.)
--   * a channel with no policy and nothing in it stays, idle, until the collector
--     removes it (fairq.collect_idle_channels): a tenant that sends again soon finds
--     its row, and no settlement has to delete one;
--   * a paused channel keeps its messages, policy, locks and row (the collector
--     leaves it alone until the pause is over); its turn waits for the pause's end
--     and it then joins the rotation like any channel whose wait is over.

-- How many concurrency slots p_count messages take: none on a channel without
-- max_concurrency, which keeps in_flight at 0 (see tables.sql).
CREATE FUNCTION fairq.slots(p_max_concurrency integer, p_count integer) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT CASE WHEN p_max_concurrency IS NULL THEN 0 ELSE p_count END $$;

-- When a channel's earliest pending message becomes due, from the index heads. A
-- one-row SQL table function, so that `CROSS JOIN LATERAL fairq.pending_due_at(id)`
-- is inlined into the caller's plan (the dequeue updates many channels at once).
CREATE FUNCTION fairq.pending_due_at(p_channel_id bigint) RETURNS TABLE(due_at timestamptz)
LANGUAGE sql STABLE
AS $$
    SELECT coalesce(
        (SELECT m.dequeue_at FROM fairq.message m
          WHERE m.channel_id = p_channel_id AND m.status = 'ready'
          ORDER BY m.priority DESC, m.dequeue_at, m.id LIMIT 1),
        (SELECT m.dequeue_at FROM fairq.message m
          WHERE m.channel_id = p_channel_id AND m.status = 'scheduled'
          ORDER BY m.dequeue_at, m.id LIMIT 1))
$$;

-- (plpgsql, not SQL, below: a SQL function that cannot be inlined would be planned
-- again at every call; plpgsql keeps its plans for the session.)

-- When each of the locked channels p_channel_ids (named p_names, all of queue
-- p_queue_id) has its earliest pending message due, for a caller about to write them
-- back; p_due_ats: what the caller has just read (fairq.pending_due_at), in its
-- snapshot, after locking them. A channel due by p_now keeps that. Making a channel
-- less eligible (nothing due now, or nothing at all) first takes its settle lock (in
-- the channels' order) and then looks again, in a new snapshot: a producer holding
-- it (one that relies on the channel staying due) means "keep it due now", and one
-- that committed just before the lock is seen by the second look. In the same
-- snapshot those channels' queued wakes are dropped, as spent (the caller holds the
-- rows, as fairq.join_rotation would): a producer that found the settle lock taken
-- queued its wake anyway, and if it commits after that snapshot its wake is not
-- seen, so it stays queued with its message. One statement for all the channels
-- settled, none when none is: a dequeue of many sparse tenants settles most of the
-- channels it serves, and a statement each cost more than the rest of their writes.
CREATE FUNCTION fairq.settled_due_ats(p_channel_ids bigint[], p_names text[], p_due_ats timestamptz[],
                                      p_queue_id integer, p_now timestamptz)
RETURNS timestamptz[]
LANGUAGE plpgsql
AS $$
DECLARE
    v_due_ats timestamptz[] := p_due_ats;
    v_settling bigint[] := '{}';  -- the channels whose settle locks this call took,
    v_settling_at integer[] := '{}';  -- at these positions
    v_settled timestamptz[];
BEGIN
    FOR i IN 1 .. cardinality(p_channel_ids) LOOP
        CONTINUE WHEN p_due_ats[i] <= p_now;
        IF fairq.settle_lock_try(p_queue_id, p_names[i]) THEN
            v_settling := v_settling || p_channel_ids[i];
            v_settling_at := v_settling_at || i;
        ELSE
            v_due_ats[i] := p_now;
        END IF;
    END LOOP;
    IF cardinality(v_settling) > 0 THEN
        WITH spent AS (DELETE FROM fairq.channel_wake w WHERE w.channel_id = ANY (v_settling))
        SELECT ARRAY(SELECT (SELECT p.due_at FROM fairq.pending_due_at(s.id) AS p)
                       FROM unnest(v_settling) AS s(id))  -- (in order: a scan of one array)
          INTO v_settled;
        FOR i IN 1 .. cardinality(v_settling) LOOP
            v_due_ats[v_settling_at[i]] := v_settled[i];
        END LOOP;
    END IF;
    RETURN v_due_ats;
END
$$;

-- The collector: removes channels that have no policy and have held nothing (and
-- been unpaused) for at least the setting fairq.idle_channel_ttl (default 10 s; a
-- PostgreSQL interval), longest idle first, at most p_limit, whatever their queue.
-- Dequeues call it once a second (see fairq.message_dequeue), so the channel table
-- holds the tenants active lately, not every tenant ever seen. A channel is removed
-- only when, under its producer lock (taken by trying, never waiting) and in a
-- snapshot taken after that lock, it holds no message and no queued wake: a producer
-- that committed a message or a wake just before is seen, and one that comes later
-- waits for the lock and then creates the channel anew. Rows another transaction
-- holds are skipped. What it locks stays locked until the dequeue's transaction
-- ends, so it locks as little as it can of what it will keep: channels with a message
-- in flight (idle, with nothing pending) are left out before their rows are locked,
-- so their settlements never wait for it; and a channel whose producer lock is taken
-- but its queue's bulk producer lock is not lets go of the first (fairq.channel_quiet).
-- Returns how many it removed.
CREATE FUNCTION fairq.collect_idle_channels(p_now timestamptz, p_limit integer) RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    v_ttl interval := fairq.setting_duration('fairq.idle_channel_ttl', interval '10 s');
    v_quiet bigint[];
    v_in_flight bigint[];
    v_removed integer;
BEGIN
    v_quiet := ARRAY(
        SELECT c.id FROM (SELECT c.id, c.queue_id, c.name FROM fairq.channel c
                           WHERE GREATEST(c.idle_since, c.paused_until) <= p_now - v_ttl
                             AND c.idle_since IS NOT NULL AND NOT c.has_policy
                             -- (A scalar subquery, one lookup per channel: as NOT
                             -- EXISTS it was planned as an anti-join that read every
                             -- lock for each channel.)
                             AND (SELECT m.id FROM fairq.message m
                                   WHERE m.channel_id = c.id AND m.status = 'locked' LIMIT 1) IS NULL
                           ORDER BY GREATEST(c.idle_since, c.paused_until)
                           LIMIT p_limit
                             FOR NO KEY UPDATE SKIP LOCKED) c
         WHERE fairq.channel_quiet(c.queue_id, c.name));
    IF cardinality(v_quiet) = 0 THEN
        RETURN 0;
    END IF;
    -- The channels with a message in flight, in one statement (one index lookup per
    -- channel: see message_locked_channel_ix): a message may have been handed out
    -- between the look above and the row lock. No message of these channels can be
    -- locked after this: their rows are held here.
    v_in_flight := ARRAY(SELECT DISTINCT m.channel_id FROM fairq.message m
                          WHERE m.channel_id = ANY (v_quiet) AND m.status = 'locked');
    -- (Scalar subqueries by status: each is one lookup in a partial index, whatever
    -- the planner thinks of those indexes' sizes.)
    DELETE FROM fairq.channel c
     WHERE c.id = ANY (v_quiet) AND NOT c.id = ANY (v_in_flight)
       AND (SELECT p.due_at FROM fairq.pending_due_at(c.id) AS p) IS NULL
       AND (SELECT w.channel_id FROM fairq.channel_wake w WHERE w.channel_id = c.id LIMIT 1) IS NULL;
    GET DIAGNOSTICS v_removed = ROW_COUNT;
    RETURN v_removed;
END
$$;

-- The channel rows of queue p_queue_id for a producer, created with the default
-- policy on first use, under each channel's producer lock (shared, taken in name
-- order; and for a channel made here its creation lock) or, for a transaction gone
-- bulk, its queue's bulk producer lock: either keeps them from being collected
-- until this transaction ends. made: this call inserted the row, so until this
-- transaction commits nobody else sees it. p_made_due_ats, by position in p_names:
-- when the caller's messages on that name fall due (each name's earliest counts;
-- NULL for a message that will not be created). A row is made due at its earliest,
-- with the turn its wake would give as of p_now (fairq.channels_wake queues no wake
-- for it): nothing can refuse a message on a channel just made (no policy, nothing
-- in it, nobody else sees it), so every first message on a made row is created, and
-- the row is written once. p_in_bulk: what fairq.producing_in_bulk answered the
-- caller for these names (which then holds their producer locks unless it said
-- yes); NULL: ask it here.
CREATE FUNCTION fairq.channels_for_producer(p_queue_id integer, p_names text[],
                                            p_made_due_ats timestamptz[], p_now timestamptz,
                                            p_in_bulk boolean DEFAULT NULL)
RETURNS TABLE(channel fairq.channel, made boolean)
LANGUAGE plpgsql
AS $$
DECLARE
    v_missing bigint;  -- names with no committed row at the creation locks' look (NULL: not looked)
    v_made bigint[] := '{}';
    v_names integer;  -- how many distinct names
BEGIN
    -- (Every look for the names below is a lookup per name: OFFSET 0 keeps each a
    -- subplan keyed by the name. Planned while the table was small, as a session's
    -- cached plan may be, an anti-join, or "name = ANY (p_names)" filtered out of a
    -- scan by queue, read every channel of the queue at each call: one transaction
    -- making n new channels took time in n².)
    IF p_in_bulk IS NULL THEN
        v_names := (SELECT count(DISTINCT u.name)::integer FROM unnest(p_names) AS u(name));
        p_in_bulk := fairq.producing_in_bulk(p_queue_id, v_names);  -- (inlined: a plain argument)
        IF NOT p_in_bulk THEN
            PERFORM pg_advisory_xact_lock_shared(fairq.producer_lock_class(),
                                                 fairq.producer_lock_key(p_queue_id, n.name))
               FROM (SELECT DISTINCT u.name FROM unnest(p_names) AS u(name) ORDER BY u.name) n;
        END IF;
    END IF;
    IF NOT p_in_bulk THEN
        -- A channel is made by one producer at a time: the others wait for its commit
        -- here, then the next statement sees its row. Left to the unique index, a
        -- second producer waited inside its INSERT for the first, and then for any
        -- dequeue updating the new row (a unique check waits for a transaction that
        -- may delete the key's row): in the churn soak, producers waited on
        -- transactions more than they worked.
        PERFORM pg_advisory_xact_lock(fairq.creation_lock_class(),
                                      fairq.producer_lock_key(p_queue_id, n.name))
           FROM (SELECT DISTINCT u.name FROM unnest(p_names) AS u(name)
                  WHERE NOT EXISTS (SELECT 1 FROM fairq.channel c
                                     WHERE c.queue_id = p_queue_id AND c.name = u.name
                                    OFFSET 0)
                  ORDER BY u.name) n;
        GET DIAGNOSTICS v_missing = ROW_COUNT;
    END IF;
    -- (Nothing missing at that look, nothing to make: the rows seen stay, under the
    -- producer locks.) A name inserted concurrently (by a transaction gone bulk) is
    -- waited for, then left alone: the next statement's snapshot sees it either way.
    IF v_missing IS DISTINCT FROM 0 THEN
        WITH inserted AS (
            INSERT INTO fairq.channel (queue_id, name, idle_since, due_at, turn_at, turn_seq)
            SELECT p_queue_id, n.name, CASE WHEN n.due_at IS NULL THEN fairq.clock() END, n.due_at,
                   -- (A new row: no release yet, no interval, nothing in flight, no
                   -- cap, no pause.)
                   fairq.next_turn(NULL, n.due_at, NULL, 0, 0, NULL, NULL, p_now),
                   CASE WHEN n.due_at IS NOT NULL THEN nextval('fairq.turn_seq') END  -- (in name order, as the ids)
              FROM (SELECT u.name, min(u.due_at) AS due_at
                      FROM unnest(p_names, p_made_due_ats) AS u(name, due_at)
                     WHERE NOT EXISTS (SELECT 1 FROM fairq.channel c
                                        WHERE c.queue_id = p_queue_id AND c.name = u.name OFFSET 0)
                     GROUP BY u.name
                     ORDER BY u.name OFFSET 0) n
            ON CONFLICT (queue_id, name) DO NOTHING
            RETURNING fairq.channel.id
        )
        SELECT coalesce(array_agg(i.id), '{}') INTO v_made FROM inserted i;
    END IF;
    RETURN QUERY SELECT c.channel, (c.channel).id = ANY (v_made)
                   FROM (SELECT DISTINCT u.name FROM unnest(p_names) AS u(name)) u
                  CROSS JOIN LATERAL (SELECT c AS channel FROM fairq.channel c
                                       WHERE c.queue_id = p_queue_id AND c.name = u.name OFFSET 0) c
                  ORDER BY (c.channel).id;
END
$$;

-- The channel row, locked for a change, its queued wakes folded in. Callers already
-- hold the message they act on (lock order: message, then channel).
CREATE FUNCTION fairq.channel_lock(p_channel_id bigint) RETURNS fairq.channel
LANGUAGE plpgsql
AS $$
DECLARE
    v_channel fairq.channel;
BEGIN
    SELECT * INTO v_channel FROM fairq.channel WHERE id = p_channel_id FOR NO KEY UPDATE;
    RETURN fairq.channel_with_wakes(v_channel);
END
$$;

-- The due time a producer's new message is compared with (fairq.needs_wake): the
-- channel's due_at, or its turn when a dequeue put it off for a message another
-- transaction holds (fairq.channel_retire: its turn is then later than fairq.next_turn
-- gives it for its due messages, pause and release interval). A message created
-- meanwhile brings that turn forward like one on an idle channel, by a wake: it was
-- kept waiting for the rest of the put-off, up to 5 s (0.7.33). (The first test
-- spares a channel in the rotation, the busy case, the second; a full channel has no
-- turn to compare.)
CREATE FUNCTION fairq.due_for_producers(p_due_at timestamptz, p_turn_at timestamptz,
                                        p_paused_until timestamptz, p_last_release_at timestamptz,
                                        p_release_interval_ms bigint, p_now timestamptz)
RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN p_turn_at > p_now
                     AND p_turn_at > fairq.next_turn(NULL, p_due_at, p_last_release_at, p_release_interval_ms,
                                                     0, NULL, p_paused_until, p_now)
                THEN p_turn_at ELSE p_due_at END
$$;

-- Whether a message due at p_due_at must bring its channel's turn forward: the
-- channel has nothing pending, or only messages due later that are not yet due (with
-- p_channel_due_at from fairq.due_for_producers: or it is put off).
CREATE FUNCTION fairq.needs_wake(p_channel_due_at timestamptz, p_due_at timestamptz,
                                 p_now timestamptz) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT p_channel_due_at IS NULL OR (p_due_at < p_channel_due_at AND p_channel_due_at > p_now)
$$;

-- True when this transaction's top level wrote the row version whose xmin is p_xmin
-- (a subtransaction's rows have xmins of their own, and may roll back alone).
CREATE FUNCTION fairq.written_here(p_xmin xid) RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT p_xmin::text = (pg_current_xact_id()::text::bigint % 4294967296)::text $$;

-- True when this transaction itself queued a wake of channel p_channel_id that brings
-- its turn to p_due_at or earlier, or wrote the channel's row with a due time by
-- p_due_at (made it: fairq.channels_wake; or changed it, and so holds it). Such a
-- wake is committed with the messages that need it, or with none of them, and such
-- a row cannot be made less eligible before they are seen; either serves them as
-- well as a second wake would (a transaction gone bulk relies on nothing else:
-- without this, one that loaded a million messages in batches queued a wake per
-- channel per batch, and each batch read more of them). Only the top transaction's
-- rows count (fairq.written_here): a wake queued by another transaction may be
-- applied before the messages commit. Only the latest wake due by p_due_at is looked
-- at (one index probe): other transactions' wakes can be thousands, and when one of
-- them is the latest, a wake queued now is the latest at this transaction's next
-- call.
CREATE FUNCTION fairq.woken_here(p_channel_id bigint, p_due_at timestamptz) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT coalesce((SELECT fairq.written_here(w.xmin)
                       FROM fairq.channel_wake w
                      WHERE w.channel_id = p_channel_id AND w.due_at <= p_due_at
                      ORDER BY w.due_at DESC LIMIT 1), false)
        OR coalesce((SELECT fairq.written_here(c.xmin) AND c.due_at <= p_due_at
                       FROM fairq.channel c WHERE c.id = p_channel_id), false)
$$;

-- The channels p_channel_ids as the next dequeue will see them at p_now, with the
-- due times p_due_ats that producers' new messages need: their pending due time
-- (fairq.due_for_producers) includes the wakes already queued (those of producers
-- still open are not seen; a second wake is harmless: applied, it only moves a turn
-- earlier). An SQL table function, inlined into its callers' statements.
CREATE FUNCTION fairq.wake_candidates(p_channel_ids bigint[], p_due_ats timestamptz[], p_now timestamptz)
RETURNS TABLE(id bigint, queue_id integer, name text, due_at timestamptz,
              pending_due_at timestamptz)
LANGUAGE sql STABLE
AS $$
    SELECT c.id, c.queue_id, c.name, e.due_at,
           LEAST(fairq.due_for_producers(c.due_at, c.turn_at, c.paused_until, c.last_release_at,
                                         c.release_interval_ms, p_now),
                 (SELECT min(w.due_at) FROM fairq.channel_wake w WHERE w.channel_id = c.id))
      FROM fairq.channel c
      JOIN unnest(p_channel_ids, p_due_ats) AS e(id, due_at) ON e.id = c.id
     WHERE c.id = ANY (p_channel_ids)
    OFFSET 0  -- (needs_wake then gets a plain column, and is inlined)
$$;

-- For a producer holding the channels' producer locks (create, dead-letter retry):
-- the channels among p_channel_ids, all of queue p_queue_id (each with the earliest
-- due time its new messages need), whose turn those messages must bring forward
-- (fairq.needs_wake). Their wakes
-- are queued in fairq.channel_wake, committed with the messages, and the next
-- dequeues apply them (fairq.join_rotation) with the turn_seq given here, in id order.
-- A channel that seems to need no wake (it is due already) is relied on to stay due:
-- its settle lock is tried shared first, and the look that decides comes after, in a
-- new snapshot. Where that lock is taken, or the queue is being settled in bulk (a
-- call is deciding whether the channel goes idle, and may not see these messages),
-- the wake is queued anyway, and so is it for
-- a channel that needed one at the first look, and by a transaction gone bulk (which
-- takes no channel's lock) unless it queued one itself or holds the row
-- (fairq.woken_here): a second wake is harmless, and the producer never waits.
-- A producer never locks a channel row: one that did, for a wake, kept it until
-- commit, so an open producer transaction hid the channel's other messages from
-- workers and made its completions wait. A row the producer made (p_made, among
-- p_channel_ids) was made due by fairq.channels_for_producer, with the turn its wake
-- would give, and gets no wake: the next dequeues find it waiting to join, with no
-- wake to apply and none to delete (so a call's made channels take their turns
-- before the wakes it queues). Returns the channels woken, the made ones included.
-- (message_create queues its one channel's wake itself, by these rules.)
CREATE FUNCTION fairq.channels_wake(p_queue_id integer, p_channel_ids bigint[], p_due_ats timestamptz[],
                                    p_now timestamptz, p_made bigint[] DEFAULT '{}') RETURNS bigint[]
LANGUAGE plpgsql
AS $$
DECLARE
    v_forced bigint[];  -- channels woken whatever the second look says
    v_woken bigint[] := '{}';
BEGIN
    IF cardinality(p_made) < cardinality(p_channel_ids) THEN
        v_forced := ARRAY(SELECT k.id FROM fairq.wake_candidates(p_channel_ids, p_due_ats, p_now) AS k
                           WHERE NOT k.id = ANY (p_made)
                             AND (fairq.needs_wake(k.pending_due_at, k.due_at, p_now)
                                  OR CASE WHEN fairq.gone_bulk(fairq.producer_locks_setting())
                                          THEN NOT fairq.woken_here(k.id, k.due_at)
                                          ELSE NOT fairq.settle_lock_try_shared(k.queue_id, k.name) END));
        -- With the settle locks held: one settling in bulk would not see them.
        IF cardinality(v_forced) + cardinality(p_made) < cardinality(p_channel_ids)
           AND fairq.bulk_settling(p_queue_id) THEN
            v_forced := p_channel_ids;
        END IF;
        WITH queued AS (
            INSERT INTO fairq.channel_wake (channel_id, due_at, woken_at, turn_seq, queue_id)
            SELECT n.id, n.due_at, p_now, nextval('fairq.turn_seq'), n.queue_id
              FROM (SELECT k.id, k.due_at, k.queue_id
                      FROM fairq.wake_candidates(p_channel_ids, p_due_ats, p_now) AS k
                     WHERE NOT k.id = ANY (p_made)
                       AND (k.id = ANY (v_forced) OR fairq.needs_wake(k.pending_due_at, k.due_at, p_now))
                     ORDER BY k.id
                    OFFSET 0) n
            RETURNING channel_id)
        SELECT coalesce(array_agg(q.channel_id), '{}') INTO v_woken FROM queued q;
    END IF;
    RETURN v_woken || p_made;
END
$$;

-- Each of channels p_channel_ids, whose rows the caller holds, as its queued wakes
-- leave it; the wakes are deleted (woken: it had some). Each wake is applied as if
-- when it was queued, in order, as of its woken_at (the keep-turn rule): the
-- channel's due_at moves to the earliest wake's; its turn becomes the earliest any
-- wake gives, or stays the earlier one it had (in the rotation: its place), with the
-- turn_seq of the first wake that gave it. A wake committed after this statement's
-- snapshot waits for a later caller. Nothing is written to the channels: the caller
-- writes them (fairq.fold_wakes, or fairq.join_rotation and fairq.channels_join with
-- their places).
CREATE FUNCTION fairq.folded_wakes(p_channel_ids bigint[]) RETURNS SETOF fairq.folded_turn
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
BEGIN
    -- (Every step below is a scan, a sort or a window over the rows before it, never a
    -- lookup of one CTE per row of another: that made a fold of 100 channels cost
    -- 10,000 row visits.)
    RETURN QUERY
    WITH held AS (
        -- (Each channel looked up once, by id: planned while the table was small, a
        -- join with the table read every channel to find the woken ones, and a lookup
        -- per wake reads a channel as often as it has wakes.)
        SELECT c.* FROM (SELECT DISTINCT u.id FROM unnest(p_channel_ids) AS u(id)) u
         CROSS JOIN LATERAL (SELECT c.* FROM fairq.channel c WHERE c.id = u.id OFFSET 0) c
    ), taken AS (
        DELETE FROM fairq.channel_wake w WHERE w.channel_id = ANY (p_channel_ids)
        RETURNING w.channel_id, w.due_at, w.woken_at, w.turn_seq
    ), folded AS (  -- each wake's turn, applied after the ones queued before it
        SELECT t.channel_id, t.turn_seq, f.due_at,
               fairq.next_turn(NULL, f.due_at, c.last_release_at, c.release_interval_ms,
                               c.in_flight, c.max_concurrency, c.paused_until, t.woken_at) AS turn_at
          FROM (SELECT t.*, min(t.due_at) OVER (PARTITION BY t.channel_id ORDER BY t.turn_seq) AS due_so_far
                  FROM taken t) t
          JOIN held c ON c.id = t.channel_id
         CROSS JOIN LATERAL (SELECT LEAST(c.due_at, t.due_so_far) AS due_at) f
    ), woken AS (  -- per channel: the earliest turn, the earliest due time
        SELECT DISTINCT ON (f.channel_id) f.channel_id, f.turn_at, f.turn_seq,
               min(f.due_at) OVER (PARTITION BY f.channel_id) AS due_at
          FROM folded f
         ORDER BY f.channel_id, f.turn_at NULLS LAST, f.turn_seq
    )
    SELECT c.id, w.channel_id IS NOT NULL, coalesce(w.due_at, c.due_at), n.turn_at,
           fairq.kept_turn_seq(c.turn_at, n.turn_at, c.turn_seq, w.turn_seq),
           fairq.kept_pass(c.turn_at, n.turn_at, c.turn_pass, NULL),  -- (a wake frees no slot)
           fairq.kept_place(c.turn_at, n.turn_at, c.turn_given_at)
      FROM held c
      LEFT JOIN woken w ON w.channel_id = c.id
     CROSS JOIN LATERAL (SELECT LEAST(c.turn_at, w.turn_at) AS turn_at) n;
END
$$;

-- Writes the queued wakes of channels whose rows the caller holds into those rows
-- (fairq.folded_wakes): a channel in the rotation keeps its place there, a waiting one
-- the earlier of its turns. Every caller that locks a channel row to change its turn
-- folds its wakes in first (fairq.channel_lock, the dequeue's pick, recovery,
-- completions), so a wake never acts after a later change; the dequeue's join folds
-- them as it places the channels (fairq.channels_join).
CREATE FUNCTION fairq.fold_wakes(p_channel_ids bigint[]) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    UPDATE fairq.channel c
       SET due_at = w.due_at, idle_since = NULL,  -- a wake brings a due time
           turn_at = w.turn_at, turn_seq = w.turn_seq, turn_pass = w.turn_pass,
           turn_given_at = w.turn_given_at
      FROM fairq.folded_wakes(p_channel_ids) w
     WHERE c.id = ANY (p_channel_ids) AND c.id = w.id AND w.woken;
END
$$;

-- For a dequeue of queue p_queue_id, before it picks (fairq.join_rotation): the woken
-- channels it takes (taken), the channels of p_waiting it takes (waiting), their rows
-- locked, and how many of p_limit places are left (wanted). p_waiting are channels
-- waiting to join, earliest first, not locked yet: one that a woken channel passes
-- is left to other calls, not held. It reads the due wakes in windows of p_limit + 8
-- (by due and woken time: an index range, so a burst of wakes costs each dequeue no
-- more). Of a window's channels it takes those that, with p_waiting, are the
-- p_limit eligible earliest (so the pick sees every channel whose turn is among the
-- next p_limit, and the other wakes stay queued, not written), and those that stay
-- ineligible (at max_concurrency, rate-limited or paused past now), which no dequeue
-- could serve now anyway: a dequeue holds no more servable channel rows than it may
-- serve. Rows held by others are skipped; when that leaves it short, it reads the
-- next window (at most 8 in all), so concurrent dequeues take the wakes after each
-- other's instead of waiting for them. A rate-limited channel's wake can make it
-- eligible later than its place in the window says: then a channel woken just after
-- the window may take its turn one dequeue late.
CREATE FUNCTION fairq.woken_to_take(p_queue_id integer, p_now timestamptz, p_limit integer,
                                    p_waiting bigint[], OUT taken bigint[], OUT waiting bigint[],
                                    OUT wanted integer)
LANGUAGE plpgsql
AS $$
DECLARE
    -- Wakes read beyond p_limit, room for those other calls hold; and how many
    -- windows a call reads before it leaves the rest to later calls.
    v_slack CONSTANT integer := 8;
    v_max_windows CONSTANT integer := 8;
    -- (p_limit is at most a call's p_max_messages, which may be as large as an
    -- integer goes: no window reads more than that many wakes anyway.)
    v_window_size CONSTANT integer := LEAST(p_limit, 2147483647 - v_slack) + v_slack;
    v_seen bigint[] := '{}';   -- channels of the windows read so far
    v_from timestamptz := '-infinity';  -- where the next window starts
    v_read integer;            -- wakes the window read
    v_eligible bigint[];       -- channels the window's wakes make eligible, earliest first,
    v_turn_ats timestamptz[];  -- with their turns
    v_turn_seqs bigint[];
    v_ineligible bigint[];     -- the others: at max_concurrency, or rate-limited past now
    v_joined bigint[];         -- woken channels the window lets join
    v_joined_waiting bigint[]; -- and waiting ones
    v_joining integer;
BEGIN
    taken := '{}';
    waiting := '{}';
    wanted := p_limit;  -- eligible channels still to take
    FOR v_window IN 1 .. v_max_windows LOOP
        SELECT coalesce(array_agg(t.channel_id ORDER BY t.turn_at, t.turn_seq)
                            FILTER (WHERE t.turn_at <= p_now), '{}'),
               coalesce(array_agg(t.turn_at ORDER BY t.turn_at, t.turn_seq)
                            FILTER (WHERE t.turn_at <= p_now), '{}'),
               coalesce(array_agg(t.turn_seq ORDER BY t.turn_at, t.turn_seq)
                            FILTER (WHERE t.turn_at <= p_now), '{}'),
               coalesce(array_agg(t.channel_id) FILTER (WHERE t.turn_at IS NULL OR t.turn_at > p_now), '{}'),
               coalesce(sum(t.wakes), 0), max(t.last_key)
          INTO v_eligible, v_turn_ats, v_turn_seqs, v_ineligible, v_read, v_from
          FROM (SELECT w.channel_id, min(k.turn_at) AS turn_at, min(w.turn_seq) AS turn_seq,
                       count(*) AS wakes, max(w.key) AS last_key
                  FROM (SELECT w.*, GREATEST(w.due_at, w.woken_at) AS key FROM fairq.channel_wake w
                         WHERE w.queue_id = p_queue_id
                           AND GREATEST(w.due_at, w.woken_at) >= v_from
                           AND GREATEST(w.due_at, w.woken_at) <= p_now
                           AND w.channel_id <> ALL (v_seen)
                         ORDER BY GREATEST(w.due_at, w.woken_at), w.turn_seq
                         LIMIT v_window_size) w
                 CROSS JOIN LATERAL (
                       SELECT fairq.next_turn(NULL, LEAST(k.due_at, w.due_at), k.last_release_at,
                                              k.release_interval_ms, k.in_flight,
                                              k.max_concurrency, k.paused_until, w.woken_at) AS turn_at
                         FROM fairq.channel k WHERE k.id = w.channel_id
                       OFFSET 0) k  -- one lookup by id per wake
                 GROUP BY w.channel_id) t;
        -- Of these and the waiting channels, the first wanted that are free, then every
        -- free ineligible one. The waiting channels count in the first window only: a
        -- later one is read only when all of them joined.
        WITH joining AS (
            SELECT c.id, m.woken
              FROM (SELECT u.id, u.turn_at, u.turn_seq, u.woken
                      FROM (SELECT e.id, e.turn_at, e.turn_seq, true AS woken
                              FROM unnest(v_eligible, v_turn_ats, v_turn_seqs) AS e(id, turn_at, turn_seq)
                            UNION ALL
                            SELECT k.id, k.turn_at, k.turn_seq, false
                              FROM fairq.channel k
                             WHERE v_window = 1 AND k.id = ANY (p_waiting)
                               AND k.id <> ALL (v_eligible)) u
                     ORDER BY u.turn_at, u.turn_seq
                    OFFSET 0) m  -- (sorted first: the rows are then locked one by one, in order)
              JOIN fairq.channel c ON c.id = m.id
             ORDER BY m.turn_at, m.turn_seq
             LIMIT wanted
               FOR NO KEY UPDATE OF c SKIP LOCKED)
        SELECT coalesce(array_agg(j.id) FILTER (WHERE j.woken), '{}'),
               coalesce(array_agg(j.id) FILTER (WHERE NOT j.woken), '{}'), count(*)
          INTO v_joined, v_joined_waiting, v_joining
          FROM joining j;
        waiting := waiting || v_joined_waiting;
        taken := taken || v_joined;
        IF cardinality(v_ineligible) > 0 THEN
            taken := taken || ARRAY(SELECT c.id FROM fairq.channel c WHERE c.id = ANY (v_ineligible)
                                     ORDER BY c.id
                                       FOR NO KEY UPDATE SKIP LOCKED);
        END IF;
        wanted := wanted - v_joining;
        EXIT WHEN wanted <= 0 OR v_read < v_window_size;
        v_seen := v_seen || v_eligible || v_ineligible;
    END LOOP;
END
$$;

-- A channel row the caller has just locked, with its queued wakes folded in.
CREATE FUNCTION fairq.channel_with_wakes(p_channel fairq.channel) RETURNS fairq.channel
LANGUAGE plpgsql
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM fairq.channel_wake w WHERE w.channel_id = p_channel.id) THEN
        PERFORM fairq.fold_wakes(ARRAY[p_channel.id]);
        SELECT * INTO p_channel FROM fairq.channel WHERE id = p_channel.id;
    END IF;
    RETURN p_channel;
END
$$;

-- A channel whose due_at may be too early: a dequeue picked it and found nothing to
-- hand out (a cancelled or concurrently taken head). Recompute its turn from what it
-- holds (taking p_turn_seq, or the next value). When it still holds a message due
-- now, which the pick could not lock, another transaction holds that message: a
-- cancel not yet committed, whose delete this snapshot does not see. Kept due now,
-- the channel would be picked and retired again by every dequeue while that
-- transaction is open, its row rewritten each time (a transaction that cancelled the
-- last messages of a thousand channels made each dequeue slower than the one
-- before); so a dequeue looks at it again only after fairq.held_message_wait(): by
-- then the cancel has committed (the channel goes idle) or rolled back (the message
-- is served, that much late; a message created on the channel meanwhile wakes it:
-- fairq.due_for_producers). The wait grows with how long the
-- message has been due, so a long transaction costs a look every few seconds, not one
-- at every call; and it ends no later than the channel's next scheduled message
-- falls due. (A channel a producer relies on staying due waits the shortest time; one
-- with a due message free again is not put off.)
CREATE FUNCTION fairq.held_message_wait(p_due_for interval) RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT LEAST(GREATEST(p_due_for, interval '100 milliseconds'), interval '5 seconds') $$;

CREATE FUNCTION fairq.channel_retire(p_channel_id bigint, p_now timestamptz, p_turn_seq bigint)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_channel fairq.channel := fairq.channel_lock(p_channel_id);
    v_pending_due_at timestamptz := (SELECT p.due_at FROM fairq.pending_due_at(v_channel.id) AS p);
    v_look_at timestamptz := p_now;  -- the time its next turn is reckoned from
    v_due_for interval;  -- how long the held message has been due, as the put-off counts it
BEGIN
    v_channel.due_at := (fairq.settled_due_ats(ARRAY[v_channel.id], ARRAY[v_channel.name],
                                               ARRAY[v_pending_due_at], v_channel.queue_id, p_now))[1];
    -- The put-off is decided under the channel's settle lock. A producer that relies
    -- on the channel staying due (fairq.channels_wake) holds it, and then the
    -- channel is put off only for the shortest wait: kept due, it was looked at again
    -- by every dequeue for as long as that producer stayed open (a transaction that
    -- cancels a channel's message and creates its replacement is one). Then, in the
    -- new snapshot of a statement after the lock, a due message that is free again
    -- (committed since the pick) keeps the channel due now.
    IF v_pending_due_at <= p_now THEN
        v_due_for := CASE WHEN fairq.settle_lock_try(v_channel.queue_id, v_channel.name)
                          THEN p_now - v_pending_due_at ELSE interval '0' END;
        PERFORM FROM fairq.message m
         WHERE m.channel_id = v_channel.id AND m.status = 'ready'
         LIMIT 1 FOR KEY SHARE SKIP LOCKED;
        IF NOT FOUND THEN
            PERFORM FROM fairq.message m
             WHERE m.channel_id = v_channel.id AND m.status = 'scheduled' AND m.dequeue_at <= p_now
             LIMIT 1 FOR KEY SHARE SKIP LOCKED;
        END IF;
        IF NOT FOUND THEN
            v_look_at := LEAST(p_now + fairq.held_message_wait(v_due_for),
                               (SELECT m.dequeue_at FROM fairq.message m
                                 WHERE m.channel_id = v_channel.id AND m.status = 'scheduled'
                                   AND m.dequeue_at > p_now
                                 ORDER BY m.dequeue_at, m.id LIMIT 1));
        END IF;
    END IF;
    PERFORM fairq.channel_store(v_channel, v_look_at, false, p_turn_seq);
END
$$;

-- p_count messages of the locked channel left the 'locked' status (settled,
-- deferred, recovered): free their concurrency slots (a capped channel's). p_due_at
-- is set when they are pending again.
CREATE FUNCTION fairq.channel_unlock(p_channel fairq.channel, p_count integer,
                                     p_due_at timestamptz, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    p_channel.in_flight := p_channel.in_flight - fairq.slots(p_channel.max_concurrency, p_count);
    p_channel.due_at := LEAST(p_channel.due_at, p_due_at);
    PERFORM fairq.channel_store(p_channel, p_now, true);
END
$$;

-- Keeps channel_size right for a bounded channel: p_delta messages more or fewer.
-- With p_enforce (a producer, holding the channel's producer lock), admits only what
-- fits under max_size and returns how many of p_delta (> 0) were admitted, under the
-- channel_size row's lock (held to commit: producers of a channel queue there).
-- Without it (removals, operator retries) the change is recorded in
-- channel_size_change, which waits for nobody: a settlement never waits for an open
-- producer transaction.
-- (SQL, inlined into its callers: an unbounded channel, the common case, costs no
-- call.)
CREATE FUNCTION fairq.channel_resize(p_channel fairq.channel, p_delta integer, p_enforce boolean)
RETURNS integer
LANGUAGE sql
AS $$
    SELECT CASE WHEN p_channel.max_size IS NULL THEN p_delta
                ELSE fairq.bounded_channel_resize(p_channel, p_delta, p_enforce) END
$$;

-- fairq.channel_resize of a channel that has a max_size.
CREATE FUNCTION fairq.bounded_channel_resize(p_channel fairq.channel, p_delta integer, p_enforce boolean)
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    v_size integer;
    v_folded integer;  -- the changes recorded since the last producer (NULL: none)
    v_admitted integer;
BEGIN
    IF NOT p_enforce THEN
        IF p_delta <> 0 THEN
            INSERT INTO fairq.channel_size_change (channel_id, delta) VALUES (p_channel.id, p_delta);
        END IF;
        RETURN p_delta;
    END IF;
    SELECT size INTO v_size FROM fairq.channel_size WHERE channel_id = p_channel.id FOR UPDATE;
    -- (After the lock: a snapshot taken before a wait for another producer would miss
    -- the changes it folded, and fold them twice.)
    WITH folded AS (
        DELETE FROM fairq.channel_size_change d WHERE d.channel_id = p_channel.id RETURNING d.delta
    )
    SELECT sum(f.delta) INTO v_folded FROM folded f;
    v_size := v_size + coalesce(v_folded, 0);
    v_admitted := LEAST(p_delta, GREATEST(0, p_channel.max_size - v_size));
    IF v_admitted <> 0 OR v_folded IS NOT NULL THEN
        UPDATE fairq.channel_size SET size = v_size + v_admitted WHERE channel_id = p_channel.id;
    END IF;
    RETURN v_admitted;
END
$$;

-- The channel row for a change of policy or pause, created on first use, with its
-- producer lock, its queue's bulk producer lock, its policy lock and its queue's bulk
-- policy lock held exclusively, then the row itself (its wakes folded in). Waiting
-- out producers mid-insert, bulk ones too, makes them and channel_size agree on
-- max_size; waiting out completions, bulk ones too, makes them and in_flight agree
-- on max_concurrency. (The row stays: collecting it would need the producer lock
-- held here.)
-- A worker's transaction may complete a message and then produce on its channel
-- (policy lock, then producer lock), or the other way round, and no single order of
-- the two kinds suits both: holding one kind while waiting for the other deadlocked
-- with one of them. So each round waits for one lock as long as it takes, holding
-- nothing else, and then for every other one only fairq.second_lock_wait() (well
-- below PostgreSQL's deadlock_timeout); past that, everything taken is let go and
-- the next round waits first for another of them: the channel's producer lock, its
-- policy lock, the queue's bulk producer lock, the queue's bulk policy lock, in
-- turn. A transaction that needs a lock held here then waits at most that long, and
-- a holder that needs nothing more is waited for in full, in its round. (Until
-- 0.7.36 the bulk locks were waited for in full while the channel's lock was held: a
-- bulk producer left open held up every producer of the channel for as long, and
-- one that then waited for such a producer's new channel row deadlocked with it.)
-- The channel's row is a further thing such a transaction may hold (its settlement
-- wrote it) before it produces on the channel: each round first waits out the row's
-- holder while holding nothing, and every later wait for the row (the insert's
-- unique check, the row lock) is bounded like the others. (0.7.31 waited for the
-- row holding the producer lock: with a worker that deferred, failed or completed a
-- capped channel's message and then produced on it, that deadlocked.)
CREATE FUNCTION fairq.second_lock_wait() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT interval '50 milliseconds' $$;

CREATE FUNCTION fairq.channel_for_policy(p_queue_id integer, p_channel text) RETURNS fairq.channel
LANGUAGE plpgsql
AS $$
DECLARE
    v_caller_lock_timeout CONSTANT text := current_setting('lock_timeout');
    -- The caller's own lock_timeout still bounds every wait, the second's too.
    v_second_lock_timeout CONSTANT text :=
        CASE WHEN v_caller_lock_timeout::interval > interval '0'
                  AND v_caller_lock_timeout::interval < fairq.second_lock_wait()
             THEN v_caller_lock_timeout
             ELSE (extract(epoch FROM fairq.second_lock_wait()) * 1000)::bigint || 'ms' END;
    v_round integer := 0;  -- which lock this round waits for in full (0 to 3, above)
    v_waiting_for_second boolean;
    v_first_id bigint;  -- the row whose policy lock a round of the policy lock took first
    v_row_id bigint;    -- the row there is under the producer lock
    v_channel fairq.channel;
BEGIN
    LOOP
        v_waiting_for_second := false;
        BEGIN
            PERFORM FROM fairq.channel c WHERE c.queue_id = p_queue_id AND c.name = p_channel
               FOR NO KEY UPDATE;
            RAISE EXCEPTION USING ERRCODE = 'FQ001';  -- lets go of the row at once
        EXCEPTION WHEN SQLSTATE 'FQ001' THEN
            NULL;
        END;
        BEGIN  -- a subtransaction: its rollback lets go of the locks taken in it
            CASE v_round
                WHEN 0 THEN
                    PERFORM pg_advisory_xact_lock(fairq.producer_lock_class(),
                                                  fairq.producer_lock_key(p_queue_id, p_channel));
                WHEN 1 THEN
                    -- (A channel not made yet has nothing in flight: no completion to wait for.)
                    v_first_id := (SELECT c.id FROM fairq.channel c
                                    WHERE c.queue_id = p_queue_id AND c.name = p_channel);
                    PERFORM pg_advisory_xact_lock(fairq.policy_lock_class(), fairq.policy_lock_key(v_first_id))
                     WHERE v_first_id IS NOT NULL;
                WHEN 2 THEN
                    PERFORM pg_advisory_xact_lock(fairq.bulk_producer_lock_class(), p_queue_id);
                ELSE
                    PERFORM pg_advisory_xact_lock(fairq.bulk_policy_lock_class(), p_queue_id);
            END CASE;
            -- The rest, in the usual order (a lock this round already holds is taken
            -- again at once), each waited for briefly.
            v_waiting_for_second := true;
            PERFORM set_config('lock_timeout', v_second_lock_timeout, true);
            PERFORM pg_advisory_xact_lock(fairq.producer_lock_class(), fairq.producer_lock_key(p_queue_id, p_channel));
            PERFORM pg_advisory_xact_lock(fairq.bulk_producer_lock_class(), p_queue_id);
            INSERT INTO fairq.channel (queue_id, name) VALUES (p_queue_id, p_channel)
            ON CONFLICT (queue_id, name) DO NOTHING;
            -- (The row now, under the producer lock: the channel may have been collected,
            -- or made, since a round of the policy lock looked it up.)
            v_row_id := (SELECT c.id FROM fairq.channel c
                          WHERE c.queue_id = p_queue_id AND c.name = p_channel);
            PERFORM pg_advisory_xact_lock(fairq.policy_lock_class(), fairq.policy_lock_key(v_row_id));
            PERFORM pg_advisory_xact_lock(fairq.bulk_policy_lock_class(), p_queue_id);
            v_channel := fairq.channel_lock(v_row_id);
            PERFORM set_config('lock_timeout', v_caller_lock_timeout, true);
            RETURN v_channel;
        EXCEPTION WHEN lock_not_available THEN
            IF NOT v_waiting_for_second THEN
                RAISE;
            END IF;
        END;
        v_round := (v_round + 1) % 4;
    END LOOP;
END
$$;

-- Writes back a channel whose policy or pause a call changed (fairq.channel_store,
-- the turn recomputed), and tells sleeping workers where that brought its turn
-- earlier: a channel that had none (paused until resumed, full) or a later one. A
-- pause until resumed gives a sleeping worker no time to wake at (doorbell_quiet's
-- next_turn_at), so until 0.7.37 a resume woke nobody before the next poll.
CREATE FUNCTION fairq.channel_store_policy(p_channel fairq.channel, p_now timestamptz) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_stored fairq.channel := fairq.channel_store(p_channel, p_now, false);
BEGIN
    IF v_stored.turn_at IS NOT NULL AND (p_channel.turn_at IS NULL OR v_stored.turn_at < p_channel.turn_at)
       AND fairq.events_wanted(true) THEN
        IF fairq.worker_sleeps(v_stored.queue_id) THEN
            PERFORM fairq.notify_event('policy', v_stored.queue_id, v_stored.name, NULL, v_stored.turn_at);
        END IF;
    END IF;
END
$$;

CREATE FUNCTION fairq.channel_set(
    p_channel text,
    p_max_concurrency integer DEFAULT NULL,
    p_release_interval_ms bigint DEFAULT 0,
    p_max_size integer DEFAULT NULL,
    p_max_attempts integer DEFAULT NULL,
    p_weight integer DEFAULT 1,
    p_queue text DEFAULT 'default'
) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require_read_committed('fairq.channel_set'),
            fairq.require_channel_name(p_channel, 'p_channel');
    PERFORM fairq.require_limit(p_max_concurrency, 'p_max_concurrency');
    PERFORM fairq.require_duration(p_release_interval_ms, 0, 'p_release_interval_ms');
    PERFORM fairq.require_limit(p_max_size, 'p_max_size');
    PERFORM fairq.require_limit(p_max_attempts, 'p_max_attempts');
    PERFORM fairq.require_weight(p_weight, 'p_weight');
    v_channel := fairq.channel_for_policy(fairq.queue_for_producer(p_queue, 'p_queue'), p_channel);

    -- Completions of an uncapped channel do not lock its row but hold its policy
    -- lock (shared), so the count of locked messages below is exact.
    UPDATE fairq.channel
       SET has_policy = true, max_concurrency = p_max_concurrency,
           release_interval_ms = p_release_interval_ms, max_size = p_max_size,
           max_attempts = p_max_attempts, weight = p_weight,
           in_flight = CASE WHEN p_max_concurrency IS NULL THEN 0 ELSE
                           (SELECT count(*) FROM fairq.message m
                             WHERE m.channel_id = v_channel.id AND m.status = 'locked') END
     WHERE id = v_channel.id
    RETURNING * INTO v_channel;

    IF p_max_size IS NULL THEN
        DELETE FROM fairq.channel_size WHERE channel_id = v_channel.id;
        DELETE FROM fairq.channel_size_change WHERE channel_id = v_channel.id;
    ELSE
        INSERT INTO fairq.channel_size (channel_id, size)
        SELECT v_channel.id, count(*) FROM fairq.message WHERE channel_id = v_channel.id
        ON CONFLICT (channel_id) DO NOTHING;
    END IF;
    -- New limits apply from now: the turn is recomputed (a raised release interval
    -- moves it later, a lowered one brings it to now; the channel joins the rotation
    -- again at the back).
    PERFORM fairq.channel_store_policy(v_channel, v_now);
END
$$;

CREATE FUNCTION fairq.channel_clear(p_channel text, p_queue text DEFAULT 'default') RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_queue_id integer;
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require_read_committed('fairq.channel_clear'),
            fairq.require_channel_name(p_channel, 'p_channel');
    v_queue_id := (fairq.queue_lookup(p_queue, 'p_queue')).id;
    IF v_queue_id IS NULL OR NOT EXISTS (
            SELECT 1 FROM fairq.channel c
             WHERE c.queue_id = v_queue_id AND c.name = p_channel
               AND (c.has_policy OR c.paused_until > v_now)) THEN
        RETURN false;
    END IF;
    v_channel := fairq.channel_for_policy(v_queue_id, p_channel);
    DELETE FROM fairq.channel_size WHERE channel_id = v_channel.id;
    DELETE FROM fairq.channel_size_change WHERE channel_id = v_channel.id;
    UPDATE fairq.channel
       SET has_policy = false, max_concurrency = NULL, release_interval_ms = 0,
           max_size = NULL, max_attempts = NULL, in_flight = 0, weight = 1, paused_until = NULL
     WHERE id = v_channel.id
    RETURNING * INTO v_channel;
    PERFORM fairq.channel_store_policy(v_channel, v_now);
    RETURN true;
END
$$;

-- A pause changes when the channel may be served, nothing else: its turn waits for
-- p_until (fairq.next_turn), then it joins the rotation at the back.
CREATE FUNCTION fairq.channel_pause(p_channel text, p_until timestamptz DEFAULT 'infinity',
                                    p_queue text DEFAULT 'default') RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require_read_committed('fairq.channel_pause'),
            fairq.require_channel_name(p_channel, 'p_channel');
    PERFORM fairq.require_future(p_until, v_now, 'p_until');
    v_channel := fairq.channel_for_policy(fairq.queue_for_producer(p_queue, 'p_queue'), p_channel);
    v_channel.paused_until := p_until;
    UPDATE fairq.channel SET paused_until = p_until WHERE id = v_channel.id;
    PERFORM fairq.channel_store_policy(v_channel, v_now);
END
$$;

CREATE FUNCTION fairq.channel_resume(p_channel text, p_queue text DEFAULT 'default') RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_queue_id integer;
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require_read_committed('fairq.channel_resume'),
            fairq.require_channel_name(p_channel, 'p_channel');
    v_queue_id := (fairq.queue_lookup(p_queue, 'p_queue')).id;
    IF v_queue_id IS NULL OR NOT EXISTS (
            SELECT 1 FROM fairq.channel c
             WHERE c.queue_id = v_queue_id AND c.name = p_channel AND c.paused_until > v_now) THEN
        RETURN false;
    END IF;
    v_channel := fairq.channel_for_policy(v_queue_id, p_channel);
    v_channel.paused_until := NULL;
    UPDATE fairq.channel SET paused_until = NULL WHERE id = v_channel.id;
    PERFORM fairq.channel_store_policy(v_channel, v_now);
    RETURN true;
END
$$;

COMMENT ON FUNCTION fairq.channel_set(text, integer, bigint, integer, integer, integer, text) IS
    'Upserts a channel''s policy: p_max_concurrency messages in flight at once, p_max_size messages held (in flight included), p_max_attempts deliveries before dead-lettering (NULL: unlimited), p_release_interval_ms minimum gap between fresh releases (0: none), p_weight (1-1000) its share of turns.';
COMMENT ON FUNCTION fairq.channel_clear(text, text) IS
    'Forgets a channel''s explicit policy and any pause (true if it had one); the channel reverts to no limits and disappears when empty.';
COMMENT ON FUNCTION fairq.channel_pause(text, timestamptz, text) IS
    'Hands out no message of the channel before p_until (default: until resumed); it keeps its messages, policy and locks.';
COMMENT ON FUNCTION fairq.channel_resume(text, text) IS
    'Ends a channel''s pause (true if it was paused); it joins the rotation like a channel that just became eligible.';

-- ==== sql/create.sql ====

-- create.sql — putting messages on channels.
--
-- Invariants:
--   * a producer holds only its channel's producer lock and never locks a channel
--     row others can see: when its message must bring the channel's turn forward
--     (the channel had nothing due before it) it queues a wake that the next dequeue
--     applies (fairq.channels_wake), unless it made the row itself, which nobody
--     sees before it commits: then the row is inserted due, with the turn the wake
--     would give (fairq.channels_for_producer). Producers never wait for a
--     channel row, and producers and workers never wait for one another;
--   * a call never makes a channel less eligible while a producer that relies on it
--     staying due holds its settle lock, and a producer that finds that lock taken
--     queues a wake anyway, never waiting (see fairq.channels_wake), so a message
--     committed later is never stranded (one bounded exception: a dequeue that finds
--     the channel's due message held by another transaction puts it off for 100 ms,
--     fairq.channel_retire);
--   * a bounded channel admits a message only while its count is below max_size;
--   * at most one message per (channel, dedup_key) exists at a time;
--   * channel rows are locked in id order, like every call that locks several, and
--     messages with a dedup key are inserted in (channel id, key) order: a keyed
--     insert waits for an uncommitted one of the same key.
-- message_create_batch is the one complete code path. message_create takes a short
-- path for every channel without max_size (about 6 statements instead of 30), and
-- is message_create_batch of one element for a bounded channel; the model test
-- holds both to the same answers. In both, a NULL dequeue_at means now
-- and a NULL priority means 0.
--
-- Every queue call (message_*, dead_letter_*, history_prune) runs with, besides its
-- pinned search_path:
--   * plan_cache_mode = force_generic_plan: its statements are planned once per
--     session, not at every call (planning cost more than executing them);
--   * enable_seqscan = off: every statement is written for index lookups, and a plan
--     cached while a table was nearly empty must not stay a sequential scan once the
--     queue is deep (or the dead letters and history many: a purge reads the rows it
--     deletes, not the table);
--   * jit = off: statements that take microseconds never pay for compilation. Never
--     one without the other: a disabled scan type adds a huge constant to a plan's
--     estimated cost, which then passes jit_above_cost (reading the one-row clock
--     table with enable_seqscan off and jit on took 15 to 78 ms: JIT compiled it).

CREATE FUNCTION fairq.message_create_batch(
    p_channels text[],
    p_contents bytea[],
    p_dequeue_ats timestamptz[] DEFAULT NULL,
    p_priorities integer[] DEFAULT NULL,
    p_dedup_keys text[] DEFAULT NULL,
    p_queue text DEFAULT 'default'
) RETURNS TABLE(ord integer, id bigint, status text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := fairq.clock();
    v_count integer := fairq.require_batch_array(fairq.require(p_channels, 'p_channels'), 'p_channels');
    v_queue_id integer;
    v_names text[];
    v_channel_ids bigint[];
    v_bounded fairq.channel[];
    v_made bigint[];         -- the channels this call made (fairq.channels_for_producer)
    v_woken bigint[];
    v_channel fairq.channel;
    v_channel_of bigint[];   -- per element: its channel's id
    v_first_of integer[];    -- per element: the first element with its channel and dedup key
    v_first_due_ats timestamptz[];  -- per element: its due time if it is that first, else NULL
    v_ids bigint[];          -- per element: the result
    v_statuses text[];
    v_candidates integer[];
    v_new_ids bigint[];
    v_inserted boolean[];
    v_row record;
    v_admitted integer;
    v_bad integer;
    i integer;
BEGIN
    PERFORM fairq.require_read_committed('fairq.message_create_batch'),
            fairq.require_batch_array(fairq.require(p_contents, 'p_contents'), 'p_contents', v_count, 'p_channels');
    PERFORM fairq.require_batch_array(p_dequeue_ats, 'p_dequeue_ats', v_count, 'p_channels');
    PERFORM fairq.require_batch_array(p_priorities, 'p_priorities', v_count, 'p_channels');
    PERFORM fairq.require_batch_array(p_dedup_keys, 'p_dedup_keys', v_count, 'p_channels');
    -- Each element as message_create checks its argument, the first bad one named.
    SELECT min(u.i) INTO v_bad
      FROM unnest(p_channels) WITH ORDINALITY AS u(channel, i)
     WHERE u.channel IS NULL OR u.channel = '' OR octet_length(u.channel) > 255;
    IF v_bad IS NOT NULL THEN
        PERFORM fairq.require_channel_name(p_channels[v_bad], format('p_channels[%s]', v_bad));
    END IF;
    SELECT min(u.i) INTO v_bad FROM unnest(p_contents) WITH ORDINALITY AS u(content, i)
     WHERE u.content IS NULL;
    IF v_bad IS NOT NULL THEN
        PERFORM fairq.require(p_contents[v_bad], format('p_contents[%s]', v_bad));
    END IF;
    SELECT min(u.i) INTO v_bad FROM unnest(p_dedup_keys) WITH ORDINALITY AS u(dedup_key, i)
     WHERE octet_length(u.dedup_key) > 1024;
    IF v_bad IS NOT NULL THEN
        PERFORM fairq.require_dedup_key(p_dedup_keys[v_bad], format('p_dedup_keys[%s]', v_bad));
    END IF;
    SELECT min(u.i) INTO v_bad FROM unnest(p_dequeue_ats) WITH ORDINALITY AS u(dequeue_at, i)
     WHERE NOT isfinite(u.dequeue_at);
    IF v_bad IS NOT NULL THEN
        PERFORM fairq.require_finite(p_dequeue_ats[v_bad], format('p_dequeue_ats[%s]', v_bad));
    END IF;

    IF v_count = 0 THEN
        -- Nothing to create, so no queue is made for it (queues.sql): the name is only
        -- checked.
        PERFORM fairq.require_channel_name(p_queue, 'p_queue');
        RETURN;
    END IF;
    v_queue_id := fairq.queue_for_producer(p_queue, 'p_queue');
    -- Per element: the first element with its channel and dedup key, and when it falls
    -- due if it is that first (a channel made below is made due by its earliest).
    SELECT array_agg(e.first_of ORDER BY e.i),
           array_agg(CASE WHEN e.first_of = e.i THEN coalesce(e.dequeue_at, v_now) END ORDER BY e.i)
      INTO v_first_of, v_first_due_ats
      FROM (SELECT u.i, u.dequeue_at,
                   CASE WHEN u.dedup_key IS NULL THEN u.i
                        ELSE min(u.i) OVER (PARTITION BY u.channel, u.dedup_key) END::integer AS first_of
              FROM unnest(p_channels, p_dedup_keys, p_dequeue_ats)
                   WITH ORDINALITY AS u(channel, dedup_key, dequeue_at, i)) e;
    -- Take every channel's producer lock (creating the channel on first use), or past
    -- fairq.bulk_channels() in this transaction the queue's bulk producer
    -- lock; they conflict only with channel_set/channel_clear and the pause calls,
    -- each of which holds them for one short call, and with the collector, which only
    -- tries them.
    SELECT coalesce(array_agg((f.channel).name ORDER BY (f.channel).id), '{}'),
           coalesce(array_agg((f.channel).id ORDER BY (f.channel).id), '{}'),
           coalesce(array_agg(f.channel ORDER BY (f.channel).id) FILTER (WHERE (f.channel).max_size IS NOT NULL), '{}'),
           coalesce(array_agg((f.channel).id) FILTER (WHERE f.made), '{}')
      INTO v_names, v_channel_ids, v_bounded, v_made
      FROM fairq.channels_for_producer(v_queue_id, p_channels, v_first_due_ats, v_now) AS f;
    v_channel_of := ARRAY(SELECT c.id
                            FROM unnest(p_channels) WITH ORDINALITY AS u(channel, i)
                            JOIN unnest(v_names, v_channel_ids) AS c(name, id) ON c.name = u.channel
                           ORDER BY u.i);
    v_ids := array_fill(NULL::bigint, ARRAY[v_count]);
    v_statuses := array_fill(NULL::text, ARRAY[v_count]);

    -- A dedup key that a live message of the channel already has: that message.
    IF p_dedup_keys IS NOT NULL THEN
        FOR v_row IN
            SELECT u.i, m.id
              FROM unnest(v_channel_of, p_dedup_keys) WITH ORDINALITY AS u(channel_id, dedup_key, i)
             CROSS JOIN LATERAL (SELECT m.id FROM fairq.message m  -- one probe per element
                                  WHERE m.channel_id = u.channel_id AND m.dedup_key = u.dedup_key
                                  LIMIT 1) m
        LOOP
            v_ids[v_row.i] := v_row.id;
            v_statuses[v_row.i] := 'duplicate';
        END LOOP;
    END IF;

    -- A bounded channel admits, in element order, only what fits under max_size.
    FOREACH v_channel IN ARRAY v_bounded LOOP
        v_candidates := ARRAY(
            SELECT u.i FROM unnest(v_channel_of, v_first_of, v_statuses) WITH ORDINALITY AS u(channel_id, first_of, status, i)
             WHERE u.channel_id = v_channel.id AND u.first_of = u.i AND u.status IS NULL ORDER BY u.i);
        v_admitted := fairq.channel_resize(v_channel, cardinality(v_candidates), true);
        FOR i IN v_admitted + 1 .. cardinality(v_candidates) LOOP
            v_statuses[v_candidates[i]] := 'dropped';
        END LOOP;
    END LOOP;

    -- Everything else is inserted in one statement. A conflict here means a
    -- concurrent producer committed the same dedup key meanwhile. (Only messages with
    -- a key are inserted with ON CONFLICT: a speculative insertion writes a
    -- confirmation record per row, a tenth of a create's WAL.)
    WITH candidate AS MATERIALIZED (
        SELECT x.*, nextval('fairq.message_id_seq') AS new_id
          FROM (SELECT u.i, u.channel_id, u.content, coalesce(u.dequeue_at, v_now) AS dequeue_at,
                       coalesce(u.priority, 0) AS priority, u.dedup_key
                  FROM unnest(v_channel_of, p_contents, p_dequeue_ats, p_priorities, p_dedup_keys,
                              v_first_of, v_statuses)
                       WITH ORDINALITY AS u(channel_id, content, dequeue_at, priority, dedup_key,
                                            first_of, status, i)
                 WHERE u.first_of = u.i AND u.status IS NULL
                 ORDER BY u.i
                OFFSET 0) x
    ), to_insert AS (
        SELECT c.i, c.new_id, c.channel_id,
               CASE WHEN c.dequeue_at <= v_now THEN 'ready' ELSE 'scheduled' END::fairq.message_status AS status,
               c.priority, c.dequeue_at, v_now AS created_at, c.dedup_key, c.content, v_queue_id AS queue_id
          FROM candidate c
    ), unkeyed AS (
        INSERT INTO fairq.message
            (id, channel_id, status, priority, dequeue_at, created_at, dedup_key, content, queue_id)
        SELECT r.new_id, r.channel_id, r.status, r.priority, r.dequeue_at, r.created_at, r.dedup_key,
               r.content, r.queue_id
          FROM to_insert r WHERE r.dedup_key IS NULL ORDER BY r.i
        RETURNING fairq.message.id
    ), keyed AS (
        INSERT INTO fairq.message
            (id, channel_id, status, priority, dequeue_at, created_at, dedup_key, content, queue_id)
        SELECT r.new_id, r.channel_id, r.status, r.priority, r.dequeue_at, r.created_at, r.dedup_key,
               r.content, r.queue_id
          FROM to_insert r WHERE r.dedup_key IS NOT NULL
         -- (A keyed insert waits for an uncommitted one of the same key: in element
         -- order, two batches listing shared keys in different orders waited for each
         -- other. One order for every batch, as for the channels' locks.)
         ORDER BY r.channel_id, r.dedup_key
        ON CONFLICT (channel_id, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING
        RETURNING fairq.message.id
    )
    SELECT coalesce(array_agg(c.i::integer ORDER BY c.i), '{}'),
           coalesce(array_agg(c.new_id ORDER BY c.i), '{}'),
           coalesce(array_agg(c.new_id IN (SELECT n.id FROM unkeyed n UNION ALL SELECT n.id FROM keyed n)
                              ORDER BY c.i), '{}')
      INTO v_candidates, v_new_ids, v_inserted
      FROM candidate c;
    FOR i IN 1 .. cardinality(v_candidates) LOOP
        IF v_inserted[i] THEN
            v_ids[v_candidates[i]] := v_new_ids[i];
            v_statuses[v_candidates[i]] := 'created';
        ELSE
            -- (An assignment: plpgsql's INTO takes no subscripted target, and 0.7.31
            -- failed here with 42804, "cannot subscript type bigint".)
            v_ids[v_candidates[i]] := (SELECT m.id FROM fairq.message m
                                        WHERE m.channel_id = v_channel_of[v_candidates[i]]
                                          AND m.dedup_key = p_dedup_keys[v_candidates[i]]);
            v_statuses[v_candidates[i]] := 'duplicate';
            SELECT * INTO v_channel FROM fairq.channel WHERE id = v_channel_of[v_candidates[i]];
            PERFORM fairq.channel_resize(v_channel, -1, false);
        END IF;
    END LOOP;

    -- A repeated dedup key within the batch shares its first element's fate.
    FOR i IN 1 .. v_count LOOP
        IF v_first_of[i] <> i THEN
            v_ids[i] := v_ids[v_first_of[i]];
            v_statuses[i] := CASE WHEN v_statuses[v_first_of[i]] = 'dropped' THEN 'dropped' ELSE 'duplicate' END;
        END IF;
    END LOOP;

    -- Wake the channels whose turn the created messages bring forward: each by the
    -- earliest of its created messages.
    SELECT fairq.channels_wake(v_queue_id, coalesce(array_agg(e.channel_id ORDER BY e.channel_id), '{}'),
                               array_agg(e.earliest ORDER BY e.channel_id), v_now, v_made)
      INTO v_woken
      FROM (SELECT u.channel_id, min(coalesce(u.dequeue_at, v_now)) AS earliest
              FROM unnest(v_channel_of, v_statuses, p_dequeue_ats) AS u(channel_id, status, dequeue_at)
             WHERE u.status = 'created'
             GROUP BY u.channel_id) e;

    -- A message wakes workers only where its channel's turn moved earlier, and only
    -- when one may sleep (asked once per call); with the doorbell, one event at most
    -- (fairq.events_per_queue). (Elements grouped by channel first,
    -- woken ones found through a hashed set, names looked up by id: a join of the two
    -- arrays, planned as a nested loop, tested every woken id for every pair, and a
    -- batch of 4,000 new channels took 88 s while a worker slept.)
    IF fairq.events_wanted(cardinality(v_woken) > 0) THEN
        IF fairq.worker_may_sleep(p_queue) THEN
            PERFORM fairq.notify_event('created', v_queue_id, c.name, g.first_id, g.first_due)
               FROM (SELECT u.channel_id, min(u.id) AS first_id,
                            min(coalesce(u.dequeue_at, v_now)) AS first_due
                       FROM unnest(v_channel_of, v_ids, v_statuses, p_dequeue_ats)
                            AS u(channel_id, id, status, dequeue_at)
                      WHERE u.status = 'created'
                      GROUP BY u.channel_id
                     HAVING fairq.events_wanted(u.channel_id IN (SELECT w.id FROM unnest(v_woken) AS w(id)))
                      ORDER BY first_due, first_id
                      LIMIT fairq.events_per_queue()) g
               JOIN fairq.channel c ON c.id = g.channel_id;
        END IF;
    END IF;

    RETURN QUERY SELECT g.i::integer, v_ids[g.i], v_statuses[g.i] FROM generate_series(1, v_count) AS g(i);
END
$$;

CREATE FUNCTION fairq.message_create(
    p_channel text,
    p_content bytea,
    p_dequeue_at timestamptz DEFAULT NULL,
    p_priority integer DEFAULT 0,
    p_dedup_key text DEFAULT NULL,
    p_queue text DEFAULT 'default'
) RETURNS TABLE(id bigint, status text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := fairq.clock();
    v_due_at timestamptz := coalesce(p_dequeue_at, v_now);
    v_queue_id integer;
    v_channel fairq.channel;
    v_made boolean := false;  -- this call made the channel, due (fairq.channels_for_producer)
    v_for_producer record;
    v_in_bulk boolean;  -- this transaction holds its queue's bulk producer lock instead
    v_settling boolean;  -- a call is deciding whether the channel goes idle
    v_wakes boolean;  -- the message brings its channel's turn forward: a wake is queued
    v_id bigint;
    v_duplicate bigint;  -- the live message that already has p_dedup_key
    v_done boolean;  -- what the checks return (validate.sql)
BEGIN
    -- (The checks in argument order. The optional values may be NULL: each is compared
    -- with itself, so that the AND goes on.)
    v_done := fairq.require_read_committed('fairq.message_create')
              AND fairq.require_channel_name(p_channel, 'p_channel') IS NOT NULL
              AND fairq.require(p_content, 'p_content') IS NOT NULL
              AND fairq.require_dedup_key(p_dedup_key, 'p_dedup_key') IS NOT DISTINCT FROM p_dedup_key
              AND fairq.require_finite(p_dequeue_at, 'p_dequeue_at') IS NOT DISTINCT FROM p_dequeue_at;
    -- (A known queue is looked up here: a plpgsql call per message cost more than
    -- the lookup.)
    v_queue_id := coalesce((SELECT q.id FROM fairq.queue q WHERE q.name = p_queue),
                           fairq.queue_for_producer(p_queue, 'p_queue'));
    -- The producer lock first, as in the batch path: under it the row read next
    -- cannot be collected, and its max_size cannot change (channel_set takes the
    -- lock exclusively). Then the settle lock's try, and the
    -- question whether the queue is being settled in bulk, before the row is read:
    -- while the lock is held, and unless that answer is yes, the channel stays as due
    -- as read here (fairq.channels_wake, which also queues the wake when it is not). A
    -- transaction bulk for producer locks (or going bulk with this channel) holds its
    -- queue's bulk producer lock instead, and queues the wake.
    v_in_bulk := fairq.producing_in_bulk(v_queue_id, 1);
    IF v_in_bulk THEN
        v_settling := true;
    ELSE
        -- (One assignment, not a statement: validate.sql.)
        v_settling := NOT (pg_advisory_xact_lock_shared(fairq.producer_lock_class(),
                                                        fairq.producer_lock_key(v_queue_id, p_channel)) IS NOT NULL
                           AND fairq.settle_lock_try_shared(v_queue_id, p_channel));
        v_settling := v_settling OR fairq.bulk_settling(v_queue_id);  -- after the settle lock
    END IF;
    SELECT * INTO v_channel FROM fairq.channel c WHERE c.queue_id = v_queue_id AND c.name = p_channel;
    IF v_channel.id IS NULL THEN
        SELECT * INTO v_for_producer
          FROM fairq.channels_for_producer(v_queue_id, ARRAY[p_channel], ARRAY[v_due_at], v_now, v_in_bulk);
        v_channel := v_for_producer.channel;
        v_made := v_for_producer.made;
    END IF;
    IF v_channel.max_size IS NOT NULL THEN
        -- A bounded channel: the batch path's admission under max_size.
        RETURN QUERY
            SELECT b.id, b.status
              FROM fairq.message_create_batch(ARRAY[p_channel], ARRAY[p_content],
                                              ARRAY[p_dequeue_at], ARRAY[p_priority],
                                              ARRAY[p_dedup_key], p_queue) AS b;
        RETURN;
    END IF;
    -- The batch path's order, for one message: look for a live message with the same
    -- dedup key, insert, then queue the channel's wake if the message needs one.
    IF p_dedup_key IS NULL THEN
        -- (No ON CONFLICT without a key: a speculative insertion writes a confirmation
        -- record per row, a tenth of a create's WAL, for a conflict that cannot happen.)
        INSERT INTO fairq.message (channel_id, status, priority, dequeue_at, created_at, content, queue_id)
        VALUES (v_channel.id,
                CASE WHEN v_due_at <= v_now THEN 'ready' ELSE 'scheduled' END::fairq.message_status,
                coalesce(p_priority, 0), v_due_at, v_now, p_content, v_queue_id)
        RETURNING fairq.message.id INTO v_id;
    ELSE
        SELECT m.id INTO v_duplicate FROM fairq.message m
         WHERE m.channel_id = v_channel.id AND m.dedup_key = p_dedup_key;
        IF v_duplicate IS NULL THEN
            INSERT INTO fairq.message (channel_id, status, priority, dequeue_at, created_at, dedup_key,
                                       content, queue_id)
            VALUES (v_channel.id,
                    CASE WHEN v_due_at <= v_now THEN 'ready' ELSE 'scheduled' END::fairq.message_status,
                    coalesce(p_priority, 0), v_due_at, v_now, p_dedup_key, p_content, v_queue_id)
            ON CONFLICT (channel_id, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING
            RETURNING fairq.message.id INTO v_id;
        END IF;
        IF v_id IS NULL THEN
            IF v_duplicate IS NULL THEN  -- another producer committed the key since the lookup
                SELECT m.id INTO v_duplicate FROM fairq.message m
                 WHERE m.channel_id = v_channel.id AND m.dedup_key = p_dedup_key;
            END IF;
            RETURN QUERY SELECT v_duplicate, 'duplicate'::text;
            RETURN;
        END IF;
    END IF;
    -- The wake, by fairq.channels_wake's rules for one channel, in one statement: its
    -- look (fairq.wake_candidates, which counts the wakes queued already, this
    -- transaction's too) comes after the producer lock and the settle lock's try, as
    -- channels_wake's first look does, and a channel that needs a wake at it, or is
    -- being settled, gets one whatever a later look would say (a second wake is
    -- harmless), so no later look is taken (with it, a sparse tenant's create took
    -- 110 µs rather than 80). A transaction gone bulk queues one wake per channel:
    -- channels_wake knows which it queued.
    IF v_made THEN
        v_wakes := true;
    ELSIF NOT (v_settling
               OR fairq.needs_wake(fairq.due_for_producers(v_channel.due_at, v_channel.turn_at,
                                                           v_channel.paused_until, v_channel.last_release_at,
                                                           v_channel.release_interval_ms, v_now),
                                   v_due_at, v_now)) THEN
        v_wakes := false;
    ELSIF v_in_bulk THEN
        v_wakes := cardinality(fairq.channels_wake(v_queue_id, ARRAY[v_channel.id], ARRAY[v_due_at],
                                                   v_now)) > 0;
    ELSE
        INSERT INTO fairq.channel_wake (channel_id, due_at, woken_at, turn_seq, queue_id)
        SELECT k.id, k.due_at, v_now, nextval('fairq.turn_seq'), k.queue_id
          FROM fairq.wake_candidates(ARRAY[v_channel.id], ARRAY[v_due_at], v_now) AS k
         WHERE v_settling OR fairq.needs_wake(k.pending_due_at, k.due_at, v_now);
        v_wakes := FOUND;
    END IF;
    IF fairq.events_wanted(v_wakes) THEN
        IF fairq.worker_may_sleep(p_queue) THEN
            PERFORM fairq.notify_event('created', v_queue_id, p_channel, v_id, v_due_at);
        END IF;
    END IF;
    id := v_id;
    status := 'created';
    RETURN NEXT;
END
$$;

COMMENT ON FUNCTION fairq.message_create(text, bytea, timestamptz, integer, text, text) IS
    'Puts a message on a channel of queue p_queue (both created on first use). Returns (id, created), (id of the existing message, duplicate) for a live dedup key, or (NULL, dropped) when the channel is at max_size.';
COMMENT ON FUNCTION fairq.message_create_batch(text[], bytea[], timestamptz[], integer[], text[], text) IS
    'message_create for many messages at once, all to queue p_queue: one row per input element (ord = 1-based position). NULL elements of the optional arrays mean the defaults.';

-- ==== sql/dequeue.sql ====

-- dequeue.sql — handing out messages: the whole scheduling algorithm.
--
-- A dequeue serves one queue (p_queue): every lookup below starts with its id, so
-- other queues' messages and channels cost it nothing. *When* a channel may be
-- served and *in what order* channels are served are kept apart: the rules of
-- turns, the rotation and weights are in turns.sql. One call, in order:
--   1. Recover expired locks (oldest first, at most p_max_messages per call): each
--      message goes back to 'ready' in its channel, frees its concurrency slot and
--      waits for the channel's next turn like any other message — a crash never lets
--      one tenant's recovered work jump the round-robin. (Past max_attempts it is
--      buried instead.) Then, if the queue is paused, the call hands out nothing.
--   2. Channels whose wait is over join the rotation, earliest first, as many as
--      messages are wanted (fairq.join_rotation): among them the idle channels that
--      producers woke (their queued wakes are applied in the same write), each
--      placed as if it had joined when its producer gave it its turn. Then take the
--      channels first in the rotation (by pass), as many as messages are still
--      wanted: one scan of channel_turn_ix (queue_id, turn_at, turn_pass, turn_seq).
--      (A call for one message whose one joining channel, waiting or woken, would be
--      first in the rotation takes that channel without writing it into the
--      rotation: it is served from where it joins, its row written once.) Channels
--      at max_concurrency, rate-limited, paused or with nothing due are not in the
--      rotation, so they cost nothing.
--      SKIP LOCKED spreads concurrent dequeues over channels. A channel placed in
--      the rotation after this call read its clock is served at a fresh clock (its
--      release is recorded at that clock). A pick that finds
--      nothing reads the clock again and picks once more: a call that started later
--      may have served a channel meanwhile and made it wait until that later time.
--      If every eligible channel is busy with another call, a call that holds no lock
--      yet waits briefly for one to be released and picks again (with a new clock,
--      unless the queue was paused meanwhile), instead of answering "empty" while
--      work is waiting.
--   3. In those channels, promote scheduled messages that have come due to 'ready'
--      (so priority orders everything due, and a future message waits however
--      urgent), bury heads that would exceed max_attempts, then lock each channel's
--      best ready message: one lookup on message_ready_ix (priority DESC,
--      dequeue_at, id) per channel. A call promotes a bounded number of a channel's
--      messages, so that a campaign of a million messages due at one instant costs
--      each call a few ms, not one call seconds (past a statement_timeout, every
--      dequeue that picked the channel failed, and it stayed first in the rotation):
--      the first fairq.promotions_per_serve() due, and, when more than that are due,
--      the first by priority (message_scheduled_priority_ix), as many as the call may
--      hand out and at least that bound. The best due message is then ready: any left
--      scheduled comes after every message promoted by priority.
--   4. Give each served channel its next turn: while it may be served again at once
--      it stays in the rotation, moved on by its stride (1,000,000 / weight); else it
--      waits (until now + release_interval_ms, its next message's due time, its
--      pause's end, or a freed slot when full) and then joins again at the back
--      (but a channel full with work due keeps its place: turns.sql). A
--      channel that had nothing to hand out gets its turn recomputed (a cancelled
--      head; one that another transaction holds puts the channel off a while:
--      fairq.channel_retire).
-- Serving k channels once each, in rotation order, is exactly what k single
-- dequeues in a row do as long as none of them comes round again before the k-th:
-- so a call with p_max_messages = n serves, in each round, the channels picked up to
-- the first whose pass lies beyond an earlier one's next pass (with weight 1
-- everywhere that is every channel picked), and repeats rounds until n messages are
-- out or no channel is eligible. It equals n single dequeues.
-- Last, once a second across all dequeues, it removes channels idle for a while
-- (fairq.collect_idle_channels), so the channel table stays as large as the set of
-- tenants active lately.
-- A dequeue should run in its own transaction: it locks the channels it serves
-- until commit.

-- The max_attempts rule, for steps 1 and 3: a message may be handed out while the
-- deliveries since it was created or last retried from the dead letters
-- (num_attempts - attempts_at_retry) are fewer than its channel's max_attempts.
-- num_attempts itself never goes back: it is the fencing token, and a holder from
-- before a retry must stay fenced out. Returns NULL while the message may be handed
-- out again, else why it dies (for its dead letter's error).
CREATE FUNCTION fairq.attempts_exhausted(p_num_attempts bigint, p_attempts_at_retry bigint,
                                         p_max_attempts integer, p_lock_expired boolean) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN p_max_attempts IS NULL OR p_num_attempts - p_attempts_at_retry < p_max_attempts THEN NULL
        WHEN p_lock_expired THEN format('lock expired on delivery %s of max_attempts %s',
                                        p_num_attempts - p_attempts_at_retry, p_max_attempts)
        ELSE format('max_attempts %s reached after %s deliveries', p_max_attempts,
                    p_num_attempts - p_attempts_at_retry)
    END || CASE WHEN p_attempts_at_retry > 0
                THEN format(' since the last retry (%s in all)', p_num_attempts) ELSE '' END
$$;

-- Step 1. Returns how many expired messages it locked: those it settled, and those
-- whose channel was busy, left to a later dequeue. The caller holds the locks of
-- both until it commits, so it must not wait for another call after this
-- (fairq.wait_for_release): the holder completing such a message waits for it.
CREATE FUNCTION fairq.recover_expired(p_queue_id integer, p_now timestamptz, p_limit integer) RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    v_message fairq.message;
    v_channel fairq.channel;
    v_exhausted text;
    v_count integer := 0;
BEGIN
    FOR v_message IN
        -- (Only locked messages have a locked_until: message_locked_ix is keyed on it.)
        SELECT * FROM fairq.message
         WHERE queue_id = p_queue_id AND locked_until <= p_now
         ORDER BY locked_until
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED
    LOOP
        SELECT * INTO v_channel FROM fairq.channel
         WHERE id = v_message.channel_id FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            v_count := v_count + 1;  -- its channel is busy; a later dequeue recovers it
            CONTINUE;
        END IF;
        v_channel := fairq.channel_with_wakes(v_channel);
        v_exhausted := fairq.attempts_exhausted(v_message.num_attempts, v_message.attempts_at_retry,
                                                v_channel.max_attempts, true);
        IF v_exhausted IS NOT NULL THEN
            DELETE FROM fairq.message WHERE id = v_message.id;
            PERFORM fairq.bury(v_message, v_channel, v_exhausted, p_now);
            PERFORM fairq.channel_unlock(v_channel, 1, NULL, p_now);
        ELSE
            UPDATE fairq.message SET status = 'ready', locked_until = NULL, recovered = true
             WHERE id = v_message.id;
            PERFORM fairq.channel_unlock(v_channel, 1, v_message.dequeue_at, p_now);
        END IF;
        v_count := v_count + 1;
    END LOOP;
    RETURN v_count;
END
$$;

-- Step 3's burial: heads of the given channels that one more delivery would take past
-- max_attempts (a deferred message on its last attempt, or a lowered limit) die
-- instead, until every head may be delivered.
CREATE FUNCTION fairq.bury_exhausted_heads(p_channel_ids bigint[], p_now timestamptz)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_message fairq.message;
    v_channel fairq.channel;
    v_buried boolean := true;
BEGIN
    WHILE v_buried LOOP
        v_buried := false;
        FOR v_message IN
            SELECT h.*
              FROM fairq.channel c
             CROSS JOIN LATERAL (
                   SELECT * FROM fairq.message m
                    WHERE m.channel_id = c.id AND m.status = 'ready'
                    ORDER BY m.priority DESC, m.dequeue_at, m.id
                    LIMIT 1
                      FOR UPDATE SKIP LOCKED) h
             WHERE c.id = ANY (p_channel_ids) AND c.max_attempts IS NOT NULL
               AND fairq.attempts_exhausted(h.num_attempts, h.attempts_at_retry, c.max_attempts,
                                            false) IS NOT NULL
        LOOP
            SELECT * INTO v_channel FROM fairq.channel WHERE id = v_message.channel_id;
            DELETE FROM fairq.message WHERE id = v_message.id;
            PERFORM fairq.bury(v_message, v_channel,
                               fairq.attempts_exhausted(v_message.num_attempts, v_message.attempts_at_retry,
                                                        v_channel.max_attempts, false), p_now);
            v_buried := true;
        END LOOP;
    END LOOP;
END
$$;

-- Step 2's fallback, for a call that holds no lock yet: every eligible channel is
-- locked, normally by other calls that take milliseconds. Wait until the first of
-- them is released, then let the caller pick again with SKIP LOCKED. The wait is
-- for that one row, by id, in a subtransaction that is always rolled back, so the
-- waiter never holds a row lock:
--   * a locking scan (... ORDER BY turn LIMIT 1 FOR UPDATE) that waits for a row
--     whose new version no longer qualifies keeps that row locked and waits for the
--     next one; two such waiters deadlocked, or stalled until lock_timeout (seen in
--     the bench as light tenants' p99 wait of 150-190 ms);
--   * when a dequeue commits, every call waiting behind it wakes at once instead of
--     receiving the row one after another.
-- "Eligible" is judged by a clock read after the statement's snapshot (the
-- subquery runs once, as the scan starts): every turn it can see was given by a call
-- that read its clock before committing, so a channel that is due now is never taken
-- for a future one. With no eligible channel, the channel of the oldest due wake is
-- waited for: another dequeue may be applying that wake. Not past p_until: a channel
-- held longer is held by a user transaction, and the honest answer is then "nothing
-- available". True when the caller should pick again. (lock_timeout takes at most
-- 2^31 - 1 ms: a longer fairq.dequeue_busy_wait, which may be up to 1,000 years,
-- waits that long, about 24.8 days; 0.7.31 failed with lock_timeout's error.)
CREATE FUNCTION fairq.wait_for_release(p_queue_id integer, p_until timestamptz) RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    v_wait_ms bigint := LEAST(ceil(extract(epoch FROM p_until - clock_timestamp()) * 1000),
                              2147483647);
    v_first bigint := coalesce(
        (SELECT c.id FROM fairq.channel c
          WHERE c.queue_id = p_queue_id AND c.turn_at <= (SELECT fairq.clock())
          ORDER BY c.turn_at, c.turn_pass, c.turn_seq LIMIT 1),
        (SELECT w.channel_id FROM fairq.channel_wake w
          WHERE w.queue_id = p_queue_id AND GREATEST(w.due_at, w.woken_at) <= (SELECT fairq.clock())
          ORDER BY GREATEST(w.due_at, w.woken_at), w.turn_seq LIMIT 1));
BEGIN
    IF v_first IS NULL OR v_wait_ms <= 0 THEN
        RETURN false;
    END IF;
    BEGIN
        -- Local to the subtransaction: its rollback restores the caller's setting.
        PERFORM set_config('lock_timeout', v_wait_ms || 'ms', true);
        PERFORM FROM fairq.channel c WHERE c.id = v_first FOR NO KEY UPDATE;
        RAISE EXCEPTION USING ERRCODE = 'FQ001';  -- rolls back the lock just taken
    EXCEPTION
        WHEN SQLSTATE 'FQ001' THEN
            RETURN true;
        WHEN lock_not_available THEN
            RETURN false;
    END;
END
$$;

-- Step 2's round: of the channels picked (in rotation order, with their weights),
-- how many n single dequeues would serve one after the other before any of them
-- comes round again: up to the first channel that waits to join, or whose pass lies
-- beyond the next pass of a channel before it (equal passes: the one already there
-- goes first). At least one.
CREATE FUNCTION fairq.round_length(p_turn_ats timestamptz[], p_passes bigint[], p_weights integer[])
RETURNS integer
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v_next_pass bigint;  -- the lowest next pass of the channels before
BEGIN
    FOR i IN 1 .. cardinality(p_passes) LOOP
        IF i > 1 AND (p_turn_ats[i] <> fairq.in_rotation() OR p_passes[i] > v_next_pass) THEN
            RETURN i - 1;
        END IF;
        IF p_turn_ats[i] <> fairq.in_rotation() THEN
            RETURN 1;  -- a channel still waiting to join (left over by join_rotation) goes alone
        END IF;
        v_next_pass := LEAST(v_next_pass, p_passes[i] + fairq.turn_stride(p_weights[i]));
    END LOOP;
    RETURN cardinality(p_passes);
END
$$;

-- Step 3's bound: how many of a channel's scheduled messages that have come due a
-- call moves to 'ready' by due time, and at least how many by priority when more
-- are due (about 5 µs each).
CREATE FUNCTION fairq.promotions_per_serve() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1000 $$;

CREATE FUNCTION fairq.message_dequeue(p_lock_ms bigint, p_max_messages integer DEFAULT 1,
                                      p_queue text DEFAULT 'default')
RETURNS TABLE(id bigint, channel text, content bytea, state bytea, num_attempts bigint,
              priority integer, dequeue_at timestamptz, recovered boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := fairq.clock();
    v_lock interval := fairq.ms(fairq.require_duration(p_lock_ms, 1, 'p_lock_ms'));
    v_queue_id integer;
    v_paused_until timestamptz;
    v_expired boolean;  -- the queue's earliest lock has expired
    v_joiners boolean;  -- fairq.join_rotation has channels to let join
    v_join record;  -- what fairq.join_rotation did
    v_first_id bigint;  -- a channel to serve first, not yet written into the rotation
    v_first_pass bigint;  -- the pass it joins at
    v_wait_until timestamptz;
    v_picked bigint[];
    v_picked_names text[];
    v_latest_given timestamptz;  -- the latest turn_given_at of the channels picked
    v_turn_ats timestamptz[];
    v_passes bigint[];
    v_weights integer[];
    v_ids bigint[];
    v_served bigint[];
    v_served_names text[];
    v_served_seqs bigint[];
    v_visited bigint[] := '{}';
    v_turn_seqs bigint[];
    v_pos integer;
    v_handed_out integer;  -- by a statement that locked one channel's head
    v_count integer := 0;
    v_holds_locks boolean := false;
    v_clock_fresh boolean := false;  -- v_now was read after the last pick that found something
    v_attempts_capped boolean;
    v_woken boolean;  -- a picked channel may have wakes queued
    v_scheduled_due boolean;  -- a picked channel may have scheduled messages come due
    v_promoted integer;  -- scheduled messages of the picked channels moved to 'ready'
    v_flooded bigint[] := '{}';  -- channels promoted by priority at v_flooded_at (step 3)
    v_flooded_at timestamptz;
    v_uneven boolean;  -- the round may end before the last channel picked
    v_collect boolean;  -- the collector's turn was due when the call began
    v_done boolean;  -- what the checks return (validate.sql)
BEGIN
    v_done := fairq.require_read_committed('fairq.message_dequeue')
              AND fairq.require_at_least(p_max_messages, 1, 'p_max_messages') IS NOT NULL;
    -- The queue, and three questions, in one statement (each statement costs):
    --   * has its earliest lock expired (one probe of message_locked_ix)?
    --   * would fairq.join_rotation find anything: a channel whose wait is over, or a
    --     queued wake? On a busy queue every due channel is already in the rotation,
    --     and two probes cost less than the call;
    --   * is the collector's turn due (read without its lock, taken at the end)?
    SELECT q.id, q.paused_until,
           (SELECT m.id FROM fairq.message m
             WHERE m.queue_id = q.id AND m.locked_until <= v_now
             ORDER BY m.locked_until LIMIT 1) IS NOT NULL,
           EXISTS (SELECT 1 FROM fairq.channel c
                    WHERE c.queue_id = q.id
                      AND c.turn_at > fairq.in_rotation() AND c.turn_at <= v_now)
           OR EXISTS (SELECT 1 FROM fairq.channel_wake w WHERE w.queue_id = q.id),
           EXISTS (SELECT 1 FROM fairq.channel_collection k WHERE k.collected_at <= v_now - interval '1 s')
      INTO v_queue_id, v_paused_until, v_expired, v_joiners, v_collect
      FROM fairq.queue q WHERE q.name = p_queue;
    IF NOT FOUND THEN
        PERFORM fairq.require_channel_name(p_queue, 'p_queue');
        RETURN;  -- nobody has named this queue yet: nothing in it
    END IF;
    -- Step 1. (A recovered message's channel may now wait to join; the call holds
    -- the locks recovery took.)
    IF v_expired AND fairq.recover_expired(v_queue_id, v_now, p_max_messages) > 0 THEN
        v_holds_locks := true;
        v_joiners := true;
    END IF;
    IF v_paused_until > v_now THEN
        v_count := p_max_messages;  -- a paused queue hands nothing out
    ELSIF v_joiners THEN
        v_join := fairq.join_rotation(v_queue_id, v_now, p_max_messages, p_max_messages = 1);
        v_holds_locks := v_join.took OR v_holds_locks;
        v_first_id := v_join.first_id;
        v_first_pass := v_join.first_pass;
    END IF;

    WHILE v_count < p_max_messages LOOP
        IF v_first_id IS NOT NULL THEN
            -- Step 2 for the channel fairq.join_rotation found first (this call holds it):
            -- picked alone, where it joins.
            v_picked := ARRAY[v_first_id];
            v_picked_names := ARRAY[v_join.first_name];
            v_attempts_capped := v_join.first_capped;
            v_uneven := false;
            v_turn_seqs := ARRAY[nextval('fairq.turn_seq')];
            v_latest_given := NULL;
            -- (Its wakes were spent as it joined: any queued since?)
            v_woken := EXISTS (SELECT 1 FROM fairq.channel_wake w WHERE w.channel_id = v_first_id);
            v_scheduled_due := true;
        ELSE
            -- Step 2. (The aggregates take the rows in the order the subquery gives them,
            -- the rotation order: PostgreSQL's sorted-subquery idiom, without a sort of
            -- their own.)
            SELECT coalesce(array_agg(p.id), '{}'), coalesce(array_agg(p.name), '{}'),
                   coalesce(bool_or(p.max_attempts IS NOT NULL), false),
                   -- Only different weights, or a channel still waiting to join, can end a
                   -- round early (fairq.round_length).
                   count(*) > 1 AND (bool_or(p.turn_at <> fairq.in_rotation())
                                     OR min(p.weight) <> max(p.weight)),
                   -- The turn_seq of each picked channel, taken in pick order: served or
                   -- not, each takes its next turn in the order n single dequeues would
                   -- give it.
                   coalesce(array_agg(nextval('fairq.turn_seq')), '{}'),
                   max(p.turn_given_at),
                   -- Whether steps 2 and 3 below have anything to do, asked here: two
                   -- probes of an index cost less than the two statements. (A wake or a
                   -- scheduled message committed after this snapshot is one committed a
                   -- moment later: the next serve of the channel folds or promotes it.)
                   coalesce(bool_or(EXISTS (SELECT 1 FROM fairq.channel_wake w WHERE w.channel_id = p.id)),
                            false),
                   coalesce(bool_or(EXISTS (SELECT 1 FROM fairq.message s
                                             WHERE s.channel_id = p.id AND s.status = 'scheduled'
                                               AND s.dequeue_at <= v_now)), false)
              INTO v_picked, v_picked_names, v_attempts_capped, v_uneven, v_turn_seqs, v_latest_given,
                   v_woken, v_scheduled_due
              FROM (SELECT c.id, c.name, c.turn_at, c.turn_pass, c.turn_seq, c.weight, c.max_attempts,
                           c.turn_given_at
                      FROM fairq.channel c
                     WHERE c.queue_id = v_queue_id AND c.turn_at <= v_now AND c.id <> ALL (v_visited)
                     ORDER BY c.turn_at, c.turn_pass, c.turn_seq
                     LIMIT p_max_messages - v_count
                       FOR NO KEY UPDATE SKIP LOCKED) p;
        END IF;
        IF cardinality(v_picked) = 0 THEN
            -- A call that read the clock after this one may have served a channel
            -- meanwhile and given it its next turn at that later clock (so may a
            -- completion that freed a slot): read the clock again and look once more
            -- before answering "nothing available" or waiting.
            IF NOT v_clock_fresh THEN
                v_now := fairq.clock();
                v_clock_fresh := true;
                v_holds_locks := (fairq.join_rotation(v_queue_id, v_now, p_max_messages - v_count)).took
                                 OR v_holds_locks;
                CONTINUE;
            END IF;
            EXIT WHEN v_holds_locks;
            -- How long, in all, a call waits for busy channels: the setting
            -- fairq.dequeue_busy_wait (an interval, default 200 ms). Longer means a user
            -- transaction holds the channel, and the answer is "nothing available".
            v_wait_until := coalesce(v_wait_until, clock_timestamp()
                + fairq.setting_duration('fairq.dequeue_busy_wait', interval '200 ms'));
            EXIT WHEN NOT fairq.wait_for_release(v_queue_id, v_wait_until);
            -- The call we waited for may have applied a wake, or left one free to apply,
            -- and gave its channel a turn at its own clock. This call goes on with a new
            -- clock: a channel that joins the rotation now is served at that clock, never
            -- at the one read before the wait (a rate limit counts from the release).
            -- A queue paused meanwhile hands nothing more out (until 0.7.37 a dequeue
            -- that had waited for a busy channel served it after the pause committed).
            v_now := fairq.clock();
            EXIT WHEN fairq.queue_paused(v_queue_id, v_now);
            v_holds_locks := (fairq.join_rotation(v_queue_id, v_now, p_max_messages - v_count)).took;
            v_clock_fresh := false;
            CONTINUE;
        END IF;
        -- A channel that another call gave its place after this one read its clock (at a
        -- later clock: a rate-limited channel joins at the end of its interval) is
        -- served at a clock no earlier than that place. The release is recorded at this
        -- clock, and a rate limit counts from it: with the older clock, two releases
        -- were recorded closer than release_interval_ms.
        IF v_latest_given > v_now THEN
            v_now := fairq.clock();
            v_scheduled_due := true;  -- (asked at the older clock)
        END IF;
        v_clock_fresh := false;
        v_holds_locks := true;
        -- This round serves the channels that single dequeues would serve in a row;
        -- the others stay locked by this call and are picked again.
        IF v_uneven THEN
            SELECT array_agg(c.turn_at ORDER BY p.pos), array_agg(c.turn_pass ORDER BY p.pos),
                   array_agg(c.weight ORDER BY p.pos)
              INTO v_turn_ats, v_passes, v_weights
              FROM unnest(v_picked) WITH ORDINALITY AS p(id, pos)
             CROSS JOIN LATERAL (SELECT k.turn_at, k.turn_pass, k.weight FROM fairq.channel k
                                  WHERE k.id = p.id OFFSET 0) c;
            v_pos := fairq.round_length(v_turn_ats, v_passes, v_weights);
            v_picked := v_picked[1 : v_pos];
            v_picked_names := v_picked_names[1 : v_pos];
            v_turn_seqs := v_turn_seqs[1 : v_pos];
        END IF;
        -- Wakes still queued for the picked channels happened before this serve.
        IF v_woken THEN
            PERFORM fairq.fold_wakes(v_picked);
        END IF;

        -- Step 3. (SKIP LOCKED: a message being cancelled stays put.) More promoted
        -- than one channel's bound means a channel had more due: the second statement
        -- promotes, in each channel, the first by priority (none where all were in),
        -- as many as this call may serve; so later rounds of the call, at the same
        -- clock, need promote nothing more in those channels.
        IF v_scheduled_due AND NOT (v_flooded_at = v_now AND v_picked <@ v_flooded) THEN
            UPDATE fairq.message m SET status = 'ready'
             WHERE m.id = ANY (ARRAY(
                   SELECT s.id FROM unnest(v_picked) AS p(id)
                    CROSS JOIN LATERAL (
                          SELECT s.id FROM fairq.message s
                           WHERE s.channel_id = p.id AND s.status = 'scheduled'
                             AND s.dequeue_at <= v_now
                           ORDER BY s.dequeue_at, s.id
                           LIMIT fairq.promotions_per_serve() + 1
                             FOR UPDATE SKIP LOCKED) s));
            GET DIAGNOSTICS v_promoted = ROW_COUNT;
            IF v_promoted > fairq.promotions_per_serve() THEN
                UPDATE fairq.message m SET status = 'ready'
                 WHERE m.id = ANY (ARRAY(
                       SELECT s.id FROM unnest(v_picked) AS p(id)
                        CROSS JOIN LATERAL (
                              -- (The due test is kept out of the index conditions, as a
                              -- filter: planned while few messages were due, a scan of
                              -- message_scheduled_ix by due time with a sort read every
                              -- due message of the channel at each call.)
                              SELECT s.id FROM fairq.message s
                               WHERE s.channel_id = p.id AND s.status = 'scheduled'
                                 AND s.dequeue_at + interval '0 s' <= v_now
                               ORDER BY s.priority DESC, s.dequeue_at, s.id
                               LIMIT GREATEST(fairq.promotions_per_serve(), p_max_messages)
                                 FOR UPDATE SKIP LOCKED) s));
                v_flooded := v_picked;
                v_flooded_at := v_now;
            END IF;
        END IF;
        IF v_attempts_capped THEN
            PERFORM fairq.bury_exhausted_heads(v_picked, v_now);
        END IF;
        -- Each picked channel's best ready message is locked and handed out, in pick
        -- order. One channel (a single dequeue, or a round of one) takes one statement:
        -- the two below, with their arrays, joins and sort, cost a tenth of a
        -- one-message dequeue more.
        IF cardinality(v_picked) = 1 THEN
            RETURN QUERY
                UPDATE fairq.message m
                   SET status = 'locked', locked_until = v_now + v_lock,
                       num_attempts = m.num_attempts + 1,
                       first_dequeued_at = coalesce(m.first_dequeued_at, v_now)
                 WHERE m.id = (SELECT s.id FROM fairq.message s
                                WHERE s.channel_id = v_picked[1] AND s.status = 'ready'
                                ORDER BY s.priority DESC, s.dequeue_at, s.id
                                LIMIT 1
                                  FOR UPDATE SKIP LOCKED)
                RETURNING m.id, v_picked_names[1], m.content, m.state, m.num_attempts, m.priority,
                          m.dequeue_at, m.recovered;
            GET DIAGNOSTICS v_handed_out = ROW_COUNT;
            v_served := v_picked[1 : v_handed_out];
            v_served_names := v_picked_names[1 : v_handed_out];
            v_served_seqs := v_turn_seqs[1 : v_handed_out];
        ELSE
            SELECT coalesce(array_agg(x.id), '{}'), coalesce(array_agg(x.channel_id), '{}'),
                   coalesce(array_agg(x.name), '{}'), coalesce(array_agg(x.turn_seq), '{}')
              INTO v_ids, v_served, v_served_names, v_served_seqs
              FROM (SELECT h.id, p.channel_id, p.name, p.turn_seq
                      FROM unnest(v_picked, v_picked_names, v_turn_seqs)
                           WITH ORDINALITY AS p(channel_id, name, turn_seq, pos)
                     CROSS JOIN LATERAL (
                           SELECT m.id FROM fairq.message m
                            WHERE m.channel_id = p.channel_id AND m.status = 'ready'
                            ORDER BY m.priority DESC, m.dequeue_at, m.id
                            LIMIT 1
                              FOR UPDATE SKIP LOCKED) h
                     ORDER BY p.pos) x;
            -- (Joined to their positions, not looked up in the arrays: array_position per
            -- row made a call of n messages cost n² comparisons.)
            RETURN QUERY
                WITH locked AS (
                    UPDATE fairq.message m
                       SET status = 'locked', locked_until = v_now + v_lock,
                           num_attempts = m.num_attempts + 1,
                           first_dequeued_at = coalesce(m.first_dequeued_at, v_now)
                     WHERE m.id = ANY (v_ids)
                    RETURNING m.id, m.content, m.state, m.num_attempts, m.priority, m.dequeue_at, m.recovered
                )
                SELECT l.id, s.name, l.content, l.state, l.num_attempts, l.priority, l.dequeue_at, l.recovered
                  FROM locked l
                  JOIN unnest(v_ids, v_served_names) WITH ORDINALITY AS s(id, name, pos) ON s.id = l.id
                 ORDER BY s.pos;
        END IF;

        -- Step 4. Every served channel is written once (turns.sql: fairq.served_turn_at),
        -- with the due time of its next pending message; those with nothing more due now
        -- are looked at again under their settle locks before they go idle or wait
        -- (fairq.settled_due_ats, which reads in a snapshot of its own).
        UPDATE fairq.channel c
               SET in_flight = c.in_flight + fairq.slots(c.max_concurrency, 1),
                   last_release_at = v_now,
                   due_at = n.due_at,
                   -- (It had work until now, so it is idle from now on, if at all:
                   -- not since the idle_since in its row, which a woken channel served
                   -- first still carries from before its wake.)
                   idle_since = fairq.idle_since(n.due_at, NULL, v_now),
                   turn_at = n.turn_at,
                   turn_pass = fairq.served_pass(n.was_turn_at, n.turn_at, n.due_at, v_now,
                                                 CASE WHEN c.id = v_first_id THEN v_first_pass
                                                      ELSE c.turn_pass END, c.weight),
                   turn_given_at = CASE WHEN n.turn_at = fairq.in_rotation() THEN v_now END,
                   turn_seq = fairq.kept_turn_seq(NULL, n.turn_at, NULL, n.turn_seq)
              FROM (SELECT x.row_ctid, x.due_at, x.turn_seq, x.turn_at AS was_turn_at,
                           fairq.served_turn_at(x.turn_at, x.next_turn, v_now) AS turn_at
                      FROM (SELECT k.ctid AS row_ctid, s.due_at, k.turn_at, s.turn_seq,
                                   fairq.next_turn(NULL, s.due_at, v_now, k.release_interval_ms,
                                                   k.in_flight + 1, k.max_concurrency,
                                                   k.paused_until, v_now) AS next_turn
                              FROM unnest(v_served, v_served_seqs,
                                          -- (Read for all, settled together: once, before
                                          -- any row is written. A scan of one array keeps
                                          -- its order, with no sort.)
                                          fairq.settled_due_ats(
                                              v_served, v_served_names,
                                              ARRAY(SELECT (SELECT p.due_at FROM fairq.pending_due_at(u.id) AS p)
                                                      FROM unnest(v_served) AS u(id)),
                                              v_queue_id, v_now))
                                   AS s(channel_id, turn_seq, due_at)
                             CROSS JOIN LATERAL (SELECT k.ctid,
                                                        CASE WHEN k.id = v_first_id THEN fairq.in_rotation()
                                                             ELSE k.turn_at END AS turn_at,
                                                        k.release_interval_ms, k.in_flight, k.max_concurrency,
                                                        k.paused_until
                                                   FROM fairq.channel k
                                                  WHERE k.id = s.channel_id OFFSET 0) k
                            OFFSET 0) x
                    OFFSET 0) n
               -- (Every OFFSET 0 keeps its subquery apart: the channels are looked up one
               -- by one, by id, and written where they were read (this call holds them,
               -- so the row a ctid names is current); and next_turn and served_turn_at
               -- get plain columns, since a SQL function is inlined only when an argument
               -- it reads twice is cheap: planned again at every row, they made this
               -- statement five times slower.)
             WHERE c.ctid = n.row_ctid;
        -- Picked channels that had nothing to hand out, in pick order (the served are
        -- some of the picked: none when they are as many).
        IF cardinality(v_served) < cardinality(v_picked) THEN
            FOR v_pos IN 1 .. cardinality(v_picked) LOOP
                CONTINUE WHEN v_picked[v_pos] = ANY (v_served);
                PERFORM fairq.channel_retire(v_picked[v_pos], v_now, v_turn_seqs[v_pos]);
                v_visited := v_visited || v_picked[v_pos];
            END LOOP;
        END IF;
        v_count := v_count + cardinality(v_served);
        v_first_id := NULL;
    END LOOP;
    -- The collector's turn, if nobody ran it in the last second (its row is taken
    -- with SKIP LOCKED: no dequeue waits for another's collection).
    IF NOT v_collect THEN
        RETURN;
    END IF;
    PERFORM FROM fairq.channel_collection k WHERE k.collected_at <= v_now - interval '1 s'
        FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        UPDATE fairq.channel_collection SET collected_at = v_now;
        PERFORM fairq.collect_idle_channels(v_now, 1000);
    END IF;
END
$$;

COMMENT ON FUNCTION fairq.message_dequeue(bigint, integer, text) IS
    'Hands out up to p_max_messages messages of queue p_queue, each locked for p_lock_ms: channels take turns by weight, within a channel the highest priority due message goes first. Zero rows means nothing is available. recovered is true when the previous lock expired unsettled.';

-- ==== sql/settle.sql ====

-- settle.sql — what a worker (or an operator) does with a message it was handed.
--
-- Invariants:
--   * num_attempts is the fencing token: a call acts only on a message that is
--     still 'locked' with the caller's num_attempts; otherwise it answers 'stale'
--     (or 'not_found') and changes nothing;
--   * a lock that has expired but was not yet recovered still belongs to its
--     holder: nobody else has been handed the message;
--   * leaving 'locked' frees exactly one concurrency slot of a capped channel, under
--     the channel lock (and a completion then takes no policy lock); completing an
--     uncapped channel's message takes only its policy lock (shared; past
--     fairq.bulk_channels() channels in a transaction, its queue's bulk policy
--     lock): a channel left empty stays, idle, for the collector. A completion
--     waits for a channel row while it holds that channel's policy lock only when a
--     policy call capped the channel while the completion ran;
--   * lock order: the message (the fenced UPDATE/DELETE), then its channel. A
--     bounded channel's count changes by a row of channel_size_change, never by its
--     channel_size row, which its producers hold until they commit: no settlement
--     waits for an open producer transaction. Batches lock all their messages first,
--     in id order.

-- 'stale' when the message exists (in another state or attempt), else 'not_found'.
CREATE FUNCTION fairq.miss(p_id bigint, p_if_exists text) RETURNS text
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM fairq.message WHERE id = p_id) THEN
        RETURN p_if_exists;
    END IF;
    RETURN 'not_found';
END
$$;

-- The fence: the num_attempts of a message while it is locked, else NULL (which
-- equals no caller's); every settlement tests it. Written as one expression, not
-- as "status = 'locked' AND ...", so that a statement finding a message by id and
-- fencing it is never planned as a walk through every lock in message_locked_ix.
CREATE FUNCTION fairq.held_attempts(p_status fairq.message_status, p_num_attempts bigint)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT CASE WHEN p_status = 'locked' THEN p_num_attempts END $$;

-- The message, locked for update, if its caller still holds it (status 'locked' and
-- the caller's num_attempts); else NULL, and nothing locked: a stale call that
-- locked a message recovered and ready again made a dequeue take its channel for
-- busy and put it off for up to 5 s (fairq.channel_retire). (The holder's test is
-- in the lookup, rechecked on the row's newest version after a wait for its lock;
-- written through fairq.held_attempts, it cannot be served by the partial index of
-- locked messages, which a plan cached while few were locked would read whole.)
CREATE FUNCTION fairq.held_message(p_id bigint, p_num_attempts bigint) RETURNS fairq.message
LANGUAGE plpgsql
AS $$
DECLARE
    v_message fairq.message;
BEGIN
    SELECT * INTO v_message FROM fairq.message m
     WHERE m.id = p_id AND fairq.held_attempts(m.status, m.num_attempts) = p_num_attempts
       FOR UPDATE;
    IF FOUND THEN
        RETURN v_message;
    END IF;
    RETURN NULL;
END
$$;

CREATE FUNCTION fairq.message_complete_batch(p_ids bigint[], p_num_attempts bigint[])
RETURNS TABLE(id bigint, status text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := fairq.clock();
    v_done fairq.message[];
    v_claimed bigint[];
    v_channel_ids bigint[];
    v_locked bigint[];
    v_unlocked bigint[];  -- the channels whose policy locks this holds
    v_woken bigint[];
    v_event record;
    v_asked integer;    -- the queue fairq.worker_sleeps was last asked about
    v_sleeps boolean;
BEGIN
    PERFORM fairq.require_read_committed('fairq.message_complete_batch'),
            fairq.require_batch_array(fairq.require(p_ids, 'p_ids'), 'p_ids');
    PERFORM fairq.require_batch_array(fairq.require(p_num_attempts, 'p_num_attempts'), 'p_num_attempts',
                                      cardinality(p_ids), 'p_ids');
    IF array_position(p_ids, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'p_ids[%] must not be NULL', array_position(p_ids, NULL) USING ERRCODE = '22004';
    END IF;
    IF array_position(p_num_attempts, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'p_num_attempts[%] must not be NULL', array_position(p_num_attempts, NULL)
            USING ERRCODE = '22004';
    END IF;

    -- Messages first, in id order, then channels in id order: the global lock order.
    -- Only messages in flight are locked (as in fairq.held_message: never a ready one
    -- a dequeue may be about to take). Of those, the ones the caller still holds are
    -- settled: the elements are answered as message_complete would answer them one
    -- after the other, so an id listed twice is settled by its first element that
    -- holds its token. (OFFSET 0 keeps the tokens' join out of the locking subquery,
    -- so messages are found by id, never by reading every lock in message_locked_ix.
    -- A join on (id, token), not a lookup in the arrays per message: array_position
    -- per message made a batch of n cost n² comparisons.)
    v_claimed := ARRAY(
        SELECT m.id
          FROM (SELECT * FROM fairq.message m
                 WHERE m.id = ANY (p_ids) AND fairq.held_attempts(m.status, m.num_attempts) IS NOT NULL
                 ORDER BY m.id
                   FOR UPDATE OFFSET 0) m
         WHERE EXISTS (SELECT 1 FROM unnest(p_ids, p_num_attempts) AS u(id, num_attempts)
                        WHERE u.id = m.id
                          AND u.num_attempts = fairq.held_attempts(m.status, m.num_attempts)));
    WITH deleted AS (
        DELETE FROM fairq.message m WHERE m.id = ANY (v_claimed) RETURNING m.*
    )
    SELECT coalesce(array_agg(d ORDER BY d.id), '{}') INTO v_done FROM deleted d;

    v_channel_ids := ARRAY(SELECT DISTINCT d.channel_id FROM unnest(v_done) AS d ORDER BY 1);
    -- Only a capped channel needs its row, to free slots; its row lock (message, then
    -- channel, in id order), not its policy lock, keeps channel_set from changing its
    -- max_concurrency, and recounting in_flight, before this commits (as in
    -- message_complete). A row found uncapped once locked is not returned, and its
    -- channel is treated as uncapped below. Every other completion leaves its
    -- channel's row alone, so workers completing one tenant's messages do not queue
    -- behind each other, behind its dequeues or behind its producers.
    v_locked := ARRAY(
        SELECT c.id FROM fairq.channel c
         WHERE c.id = ANY (v_channel_ids) AND c.max_concurrency IS NOT NULL
         ORDER BY c.id
           FOR NO KEY UPDATE);
    -- The other channels' policy locks (shared), for the same reason; then the rows of
    -- those capped meanwhile (by a policy call this waited for, which counted these
    -- messages in flight). Only those are locked under a policy lock, out of id
    -- order with the rows above.
    v_unlocked := ARRAY(SELECT u.id FROM unnest(v_channel_ids) AS u(id) WHERE u.id <> ALL (v_locked));
    IF v_unlocked <> '{}' THEN
        PERFORM fairq.policy_locks_shared(v_unlocked, ARRAY(SELECT d.queue_id FROM unnest(v_done) AS d
                                                             WHERE d.channel_id = ANY (v_unlocked)));
        v_locked := v_locked || ARRAY(
            SELECT c.id FROM fairq.channel c
             WHERE c.id = ANY (v_unlocked) AND c.max_concurrency IS NOT NULL
             ORDER BY c.id
               FOR NO KEY UPDATE);
    END IF;
    IF EXISTS (SELECT 1 FROM fairq.channel_wake w WHERE w.channel_id = ANY (v_locked)) THEN
        PERFORM fairq.fold_wakes(v_locked);
    END IF;
    -- The bounded channels' counts (fairq.bounded_channel_resize: never waiting).
    IF EXISTS (SELECT 1 FROM fairq.channel c WHERE c.id = ANY (v_channel_ids) AND c.max_size IS NOT NULL) THEN
        INSERT INTO fairq.channel_size_change (channel_id, delta)
        SELECT d.channel_id, -count(*)::integer
          FROM unnest(v_done) AS d
         WHERE d.channel_id IN (SELECT c.id FROM fairq.channel c
                                 WHERE c.id = ANY (v_channel_ids) AND c.max_size IS NOT NULL)
         GROUP BY d.channel_id;
    END IF;
    PERFORM fairq.record_history(d, c.name, 'completed', v_now)
       FROM unnest(v_done) AS d JOIN fairq.channel c ON c.id = d.channel_id
      WHERE c.id = ANY (v_channel_ids) AND fairq.setting_on('fairq.history');

    -- Free the capped channels' slots (the set-based form of fairq.channel_unlock). A
    -- freed slot wakes workers where the channel was full and has work waiting.
    WITH freed AS (
        UPDATE fairq.channel c
           SET in_flight = c.in_flight - g.n,
               turn_at = g.turn_at,  -- the keep-turn rule (turns.sql)
               turn_pass = fairq.kept_pass(c.turn_at, g.turn_at, c.turn_pass, v_now),
               turn_given_at = fairq.kept_place(c.turn_at, g.turn_at, c.turn_given_at),
               turn_seq = fairq.kept_turn_seq(c.turn_at, g.turn_at, c.turn_seq, nextval('fairq.turn_seq'))
          FROM (SELECT k.id AS channel_id, d.n,
                       fairq.next_turn(k.turn_at, k.due_at, k.last_release_at, k.release_interval_ms,
                                       k.in_flight - d.n, k.max_concurrency, k.paused_until, v_now) AS turn_at
                  FROM (SELECT d.channel_id, count(*)::integer AS n FROM unnest(v_done) AS d GROUP BY 1) d
                 CROSS JOIN LATERAL (SELECT k.* FROM fairq.channel k  -- by id, one by one
                                      WHERE k.id = d.channel_id OFFSET 0) k
                 WHERE k.id = ANY (v_locked)
                OFFSET 0) g
         WHERE c.id = ANY (v_locked) AND c.id = g.channel_id
        RETURNING c.id, c.in_flight + g.n >= c.max_concurrency AND c.turn_at IS NOT NULL AS woke
    )
    SELECT coalesce(array_agg(f.id) FILTER (WHERE f.woke), '{}') INTO v_woken FROM freed f;
    -- (With the doorbell, one event a queue: fairq.events_per_queue.)
    FOR v_event IN
        SELECT e.queue_id, e.name, e.id
          FROM (SELECT c.queue_id, c.name, max(d.id) AS id,
                       row_number() OVER (PARTITION BY c.queue_id ORDER BY c.name) AS nth
                  FROM unnest(v_done) AS d JOIN fairq.channel c ON c.id = d.channel_id
                 WHERE c.id = ANY (v_channel_ids) AND fairq.events_wanted(c.id = ANY (v_woken))
                 GROUP BY c.queue_id, c.name) e
         WHERE e.nth <= coalesce(fairq.events_per_queue(), e.nth)
         ORDER BY e.queue_id
    LOOP
        IF v_event.queue_id IS DISTINCT FROM v_asked THEN  -- once per queue
            v_asked := v_event.queue_id;
            v_sleeps := fairq.worker_sleeps(v_asked);
        END IF;
        IF v_sleeps THEN
            PERFORM fairq.notify_event('completed', v_event.queue_id, v_event.name, v_event.id, NULL);
        END IF;
    END LOOP;

    -- An element before the one that settled its message found it held with another
    -- token (stale); one after it finds it gone (not_found).
    RETURN QUERY
        SELECT x.id,
               CASE WHEN x.settled_at IS NULL THEN fairq.miss(x.id, 'stale')
                    WHEN x.i = x.settled_at THEN 'completed'
                    WHEN x.i < x.settled_at THEN 'stale'
                    ELSE 'not_found' END
          FROM (SELECT u.id, u.i,
                       min(u.i) FILTER (WHERE u.num_attempts = d.num_attempts)
                           OVER (PARTITION BY u.id) AS settled_at
                  FROM unnest(p_ids, p_num_attempts) WITH ORDINALITY AS u(id, num_attempts, i)
                  LEFT JOIN unnest(v_done) AS d ON d.id = u.id) x
         ORDER BY x.i;
END
$$;

-- The scalar form of message_complete_batch (same locks, same outcome), in a third
-- of the statements: a worker completes every message it handles.
CREATE FUNCTION fairq.message_complete(p_id bigint, p_num_attempts bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_message fairq.message;
    v_channel fairq.channel;
    v_woke boolean := false;
    v_deleted record;  -- the message deleted, and whether its channel was capped
    v_done boolean;  -- what the checks, the lock and the record return (validate.sql)
BEGIN
    v_done := fairq.require_read_committed('fairq.message_complete')
              AND fairq.require(p_id, 'p_id') IS NOT NULL
              AND fairq.require(p_num_attempts, 'p_num_attempts') IS NOT NULL;
    -- The fenced delete locks the message as it removes it: one statement, one row
    -- lock, where locking first and deleting after would write the row twice. It
    -- also tells whether the channel was capped when it began (a hint, read without
    -- a lock: which of the two ways below the completion goes).
    DELETE FROM fairq.message m
     WHERE m.id = p_id AND fairq.held_attempts(m.status, m.num_attempts) = p_num_attempts
    RETURNING m AS message,
              (SELECT c.max_concurrency IS NOT NULL FROM fairq.channel c WHERE c.id = m.channel_id) AS capped
         INTO v_deleted;
    v_message := v_deleted.message;
    IF v_message.id IS NULL THEN
        RETURN fairq.miss(p_id, 'stale');
    END IF;
    -- A capped channel's row is locked at once (message, then channel, as a defer
    -- does), and its values read under the lock: while this holds the row, no policy
    -- call can change max_concurrency or recount in_flight. An uncapped channel's row
    -- is left alone; its policy lock (shared) keeps channel_set from capping it, and
    -- counting this message in flight, before this commits. The policy is read after
    -- that lock, in a statement of its own (a snapshot taken before a wait for
    -- channel_set would miss the policy it set), and a channel capped meanwhile has
    -- its row locked then. (Until 0.7.37 every completion took the policy lock first:
    -- one of a capped channel then waited for the row holding the policy lock, and a
    -- transaction that had written the row (a defer) and then paused the channel
    -- waited for that policy lock: a deadlock.)
    IF v_deleted.capped THEN
        v_channel := fairq.channel_lock(v_message.channel_id);  -- (uncapped meanwhile: frees no slot)
    ELSE
        v_done := fairq.policy_lock_shared(v_message.channel_id, v_message.queue_id);
        SELECT * INTO v_channel FROM fairq.channel WHERE id = v_message.channel_id;
        IF v_channel.max_concurrency IS NOT NULL THEN
            v_channel := fairq.channel_lock(v_channel.id);
        END IF;
    END IF;
    IF v_channel.max_concurrency IS NOT NULL THEN
        -- Its freed slot makes a full channel with work waiting eligible again.
        v_woke := v_channel.in_flight = v_channel.max_concurrency AND v_channel.due_at IS NOT NULL;
        PERFORM fairq.channel_unlock(v_channel, 1, NULL, v_now);
    END IF;
    v_done := fairq.channel_resize(v_channel, -1, false) IS NOT NULL
              AND fairq.record_history(v_message, v_channel.name, 'completed', v_now);
    IF fairq.events_wanted(coalesce(v_woke, false)) THEN
        IF fairq.worker_sleeps(v_channel.queue_id) THEN
            PERFORM fairq.notify_event('completed', v_channel.queue_id, v_channel.name, p_id, NULL);
        END IF;
    END IF;
    RETURN 'completed';
END
$$;

CREATE FUNCTION fairq.message_defer(p_id bigint, p_num_attempts bigint,
                                    p_dequeue_at timestamptz DEFAULT NULL, p_state bytea DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_dequeue_at timestamptz := coalesce(p_dequeue_at, v_now);
    v_message fairq.message;
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require_read_committed('fairq.message_defer'),
            fairq.require(p_id, 'p_id');
    PERFORM fairq.require(p_num_attempts, 'p_num_attempts');
    PERFORM fairq.require_finite(p_dequeue_at, 'p_dequeue_at');
    IF (fairq.held_message(p_id, p_num_attempts)).id IS NULL THEN
        RETURN fairq.miss(p_id, 'stale');
    END IF;
    UPDATE fairq.message
       SET status = CASE WHEN v_dequeue_at <= v_now THEN 'ready' ELSE 'scheduled' END::fairq.message_status,
           dequeue_at = v_dequeue_at, locked_until = NULL, recovered = false,
           state = coalesce(p_state, state)
     WHERE id = p_id
    RETURNING * INTO v_message;
    v_channel := fairq.channel_lock(v_message.channel_id);
    PERFORM fairq.channel_unlock(v_channel, 1, v_dequeue_at, v_now);
    IF fairq.events_wanted(true) THEN
        IF fairq.worker_sleeps(v_channel.queue_id) THEN
            PERFORM fairq.notify_event('deferred', v_channel.queue_id, v_channel.name, p_id, v_dequeue_at);
        END IF;
    END IF;
    RETURN 'deferred';
END
$$;

CREATE FUNCTION fairq.message_heartbeat(p_id bigint, p_num_attempts bigint, p_lock_ms bigint)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
BEGIN
    PERFORM fairq.require(p_id, 'p_id');
    PERFORM fairq.require(p_num_attempts, 'p_num_attempts');
    PERFORM fairq.require_duration(p_lock_ms, 1, 'p_lock_ms');
    IF (fairq.held_message(p_id, p_num_attempts)).id IS NULL THEN
        RETURN fairq.miss(p_id, 'stale');
    END IF;
    UPDATE fairq.message
       SET locked_until = GREATEST(locked_until, v_now + fairq.ms(p_lock_ms))
     WHERE id = p_id;
    RETURN 'heartbeated';
END
$$;

CREATE FUNCTION fairq.message_fail(p_id bigint, p_num_attempts bigint, p_error text DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_message fairq.message;
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require_read_committed('fairq.message_fail'),
            fairq.require(p_id, 'p_id');
    PERFORM fairq.require(p_num_attempts, 'p_num_attempts');
    IF (fairq.held_message(p_id, p_num_attempts)).id IS NULL THEN
        RETURN fairq.miss(p_id, 'stale');
    END IF;
    DELETE FROM fairq.message WHERE id = p_id RETURNING * INTO v_message;
    v_channel := fairq.channel_lock(v_message.channel_id);
    PERFORM fairq.bury(v_message, v_channel, p_error, v_now);
    PERFORM fairq.channel_unlock(v_channel, 1, NULL, v_now);
    RETURN 'dead';
END
$$;

-- Cancelling takes only the producer lock, like creating, and never the channel's
-- row: a producer may cancel inside a long transaction without hiding the channel's
-- other messages from workers, stopping the recovery of its expired locks or making
-- its settlements wait. The channel's due_at may then stay early, even with nothing
-- left pending: a dequeue that picks the channel finds nothing, recomputes its turn
-- (fairq.channel_retire) and goes on to the next channel, and the channel then goes
-- idle and is collected like any other. A message due later than now may be what
-- gave the channel its wait, here or in a dequeue or settlement that saw it pending
-- and commits after this cancel (its snapshot did not see the delete): so cancelling
-- one makes sure the channel is due now, as a producer of a message due now would
-- (fairq.channels_wake: a wake for now, committed with the cancel, unless the
-- channel is due already, and then it holds the channel's settle lock, shared, so
-- that no dequeue makes it wait until this cancel is seen). (0.7.32 locked the row
-- when nothing was left pending, and kept it until the transaction ended.)
CREATE FUNCTION fairq.message_cancel(p_id bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_message fairq.message;
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require_read_committed('fairq.message_cancel'),
            fairq.require(p_id, 'p_id');
    DELETE FROM fairq.message WHERE id = p_id AND status <> 'locked'
    RETURNING * INTO v_message;
    IF NOT FOUND THEN
        RETURN fairq.miss(p_id, 'locked');
    END IF;
    -- The producer lock keeps channel_set from changing max_size under our feet, and
    -- the collector from removing the channel while its wake is not committed (in a
    -- transaction gone bulk, its queue's bulk producer lock does both: it takes no
    -- channel's producer lock after that, or it could wait in a cycle with
    -- channel_set).
    SELECT * INTO v_channel FROM fairq.channel WHERE id = v_message.channel_id;
    IF NOT fairq.producing_in_bulk(v_channel.queue_id, 1) THEN
        PERFORM pg_advisory_xact_lock_shared(fairq.producer_lock_class(),
                                             fairq.producer_lock_key(v_channel.queue_id, v_channel.name));
    END IF;
    SELECT * INTO v_channel FROM fairq.channel WHERE id = v_message.channel_id;
    PERFORM fairq.record_history(v_message, v_channel.name, 'cancelled', v_now);
    PERFORM fairq.channel_resize(v_channel, -1, false);
    IF v_message.dequeue_at > v_now THEN
        PERFORM fairq.channels_wake(v_channel.queue_id, ARRAY[v_channel.id], ARRAY[v_now], v_now);
    END IF;
    RETURN 'cancelled';
END
$$;

CREATE FUNCTION fairq.dead_letter_retry(p_id bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_dead fairq.dead_letter;
    v_for_producer record;
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require_read_committed('fairq.dead_letter_retry'),
            fairq.require(p_id, 'p_id');
    DELETE FROM fairq.dead_letter WHERE id = p_id RETURNING * INTO v_dead;
    IF NOT FOUND THEN
        RETURN 'not_found';
    END IF;
    -- An operator's retry is not subject to max_size, and carries no dedup key.
    SELECT * INTO v_for_producer
      FROM fairq.channels_for_producer(fairq.queue_for_producer(v_dead.queue, 'queue'), ARRAY[v_dead.channel],
                                       ARRAY[v_now], v_now);
    v_channel := v_for_producer.channel;
    IF NOT v_for_producer.made THEN  -- (a row made here is made due)
        PERFORM fairq.channels_wake(v_channel.queue_id, ARRAY[v_channel.id], ARRAY[v_now], v_now);
    END IF;
    PERFORM fairq.channel_resize(v_channel, 1, false);
    -- num_attempts goes on counting (it is the fencing token: a holder from before the
    -- message died must stay stale); max_attempts counts afresh from here.
    INSERT INTO fairq.message (id, channel_id, status, priority, dequeue_at, created_at, content, state,
                               num_attempts, attempts_at_retry, queue_id)
    VALUES (v_dead.id, v_channel.id, 'ready', v_dead.priority, v_now, v_dead.created_at,
            v_dead.content, v_dead.state, v_dead.num_attempts, v_dead.num_attempts, v_channel.queue_id);
    IF fairq.events_wanted(true) THEN
        IF fairq.worker_sleeps(v_channel.queue_id) THEN
            PERFORM fairq.notify_event('created', v_channel.queue_id, v_channel.name, v_dead.id, v_now);
        END IF;
    END IF;
    RETURN 'requeued';
END
$$;

CREATE FUNCTION fairq.dead_letter_delete(p_id bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
BEGIN
    DELETE FROM fairq.dead_letter WHERE id = fairq.require(p_id, 'p_id');
    RETURN CASE WHEN FOUND THEN 'deleted' ELSE 'not_found' END;
END
$$;

CREATE FUNCTION fairq.dead_letter_purge(p_before timestamptz, p_queue text DEFAULT NULL) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_deleted bigint;
BEGIN
    PERFORM fairq.require(p_before, 'p_before');
    IF p_queue IS NULL THEN
        DELETE FROM fairq.dead_letter WHERE died_at < p_before;
    ELSE
        DELETE FROM fairq.dead_letter
         WHERE queue = fairq.require_channel_name(p_queue, 'p_queue') AND died_at < p_before;
    END IF;
    GET DIAGNOSTICS v_deleted = ROW_COUNT;
    RETURN v_deleted;
END
$$;

COMMENT ON FUNCTION fairq.message_complete(bigint, bigint) IS
    'Removes a message its caller holds (fenced by num_attempts): completed | not_found | stale.';
COMMENT ON FUNCTION fairq.message_complete_batch(bigint[], bigint[]) IS
    'message_complete for many messages: one (id, status) row per input element, each answered as message_complete calls one after the other would answer it.';
COMMENT ON FUNCTION fairq.message_defer(bigint, bigint, timestamptz, bytea) IS
    'Unlocks a held message and reschedules it (NULL = now), keeping num_attempts; a non-NULL p_state replaces the saved state: deferred | not_found | stale.';
COMMENT ON FUNCTION fairq.message_heartbeat(bigint, bigint, bigint) IS
    'Extends a held message''s lock to now + p_lock_ms (never shortens it): heartbeated | not_found | stale.';
COMMENT ON FUNCTION fairq.message_fail(bigint, bigint, text) IS
    'Moves a held message to the dead letters now, with p_error: dead | not_found | stale.';
COMMENT ON FUNCTION fairq.message_cancel(bigint) IS
    'Removes a message that is not in flight: cancelled | not_found | locked.';
COMMENT ON FUNCTION fairq.dead_letter_retry(bigint) IS
    'Puts a dead letter back on its channel with a fresh budget of max_attempts deliveries (same id, priority and state, no dedup key, not subject to max_size); num_attempts, the fencing token, goes on counting: requeued | not_found.';
COMMENT ON FUNCTION fairq.dead_letter_delete(bigint) IS
    'Deletes a dead letter for good: deleted | not_found.';
COMMENT ON FUNCTION fairq.dead_letter_purge(timestamptz, text) IS
    'Deletes the dead letters that died before p_before, of queue p_queue or of every queue when NULL; returns how many.';

-- ==== sql/observe.sql ====

-- observe.sql — what operators read from psql.
--
-- Invariants:
--   * views read the tables as the extension's owner, so an observer needs SELECT on
--     the view only, never on the tables;
--   * fairq.check() reads everything in one snapshot and returns one row per broken
--     invariant: no rows means the counters, heads and turns are consistent.

CREATE VIEW fairq.channels AS
SELECT q.name AS queue,
       c.name AS channel,
       c.max_concurrency,
       c.release_interval_ms,
       c.max_size,
       c.max_attempts,
       c.weight,
       CASE WHEN c.paused_until > k.now THEN c.paused_until END AS paused_until,
       n.ready + n.scheduled + n.in_flight AS size,
       n.ready,
       n.scheduled,
       n.in_flight,
       -- In the rotation: now. A wake not yet applied gives its time; a paused queue
       -- serves nothing before its pause ends. Nothing pending, nothing to serve: a
       -- channel may keep its turn after its last pending message was cancelled,
       -- until a dequeue recomputes it (settle.sql).
       CASE WHEN w.turn_at IS NOT NULL AND n.ready + n.scheduled > 0
            THEN GREATEST(w.turn_at, k.now, CASE WHEN q.paused_until > k.now THEN q.paused_until END)
       END AS next_dequeue_at
  FROM fairq.channel c
  JOIN fairq.queue q ON q.id = c.queue_id
 -- A scalar subquery, evaluated once: joined as a table, the one-row clock_offset
 -- (never analyzed) would be costed at thousands of rows and drag in JIT.
 CROSS JOIN (SELECT (SELECT clock_timestamp() + shift FROM fairq.clock_offset) AS now) k
 CROSS JOIN LATERAL (
       SELECT (SELECT count(*) FROM fairq.message m
                WHERE m.channel_id = c.id AND m.status = 'ready')
            + (SELECT count(*) FROM fairq.message m
                WHERE m.channel_id = c.id AND m.status = 'scheduled' AND m.dequeue_at <= k.now) AS ready,
              (SELECT count(*) FROM fairq.message m
                WHERE m.channel_id = c.id AND m.status = 'scheduled' AND m.dequeue_at > k.now) AS scheduled,
              (SELECT count(*)::integer FROM fairq.message m
                WHERE m.channel_id = c.id AND m.status = 'locked') AS in_flight
       ) n
 CROSS JOIN LATERAL (
       SELECT coalesce(c.turn_at,
                       CASE WHEN c.max_concurrency IS NULL OR c.in_flight < c.max_concurrency
                            THEN (SELECT min(GREATEST(x.due_at, x.woken_at, c.paused_until))
                                    FROM fairq.channel_wake x WHERE x.channel_id = c.id) END) AS turn_at
       ) w
 -- An idle channel without policy or pause is only kept for the collector: not shown.
 WHERE c.has_policy OR c.paused_until > k.now OR n.ready + n.scheduled + n.in_flight > 0;

CREATE VIEW fairq.dead_letters AS
SELECT id, queue, channel, content, state, num_attempts, error, created_at, died_at
  FROM fairq.dead_letter;

-- The sums of fairq.channels per queue, without its per-channel lookups: every
-- message is read once, grouped by channel, so the view costs the same with 100 or
-- 100,000 channels. (A channel shows in fairq.channels when it has a policy, a pause
-- or a message.)
CREATE VIEW fairq.queues AS
WITH k AS (SELECT (SELECT clock_timestamp() + shift FROM fairq.clock_offset) AS now),
held AS (
    SELECT m.channel_id,
           count(*) AS size,
           count(*) FILTER (WHERE m.status = 'ready'
                               OR (m.status = 'scheduled' AND m.dequeue_at <= k.now)) AS ready,
           count(*) FILTER (WHERE m.status = 'scheduled' AND m.dequeue_at > k.now) AS scheduled,
           count(*) FILTER (WHERE m.status = 'locked') AS in_flight
      FROM fairq.message m CROSS JOIN k
     GROUP BY m.channel_id
), shown AS (
    SELECT c.queue_id, h.size, h.ready, h.scheduled, h.in_flight
      FROM fairq.channel c
      CROSS JOIN k
      LEFT JOIN held h ON h.channel_id = c.id
     WHERE c.has_policy OR c.paused_until > k.now OR h.channel_id IS NOT NULL
)
SELECT q.name AS queue,
       count(s.queue_id) AS channels,
       coalesce(sum(s.size), 0)::bigint AS size,
       coalesce(sum(s.ready), 0)::bigint AS ready,
       coalesce(sum(s.scheduled), 0)::bigint AS scheduled,
       coalesce(sum(s.in_flight), 0)::bigint AS in_flight,
       (SELECT count(*) FROM fairq.dead_letter d WHERE d.queue = q.name) AS dead,
       CASE WHEN q.paused_until > k.now THEN q.paused_until END AS paused_until
  FROM fairq.queue q
 CROSS JOIN k
  LEFT JOIN shown s ON s.queue_id = q.id
 GROUP BY q.id, q.name, q.paused_until, k.now;

CREATE FUNCTION fairq.history_prune(p_before timestamptz) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_deleted bigint;
BEGIN
    PERFORM fairq.require(p_before, 'p_before');
    DELETE FROM fairq.message_history WHERE settled_at < p_before;
    GET DIAGNOSTICS v_deleted = ROW_COUNT;
    RETURN v_deleted;
END
$$;

CREATE FUNCTION fairq.check() RETURNS TABLE(channel text, problem text)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    -- Messages, wakes and size changes are read once each, grouped by channel: per-channel lookups
    -- would read the whole message table once per channel (no index on channel_id
    -- alone covers every status).
    WITH held AS (
        SELECT m.channel_id,
               count(*) AS messages,
               count(*) FILTER (WHERE m.status = 'locked') AS locked,
               count(*) FILTER (WHERE (m.status = 'locked') <> (m.locked_until IS NOT NULL)) AS lock_mismatch,
               min(m.dequeue_at) FILTER (WHERE m.status IN ('ready', 'scheduled')) AS earliest_due
          FROM fairq.message m
         GROUP BY m.channel_id
    ), waking AS (
        SELECT w.channel_id, min(w.due_at) AS due_at FROM fairq.channel_wake w GROUP BY w.channel_id
    ), changed AS (
        SELECT x.channel_id, sum(x.delta) AS delta FROM fairq.channel_size_change x GROUP BY x.channel_id
    ), truth AS (
        SELECT c.*,
               coalesce(h.locked, 0) AS locked,
               coalesce(h.messages, 0) AS messages,
               coalesce(h.lock_mismatch, 0) AS lock_mismatch,
               h.earliest_due,
               s.size + coalesce(x.delta, 0) AS counted_size,
               x.channel_id IS NOT NULL AS size_changed,
               -- a queued wake (fairq.channels_wake) stands for due_at until applied
               LEAST(c.due_at, w.due_at) AS due_or_waking,
               (SELECT clock_timestamp() + shift FROM fairq.clock_offset) AS now
          FROM fairq.channel c
          LEFT JOIN held h ON h.channel_id = c.id
          LEFT JOIN waking w ON w.channel_id = c.id
          LEFT JOIN fairq.channel_size s ON s.channel_id = c.id
          LEFT JOIN changed x ON x.channel_id = c.id
    )
    SELECT t.name, p.problem
      FROM truth t
     CROSS JOIN LATERAL (VALUES
        (CASE WHEN t.in_flight <> fairq.slots(t.max_concurrency, t.locked::integer)
              THEN CASE WHEN t.max_concurrency IS NULL
                        THEN format('in_flight is %s but the channel has no max_concurrency: it should be 0',
                                    t.in_flight)
                        ELSE format('in_flight is %s but %s messages are locked (max_concurrency %s)',
                                    t.in_flight, t.locked, t.max_concurrency) END END),
        -- (Lock expiry and recovery find locked messages by locked_until alone.)
        (CASE WHEN t.lock_mismatch > 0
              THEN format('%s messages have a locked_until but are not locked, or are locked without one',
                          t.lock_mismatch) END),
        (CASE WHEN t.due_or_waking IS NULL AND t.earliest_due IS NOT NULL
              THEN 'pending messages but no due_at: they would never be delivered' END),
        (CASE WHEN t.due_or_waking > GREATEST(t.earliest_due, t.now)
              THEN format('due_at %s is later than the earliest pending message (%s)', t.due_or_waking, t.earliest_due) END),
        (CASE WHEN (t.turn_at IS NULL)
                   <> (t.due_at IS NULL OR coalesce(t.in_flight >= t.max_concurrency, false))
              THEN format('turn_at %s does not match due_at %s, in_flight %s and max_concurrency %s',
                          t.turn_at, t.due_at, t.in_flight, t.max_concurrency) END),
        (CASE WHEN (t.idle_since IS NULL) = (t.due_at IS NULL)
              THEN format('idle_since %s does not match due_at %s', t.idle_since, t.due_at) END),
        (CASE WHEN t.turn_at > fairq.in_rotation()
                   AND t.turn_at < t.last_release_at + fairq.ms(t.release_interval_ms)
              THEN 'next turn comes before the release interval has passed' END),
        (CASE WHEN (t.turn_at = fairq.in_rotation() AND t.turn_pass IS NULL)
                   OR (t.turn_at = fairq.in_rotation()) <> (t.turn_given_at IS NOT NULL)
              THEN format('turn_pass %s and turn_given_at %s do not match turn_at %s: a channel in the rotation has both, and no other a turn_given_at',
                          t.turn_pass, t.turn_given_at, t.turn_at) END),
        -- A kept place (turns.sql): outside the rotation only a channel full with work
        -- due, or freed and servable now, keeps a pass.
        (CASE WHEN t.turn_pass IS NOT NULL AND t.turn_at IS DISTINCT FROM fairq.in_rotation()
                   AND NOT coalesce(CASE WHEN t.turn_at IS NULL
                                         THEN t.due_at <= t.now AND t.in_flight >= t.max_concurrency
                                         ELSE t.turn_at <= t.now END, false)
              THEN format('turn_pass %s kept outside the rotation with turn_at %s, due_at %s, in_flight %s and max_concurrency %s: only a channel full with work due, or freed and servable now, keeps its place',
                          t.turn_pass, t.turn_at, t.due_at, t.in_flight, t.max_concurrency) END),
        (CASE WHEN t.turn_at > fairq.in_rotation() AND t.turn_at < t.paused_until
              THEN format('next turn %s comes before the pause ends (%s)', t.turn_at, t.paused_until) END),
        (CASE WHEN t.turn_at = fairq.in_rotation() AND t.paused_until > t.now
              THEN format('in the rotation while paused until %s', t.paused_until) END),
        (CASE WHEN t.weight NOT BETWEEN 1 AND 1000
              THEN format('weight %s is outside 1..1000', t.weight) END),
        (CASE WHEN t.max_size IS NOT NULL AND t.counted_size IS DISTINCT FROM t.messages
              THEN format('channel_size says %s but the channel holds %s messages', t.counted_size, t.messages) END),
        (CASE WHEN t.max_size IS NULL AND t.counted_size IS NOT NULL
              THEN 'channel_size row for a channel without max_size' END),
        (CASE WHEN t.max_size IS NULL AND t.size_changed
              THEN 'channel_size_change rows for a channel without max_size' END)
     ) AS p(problem)
     WHERE p.problem IS NOT NULL
    UNION ALL
    SELECT NULL, format('%s queued wakes belong to no channel', count(*))
      FROM fairq.channel_wake w
     WHERE NOT EXISTS (SELECT 1 FROM fairq.channel c WHERE c.id = w.channel_id)
    HAVING count(*) > 0
    UNION ALL
    SELECT NULL, format('%s messages count more deliveries since their last retry than in all', count(*))
      FROM fairq.message m
     WHERE m.attempts_at_retry > m.num_attempts
    HAVING count(*) > 0
    UNION ALL
    SELECT NULL, format('%s messages or wakes say another queue than their channel', count(*))
      FROM (SELECT m.channel_id, m.queue_id FROM fairq.message m
            UNION ALL
            SELECT w.channel_id, w.queue_id FROM fairq.channel_wake w) x
      JOIN fairq.channel c ON c.id = x.channel_id
     WHERE c.queue_id <> x.queue_id
    HAVING count(*) > 0
    UNION ALL
    SELECT NULL, format('%s messages belong to no channel', count(*))
      FROM fairq.message m
     WHERE NOT EXISTS (SELECT 1 FROM fairq.channel c WHERE c.id = m.channel_id)
    HAVING count(*) > 0
    UNION ALL
    SELECT NULL, format('%s channel_size_change rows belong to no channel', count(*))
      FROM fairq.channel_size_change x
     WHERE NOT EXISTS (SELECT 1 FROM fairq.channel c WHERE c.id = x.channel_id)
    HAVING count(*) > 0
$$;

COMMENT ON VIEW fairq.channels IS
    'Every channel with a policy, a pause or messages (idle channels kept for the collector are not shown), by queue, with its policy, weight and pause and its contents: size (all messages), ready (due), scheduled (future), in_flight, and next_dequeue_at (when it may next be served; NULL when nothing is pending or at max_concurrency).';
COMMENT ON VIEW fairq.queues IS
    'Every queue: its channels (as fairq.channels shows them), messages (size, ready, scheduled, in_flight), dead letters, and the end of its pause.';
COMMENT ON VIEW fairq.dead_letters IS
    'Messages that failed or ran out of attempts, by queue and channel, with the error and when they died.';
COMMENT ON FUNCTION fairq.history_prune(timestamptz) IS
    'Deletes message_history rows settled before p_before; returns how many.';
COMMENT ON FUNCTION fairq.check() IS
    'Operator''s invariant check: one row per inconsistency between counters, turns and messages; no rows means healthy.';

-- ==== sql/privileges.sql ====

-- privileges.sql — who may call what.
--
-- Invariants:
--   * nothing in schema fairq is granted to PUBLIC;
--   * the public functions are SECURITY DEFINER with a pinned search_path, so
--     callers need EXECUTE on them and USAGE on the schema, never table privileges;
--   * a producer can create and cancel messages but neither dequeue nor read
--     contents; a worker can dequeue and settle; an observer can read the views and
--     the history, and run fairq.check(); an operator can set policies, pause and
--     resume queues and channels, retry, delete and purge dead letters and prune the
--     history, and nothing else (it reads what it acts on with an observer's grant).
--     The test clock stays with the owner;
--   * fairq.revoke_producer / revoke_worker / revoke_observer / revoke_operator take
--     back exactly what the matching grant gave (one list of objects for both), except
--     USAGE on the schema, which another grant of the role may need.

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA fairq FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA fairq FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA fairq FROM PUBLIC;
REVOKE ALL ON TYPE fairq.message_status FROM PUBLIC;
REVOKE ALL ON TYPE fairq.folded_turn FROM PUBLIC;
REVOKE ALL ON SCHEMA fairq FROM PUBLIC;

-- What each kind of caller is granted: one list for the grant and the revoke.
CREATE FUNCTION fairq.producer_functions() RETURNS text[]
LANGUAGE sql IMMUTABLE
AS $$
    SELECT ARRAY[
        'FUNCTION fairq.message_create(text, bytea, timestamptz, integer, text, text)',
        'FUNCTION fairq.message_create_batch(text[], bytea[], timestamptz[], integer[], text[], text)',
        'FUNCTION fairq.message_cancel(bigint)']
$$;

CREATE FUNCTION fairq.worker_functions() RETURNS text[]
LANGUAGE sql IMMUTABLE
AS $$
    SELECT ARRAY[
        'FUNCTION fairq.message_dequeue(bigint, integer, text)',
        'FUNCTION fairq.message_complete(bigint, bigint)',
        'FUNCTION fairq.message_complete_batch(bigint[], bigint[])',
        'FUNCTION fairq.message_defer(bigint, bigint, timestamptz, bytea)',
        'FUNCTION fairq.message_heartbeat(bigint, bigint, bigint)',
        'FUNCTION fairq.message_fail(bigint, bigint, text)',
        'FUNCTION fairq.doorbell_hold(text)',
        'FUNCTION fairq.doorbell_quiet(text)',
        'FUNCTION fairq.doorbell_release(text)']
$$;

CREATE FUNCTION fairq.observer_relations() RETURNS text[]
LANGUAGE sql IMMUTABLE
AS $$
    SELECT ARRAY['fairq.queues', 'fairq.channels', 'fairq.dead_letters', 'fairq.message_history']
$$;

CREATE FUNCTION fairq.observer_functions() RETURNS text[]
LANGUAGE sql IMMUTABLE
AS $$
    SELECT ARRAY['FUNCTION fairq.check()']
$$;

CREATE FUNCTION fairq.operator_functions() RETURNS text[]
LANGUAGE sql IMMUTABLE
AS $$
    SELECT ARRAY[
        'FUNCTION fairq.queue_pause(text, timestamptz)',
        'FUNCTION fairq.queue_resume(text)',
        'FUNCTION fairq.channel_set(text, integer, bigint, integer, integer, integer, text)',
        'FUNCTION fairq.channel_clear(text, text)',
        'FUNCTION fairq.channel_pause(text, timestamptz, text)',
        'FUNCTION fairq.channel_resume(text, text)',
        'FUNCTION fairq.dead_letter_retry(bigint)',
        'FUNCTION fairq.dead_letter_delete(bigint)',
        'FUNCTION fairq.dead_letter_purge(timestamptz, text)',
        'FUNCTION fairq.history_prune(timestamptz)']
$$;

-- The name of role p_role, which must exist (an OID cast to regrole is not checked:
-- a dropped role's, say).
CREATE FUNCTION fairq.existing_role(p_role regrole) RETURNS name
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_role name := (SELECT rolname FROM pg_roles WHERE oid = fairq.require(p_role, 'p_role'));
BEGIN
    IF v_role IS NULL THEN
        RAISE EXCEPTION 'p_role must be an existing role, got OID %', p_role::oid USING ERRCODE = '42704';
    END IF;
    RETURN v_role;
END
$$;

-- Grants p_privileges on each of p_objects to the role, and USAGE on the schema
-- (identifiers quoted by format's %I, object signatures are fixed strings of this
-- file).
CREATE FUNCTION fairq.grant_to(p_role regrole, p_privileges text, p_objects text[]) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_role name := fairq.existing_role(p_role);
    v_object text;
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA fairq TO %I', v_role);
    FOREACH v_object IN ARRAY p_objects LOOP
        EXECUTE format('GRANT %s ON %s TO %I', p_privileges, v_object, v_role);
    END LOOP;
END
$$;

-- Revokes what fairq.grant_to granted, but not USAGE on the schema: another kind of
-- caller's grant may need it, and alone it gives nothing (nothing in the schema is
-- granted to PUBLIC).
CREATE FUNCTION fairq.revoke_from(p_role regrole, p_privileges text, p_objects text[]) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_role name := fairq.existing_role(p_role);
    v_object text;
BEGIN
    FOREACH v_object IN ARRAY p_objects LOOP
        EXECUTE format('REVOKE %s ON %s FROM %I', p_privileges, v_object, v_role);
    END LOOP;
END
$$;

CREATE FUNCTION fairq.grant_producer(p_role regrole) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT fairq.grant_to(p_role, 'EXECUTE', fairq.producer_functions())
$$;

CREATE FUNCTION fairq.grant_worker(p_role regrole) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT fairq.grant_to(p_role, 'EXECUTE', fairq.worker_functions())
$$;

CREATE FUNCTION fairq.grant_observer(p_role regrole) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT fairq.grant_to(p_role, 'SELECT', fairq.observer_relations());
    SELECT fairq.grant_to(p_role, 'EXECUTE', fairq.observer_functions());
$$;

CREATE FUNCTION fairq.grant_operator(p_role regrole) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT fairq.grant_to(p_role, 'EXECUTE', fairq.operator_functions())
$$;

CREATE FUNCTION fairq.revoke_producer(p_role regrole) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT fairq.revoke_from(p_role, 'EXECUTE', fairq.producer_functions())
$$;

CREATE FUNCTION fairq.revoke_worker(p_role regrole) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT fairq.revoke_from(p_role, 'EXECUTE', fairq.worker_functions())
$$;

CREATE FUNCTION fairq.revoke_observer(p_role regrole) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT fairq.revoke_from(p_role, 'SELECT', fairq.observer_relations());
    SELECT fairq.revoke_from(p_role, 'EXECUTE', fairq.observer_functions());
$$;

CREATE FUNCTION fairq.revoke_operator(p_role regrole) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT fairq.revoke_from(p_role, 'EXECUTE', fairq.operator_functions())
$$;

-- The functions above were created after the blanket REVOKE.
REVOKE ALL ON FUNCTION fairq.producer_functions() FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.worker_functions() FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.observer_relations() FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.observer_functions() FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.operator_functions() FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.existing_role(regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.grant_to(regrole, text, text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.revoke_from(regrole, text, text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.grant_producer(regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.grant_worker(regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.grant_observer(regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.grant_operator(regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.revoke_producer(regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.revoke_worker(regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.revoke_observer(regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.revoke_operator(regrole) FROM PUBLIC;

COMMENT ON FUNCTION fairq.grant_producer(regrole) IS
    'Lets a role create (single and batch) and cancel messages; it cannot dequeue or read contents.';
COMMENT ON FUNCTION fairq.grant_worker(regrole) IS
    'Lets a role dequeue, complete (single and batch), defer, heartbeat and fail messages, and hold a queue''s doorbell while it sleeps.';
COMMENT ON FUNCTION fairq.grant_observer(regrole) IS
    'Lets a role read fairq.queues, fairq.channels, fairq.dead_letters and fairq.message_history, and run fairq.check().';
COMMENT ON FUNCTION fairq.grant_operator(regrole) IS
    'Lets a role set and clear channel policies, pause and resume queues and channels, retry, delete and purge dead letters, and prune the history (grant_observer lets it see what it acts on).';
COMMENT ON FUNCTION fairq.revoke_producer(regrole) IS
    'Takes back what fairq.grant_producer gave the role (USAGE on the schema stays: another grant may need it).';
COMMENT ON FUNCTION fairq.revoke_worker(regrole) IS
    'Takes back what fairq.grant_worker gave the role (USAGE on the schema stays: another grant may need it).';
COMMENT ON FUNCTION fairq.revoke_observer(regrole) IS
    'Takes back what fairq.grant_observer gave the role (USAGE on the schema stays: another grant may need it).';
COMMENT ON FUNCTION fairq.revoke_operator(regrole) IS
    'Takes back what fairq.grant_operator gave the role (USAGE on the schema stays: another grant may need it).';
