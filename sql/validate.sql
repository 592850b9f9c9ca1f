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
