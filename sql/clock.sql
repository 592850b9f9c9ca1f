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
