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
