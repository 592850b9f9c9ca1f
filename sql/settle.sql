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
