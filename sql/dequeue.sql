-- dequeue.sql — handing out messages: the whole scheduling algorithm.
--
-- One delivery, in order:
--   1. Recover expired locks (oldest first, a few per call): each message goes back
--      to 'ready' in its channel, frees its concurrency slot and waits for the
--      channel's next turn like any other message — a crash never lets one tenant's
--      recovered work jump the round-robin. (Past max_attempts it is buried.)
--   2. Take the eligible channel whose turn is earliest: one index lookup on
--      channel_turn_ix ((turn_at, turn_seq) WHERE turn_at IS NOT NULL). Channels at
--      max_concurrency, rate-limited channels and channels with nothing due have no
--      turn or a future one, so they cost nothing here. SKIP LOCKED spreads
--      concurrent dequeues over channels; if every eligible channel is busy with
--      another dequeue, a call that holds no other lock waits for one instead of
--      answering "empty" while work is waiting.
--   3. In that channel, promote scheduled messages that have come due to 'ready'
--      (so priority orders everything due, and a future message waits however
--      urgent), then lock the best ready message: one index lookup on
--      message_ready_ix (priority DESC, dequeue_at, id).
--   4. Give the channel its next turn: at the back of the rotation (now, next
--      turn_seq), no earlier than now + release_interval_ms, no earlier than its
--      next message is due, and none while it is full.
-- A call with p_max_messages = n repeats 2-4 n times under one clock reading, which
-- is exactly n single dequeues in a row: turn_seq keeps the turns strict even though
-- every release in the call happens "at the same time".
-- A dequeue should run in its own transaction: it locks the channels it serves
-- until commit.

-- Step 1. Returns how many expired locks it settled.
CREATE FUNCTION fairq.recover_expired(p_now timestamptz, p_limit integer) RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    v_message fairq.message;
    v_channel fairq.channel;
    v_count integer := 0;
BEGIN
    FOR v_message IN
        SELECT * FROM fairq.message
         WHERE status = 'locked' AND locked_until <= p_now
         ORDER BY locked_until
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED
    LOOP
        SELECT * INTO v_channel FROM fairq.channel
         WHERE id = v_message.channel_id FOR NO KEY UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND; -- its channel is busy; a later dequeue recovers it
        IF v_channel.max_attempts IS NOT NULL AND v_message.num_attempts >= v_channel.max_attempts THEN
            DELETE FROM fairq.message WHERE id = v_message.id;
            PERFORM fairq.bury(v_message, v_channel,
                               format('lock expired on delivery %s of max_attempts %s',
                                      v_message.num_attempts, v_channel.max_attempts), p_now);
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

-- Steps 3 and 4 on a channel the caller has locked. Returns the locked message, or
-- a NULL row when the channel had nothing to hand out.
CREATE FUNCTION fairq.channel_take(p_channel fairq.channel, p_now timestamptz, p_lock interval)
RETURNS fairq.message
LANGUAGE plpgsql
AS $$
DECLARE
    v_message fairq.message;
BEGIN
    -- SKIP LOCKED: a scheduled message being cancelled right now just stays put.
    UPDATE fairq.message SET status = 'ready'
     WHERE id IN (SELECT s.id FROM fairq.message s
                   WHERE s.channel_id = p_channel.id AND s.status = 'scheduled'
                     AND s.dequeue_at <= p_now
                     FOR UPDATE SKIP LOCKED);
    LOOP
        SELECT * INTO v_message FROM fairq.message m
         WHERE m.channel_id = p_channel.id AND m.status = 'ready'
         ORDER BY m.priority DESC, m.dequeue_at, m.id
         LIMIT 1
           FOR UPDATE SKIP LOCKED;
        EXIT WHEN NOT FOUND;
        IF p_channel.max_attempts IS NULL OR v_message.num_attempts < p_channel.max_attempts THEN
            UPDATE fairq.message
               SET status = 'locked', locked_until = p_now + p_lock,
                   num_attempts = num_attempts + 1,
                   first_dequeued_at = coalesce(first_dequeued_at, p_now)
             WHERE id = v_message.id
            RETURNING * INTO v_message;
            p_channel.in_flight := p_channel.in_flight + 1;
            p_channel.last_release_at := p_now;
            EXIT;
        END IF;
        -- Delivering it again would exceed max_attempts (e.g. a deferred message on
        -- its last attempt, or a lowered limit): it dies instead.
        DELETE FROM fairq.message WHERE id = v_message.id;
        PERFORM fairq.bury(v_message, p_channel,
                           format('max_attempts %s reached after %s deliveries',
                                  p_channel.max_attempts, v_message.num_attempts), p_now);
        v_message := NULL;
    END LOOP;

    p_channel.due_at := fairq.pending_due_at(p_channel.id);
    IF (p_channel.due_at IS NULL OR p_channel.due_at > p_now)
       AND NOT fairq.channel_quiet(p_channel.id) THEN
        -- A producer is inserting into this channel right now and decided, seeing the
        -- channel due, not to move its turn. Keep it due; a later turn finds the message.
        p_channel.due_at := p_now;
    END IF;
    p_channel := fairq.channel_store(p_channel, p_now, false);
    IF v_message.id IS NULL THEN
        PERFORM fairq.channel_collect(p_channel);
    END IF;
    RETURN v_message;
END
$$;

-- Step 2's fallback, for a call that holds no lock yet: every eligible channel is
-- locked, normally by another dequeue or settlement that takes about a millisecond.
-- Wait for the first one, but not for long: a channel held longer is held by a user
-- transaction, and the honest answer is then "nothing available".
CREATE FUNCTION fairq.channel_wait(p_now timestamptz) RETURNS fairq.channel
LANGUAGE plpgsql
AS $$
DECLARE
    v_channel fairq.channel;
    v_lock_timeout text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', '200ms', true);
    SELECT * INTO v_channel FROM fairq.channel c
     WHERE c.turn_at <= p_now
     ORDER BY c.turn_at, c.turn_seq
     LIMIT 1
       FOR NO KEY UPDATE;
    PERFORM set_config('lock_timeout', v_lock_timeout, true);
    RETURN v_channel;
EXCEPTION WHEN lock_not_available THEN
    RETURN NULL;
END
$$;

CREATE FUNCTION fairq.message_dequeue(p_lock_ms bigint, p_max_messages integer DEFAULT 1)
RETURNS TABLE(id bigint, channel text, content bytea, state bytea, num_attempts bigint,
              priority integer, dequeue_at timestamptz, recovered boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := fairq.clock();
    v_lock interval := fairq.ms(fairq.require_duration(p_lock_ms, 1, 'p_lock_ms'));
    v_channel fairq.channel;
    v_message fairq.message;
    v_visited bigint[] := '{}';
    v_served integer := 0;
    v_holds_locks boolean;
BEGIN
    PERFORM fairq.require_at_least(p_max_messages, 1, 'p_max_messages');
    v_holds_locks := fairq.recover_expired(v_now, p_max_messages) > 0;

    WHILE v_served < p_max_messages LOOP
        SELECT * INTO v_channel FROM fairq.channel c
         WHERE c.turn_at <= v_now AND c.id <> ALL (v_visited)
         ORDER BY c.turn_at, c.turn_seq
         LIMIT 1
           FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            EXIT WHEN v_holds_locks;
            v_channel := fairq.channel_wait(v_now);
            EXIT WHEN v_channel.id IS NULL;
        END IF;
        v_holds_locks := true;

        v_message := fairq.channel_take(v_channel, v_now, v_lock);
        IF v_message.id IS NULL THEN
            v_visited := v_visited || v_channel.id;
            CONTINUE;
        END IF;
        v_served := v_served + 1;
        id := v_message.id;
        channel := v_channel.name;
        content := v_message.content;
        state := v_message.state;
        num_attempts := v_message.num_attempts;
        priority := v_message.priority;
        dequeue_at := v_message.dequeue_at;
        recovered := v_message.recovered;
        RETURN NEXT;
    END LOOP;
END
$$;

COMMENT ON FUNCTION fairq.message_dequeue(bigint, integer) IS
    'Hands out up to p_max_messages messages, each locked for p_lock_ms: channels take strict turns, within a channel the highest priority due message goes first. Zero rows means nothing is available. recovered is true when the previous lock expired unsettled.';
