-- settle.sql — what a worker (or an operator) does with a message it was handed.
--
-- Invariants:
--   * num_attempts is the fencing token: a call acts only on a message that is
--     still 'locked' with the caller's num_attempts; otherwise it answers 'stale'
--     (or 'not_found') and changes nothing, and takes no lock;
--   * a lock that has expired but was not yet recovered still belongs to its
--     holder: nobody else has been handed the message;
--   * leaving 'locked' frees exactly one concurrency slot, under the channel lock;
--   * lock order: the message (the fenced UPDATE/DELETE), then its channel, then its
--     channel_size row. Batches lock all their messages first, in id order.

-- 'stale' when the message exists (in another state or attempt), else 'not_found'.
CREATE FUNCTION fairq.miss(p_id bigint, p_if_exists text) RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT CASE WHEN EXISTS (SELECT 1 FROM fairq.message WHERE id = p_id)
                THEN p_if_exists ELSE 'not_found' END
$$;

CREATE FUNCTION fairq.message_complete_batch(p_ids bigint[], p_num_attempts bigint[])
RETURNS TABLE(id bigint, status text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := fairq.clock();
    v_input record;
    v_message fairq.message;
    v_done fairq.message[] := '{}';
    v_channel fairq.channel;
    v_group record;
BEGIN
    PERFORM fairq.require(p_ids, 'p_ids');
    PERFORM fairq.require(p_num_attempts, 'p_num_attempts');
    IF array_ndims(p_ids) > 1 OR cardinality(p_num_attempts) <> cardinality(p_ids) THEN
        RAISE EXCEPTION 'p_num_attempts must be a one-dimensional array as long as p_ids (%), got %',
            cardinality(p_ids), cardinality(p_num_attempts) USING ERRCODE = '22023';
    END IF;
    IF array_position(p_ids, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'p_ids[%] must not be NULL', array_position(p_ids, NULL) USING ERRCODE = '22004';
    END IF;
    IF array_position(p_num_attempts, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'p_num_attempts[%] must not be NULL', array_position(p_num_attempts, NULL)
            USING ERRCODE = '22004';
    END IF;

    PERFORM 1 FROM fairq.message m WHERE m.id = ANY (p_ids) ORDER BY m.id FOR UPDATE;
    FOR v_input IN
        SELECT u.id, u.num_attempts FROM unnest(p_ids, p_num_attempts) WITH ORDINALITY AS u(id, num_attempts, i)
         ORDER BY u.i
    LOOP
        DELETE FROM fairq.message m
         WHERE m.id = v_input.id AND m.status = 'locked' AND m.num_attempts = v_input.num_attempts
        RETURNING * INTO v_message;
        IF FOUND THEN
            v_done := v_done || v_message;
            id := v_input.id;
            status := 'completed';
        ELSE
            id := v_input.id;
            status := fairq.miss(v_input.id, 'stale');
        END IF;
        RETURN NEXT;
    END LOOP;

    FOR v_group IN
        SELECT d.channel_id, count(*)::integer AS n, max(d.id) AS last_id
          FROM unnest(v_done) AS d GROUP BY d.channel_id ORDER BY d.channel_id
    LOOP
        v_channel := fairq.channel_lock(v_group.channel_id);
        PERFORM fairq.record_history(d, v_channel.name, 'completed', v_now)
           FROM unnest(v_done) AS d WHERE d.channel_id = v_group.channel_id;
        PERFORM fairq.channel_resize(v_channel, -v_group.n, false);
        PERFORM fairq.channel_unlock(v_channel, v_group.n, NULL, v_now);
        PERFORM fairq.notify_event('completed', v_channel.name, v_group.last_id, NULL);
    END LOOP;
END
$$;

CREATE FUNCTION fairq.message_complete(p_id bigint, p_num_attempts bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM fairq.require(p_id, 'p_id');
    PERFORM fairq.require(p_num_attempts, 'p_num_attempts');
    RETURN (SELECT b.status FROM fairq.message_complete_batch(ARRAY[p_id], ARRAY[p_num_attempts]) AS b);
END
$$;

CREATE FUNCTION fairq.message_defer(p_id bigint, p_num_attempts bigint,
                                    p_dequeue_at timestamptz DEFAULT NULL, p_state bytea DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_dequeue_at timestamptz := coalesce(p_dequeue_at, v_now);
    v_message fairq.message;
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require(p_id, 'p_id');
    PERFORM fairq.require(p_num_attempts, 'p_num_attempts');
    UPDATE fairq.message
       SET status = CASE WHEN v_dequeue_at <= v_now THEN 'ready' ELSE 'scheduled' END::fairq.message_status,
           dequeue_at = v_dequeue_at, locked_until = NULL, recovered = false,
           state = coalesce(p_state, state)
     WHERE id = p_id AND status = 'locked' AND num_attempts = p_num_attempts
    RETURNING * INTO v_message;
    IF NOT FOUND THEN
        RETURN fairq.miss(p_id, 'stale');
    END IF;
    v_channel := fairq.channel_lock(v_message.channel_id);
    PERFORM fairq.channel_unlock(v_channel, 1, v_dequeue_at, v_now);
    PERFORM fairq.notify_event('deferred', v_channel.name, p_id, v_dequeue_at);
    RETURN 'deferred';
END
$$;

CREATE FUNCTION fairq.message_heartbeat(p_id bigint, p_num_attempts bigint, p_lock_ms bigint)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
BEGIN
    PERFORM fairq.require(p_id, 'p_id');
    PERFORM fairq.require(p_num_attempts, 'p_num_attempts');
    PERFORM fairq.require_duration(p_lock_ms, 1, 'p_lock_ms');
    UPDATE fairq.message
       SET locked_until = GREATEST(locked_until, v_now + fairq.ms(p_lock_ms))
     WHERE id = p_id AND status = 'locked' AND num_attempts = p_num_attempts;
    IF NOT FOUND THEN
        RETURN fairq.miss(p_id, 'stale');
    END IF;
    RETURN 'heartbeated';
END
$$;

CREATE FUNCTION fairq.message_fail(p_id bigint, p_num_attempts bigint, p_error text DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_message fairq.message;
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require(p_id, 'p_id');
    PERFORM fairq.require(p_num_attempts, 'p_num_attempts');
    DELETE FROM fairq.message
     WHERE id = p_id AND status = 'locked' AND num_attempts = p_num_attempts
    RETURNING * INTO v_message;
    IF NOT FOUND THEN
        RETURN fairq.miss(p_id, 'stale');
    END IF;
    v_channel := fairq.channel_lock(v_message.channel_id);
    PERFORM fairq.bury(v_message, v_channel, p_error, v_now);
    PERFORM fairq.channel_unlock(v_channel, 1, NULL, v_now);
    RETURN 'dead';
END
$$;

-- Cancelling only share-locks the channel, like creating, so a producer may cancel
-- inside a long transaction without hiding the channel from workers: the channel's due_at may stay early (a
-- dequeue then finds nothing, recomputes it, and collects an empty channel).
CREATE FUNCTION fairq.message_cancel(p_id bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_message fairq.message;
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require(p_id, 'p_id');
    DELETE FROM fairq.message WHERE id = p_id AND status <> 'locked'
    RETURNING * INTO v_message;
    IF NOT FOUND THEN
        RETURN fairq.miss(p_id, 'locked');
    END IF;
    -- The share lock only keeps channel_set from changing max_size under our feet.
    SELECT * INTO v_channel FROM fairq.channel WHERE id = v_message.channel_id FOR KEY SHARE;
    PERFORM fairq.record_history(v_message, v_channel.name, 'cancelled', v_now);
    PERFORM fairq.channel_resize(v_channel, -1, false);
    RETURN 'cancelled';
END
$$;

CREATE FUNCTION fairq.dead_letter_retry(p_id bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_dead fairq.dead_letter;
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require(p_id, 'p_id');
    DELETE FROM fairq.dead_letter WHERE id = p_id RETURNING * INTO v_dead;
    IF NOT FOUND THEN
        RETURN 'not_found';
    END IF;
    -- An operator's retry is not subject to max_size, and carries no dedup key.
    v_channel := fairq.channel_for_producer(v_dead.channel);
    PERFORM fairq.channel_wake(v_channel.id, v_now, v_now);
    PERFORM fairq.channel_resize(v_channel, 1, false);
    INSERT INTO fairq.message (id, channel_id, status, priority, dequeue_at, created_at, content, state)
    VALUES (v_dead.id, v_channel.id, 'ready', v_dead.priority, v_now, v_dead.created_at,
            v_dead.content, v_dead.state);
    PERFORM fairq.notify_event('created', v_channel.name, v_dead.id, v_now);
    RETURN 'requeued';
END
$$;

COMMENT ON FUNCTION fairq.message_complete(bigint, bigint) IS
    'Removes a message its caller holds (fenced by num_attempts): completed | not_found | stale.';
COMMENT ON FUNCTION fairq.message_complete_batch(bigint[], bigint[]) IS
    'message_complete for many messages: one (id, status) row per input element.';
COMMENT ON FUNCTION fairq.message_defer(bigint, bigint, timestamptz, bytea) IS
    'Unlocks a held message and reschedules it (NULL = now), keeping num_attempts; a non-NULL p_state replaces the saved state: deferred | not_found | stale.';
COMMENT ON FUNCTION fairq.message_heartbeat(bigint, bigint, bigint) IS
    'Extends a held message''s lock to now + p_lock_ms (never shortens it): heartbeated | not_found | stale.';
COMMENT ON FUNCTION fairq.message_fail(bigint, bigint, text) IS
    'Moves a held message to the dead letters now, with p_error: dead | not_found | stale.';
COMMENT ON FUNCTION fairq.message_cancel(bigint) IS
    'Removes a message that is not in flight: cancelled | not_found | locked.';
COMMENT ON FUNCTION fairq.dead_letter_retry(bigint) IS
    'Puts a dead letter back on its channel with num_attempts reset to 0 (same id and priority, no dedup key, not subject to max_size): requeued | not_found.';
