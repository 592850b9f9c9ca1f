-- dequeue.sql — handing out messages: the whole scheduling algorithm.
--
-- A dequeue serves one queue (p_queue): every lookup below starts with its id, so
-- other queues' messages and channels cost it nothing. *When* a channel may be
-- served and *in what order* channels are served are kept apart: the rules of
-- turns, the rotation and weights are in turns.sql. One call, in order:
--   1. Recover expired locks (oldest first, at most p_max_messages per call): each
--      message goes back to 'ready' in its channel, frees its concurrency slot and
--      waits for the channel's next turn like any other message — a crash never lets
--      one tenant's recovered work jump the round-robin. (Past max_attempts it is
--      buried instead.) Then, if the queue is paused, the call hands out nothing.
--   2. Channels whose wait is over join the rotation, earliest first, as many as
--      messages are wanted (fairq.join_rotation): among them the idle channels that
--      producers woke (their queued wakes are applied in the same write), each
--      placed as if it had joined when its producer gave it its turn. Then take the
--      channels first in the rotation (by pass), as many as messages are still
--      wanted: one scan of channel_turn_ix (queue_id, turn_at, turn_pass, turn_seq).
--      (A call for one message whose one joining channel, waiting or woken, would be
--      first in the rotation takes that channel without writing it into the
--      rotation: it is served from where it joins, its row written once.) Channels
--      at max_concurrency, rate-limited, paused or with nothing due are not in the
--      rotation, so they cost nothing.
--      SKIP LOCKED spreads concurrent dequeues over channels. A channel placed in
--      the rotation after this call read its clock is served at a fresh clock (its
--      release is recorded at that clock). A pick that finds
--      nothing reads the clock again and picks once more: a call that started later
--      may have served a channel meanwhile and made it wait until that later time.
--      If every eligible channel is busy with another call, a call that holds no lock
--      yet waits briefly for one to be released and picks again (with a new clock,
--      unless the queue was paused meanwhile), instead of answering "empty" while
--      work is waiting.
--   3. In those channels, promote scheduled messages that have come due to 'ready'
--      (so priority orders everything due, and a future message waits however
--      urgent), bury heads that would exceed max_attempts, then lock each channel's
--      best ready message: one lookup on message_ready_ix (priority DESC,
--      dequeue_at, id) per channel. A call promotes a bounded number of a channel's
--      messages, so that a campaign of a million messages due at one instant costs
--      each call a few ms, not one call seconds (past a statement_timeout, every
--      dequeue that picked the channel failed, and it stayed first in the rotation):
--      the first fairq.promotions_per_serve() due, and, when more than that are due,
--      the first by priority (message_scheduled_priority_ix), as many as the call may
--      hand out and at least that bound. The best due message is then ready: any left
--      scheduled comes after every message promoted by priority.
--   4. Give each served channel its next turn: while it may be served again at once
--      it stays in the rotation, moved on by its stride (1,000,000 / weight); else it
--      waits (until now + release_interval_ms, its next message's due time, its
--      pause's end, or a freed slot when full) and then joins again at the back
--      (but a channel full with work due keeps its place: turns.sql). A
--      channel that had nothing to hand out gets its turn recomputed (a cancelled
--      head; one that another transaction holds puts the channel off a while:
--      fairq.channel_retire).
-- Serving k channels once each, in rotation order, is exactly what k single
-- dequeues in a row do as long as none of them comes round again before the k-th:
-- so a call with p_max_messages = n serves, in each round, the channels picked up to
-- the first whose pass lies beyond an earlier one's next pass (with weight 1
-- everywhere that is every channel picked), and repeats rounds until n messages are
-- out or no channel is eligible. It equals n single dequeues.
-- Last, once a second across all dequeues, it removes channels idle for a while
-- (fairq.collect_idle_channels), so the channel table stays as large as the set of
-- tenants active lately.
-- A dequeue should run in its own transaction: it locks the channels it serves
-- until commit.

-- The max_attempts rule, for steps 1 and 3: a message may be handed out while the
-- deliveries since it was created or last retried from the dead letters
-- (num_attempts - attempts_at_retry) are fewer than its channel's max_attempts.
-- num_attempts itself never goes back: it is the fencing token, and a holder from
-- before a retry must stay fenced out. Returns NULL while the message may be handed
-- out again, else why it dies (for its dead letter's error).
CREATE FUNCTION fairq.attempts_exhausted(p_num_attempts bigint, p_attempts_at_retry bigint,
                                         p_max_attempts integer, p_lock_expired boolean) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN p_max_attempts IS NULL OR p_num_attempts - p_attempts_at_retry < p_max_attempts THEN NULL
        WHEN p_lock_expired THEN format('lock expired on delivery %s of max_attempts %s',
                                        p_num_attempts - p_attempts_at_retry, p_max_attempts)
        ELSE format('max_attempts %s reached after %s deliveries', p_max_attempts,
                    p_num_attempts - p_attempts_at_retry)
    END || CASE WHEN p_attempts_at_retry > 0
                THEN format(' since the last retry (%s in all)', p_num_attempts) ELSE '' END
$$;

-- Step 1. Returns how many expired messages it locked: those it settled, and those
-- whose channel was busy, left to a later dequeue. The caller holds the locks of
-- both until it commits, so it must not wait for another call after this
-- (fairq.wait_for_release): the holder completing such a message waits for it.
CREATE FUNCTION fairq.recover_expired(p_queue_id integer, p_now timestamptz, p_limit integer) RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    v_message fairq.message;
    v_channel fairq.channel;
    v_exhausted text;
    v_count integer := 0;
BEGIN
    FOR v_message IN
        -- (Only locked messages have a locked_until: message_locked_ix is keyed on it.)
        SELECT * FROM fairq.message
         WHERE queue_id = p_queue_id AND locked_until <= p_now
         ORDER BY locked_until
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED
    LOOP
        SELECT * INTO v_channel FROM fairq.channel
         WHERE id = v_message.channel_id FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            v_count := v_count + 1;  -- its channel is busy; a later dequeue recovers it
            CONTINUE;
        END IF;
        v_channel := fairq.channel_with_wakes(v_channel);
        v_exhausted := fairq.attempts_exhausted(v_message.num_attempts, v_message.attempts_at_retry,
                                                v_channel.max_attempts, true);
        IF v_exhausted IS NOT NULL THEN
            DELETE FROM fairq.message WHERE id = v_message.id;
            PERFORM fairq.bury(v_message, v_channel, v_exhausted, p_now);
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

-- Step 3's burial: heads of the given channels that one more delivery would take past
-- max_attempts (a deferred message on its last attempt, or a lowered limit) die
-- instead, until every head may be delivered.
CREATE FUNCTION fairq.bury_exhausted_heads(p_channel_ids bigint[], p_now timestamptz)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_message fairq.message;
    v_channel fairq.channel;
    v_buried boolean := true;
BEGIN
    WHILE v_buried LOOP
        v_buried := false;
        FOR v_message IN
            SELECT h.*
              FROM fairq.channel c
             CROSS JOIN LATERAL (
                   SELECT * FROM fairq.message m
                    WHERE m.channel_id = c.id AND m.status = 'ready'
                    ORDER BY m.priority DESC, m.dequeue_at, m.id
                    LIMIT 1
                      FOR UPDATE SKIP LOCKED) h
             WHERE c.id = ANY (p_channel_ids) AND c.max_attempts IS NOT NULL
               AND fairq.attempts_exhausted(h.num_attempts, h.attempts_at_retry, c.max_attempts,
                                            false) IS NOT NULL
        LOOP
            SELECT * INTO v_channel FROM fairq.channel WHERE id = v_message.channel_id;
            DELETE FROM fairq.message WHERE id = v_message.id;
            PERFORM fairq.bury(v_message, v_channel,
                               fairq.attempts_exhausted(v_message.num_attempts, v_message.attempts_at_retry,
                                                        v_channel.max_attempts, false), p_now);
            v_buried := true;
        END LOOP;
    END LOOP;
END
$$;

-- Step 2's fallback, for a call that holds no lock yet: every eligible channel is
-- locked, normally by other calls that take milliseconds. Wait until the first of
-- them is released, then let the caller pick again with SKIP LOCKED. The wait is
-- for that one row, by id, in a subtransaction that is always rolled back, so the
-- waiter never holds a row lock:
--   * a locking scan (... ORDER BY turn LIMIT 1 FOR UPDATE) that waits for a row
--     whose new version no longer qualifies keeps that row locked and waits for the
--     next one; two such waiters deadlocked, or stalled until lock_timeout (seen in
--     the bench as light tenants' p99 wait of 150-190 ms);
--   * when a dequeue commits, every call waiting behind it wakes at once instead of
--     receiving the row one after another.
-- "Eligible" is judged by a clock read after the statement's snapshot (the
-- subquery runs once, as the scan starts): every turn it can see was given by a call
-- that read its clock before committing, so a channel that is due now is never taken
-- for a future one. With no eligible channel, the channel of the oldest due wake is
-- waited for: another dequeue may be applying that wake. Not past p_until: a channel
-- held longer is held by a user transaction, and the honest answer is then "nothing
-- available". True when the caller should pick again. (lock_timeout takes at most
-- 2^31 - 1 ms: a longer fairq.dequeue_busy_wait, which may be up to 1,000 years,
-- waits that long, about 24.8 days; 0.7.31 failed with lock_timeout's error.)
CREATE FUNCTION fairq.wait_for_release(p_queue_id integer, p_until timestamptz) RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    v_wait_ms bigint := LEAST(ceil(extract(epoch FROM p_until - clock_timestamp()) * 1000),
                              2147483647);
    v_first bigint := coalesce(
        (SELECT c.id FROM fairq.channel c
          WHERE c.queue_id = p_queue_id AND c.turn_at <= (SELECT fairq.clock())
          ORDER BY c.turn_at, c.turn_pass, c.turn_seq LIMIT 1),
        (SELECT w.channel_id FROM fairq.channel_wake w
          WHERE w.queue_id = p_queue_id AND GREATEST(w.due_at, w.woken_at) <= (SELECT fairq.clock())
          ORDER BY GREATEST(w.due_at, w.woken_at), w.turn_seq LIMIT 1));
BEGIN
    IF v_first IS NULL OR v_wait_ms <= 0 THEN
        RETURN false;
    END IF;
    BEGIN
        -- Local to the subtransaction: its rollback restores the caller's setting.
        PERFORM set_config('lock_timeout', v_wait_ms || 'ms', true);
        PERFORM FROM fairq.channel c WHERE c.id = v_first FOR NO KEY UPDATE;
        RAISE EXCEPTION USING ERRCODE = 'FQ001';  -- rolls back the lock just taken
    EXCEPTION
        WHEN SQLSTATE 'FQ001' THEN
            RETURN true;
        WHEN lock_not_available THEN
            RETURN false;
    END;
END
$$;

-- Step 2's round: of the channels picked (in rotation order, with their weights),
-- how many n single dequeues would serve one after the other before any of them
-- comes round again: up to the first channel that waits to join, or whose pass lies
-- beyond the next pass of a channel before it (equal passes: the one already there
-- goes first). At least one.
CREATE FUNCTION fairq.round_length(p_turn_ats timestamptz[], p_passes bigint[], p_weights integer[])
RETURNS integer
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v_next_pass bigint;  -- the lowest next pass of the channels before
BEGIN
    FOR i IN 1 .. cardinality(p_passes) LOOP
        IF i > 1 AND (p_turn_ats[i] <> fairq.in_rotation() OR p_passes[i] > v_next_pass) THEN
            RETURN i - 1;
        END IF;
        IF p_turn_ats[i] <> fairq.in_rotation() THEN
            RETURN 1;  -- a channel still waiting to join (left over by join_rotation) goes alone
        END IF;
        v_next_pass := LEAST(v_next_pass, p_passes[i] + fairq.turn_stride(p_weights[i]));
    END LOOP;
    RETURN cardinality(p_passes);
END
$$;

-- Step 3's bound: how many of a channel's scheduled messages that have come due a
-- call moves to 'ready' by due time, and at least how many by priority when more
-- are due (about 5 µs each).
CREATE FUNCTION fairq.promotions_per_serve() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1000 $$;

CREATE FUNCTION fairq.message_dequeue(p_lock_ms bigint, p_max_messages integer DEFAULT 1,
                                      p_queue text DEFAULT 'default')
RETURNS TABLE(id bigint, channel text, content bytea, state bytea, num_attempts bigint,
              priority integer, dequeue_at timestamptz, recovered boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := fairq.clock();
    v_lock interval := fairq.ms(fairq.require_duration(p_lock_ms, 1, 'p_lock_ms'));
    v_queue_id integer;
    v_paused_until timestamptz;
    v_expired boolean;  -- the queue's earliest lock has expired
    v_joiners boolean;  -- fairq.join_rotation has channels to let join
    v_join record;  -- what fairq.join_rotation did
    v_first_id bigint;  -- a channel to serve first, not yet written into the rotation
    v_first_pass bigint;  -- the pass it joins at
    v_wait_until timestamptz;
    v_picked bigint[];
    v_picked_names text[];
    v_latest_given timestamptz;  -- the latest turn_given_at of the channels picked
    v_turn_ats timestamptz[];
    v_passes bigint[];
    v_weights integer[];
    v_ids bigint[];
    v_served bigint[];
    v_served_names text[];
    v_served_seqs bigint[];
    v_visited bigint[] := '{}';
    v_turn_seqs bigint[];
    v_pos integer;
    v_handed_out integer;  -- by a statement that locked one channel's head
    v_count integer := 0;
    v_holds_locks boolean := false;
    v_clock_fresh boolean := false;  -- v_now was read after the last pick that found something
    v_attempts_capped boolean;
    v_woken boolean;  -- a picked channel may have wakes queued
    v_scheduled_due boolean;  -- a picked channel may have scheduled messages come due
    v_promoted integer;  -- scheduled messages of the picked channels moved to 'ready'
    v_flooded bigint[] := '{}';  -- channels promoted by priority at v_flooded_at (step 3)
    v_flooded_at timestamptz;
    v_uneven boolean;  -- the round may end before the last channel picked
    v_collect boolean;  -- the collector's turn was due when the call began
    v_done boolean;  -- what the checks return (validate.sql)
BEGIN
    v_done := fairq.require_read_committed('fairq.message_dequeue')
              AND fairq.require_at_least(p_max_messages, 1, 'p_max_messages') IS NOT NULL;
    -- The queue, and three questions, in one statement (each statement costs):
    --   * has its earliest lock expired (one probe of message_locked_ix)?
    --   * would fairq.join_rotation find anything: a channel whose wait is over, or a
    --     queued wake? On a busy queue every due channel is already in the rotation,
    --     and two probes cost less than the call;
    --   * is the collector's turn due (read without its lock, taken at the end)?
    SELECT q.id, q.paused_until,
           (SELECT m.id FROM fairq.message m
             WHERE m.queue_id = q.id AND m.locked_until <= v_now
             ORDER BY m.locked_until LIMIT 1) IS NOT NULL,
           EXISTS (SELECT 1 FROM fairq.channel c
                    WHERE c.queue_id = q.id
                      AND c.turn_at > fairq.in_rotation() AND c.turn_at <= v_now)
           OR EXISTS (SELECT 1 FROM fairq.channel_wake w WHERE w.queue_id = q.id),
           EXISTS (SELECT 1 FROM fairq.channel_collection k WHERE k.collected_at <= v_now - interval '1 s')
      INTO v_queue_id, v_paused_until, v_expired, v_joiners, v_collect
      FROM fairq.queue q WHERE q.name = p_queue;
    IF NOT FOUND THEN
        PERFORM fairq.require_channel_name(p_queue, 'p_queue');
        RETURN;  -- nobody has named this queue yet: nothing in it
    END IF;
    -- Step 1. (A recovered message's channel may now wait to join; the call holds
    -- the locks recovery took.)
    IF v_expired AND fairq.recover_expired(v_queue_id, v_now, p_max_messages) > 0 THEN
        v_holds_locks := true;
        v_joiners := true;
    END IF;
    IF v_paused_until > v_now THEN
        v_count := p_max_messages;  -- a paused queue hands nothing out
    ELSIF v_joiners THEN
        v_join := fairq.join_rotation(v_queue_id, v_now, p_max_messages, p_max_messages = 1);
        v_holds_locks := v_join.took OR v_holds_locks;
        v_first_id := v_join.first_id;
        v_first_pass := v_join.first_pass;
    END IF;

    WHILE v_count < p_max_messages LOOP
        IF v_first_id IS NOT NULL THEN
            -- Step 2 for the channel fairq.join_rotation found first (this call holds it):
            -- picked alone, where it joins.
            v_picked := ARRAY[v_first_id];
            v_picked_names := ARRAY[v_join.first_name];
            v_attempts_capped := v_join.first_capped;
            v_uneven := false;
            v_turn_seqs := ARRAY[nextval('fairq.turn_seq')];
            v_latest_given := NULL;
            -- (Its wakes were spent as it joined: any queued since?)
            v_woken := EXISTS (SELECT 1 FROM fairq.channel_wake w WHERE w.channel_id = v_first_id);
            v_scheduled_due := true;
        ELSE
            -- Step 2. (The aggregates take the rows in the order the subquery gives them,
            -- the rotation order: PostgreSQL's sorted-subquery idiom, without a sort of
            -- their own.)
            SELECT coalesce(array_agg(p.id), '{}'), coalesce(array_agg(p.name), '{}'),
                   coalesce(bool_or(p.max_attempts IS NOT NULL), false),
                   -- Only different weights, or a channel still waiting to join, can end a
                   -- round early (fairq.round_length).
                   count(*) > 1 AND (bool_or(p.turn_at <> fairq.in_rotation())
                                     OR min(p.weight) <> max(p.weight)),
                   -- The turn_seq of each picked channel, taken in pick order: served or
                   -- not, each takes its next turn in the order n single dequeues would
                   -- give it.
                   coalesce(array_agg(nextval('fairq.turn_seq')), '{}'),
                   max(p.turn_given_at),
                   -- Whether steps 2 and 3 below have anything to do, asked here: two
                   -- probes of an index cost less than the two statements. (A wake or a
                   -- scheduled message committed after this snapshot is one committed a
                   -- moment later: the next serve of the channel folds or promotes it.)
                   coalesce(bool_or(EXISTS (SELECT 1 FROM fairq.channel_wake w WHERE w.channel_id = p.id)),
                            false),
                   coalesce(bool_or(EXISTS (SELECT 1 FROM fairq.message s
                                             WHERE s.channel_id = p.id AND s.status = 'scheduled'
                                               AND s.dequeue_at <= v_now)), false)
              INTO v_picked, v_picked_names, v_attempts_capped, v_uneven, v_turn_seqs, v_latest_given,
                   v_woken, v_scheduled_due
              FROM (SELECT c.id, c.name, c.turn_at, c.turn_pass, c.turn_seq, c.weight, c.max_attempts,
                           c.turn_given_at
                      FROM fairq.channel c
                     WHERE c.queue_id = v_queue_id AND c.turn_at <= v_now AND c.id <> ALL (v_visited)
                     ORDER BY c.turn_at, c.turn_pass, c.turn_seq
                     LIMIT p_max_messages - v_count
                       FOR NO KEY UPDATE SKIP LOCKED) p;
        END IF;
        IF cardinality(v_picked) = 0 THEN
            -- A call that read the clock after this one may have served a channel
            -- meanwhile and given it its next turn at that later clock (so may a
            -- completion that freed a slot): read the clock again and look once more
            -- before answering "nothing available" or waiting.
            IF NOT v_clock_fresh THEN
                v_now := fairq.clock();
                v_clock_fresh := true;
                v_holds_locks := (fairq.join_rotation(v_queue_id, v_now, p_max_messages - v_count)).took
                                 OR v_holds_locks;
                CONTINUE;
            END IF;
            EXIT WHEN v_holds_locks;
            -- How long, in all, a call waits for busy channels: the setting
            -- fairq.dequeue_busy_wait (an interval, default 200 ms). Longer means a user
            -- transaction holds the channel, and the answer is "nothing available".
            v_wait_until := coalesce(v_wait_until, clock_timestamp()
                + fairq.setting_duration('fairq.dequeue_busy_wait', interval '200 ms'));
            EXIT WHEN NOT fairq.wait_for_release(v_queue_id, v_wait_until);
            -- The call we waited for may have applied a wake, or left one free to apply,
            -- and gave its channel a turn at its own clock. This call goes on with a new
            -- clock: a channel that joins the rotation now is served at that clock, never
            -- at the one read before the wait (a rate limit counts from the release).
            -- A queue paused meanwhile hands nothing more out (until 0.7.37 a dequeue
            -- that had waited for a busy channel served it after the pause committed).
            v_now := fairq.clock();
            EXIT WHEN fairq.queue_paused(v_queue_id, v_now);
            v_holds_locks := (fairq.join_rotation(v_queue_id, v_now, p_max_messages - v_count)).took;
            v_clock_fresh := false;
            CONTINUE;
        END IF;
        -- A channel that another call gave its place after this one read its clock (at a
        -- later clock: a rate-limited channel joins at the end of its interval) is
        -- served at a clock no earlier than that place. The release is recorded at this
        -- clock, and a rate limit counts from it: with the older clock, two releases
        -- were recorded closer than release_interval_ms.
        IF v_latest_given > v_now THEN
            v_now := fairq.clock();
            v_scheduled_due := true;  -- (asked at the older clock)
        END IF;
        v_clock_fresh := false;
        v_holds_locks := true;
        -- This round serves the channels that single dequeues would serve in a row;
        -- the others stay locked by this call and are picked again.
        IF v_uneven THEN
            SELECT array_agg(c.turn_at ORDER BY p.pos), array_agg(c.turn_pass ORDER BY p.pos),
                   array_agg(c.weight ORDER BY p.pos)
              INTO v_turn_ats, v_passes, v_weights
              FROM unnest(v_picked) WITH ORDINALITY AS p(id, pos)
             CROSS JOIN LATERAL (SELECT k.turn_at, k.turn_pass, k.weight FROM fairq.channel k
                                  WHERE k.id = p.id OFFSET 0) c;
            v_pos := fairq.round_length(v_turn_ats, v_passes, v_weights);
            v_picked := v_picked[1 : v_pos];
            v_picked_names := v_picked_names[1 : v_pos];
            v_turn_seqs := v_turn_seqs[1 : v_pos];
        END IF;
        -- Wakes still queued for the picked channels happened before this serve.
        IF v_woken THEN
            PERFORM fairq.fold_wakes(v_picked);
        END IF;

        -- Step 3. (SKIP LOCKED: a message being cancelled stays put.) More promoted
        -- than one channel's bound means a channel had more due: the second statement
        -- promotes, in each channel, the first by priority (none where all were in),
        -- as many as this call may serve; so later rounds of the call, at the same
        -- clock, need promote nothing more in those channels.
        IF v_scheduled_due AND NOT (v_flooded_at = v_now AND v_picked <@ v_flooded) THEN
            UPDATE fairq.message m SET status = 'ready'
             WHERE m.id = ANY (ARRAY(
                   SELECT s.id FROM unnest(v_picked) AS p(id)
                    CROSS JOIN LATERAL (
                          SELECT s.id FROM fairq.message s
                           WHERE s.channel_id = p.id AND s.status = 'scheduled'
                             AND s.dequeue_at <= v_now
                           ORDER BY s.dequeue_at, s.id
                           LIMIT fairq.promotions_per_serve() + 1
                             FOR UPDATE SKIP LOCKED) s));
            GET DIAGNOSTICS v_promoted = ROW_COUNT;
            IF v_promoted > fairq.promotions_per_serve() THEN
                UPDATE fairq.message m SET status = 'ready'
                 WHERE m.id = ANY (ARRAY(
                       SELECT s.id FROM unnest(v_picked) AS p(id)
                        CROSS JOIN LATERAL (
                              -- (The due test is kept out of the index conditions, as a
                              -- filter: planned while few messages were due, a scan of
                              -- message_scheduled_ix by due time with a sort read every
                              -- due message of the channel at each call.)
                              SELECT s.id FROM fairq.message s
                               WHERE s.channel_id = p.id AND s.status = 'scheduled'
                                 AND s.dequeue_at + interval '0 s' <= v_now
                               ORDER BY s.priority DESC, s.dequeue_at, s.id
                               LIMIT GREATEST(fairq.promotions_per_serve(), p_max_messages)
                                 FOR UPDATE SKIP LOCKED) s));
                v_flooded := v_picked;
                v_flooded_at := v_now;
            END IF;
        END IF;
        IF v_attempts_capped THEN
            PERFORM fairq.bury_exhausted_heads(v_picked, v_now);
        END IF;
        -- Each picked channel's best ready message is locked and handed out, in pick
        -- order. One channel (a single dequeue, or a round of one) takes one statement:
        -- the two below, with their arrays, joins and sort, cost a tenth of a
        -- one-message dequeue more.
        IF cardinality(v_picked) = 1 THEN
            RETURN QUERY
                UPDATE fairq.message m
                   SET status = 'locked', locked_until = v_now + v_lock,
                       num_attempts = m.num_attempts + 1,
                       first_dequeued_at = coalesce(m.first_dequeued_at, v_now)
                 WHERE m.id = (SELECT s.id FROM fairq.message s
                                WHERE s.channel_id = v_picked[1] AND s.status = 'ready'
                                ORDER BY s.priority DESC, s.dequeue_at, s.id
                                LIMIT 1
                                  FOR UPDATE SKIP LOCKED)
                RETURNING m.id, v_picked_names[1], m.content, m.state, m.num_attempts, m.priority,
                          m.dequeue_at, m.recovered;
            GET DIAGNOSTICS v_handed_out = ROW_COUNT;
            v_served := v_picked[1 : v_handed_out];
            v_served_names := v_picked_names[1 : v_handed_out];
            v_served_seqs := v_turn_seqs[1 : v_handed_out];
        ELSE
            SELECT coalesce(array_agg(x.id), '{}'), coalesce(array_agg(x.channel_id), '{}'),
                   coalesce(array_agg(x.name), '{}'), coalesce(array_agg(x.turn_seq), '{}')
              INTO v_ids, v_served, v_served_names, v_served_seqs
              FROM (SELECT h.id, p.channel_id, p.name, p.turn_seq
                      FROM unnest(v_picked, v_picked_names, v_turn_seqs)
                           WITH ORDINALITY AS p(channel_id, name, turn_seq, pos)
                     CROSS JOIN LATERAL (
                           SELECT m.id FROM fairq.message m
                            WHERE m.channel_id = p.channel_id AND m.status = 'ready'
                            ORDER BY m.priority DESC, m.dequeue_at, m.id
                            LIMIT 1
                              FOR UPDATE SKIP LOCKED) h
                     ORDER BY p.pos) x;
            -- (Joined to their positions, not looked up in the arrays: array_position per
            -- row made a call of n messages cost n² comparisons.)
            RETURN QUERY
                WITH locked AS (
                    UPDATE fairq.message m
                       SET status = 'locked', locked_until = v_now + v_lock,
                           num_attempts = m.num_attempts + 1,
                           first_dequeued_at = coalesce(m.first_dequeued_at, v_now)
                     WHERE m.id = ANY (v_ids)
                    RETURNING m.id, m.content, m.state, m.num_attempts, m.priority, m.dequeue_at, m.recovered
                )
                SELECT l.id, s.name, l.content, l.state, l.num_attempts, l.priority, l.dequeue_at, l.recovered
                  FROM locked l
                  JOIN unnest(v_ids, v_served_names) WITH ORDINALITY AS s(id, name, pos) ON s.id = l.id
                 ORDER BY s.pos;
        END IF;

        -- Step 4. Every served channel is written once (turns.sql: fairq.served_turn_at),
        -- with the due time of its next pending message; those with nothing more due now
        -- are looked at again under their settle locks before they go idle or wait
        -- (fairq.settled_due_ats, which reads in a snapshot of its own).
        UPDATE fairq.channel c
               SET in_flight = c.in_flight + fairq.slots(c.max_concurrency, 1),
                   last_release_at = v_now,
                   due_at = n.due_at,
                   -- (It had work until now, so it is idle from now on, if at all:
                   -- not since the idle_since in its row, which a woken channel served
                   -- first still carries from before its wake.)
                   idle_since = fairq.idle_since(n.due_at, NULL, v_now),
                   turn_at = n.turn_at,
                   turn_pass = fairq.served_pass(n.was_turn_at, n.turn_at, n.due_at, v_now,
                                                 CASE WHEN c.id = v_first_id THEN v_first_pass
                                                      ELSE c.turn_pass END, c.weight),
                   turn_given_at = CASE WHEN n.turn_at = fairq.in_rotation() THEN v_now END,
                   turn_seq = fairq.kept_turn_seq(NULL, n.turn_at, NULL, n.turn_seq)
              FROM (SELECT x.row_ctid, x.due_at, x.turn_seq, x.turn_at AS was_turn_at,
                           fairq.served_turn_at(x.turn_at, x.next_turn, v_now) AS turn_at
                      FROM (SELECT k.ctid AS row_ctid, s.due_at, k.turn_at, s.turn_seq,
                                   fairq.next_turn(NULL, s.due_at, v_now, k.release_interval_ms,
                                                   k.in_flight + 1, k.max_concurrency,
                                                   k.paused_until, v_now) AS next_turn
                              FROM unnest(v_served, v_served_seqs,
                                          -- (Read for all, settled together: once, before
                                          -- any row is written. A scan of one array keeps
                                          -- its order, with no sort.)
                                          fairq.settled_due_ats(
                                              v_served, v_served_names,
                                              ARRAY(SELECT (SELECT p.due_at FROM fairq.pending_due_at(u.id) AS p)
                                                      FROM unnest(v_served) AS u(id)),
                                              v_queue_id, v_now))
                                   AS s(channel_id, turn_seq, due_at)
                             CROSS JOIN LATERAL (SELECT k.ctid,
                                                        CASE WHEN k.id = v_first_id THEN fairq.in_rotation()
                                                             ELSE k.turn_at END AS turn_at,
                                                        k.release_interval_ms, k.in_flight, k.max_concurrency,
                                                        k.paused_until
                                                   FROM fairq.channel k
                                                  WHERE k.id = s.channel_id OFFSET 0) k
                            OFFSET 0) x
                    OFFSET 0) n
               -- (Every OFFSET 0 keeps its subquery apart: the channels are looked up one
               -- by one, by id, and written where they were read (this call holds them,
               -- so the row a ctid names is current); and next_turn and served_turn_at
               -- get plain columns, since a SQL function is inlined only when an argument
               -- it reads twice is cheap: planned again at every row, they made this
               -- statement five times slower.)
             WHERE c.ctid = n.row_ctid;
        -- Picked channels that had nothing to hand out, in pick order (the served are
        -- some of the picked: none when they are as many).
        IF cardinality(v_served) < cardinality(v_picked) THEN
            FOR v_pos IN 1 .. cardinality(v_picked) LOOP
                CONTINUE WHEN v_picked[v_pos] = ANY (v_served);
                PERFORM fairq.channel_retire(v_picked[v_pos], v_now, v_turn_seqs[v_pos]);
                v_visited := v_visited || v_picked[v_pos];
            END LOOP;
        END IF;
        v_count := v_count + cardinality(v_served);
        v_first_id := NULL;
    END LOOP;
    -- The collector's turn, if nobody ran it in the last second (its row is taken
    -- with SKIP LOCKED: no dequeue waits for another's collection).
    IF NOT v_collect THEN
        RETURN;
    END IF;
    PERFORM FROM fairq.channel_collection k WHERE k.collected_at <= v_now - interval '1 s'
        FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        UPDATE fairq.channel_collection SET collected_at = v_now;
        PERFORM fairq.collect_idle_channels(v_now, 1000);
    END IF;
END
$$;

COMMENT ON FUNCTION fairq.message_dequeue(bigint, integer, text) IS
    'Hands out up to p_max_messages messages of queue p_queue, each locked for p_lock_ms: channels take turns by weight, within a channel the highest priority due message goes first. Zero rows means nothing is available. recovered is true when the previous lock expired unsettled.';
