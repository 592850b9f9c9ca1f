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
