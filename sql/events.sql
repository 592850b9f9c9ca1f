-- events.sql — what fairq tells the outside world: NOTIFY events and history.
--
-- Invariants:
--   * events are hints sent from inside the caller's transaction, so listeners hear
--     of a message only once it is committed; by default only calls that make work
--     available send one (see fairq.events_wanted), payloads stay small, and
--     `SET fairq.events = off` silences them;
--   * with `fairq.history = on`, every message that leaves the queue (completed,
--     dead, cancelled) leaves exactly one row in fairq.message_history;
--   * a dead letter keeps everything needed to put the message back.

-- Whether a call should send its event. fairq.events = 'wake' (the default; 'on' too)
-- sends only the events that may wake a sleeping worker: the call made work
-- available that was not (p_wakes). 'all' sends every event, 'off' none. Every
-- NOTIFY holds a database-wide lock from commit until its WAL is flushed, so events
-- that wake nobody are what serialises a busy queue's commits.
CREATE FUNCTION fairq.events_wanted(p_wakes boolean) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT CASE coalesce(current_setting('fairq.events', true), '')
               WHEN 'all' THEN true
               WHEN 'off' THEN false WHEN 'false' THEN false WHEN '0' THEN false
               ELSE p_wakes
           END
$$;

-- Sends one event; callers ask fairq.events_wanted first. Workers filter by queue.
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

CREATE FUNCTION fairq.record_history(p_message fairq.message, p_channel text, p_outcome text,
                                     p_now timestamptz)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF coalesce(current_setting('fairq.history', true), '') IN ('on', 'true', '1') THEN
        INSERT INTO fairq.message_history
            (id, channel, priority, created_at, first_dequeued_at, settled_at, num_attempts, outcome, queue)
        VALUES (p_message.id, p_channel, p_message.priority, p_message.created_at,
                p_message.first_dequeued_at, p_now, p_message.num_attempts, p_outcome,
                (SELECT q.name FROM fairq.queue q WHERE q.id = p_message.queue_id));
    END IF;
END
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
