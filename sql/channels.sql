-- channels.sql — channel policy, turns and lifecycle.
--
-- Invariants:
--   * lock order, everywhere: a message row, then the channel's advisory locks
--     (producer lock, then policy lock), then its channel row, then its
--     channel_size row; several channels by channel id. The dequeue takes channel
--     rows only with SKIP LOCKED, or by waiting while it holds no other lock, and
--     advisory locks only by trying, so fairq calls do not wait for one another in a
--     cycle (a dequeue that buries a message may still wait for a bounded channel's
--     size row);
--   * producers take no lock on their channel row: they hold the channel's producer
--     lock (a transaction-level advisory lock on the channel name, shared among
--     producers), which dequeues and settlements never wait for, so an open producer
--     transaction never hides or blocks its channel. Only a change that would make a
--     channel *less* eligible (going idle, removal) needs to know that no producer is
--     mid-insert, and it learns that by trying the producer lock exclusively, never by
--     waiting. (Row share locks would do the same job, but the MultiXacts they create
--     make even SKIP LOCKED wait, and deadlock, when it follows a row's update chain.)
--   * a channel joins the round-robin at the back (its turn is "now"), a served
--     channel goes to the back, and a rate-limited channel's turn is never earlier
--     than its last release plus release_interval_ms.

-- When a channel's next turn comes. With p_turn_at set, an existing earlier turn is
-- kept (a new message never delays a channel that already waits for its turn).
-- STABLE, not IMMUTABLE, because timestamptz + interval is: a SQL function is inlined
-- into the statements that call it only when it claims no more than its body does.
CREATE FUNCTION fairq.next_turn(
    p_turn_at timestamptz, p_due_at timestamptz, p_last_release_at timestamptz,
    p_release_interval_ms bigint, p_in_flight integer, p_max_concurrency integer,
    p_now timestamptz
) RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN p_due_at IS NULL THEN NULL
        WHEN p_max_concurrency IS NOT NULL AND p_in_flight >= p_max_concurrency THEN NULL
        ELSE LEAST(p_turn_at,
                   GREATEST(p_due_at, p_now,
                            p_last_release_at + fairq.ms(p_release_interval_ms)))
    END
$$;

-- Writes back a channel row its caller has locked and changed. p_keep_turn keeps an
-- earlier turn (create, defer, settle); without it the turn is recomputed from
-- scratch (the channel was just served or found to have nothing due). A new turn
-- takes p_turn_seq, or the next value of fairq.turn_seq.
CREATE FUNCTION fairq.channel_store(p_channel fairq.channel, p_now timestamptz, p_keep_turn boolean,
                                    p_turn_seq bigint DEFAULT NULL)
RETURNS fairq.channel
LANGUAGE plpgsql
AS $$
DECLARE
    v_turn_at timestamptz := fairq.next_turn(
        CASE WHEN p_keep_turn THEN p_channel.turn_at END, p_channel.due_at,
        p_channel.last_release_at, p_channel.release_interval_ms,
        p_channel.in_flight, p_channel.max_concurrency, p_now);
BEGIN
    IF v_turn_at IS NULL THEN
        p_channel.turn_seq := NULL;
    ELSIF NOT p_keep_turn OR v_turn_at IS DISTINCT FROM p_channel.turn_at THEN
        p_channel.turn_seq := coalesce(p_turn_seq, nextval('fairq.turn_seq'));
    END IF;
    p_channel.turn_at := v_turn_at;
    UPDATE fairq.channel
       SET in_flight = p_channel.in_flight,
           last_release_at = p_channel.last_release_at,
           due_at = p_channel.due_at,
           turn_at = p_channel.turn_at,
           turn_seq = p_channel.turn_seq
     WHERE id = p_channel.id;
    RETURN p_channel;
END
$$;

-- How many concurrency slots p_count messages take: none on a channel without
-- max_concurrency, which keeps in_flight at 0 (see tables.sql).
CREATE FUNCTION fairq.slots(p_max_concurrency integer, p_count integer) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT CASE WHEN p_max_concurrency IS NULL THEN 0 ELSE p_count END $$;

-- When a channel's earliest pending message becomes due, from the index heads. A
-- one-row SQL table function, so that `CROSS JOIN LATERAL fairq.pending_due_at(id)`
-- is inlined into the caller's plan (the dequeue updates many channels at once).
CREATE FUNCTION fairq.pending_due_at(p_channel_id bigint) RETURNS TABLE(due_at timestamptz)
LANGUAGE sql STABLE
AS $$
    SELECT coalesce(
        (SELECT m.dequeue_at FROM fairq.message m
          WHERE m.channel_id = p_channel_id AND m.status = 'ready'
          ORDER BY m.priority DESC, m.dequeue_at, m.id LIMIT 1),
        (SELECT m.dequeue_at FROM fairq.message m
          WHERE m.channel_id = p_channel_id AND m.status = 'scheduled'
          ORDER BY m.dequeue_at, m.id LIMIT 1))
$$;

-- (plpgsql, not SQL, below: a SQL function that cannot be inlined would be planned
-- again at every call; plpgsql keeps its plans for the session.)

-- The producer lock of a channel: advisory, transaction-level, keyed by the channel
-- name in fairq's own key space (class 1717660018 = 'fair' in ASCII; two-key advisory
-- locks never collide with one-key ones). Two names sharing a hash only cost an
-- extra wait or a skipped clean-up, never correctness.
CREATE FUNCTION fairq.producer_lock_key(p_channel text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashtext(p_channel) $$;

-- The policy lock of a channel: advisory, transaction-level, class 1717660019, keyed
-- by the channel id. Completions hold it shared, channel_set and channel_clear
-- exclusively (before they lock the row), so a completion never sees max_concurrency
-- change under it, and a dequeue never mistakes a completion for a producer.
CREATE FUNCTION fairq.policy_lock_key(p_channel_id bigint) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashint8(p_channel_id) $$;

-- True when no producer is inserting into the channel right now. On true, holds the
-- producer lock exclusively until commit, so producers that arrive later wait for
-- this transaction and then see what it decided.
CREATE FUNCTION fairq.channel_quiet(p_channel text) RETURNS boolean
LANGUAGE plpgsql
AS $$
BEGIN
    RETURN pg_try_advisory_xact_lock(1717660018, fairq.producer_lock_key(p_channel));
END
$$;

-- When a locked channel's earliest pending message is due, for a caller about to
-- write it back. Making the channel less eligible (nothing due now, or nothing at
-- all) first takes the producer lock and then looks again, in a new snapshot: a
-- producer mid-insert means "keep it due now", and one that committed just before
-- the lock is seen by the second look.
CREATE FUNCTION fairq.settled_due_at(p_channel_id bigint, p_channel_name text, p_now timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql
AS $$
DECLARE
    v_due_at timestamptz := (SELECT p.due_at FROM fairq.pending_due_at(p_channel_id) AS p);
BEGIN
    IF v_due_at IS NULL OR v_due_at > p_now THEN
        IF NOT fairq.channel_quiet(p_channel_name) THEN
            RETURN p_now;
        END IF;
        v_due_at := (SELECT p.due_at FROM fairq.pending_due_at(p_channel_id) AS p);
    END IF;
    RETURN v_due_at;
END
$$;

-- Removes a channel that has no policy and no messages, unless a producer is
-- inserting into it. The caller holds the row and has checked due_at IS NULL. (A
-- channel without policy counts no in_flight: its locked messages are looked up.)
CREATE FUNCTION fairq.channel_collect(p_channel fairq.channel) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF NOT p_channel.has_policy AND p_channel.due_at IS NULL
       AND NOT EXISTS (SELECT 1 FROM fairq.message m
                        WHERE m.channel_id = p_channel.id AND m.status = 'locked')
       AND fairq.channel_quiet(p_channel.name) THEN
        -- Look again under the producer lock, in a new snapshot. A producer does not
        -- wait for the row this caller holds: it may have committed a message and
        -- queued the channel's wake (fairq.channels_wake) since the row was read, and
        -- before the lock was free. Then due_at is NULL although the channel is not
        -- empty. (Found by the bench's soak: one message in 10^6 left without a
        -- channel.)
        IF NOT EXISTS (SELECT 1 FROM fairq.channel_wake w WHERE w.channel_id = p_channel.id)
           AND (SELECT p.due_at FROM fairq.pending_due_at(p_channel.id) AS p) IS NULL THEN
            DELETE FROM fairq.channel WHERE id = p_channel.id;
        END IF;
    END IF;
END
$$;

-- The channel rows for a producer, created with the default policy on first use,
-- under each channel's producer lock (shared, taken in name order), which also keeps
-- them from being collected until this transaction ends.
CREATE FUNCTION fairq.channels_for_producer(p_names text[]) RETURNS SETOF fairq.channel
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(1717660018, fairq.producer_lock_key(n.name))
       FROM (SELECT DISTINCT u.name FROM unnest(p_names) AS u(name) ORDER BY u.name) n;
    -- A name inserted concurrently is waited for, then left alone: the next
    -- statement's snapshot sees it either way.
    INSERT INTO fairq.channel (name)
    SELECT DISTINCT u.name FROM unnest(p_names) AS u(name)
     WHERE NOT EXISTS (SELECT 1 FROM fairq.channel c WHERE c.name = u.name)
     ORDER BY u.name
    ON CONFLICT (name) DO NOTHING;
    RETURN QUERY SELECT c.* FROM fairq.channel c WHERE c.name = ANY (p_names) ORDER BY c.id;
END
$$;

-- The channel row, locked for a change. Callers already hold the message they act
-- on (lock order: message, then channel).
CREATE FUNCTION fairq.channel_lock(p_channel_id bigint) RETURNS fairq.channel
LANGUAGE plpgsql
AS $$
DECLARE
    v_channel fairq.channel;
BEGIN
    SELECT * INTO v_channel FROM fairq.channel WHERE id = p_channel_id FOR NO KEY UPDATE;
    RETURN v_channel;
END
$$;

-- Whether a message due at p_due_at must bring its channel's turn forward: the
-- channel has nothing pending, or only messages due later that are not yet due.
CREATE FUNCTION fairq.needs_wake(p_channel_due_at timestamptz, p_due_at timestamptz,
                                 p_now timestamptz) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT p_channel_due_at IS NULL OR (p_due_at < p_channel_due_at AND p_channel_due_at > p_now)
$$;

-- Wakes for channel rows the caller holds: each channel's due_at moves to its wake's
-- due time if that is earlier, and its turn is recomputed as of woken_at, keeping an
-- earlier turn (the set-based form of channel_store with p_keep_turn). A channel
-- whose turn changes takes the wake's turn_seq. Serves the producers that wake
-- channels (fairq.channels_wake) and the dequeues that apply queued wakes
-- (fairq.apply_wakes).
CREATE FUNCTION fairq.channels_store_wakes(p_channel_ids bigint[], p_due_ats timestamptz[],
                                           p_woken_ats timestamptz[], p_turn_seqs bigint[])
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    UPDATE fairq.channel c
       SET due_at = w.due_at,
           turn_at = w.turn_at,
           turn_seq = CASE WHEN w.turn_at IS NULL THEN NULL
                           WHEN w.turn_at IS DISTINCT FROM c.turn_at THEN w.turn_seq
                           ELSE c.turn_seq END
      FROM (SELECT k.id, k.due_at, k.turn_seq,
                   fairq.next_turn(k.turn_at, k.due_at, k.last_release_at, k.release_interval_ms,
                                   k.in_flight, k.max_concurrency, k.woken_at) AS turn_at
              FROM (SELECT c.id, c.turn_at, c.last_release_at, c.release_interval_ms,
                           c.in_flight, c.max_concurrency, LEAST(c.due_at, u.due_at) AS due_at,
                           u.woken_at, u.turn_seq
                      FROM unnest(p_channel_ids, p_due_ats, p_woken_ats, p_turn_seqs)
                           AS u(id, due_at, woken_at, turn_seq)
                      JOIN fairq.channel c ON c.id = u.id
                     WHERE c.id = ANY (p_channel_ids)
                    OFFSET 0) k) w  -- keeps w.due_at a plain column, so next_turn is inlined
     WHERE c.id = ANY (p_channel_ids) AND c.id = w.id;
END
$$;

-- For a producer holding the channels' producer locks (create, dead-letter retry):
-- move forward the turns of those (p_channel_ids, each with the earliest due time its
-- new messages need) that need it (fairq.needs_wake). The rows free right now are
-- locked in id order and updated (woken). A row another transaction holds (a
-- producer waking the same channel, a dequeue, a settlement) is not waited for: its
-- wake is queued in fairq.channel_wake, committed with the producer's messages, and
-- the next dequeue applies it (queued). So producers never queue behind each other on
-- channel rows: a batch over many idle channels used to hold every row it had woken
-- while it waited for the next one, and other producers waited for it in turn. Each
-- channel takes its turn_seq in id order, woken ones first.
CREATE FUNCTION fairq.channels_wake(p_channel_ids bigint[], p_due_ats timestamptz[],
                                    p_now timestamptz, OUT woken bigint[], OUT queued bigint[])
LANGUAGE plpgsql
AS $$
DECLARE
    v_needed bigint[] := ARRAY(
        SELECT c.id FROM fairq.channel c
          JOIN unnest(p_channel_ids, p_due_ats) AS e(id, due_at) ON e.id = c.id
         WHERE c.id = ANY (p_channel_ids) AND fairq.needs_wake(c.due_at, e.due_at, p_now)
         ORDER BY c.id);
    v_turn_seqs bigint[];
BEGIN
    woken := '{}';
    queued := '{}';
    IF cardinality(v_needed) = 0 THEN  -- a backlogged channel: the usual case
        RETURN;
    END IF;
    woken := ARRAY(
        SELECT c.id FROM fairq.channel c
          JOIN unnest(p_channel_ids, p_due_ats) AS e(id, due_at) ON e.id = c.id
         WHERE c.id = ANY (v_needed) AND fairq.needs_wake(c.due_at, e.due_at, p_now)
         ORDER BY c.id
           FOR NO KEY UPDATE OF c SKIP LOCKED);
    -- Skipped rows, and rows that changed and no longer need a wake (harmless: a
    -- wake only ever moves a turn earlier).
    queued := ARRAY(SELECT n.id FROM unnest(v_needed) AS n(id) WHERE n.id <> ALL (woken) ORDER BY n.id);
    v_turn_seqs := ARRAY(SELECT nextval('fairq.turn_seq') FROM generate_series(1, cardinality(v_needed)));
    PERFORM fairq.channels_store_wakes(array_agg(e.id ORDER BY w.pos), array_agg(e.due_at ORDER BY w.pos),
                                       array_agg(p_now ORDER BY w.pos),
                                       array_agg(v_turn_seqs[w.pos] ORDER BY w.pos))
       FROM unnest(woken) WITH ORDINALITY AS w(id, pos)
       JOIN unnest(p_channel_ids, p_due_ats) AS e(id, due_at) ON e.id = w.id;
    INSERT INTO fairq.channel_wake (channel_id, due_at, woken_at, turn_seq)
    SELECT q.id, e.due_at, p_now, v_turn_seqs[cardinality(woken) + q.pos]
      FROM unnest(queued) WITH ORDINALITY AS q(id, pos)
      JOIN unnest(p_channel_ids, p_due_ats) AS e(id, due_at) ON e.id = q.id;
END
$$;

-- For a dequeue, before it picks: apply the queued wakes (fairq.channels_wake) of
-- channels whose rows are free, as the producer would have: the channel's due_at
-- moves to the earliest wake, its turn is computed as of the first wake and takes
-- that wake's turn_seq. A channel whose row is held keeps its wakes for a later
-- dequeue. True if it applied any (the caller then holds those channel rows).
CREATE FUNCTION fairq.apply_wakes() RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    v_channel_ids bigint[];
    v_due_ats timestamptz[];
    v_woken_ats timestamptz[];
    v_turn_seqs bigint[];
BEGIN
    WITH taken AS (
        SELECT w.ctid AS wake, w.channel_id, w.due_at, w.woken_at, w.turn_seq
          FROM fairq.channel_wake w
          JOIN fairq.channel c ON c.id = w.channel_id
         ORDER BY w.channel_id, w.turn_seq
           FOR UPDATE OF w SKIP LOCKED
           FOR NO KEY UPDATE OF c SKIP LOCKED
    ), dropped AS (
        DELETE FROM fairq.channel_wake w USING taken t WHERE w.ctid = t.wake
    )
    SELECT coalesce(array_agg(g.channel_id), '{}'), array_agg(g.due_at), array_agg(g.woken_at),
           array_agg(g.turn_seq)
      INTO v_channel_ids, v_due_ats, v_woken_ats, v_turn_seqs
      FROM (SELECT t.channel_id, min(t.due_at) AS due_at, min(t.woken_at) AS woken_at,
                   min(t.turn_seq) AS turn_seq
              FROM taken t GROUP BY t.channel_id) g;
    IF cardinality(v_channel_ids) = 0 THEN
        RETURN false;
    END IF;
    PERFORM fairq.channels_store_wakes(v_channel_ids, v_due_ats, v_woken_ats, v_turn_seqs);
    RETURN true;
END
$$;

-- A channel whose due_at may be too early: a dequeue picked it and found nothing to
-- hand out (a cancelled or concurrently taken head), or a create woke it for
-- messages that were not created after all (dropped, duplicates). Recompute its
-- turn from what it holds (taking p_turn_seq, or the next value); if it is empty,
-- collect it.
CREATE FUNCTION fairq.channel_retire(p_channel_id bigint, p_now timestamptz, p_turn_seq bigint)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_channel fairq.channel := fairq.channel_lock(p_channel_id);
BEGIN
    v_channel.due_at := fairq.settled_due_at(p_channel_id, v_channel.name, p_now);
    v_channel := fairq.channel_store(v_channel, p_now, false, p_turn_seq);
    PERFORM fairq.channel_collect(v_channel);
END
$$;

-- p_count messages of the locked channel left the 'locked' status (settled,
-- deferred, recovered): free their concurrency slots (a capped channel's). p_due_at
-- is set when they are pending again.
CREATE FUNCTION fairq.channel_unlock(p_channel fairq.channel, p_count integer,
                                     p_due_at timestamptz, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    p_channel.in_flight := p_channel.in_flight - fairq.slots(p_channel.max_concurrency, p_count);
    p_channel.due_at := LEAST(p_channel.due_at, p_due_at);
    p_channel := fairq.channel_store(p_channel, p_now, true);
    PERFORM fairq.channel_collect(p_channel);
END
$$;

-- Keeps channel_size right for a bounded channel: p_delta messages more or fewer.
-- With p_enforce, admits only what fits under max_size and returns how many of
-- p_delta (> 0) were admitted; without it (removals, operator retries) the count
-- just moves. The caller holds the channel row (lock order: channel, then size).
CREATE FUNCTION fairq.channel_resize(p_channel fairq.channel, p_delta integer, p_enforce boolean)
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    v_size integer;
    v_admitted integer := p_delta;
BEGIN
    IF p_channel.max_size IS NULL THEN
        RETURN p_delta;
    END IF;
    IF p_enforce THEN
        SELECT size INTO v_size FROM fairq.channel_size WHERE channel_id = p_channel.id FOR UPDATE;
        v_admitted := LEAST(p_delta, GREATEST(0, p_channel.max_size - v_size));
    END IF;
    IF v_admitted <> 0 THEN
        UPDATE fairq.channel_size SET size = size + v_admitted WHERE channel_id = p_channel.id;
    END IF;
    RETURN v_admitted;
END
$$;

CREATE FUNCTION fairq.channel_set(
    p_channel text,
    p_max_concurrency integer DEFAULT NULL,
    p_release_interval_ms bigint DEFAULT 0,
    p_max_size integer DEFAULT NULL,
    p_max_attempts integer DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require_channel_name(p_channel, 'p_channel');
    PERFORM fairq.require_limit(p_max_concurrency, 'p_max_concurrency');
    PERFORM fairq.require_duration(p_release_interval_ms, 0, 'p_release_interval_ms');
    PERFORM fairq.require_limit(p_max_size, 'p_max_size');
    PERFORM fairq.require_limit(p_max_attempts, 'p_max_attempts');

    -- The producer lock, exclusively: waits out producers mid-insert, so that they
    -- and the size count below agree on max_size.
    PERFORM pg_advisory_xact_lock(1717660018, fairq.producer_lock_key(p_channel));
    INSERT INTO fairq.channel (name) VALUES (p_channel) ON CONFLICT (name) DO NOTHING;
    -- (The row stays: collecting it would need the producer lock held here.)
    SELECT * INTO v_channel FROM fairq.channel WHERE name = p_channel;
    PERFORM pg_advisory_xact_lock(1717660019, fairq.policy_lock_key(v_channel.id));
    v_channel := fairq.channel_lock(v_channel.id);

    -- Completions of an uncapped channel do not lock its row but hold its policy
    -- lock (shared), so the count of locked messages below is exact.
    UPDATE fairq.channel
       SET has_policy = true, max_concurrency = p_max_concurrency,
           release_interval_ms = p_release_interval_ms, max_size = p_max_size,
           max_attempts = p_max_attempts,
           in_flight = CASE WHEN p_max_concurrency IS NULL THEN 0 ELSE
                           (SELECT count(*) FROM fairq.message m
                             WHERE m.channel_id = v_channel.id AND m.status = 'locked') END
     WHERE id = v_channel.id
    RETURNING * INTO v_channel;

    IF p_max_size IS NULL THEN
        DELETE FROM fairq.channel_size WHERE channel_id = v_channel.id;
    ELSE
        INSERT INTO fairq.channel_size (channel_id, size)
        SELECT v_channel.id, count(*) FROM fairq.message WHERE channel_id = v_channel.id
        ON CONFLICT (channel_id) DO NOTHING;
    END IF;
    -- New limits apply from now: the turn is recomputed (a raised release interval
    -- moves it later, a lowered one brings it to now).
    PERFORM fairq.channel_store(v_channel, v_now, false);
END
$$;

CREATE FUNCTION fairq.channel_clear(p_channel text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require_channel_name(p_channel, 'p_channel');
    PERFORM pg_advisory_xact_lock(1717660018, fairq.producer_lock_key(p_channel));
    SELECT * INTO v_channel FROM fairq.channel WHERE name = p_channel AND has_policy;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM pg_advisory_xact_lock(1717660019, fairq.policy_lock_key(v_channel.id));
    v_channel := fairq.channel_lock(v_channel.id);
    DELETE FROM fairq.channel_size WHERE channel_id = v_channel.id;
    UPDATE fairq.channel
       SET has_policy = false, max_concurrency = NULL, release_interval_ms = 0,
           max_size = NULL, max_attempts = NULL, in_flight = 0
     WHERE id = v_channel.id
    RETURNING * INTO v_channel;
    v_channel := fairq.channel_store(v_channel, v_now, false);
    PERFORM fairq.channel_collect(v_channel);
    RETURN true;
END
$$;

COMMENT ON FUNCTION fairq.channel_set(text, integer, bigint, integer, integer) IS
    'Upserts a channel''s policy. NULL means unlimited: p_max_concurrency messages in flight at once, p_release_interval_ms minimum gap between fresh releases, p_max_size messages held (in flight included), p_max_attempts deliveries before dead-lettering.';
COMMENT ON FUNCTION fairq.channel_clear(text) IS
    'Forgets a channel''s explicit policy (true if it had one); the channel reverts to no limits and disappears when empty.';
