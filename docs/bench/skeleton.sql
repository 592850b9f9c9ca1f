-- skeleton.sql — a measuring device, not a queue: never load it where data matters.
--
-- What one message costs fairq's design with none of its promises but the rotation:
-- run in a scratch database that has `CREATE EXTENSION fairq` (written against 0.7.31's
-- tables and signatures), it renames message_create, message_dequeue and
-- message_complete to *_real and puts in their place the least those three calls can
-- do on fairq's own tables and indexes:
--   * a dequeue of one message: take the first channel of the rotation
--     (channel_turn_ix, SKIP LOCKED), lock its best ready message (message_ready_ix,
--     SKIP LOCKED, num_attempts + 1 as the fencing token), then move the channel on
--     by one stride if it has another ready message, else take it out of the
--     rotation;
--   * a create: look the channel up by name; if it is out of the rotation, write it
--     back in (the naive lifecycle that fairq's wakes replaced: here a producer
--     writes the channel row, and may wait for a dequeue that holds it); insert;
--   * a completion: the fenced delete.
-- Everything else falls back to the real call: a batch dequeue, an empty rotation, a
-- picked channel with nothing ready, a create on a channel not made yet or waiting to
-- join the rotation, or with a dequeue_at or a dedup key. What it drops: argument
-- checks, expired-lock recovery, wakes, joining at the back, pauses, caps, rate
-- limits, weights, max_attempts, scheduled messages coming due, bounded channels,
-- history, events, the collector, fresh clocks, and the producer, settle and policy
-- locks — so it is wrong under races (a message created while its channel is being
-- taken out of the rotation can be stranded) and unfair (a channel put back goes
-- first), which a 15-second throughput run hardly notices.
-- docs/bench.md, "Measured after 0.7.31: the design without its promises", has what
-- it measured, and how.

ALTER FUNCTION fairq.message_dequeue(bigint, integer, text) RENAME TO message_dequeue_real;
ALTER FUNCTION fairq.message_create(text, bytea, timestamptz, integer, text, text) RENAME TO message_create_real;
ALTER FUNCTION fairq.message_complete(bigint, bigint) RENAME TO message_complete_real;

CREATE FUNCTION fairq.message_dequeue(p_lock_ms bigint, p_max_messages integer DEFAULT 1,
                                      p_queue text DEFAULT 'default')
RETURNS TABLE(id bigint, channel text, content bytea, state bytea, num_attempts bigint,
              priority integer, dequeue_at timestamptz, recovered boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := clock_timestamp();
    v_channel_id bigint;
    v_name text;
BEGIN
    IF p_max_messages <> 1 THEN
        RETURN QUERY SELECT * FROM fairq.message_dequeue_real(p_lock_ms, p_max_messages, p_queue);
        RETURN;
    END IF;
    SELECT c.id, c.name INTO v_channel_id, v_name
      FROM fairq.channel c
     WHERE c.queue_id = (SELECT q.id FROM fairq.queue q WHERE q.name = p_queue) AND c.turn_at <= v_now
     ORDER BY c.turn_at, c.turn_pass, c.turn_seq
     LIMIT 1
       FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN QUERY SELECT * FROM fairq.message_dequeue_real(p_lock_ms, 1, p_queue);
        RETURN;
    END IF;
    RETURN QUERY
        UPDATE fairq.message m
           SET status = 'locked', locked_until = v_now + p_lock_ms * interval '1 ms',
               num_attempts = m.num_attempts + 1
         WHERE m.id = (SELECT s.id FROM fairq.message s
                        WHERE s.channel_id = v_channel_id AND s.status = 'ready'
                        ORDER BY s.priority DESC, s.dequeue_at, s.id
                        LIMIT 1
                          FOR UPDATE SKIP LOCKED)
        RETURNING m.id, v_name, m.content, m.state, m.num_attempts, m.priority, m.dequeue_at,
                  m.recovered;
    IF NOT FOUND THEN
        RETURN QUERY SELECT * FROM fairq.message_dequeue_real(p_lock_ms, 1, p_queue);
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM fairq.message s WHERE s.channel_id = v_channel_id AND s.status = 'ready') THEN
        UPDATE fairq.channel c
           SET turn_pass = c.turn_pass + 1000000, turn_seq = nextval('fairq.turn_seq'),
               last_release_at = v_now, turn_given_at = v_now
         WHERE c.id = v_channel_id;
    ELSE
        UPDATE fairq.channel c SET turn_at = NULL, last_release_at = v_now, turn_given_at = NULL
         WHERE c.id = v_channel_id;
    END IF;
END
$$;

CREATE FUNCTION fairq.message_create(p_channel text, p_content bytea, p_dequeue_at timestamptz DEFAULT NULL,
                                     p_priority integer DEFAULT 0, p_dedup_key text DEFAULT NULL,
                                     p_queue text DEFAULT 'default')
RETURNS TABLE(id bigint, status text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_channel_id bigint;
    v_queue_id integer;
BEGIN
    SELECT c.id, c.queue_id INTO v_channel_id, v_queue_id
      FROM fairq.channel c
     WHERE c.queue_id = (SELECT q.id FROM fairq.queue q WHERE q.name = p_queue)
       AND c.name = p_channel AND (c.turn_at IS NULL OR c.turn_at <= clock_timestamp());
    IF v_channel_id IS NULL OR p_dequeue_at IS NOT NULL OR p_dedup_key IS NOT NULL THEN
        RETURN QUERY SELECT * FROM fairq.message_create_real(p_channel, p_content, p_dequeue_at,
                                                             p_priority, p_dedup_key, p_queue);
        RETURN;
    END IF;
    UPDATE fairq.channel c SET turn_at = '-infinity', turn_pass = 0, turn_seq = nextval('fairq.turn_seq'),
                               turn_given_at = clock_timestamp()
     WHERE c.id = v_channel_id AND c.turn_at IS NULL;
    INSERT INTO fairq.message (channel_id, status, priority, dequeue_at, created_at, content, queue_id)
    VALUES (v_channel_id, 'ready', coalesce(p_priority, 0), clock_timestamp(), clock_timestamp(),
            p_content, v_queue_id)
    RETURNING fairq.message.id INTO id;
    status := 'created';
    RETURN NEXT;
END
$$;

CREATE FUNCTION fairq.message_complete(p_id bigint, p_num_attempts bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    DELETE FROM fairq.message m
     WHERE m.id = p_id AND m.status = 'locked' AND m.num_attempts = p_num_attempts;
    RETURN CASE WHEN FOUND THEN 'completed' ELSE 'stale' END;
END
$$;
