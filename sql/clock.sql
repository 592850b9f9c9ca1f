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
--     extension's owner can, so no caller can bend the queue's time.

CREATE TABLE fairq.clock_offset (
    singleton boolean  NOT NULL DEFAULT true PRIMARY KEY CHECK (singleton),
    shift     interval NOT NULL DEFAULT interval '0'
);
INSERT INTO fairq.clock_offset DEFAULT VALUES;

-- plpgsql rather than SQL: a SQL function with a subquery is not inlined and would
-- be planned again at every call; plpgsql keeps its plan for the session.
CREATE FUNCTION fairq.clock() RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RETURN clock_timestamp() + coalesce((SELECT shift FROM fairq.clock_offset), interval '0');
END
$$;

CREATE FUNCTION fairq.ms(p_milliseconds bigint) RETURNS interval
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$ SELECT p_milliseconds * interval '1 millisecond' $$;

-- For tests only (not granted to anyone): moves the queue's clock by p_shift_ms
-- relative to real time. fairq.clock_travel(0) returns to real time.
CREATE FUNCTION fairq.clock_travel(p_shift_ms bigint) RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_shift_ms IS NULL THEN
        RAISE EXCEPTION 'p_shift_ms must not be NULL' USING ERRCODE = '22004';
    END IF;
    UPDATE fairq.clock_offset SET shift = fairq.ms(p_shift_ms);
    RETURN fairq.clock();
END
$$;

COMMENT ON TABLE fairq.clock_offset IS 'Shift of the queue''s clock from real time; zero except in tests.';
COMMENT ON FUNCTION fairq.clock() IS
    'The queue''s clock: the server''s clock_timestamp() at the moment of the call (plus the test shift, normally zero).';
COMMENT ON FUNCTION fairq.clock_travel(bigint) IS
    'Tests only, owner only: sets the queue''s clock to real time plus p_shift_ms and returns it.';
