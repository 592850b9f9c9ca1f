-- turns.sql — when a channel may be served, and in what order: the round-robin.
--
-- *When* and *in what order* are kept apart. A channel's turn_at says when:
--   * NULL: it cannot be served (nothing pending, or at max_concurrency);
--   * a time: it may be served from then on (its earliest pending message is due,
--     its release interval has passed since its last release, its pause is over):
--     it waits to join the rotation;
--   * '-infinity' (fairq.in_rotation()): it is in its queue's rotation now, and
--     turn_pass (then turn_seq) says where.
-- Invariants:
--   * order is a pass, never a clock: serving a channel moves it on by its stride,
--     1,000,000 / weight (fairq.turn_stride), so between two turns of a channel of
--     weight 1 every other backlogged channel of its queue takes w turns, spread out
--     (stride scheduling); with weight 1 everywhere that is strict round-robin;
--   * a channel joins the rotation where it would have been had it joined the
--     moment its wait ended (at turn_at): behind every channel whose place was given
--     before that moment, ahead of every channel given its place after it
--     (turn_given_at: when it was served or joined). So it does not matter which
--     dequeue lets it join, or how late; with weight 1 everywhere the rotation is
--     exactly "earliest turn first", as if every turn were a time. turn_seq, taken
--     when a channel joins or moves, keeps the order among equal passes;
--   * only a dequeue puts a channel into the rotation (fairq.join_rotation, at its
--     start, earliest time first, no more than it may serve): every other call that
--     makes a channel servable gives it a time, so no call but the dequeue reads
--     the rotation. One that would be first there and is served at once is written
--     by the serve alone, with the place it joins at;
--   * a channel stays in the rotation, moved on by its stride, while it is served
--     and still servable at once; anything that makes it wait (rate limit, a future
--     message, a pause, a full channel) takes it out, and it joins again at the
--     back once the wait is over;
--   * except a full one (since 0.7.37): a channel served from the rotation that
--     reaches its max_concurrency with work due keeps its pass, moved on by its
--     stride, while turn_at is NULL (a kept place: turn_pass without turn_at), and
--     keeps it when a freed slot makes it servable at once (turn_at a time, at most
--     now, with turn_pass). It then joins at fairq.kept_join_pass: its kept pass,
--     but no more than one round of its weight behind the front (a channel full
--     for an hour does not burst ahead) and never behind the back (where any other
--     wait joins). Its weight so holds when its cap is reached between dequeues (a
--     weight-5 channel with max_concurrency 1 whose worker completes before it
--     dequeues again takes 5 turns in 6, not 1 in 2). Anything else that makes it
--     wait (a slot freed but a rate limit, pause or future message left, a new
--     policy or pause, nothing due) drops the kept pass: it joins at the back;
--   * keep-turn rule (fairq.channel_store with p_keep_turn, wakes, completions): a
--     change that makes a channel *more* eligible never moves it later: a channel in
--     the rotation keeps its place, a waiting one keeps the earlier time. turn_seq
--     and turn_pass change only when turn_at does (fairq.kept_turn_seq,
--     fairq.kept_place), but for a kept place (fairq.kept_pass).

-- The turn_at of a channel in its queue's rotation.
CREATE FUNCTION fairq.in_rotation() RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT '-infinity'::timestamptz $$;

-- How far one turn moves a channel of weight p_weight on (1..1000): 1,000,000 / weight.
CREATE FUNCTION fairq.turn_stride(p_weight integer) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1000000 / p_weight $$;

-- When a channel may next be served (NULL: it cannot be). With p_turn_at set, an
-- earlier turn (or the rotation) is kept: a new message never delays a channel that
-- already waits for its turn. STABLE, not IMMUTABLE, because timestamptz + interval
-- is: a SQL function is inlined into the statements that call it only when it claims
-- no more than its body does.
CREATE FUNCTION fairq.next_turn(
    p_turn_at timestamptz, p_due_at timestamptz, p_last_release_at timestamptz,
    p_release_interval_ms bigint, p_in_flight integer, p_max_concurrency integer,
    p_paused_until timestamptz, p_now timestamptz
) RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN p_due_at IS NULL THEN NULL
        WHEN p_max_concurrency IS NOT NULL AND p_in_flight >= p_max_concurrency THEN NULL
        ELSE LEAST(p_turn_at,
                   GREATEST(p_due_at, p_now, p_paused_until,
                            p_last_release_at + fairq.ms(p_release_interval_ms)))
    END
$$;

-- The keep-turn rule: a channel whose turn_at did not move keeps its turn_seq and
-- pass; one whose turn moved takes p_new_seq, and (waiting, not in the rotation) no
-- pass.
CREATE FUNCTION fairq.kept_turn_seq(p_old_turn_at timestamptz, p_new_turn_at timestamptz,
                                    p_old_seq bigint, p_new_seq bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN p_new_turn_at IS NULL THEN NULL
                WHEN p_new_turn_at = p_old_turn_at THEN p_old_seq
                ELSE p_new_seq END
$$;

CREATE FUNCTION fairq.kept_place(p_old_turn_at timestamptz, p_new_turn_at timestamptz,
                                 p_old_value anyelement) RETURNS anyelement
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT CASE WHEN p_new_turn_at = p_old_turn_at THEN p_old_value END $$;

-- The keep-turn rule for turn_pass: kept while turn_at does not move (in the
-- rotation), and a full channel's kept place (turn_pass without turn_at) is kept
-- while it stays full (turn_at still NULL) and when a freed slot makes it servable
-- by p_now (a turn at most p_now: the channel waited only for the slot). Else none.
-- (p_now NULL: the slot is not what changed.)
CREATE FUNCTION fairq.kept_pass(p_old_turn_at timestamptz, p_new_turn_at timestamptz,
                                p_old_pass bigint, p_now timestamptz) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN p_new_turn_at IS NOT DISTINCT FROM p_old_turn_at
                     OR (p_old_turn_at IS NULL AND p_new_turn_at <= p_now)
                THEN p_old_pass END
$$;

-- The pass at which a channel joins the rotation whose front and back passes are
-- p_front and p_back (NULL: empty) with its kept place p_kept (turns.sql): that
-- pass, but at most one round of its weight behind the front and never behind the
-- back (one past the highest pass, as any other channel joining at the back).
CREATE FUNCTION fairq.kept_join_pass(p_kept bigint, p_front bigint, p_back bigint, p_weight integer)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT LEAST(GREATEST(p_kept, p_front - 1000000 + fairq.turn_stride(p_weight)), p_back + 1)
$$;

-- A served channel's next turn: it stays in the rotation, moved on by its stride,
-- when it was there and may be served again at once (p_next_turn, from next_turn
-- without p_turn_at, is now); else it waits for p_next_turn.
CREATE FUNCTION fairq.served_turn_at(p_turn_at timestamptz, p_next_turn timestamptz,
                                     p_now timestamptz) RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN p_turn_at = fairq.in_rotation() AND p_next_turn <= p_now
                THEN fairq.in_rotation() ELSE p_next_turn END
$$;

-- Its pass: moved on by its stride while it stays in the rotation, and kept so as
-- its kept place when it was served from the rotation (p_turn_at) and is now full
-- (p_served_turn_at NULL) with work due by p_now (p_due_at).
CREATE FUNCTION fairq.served_pass(p_turn_at timestamptz, p_served_turn_at timestamptz,
                                  p_due_at timestamptz, p_now timestamptz,
                                  p_turn_pass bigint, p_weight integer) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN p_served_turn_at = fairq.in_rotation()
                     OR (p_turn_at = fairq.in_rotation() AND p_served_turn_at IS NULL
                         AND p_due_at <= p_now)
                THEN p_turn_pass + fairq.turn_stride(p_weight) END
$$;

-- Since when a channel with pending work due at p_due_at has been idle: NULL while it
-- has pending work, else the earlier idle time, or now.
CREATE FUNCTION fairq.idle_since(p_due_at timestamptz, p_idle_since timestamptz, p_now timestamptz)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT CASE WHEN p_due_at IS NULL THEN coalesce(p_idle_since, p_now) END $$;

-- Writes back a channel row its caller has locked and changed. p_keep_turn keeps an
-- earlier turn (create, defer, settle); without it the turn is recomputed from
-- scratch (a new policy or pause, or the channel was found to have nothing due): it
-- then waits, and joins the rotation at the back. A new turn takes p_turn_seq, or
-- the next value of fairq.turn_seq.
CREATE FUNCTION fairq.channel_store(p_channel fairq.channel, p_now timestamptz, p_keep_turn boolean,
                                    p_turn_seq bigint DEFAULT NULL)
RETURNS fairq.channel
LANGUAGE plpgsql
AS $$
DECLARE
    v_turn_at timestamptz := fairq.next_turn(
        CASE WHEN p_keep_turn THEN p_channel.turn_at END, p_channel.due_at,
        p_channel.last_release_at, p_channel.release_interval_ms,
        p_channel.in_flight, p_channel.max_concurrency, p_channel.paused_until, p_now);
BEGIN
    -- (The keep-turn rule of fairq.kept_turn_seq, without taking a value for nothing.)
    IF v_turn_at IS NULL OR NOT p_keep_turn OR v_turn_at IS DISTINCT FROM p_channel.turn_at THEN
        -- A new turn is a time: the channel waits to join; at the back, unless it
        -- keeps its place (fairq.kept_pass: full, or freed and servable now).
        p_channel.turn_pass := CASE WHEN p_keep_turn
                                    THEN fairq.kept_pass(p_channel.turn_at, v_turn_at,
                                                         p_channel.turn_pass, p_now) END;
        p_channel.turn_given_at := NULL;
        p_channel.turn_seq := CASE WHEN v_turn_at IS NOT NULL
                                   THEN coalesce(p_turn_seq, nextval('fairq.turn_seq')) END;
    END IF;
    p_channel.turn_at := v_turn_at;
    UPDATE fairq.channel
       SET in_flight = p_channel.in_flight,
           last_release_at = p_channel.last_release_at,
           due_at = p_channel.due_at,
           turn_at = p_channel.turn_at,
           turn_pass = p_channel.turn_pass,
           turn_given_at = p_channel.turn_given_at,
           turn_seq = p_channel.turn_seq,
           idle_since = fairq.idle_since(p_channel.due_at, p_channel.idle_since, p_now)
     WHERE id = p_channel.id;
    RETURN p_channel;
END
$$;

-- Where a channel joins the rotation of queue p_queue_id (fairq.channels_join, and
-- fairq.join_rotation for one channel): just ahead of the first
-- channel given its place after its turn (rotation_after: when that place was given,
-- and its pass), or else behind the last (rotation_back: the highest pass); whether
-- that is ahead of every channel there (rotation_front: the lowest pass). Table
-- functions of one row, inlined into the statements that read them.
CREATE FUNCTION fairq.rotation_after(p_queue_id integer, p_turn_at timestamptz)
RETURNS TABLE(turn_given_at timestamptz, turn_pass bigint)
LANGUAGE sql STABLE
AS $$
    SELECT r.turn_given_at, r.turn_pass FROM fairq.channel r
     WHERE r.queue_id = p_queue_id AND r.turn_at = fairq.in_rotation() AND r.turn_given_at > p_turn_at
     ORDER BY r.turn_given_at, r.turn_pass LIMIT 1
$$;

-- The front and the back are the ends of the rotation's range of channel_turn_ix,
-- read by one lookup each. (turn_at <= '-infinity' is turn_at = '-infinity', but
-- does not let channel_turn_given_ix, whose rows are those of the rotation, serve
-- them: planned while statistics said the rotation was short, as a session that
-- starts on a prefilled queue plans it, 0.7.24 read and sorted the whole rotation
-- through that index at each lookup.)
CREATE FUNCTION fairq.rotation_back(p_queue_id integer) RETURNS TABLE(turn_pass bigint)
LANGUAGE sql STABLE
AS $$
    SELECT r.turn_pass FROM fairq.channel r
     WHERE r.queue_id = p_queue_id AND r.turn_at <= fairq.in_rotation()
     ORDER BY r.turn_at DESC, r.turn_pass DESC LIMIT 1
$$;

CREATE FUNCTION fairq.rotation_front(p_queue_id integer) RETURNS TABLE(turn_pass bigint)
LANGUAGE sql STABLE
AS $$
    SELECT r.turn_pass FROM fairq.channel r
     WHERE r.queue_id = p_queue_id AND r.turn_at <= fairq.in_rotation()
     ORDER BY r.turn_at, r.turn_pass LIMIT 1
$$;

-- A channel's turn as its queued wakes leave it (fairq.folded_wakes, in channels.sql),
-- not yet written.
CREATE TYPE fairq.folded_turn AS (id bigint, woken boolean, due_at timestamptz, turn_at timestamptz,
                                  turn_seq bigint, turn_pass bigint, turn_given_at timestamptz);

-- For a dequeue of queue p_queue_id, before it picks: the channels whose wait is over
-- (turn_at <= p_now, or made so by the wakes producers queued: fairq.woken_to_take),
-- earliest first and at most p_limit, join the rotation (fairq.channels_join). Taking
-- the earliest first makes their places exact for whoever picks next: a channel left
-- waiting belongs behind every channel joined now. Rows other calls hold are skipped
-- (their holders will give them their turns). The caller then holds these rows, and
-- no channel waiting to join that it does not let join. took: it took any.
-- The woken channels' wakes are folded here (fairq.folded_wakes) and written by the
-- join. When one channel joins, as in the sparse steady state, its place is found
-- here by the same rule and written by a plain update, not by channels_join's
-- statement for many. With p_serve_first (a dequeue of one message), that channel,
-- waiting or woken, when it would be first in the rotation (ahead of every channel
-- there, held or not, or alone) is not written at all: first_id and first_pass say
-- which it is and the pass it joins at (and first_name and first_capped its name and
-- whether it has max_attempts), and the dequeue serves it from there, writing its
-- row once instead of twice (a woken one's wakes are spent by then). That is what
-- joining it and then picking would do: the pick takes the first of the rotation.
CREATE FUNCTION fairq.join_rotation(p_queue_id integer, p_now timestamptz, p_limit integer,
                                    p_serve_first boolean DEFAULT false,
                                    OUT took boolean, OUT first_id bigint, OUT first_pass bigint,
                                    OUT first_name text, OUT first_capped boolean)
LANGUAGE plpgsql
AS $$
DECLARE
    v_first_wake timestamptz;  -- the earliest due and woken time of the queue's wakes
    v_waiting bigint[];
    v_woken bigint[] := '{}';
    v_folded fairq.folded_turn[];  -- the woken channels as their wakes leave them
    v_joined bigint[];         -- waiting channels that the wakes let join
    v_wanted integer;          -- places left
    v_lone record;             -- the one channel joining, when it is one, and its place
BEGIN
    -- A woken channel's turn is never before its wake's due and woken time, so the
    -- channels waiting since before the earliest wake's join ahead of every woken one:
    -- those are locked at once (SKIP LOCKED: concurrent calls take different ones).
    -- The next waiting channels are compared with the woken ones and locked only if
    -- they come first (fairq.woken_to_take); any places still left go to the
    -- waiting channels after them (their places, by turn, are theirs however late
    -- they join).
    -- (One statement: the earliest wake, read once, and the channels before it.)
    SELECT f.wake_at,
           ARRAY(SELECT c.id FROM fairq.channel c
                  WHERE c.queue_id = p_queue_id
                    AND c.turn_at > fairq.in_rotation() AND c.turn_at <= p_now
                    AND c.turn_at < coalesce(f.wake_at, 'infinity')
                  ORDER BY c.turn_at, c.turn_pass, c.turn_seq
                  LIMIT p_limit
                    FOR NO KEY UPDATE SKIP LOCKED)
      INTO v_first_wake, v_waiting
      FROM (SELECT (SELECT GREATEST(w.due_at, w.woken_at) FROM fairq.channel_wake w
                     WHERE w.queue_id = p_queue_id
                     ORDER BY GREATEST(w.due_at, w.woken_at), w.turn_seq LIMIT 1) AS wake_at
            OFFSET 0) f;
    IF v_first_wake IS NOT NULL AND cardinality(v_waiting) < p_limit THEN
        SELECT w.taken, w.waiting, w.wanted INTO v_woken, v_joined, v_wanted
          FROM fairq.woken_to_take(p_queue_id, p_now, p_limit - cardinality(v_waiting),
                                   ARRAY(SELECT c.id FROM fairq.channel c
                                          WHERE c.queue_id = p_queue_id
                                            AND c.turn_at >= v_first_wake AND c.turn_at <= p_now
                                          ORDER BY c.turn_at, c.turn_pass, c.turn_seq
                                          LIMIT p_limit - cardinality(v_waiting))) AS w;
        v_waiting := v_waiting || v_joined;
        IF v_wanted > 0 THEN
            v_waiting := v_waiting || ARRAY(SELECT c.id FROM fairq.channel c
                                             WHERE c.queue_id = p_queue_id
                                               AND c.turn_at > fairq.in_rotation() AND c.turn_at <= p_now
                                               AND c.id <> ALL (v_waiting || v_woken)
                                             ORDER BY c.turn_at, c.turn_pass, c.turn_seq
                                             LIMIT v_wanted
                                               FOR NO KEY UPDATE SKIP LOCKED);
        END IF;
    END IF;
    took := cardinality(v_woken) > 0 OR cardinality(v_waiting) > 0;
    IF NOT took THEN
        RETURN;
    END IF;
    IF cardinality(v_woken) > 0 THEN
        v_folded := ARRAY(SELECT w FROM fairq.folded_wakes(v_woken) AS w);
    END IF;
    IF cardinality(v_woken) + cardinality(v_waiting) = 1 THEN
        -- One channel joins, as in the sparse steady state: its place is found here
        -- (channels_join's rule for one channel) and, unless it is served first, written
        -- in a plain update rather than channels_join's statement for many.
        -- A channel with a kept place (turns.sql) joins at fairq.kept_join_pass.
        SELECT j.id, j.turn_at, j.name, j.capped,
               CASE WHEN j.kept IS NOT NULL
                    THEN fairq.kept_join_pass(j.kept, j.front_pass, j.back_pass, j.weight)
                    ELSE coalesce(j.after_pass - 1, coalesce(j.back_pass, 0) + 1) END AS pass,
               -- First: ahead of a channel that is itself first (on an equal pass the
               -- channel already there goes first), or into an empty rotation. (So the
               -- front is looked up only when it can decide.)
               p_serve_first
               AND CASE WHEN j.kept IS NOT NULL
                        THEN j.front_pass IS NULL
                             OR fairq.kept_join_pass(j.kept, j.front_pass, j.back_pass, j.weight) < j.front_pass
                        WHEN j.after_pass IS NULL
                        THEN j.back_pass IS NULL
                        ELSE j.after_pass - 1 < (SELECT f.turn_pass
                                                   FROM fairq.rotation_front(p_queue_id) AS f) END AS first
          INTO v_lone
          FROM (SELECT c.id, t.turn_at, c.name, c.max_attempts IS NOT NULL AS capped, t.kept, c.weight,
                       a.turn_pass AS after_pass,
                       CASE WHEN a.turn_pass IS NULL  -- (read only when needed)
                            THEN (SELECT b.turn_pass FROM fairq.rotation_back(p_queue_id) AS b) END AS back_pass,
                       CASE WHEN t.kept IS NOT NULL
                            THEN (SELECT f.turn_pass FROM fairq.rotation_front(p_queue_id) AS f) END AS front_pass
                  FROM fairq.channel c
                 CROSS JOIN LATERAL (SELECT CASE WHEN cardinality(v_woken) = 0 THEN c.turn_at
                                                 ELSE (v_folded[1]).turn_at END AS turn_at,
                                            CASE WHEN cardinality(v_woken) = 0 THEN c.turn_pass
                                                 ELSE (v_folded[1]).turn_pass END AS kept) t
                  LEFT JOIN LATERAL (SELECT a.turn_pass FROM fairq.rotation_after(p_queue_id, t.turn_at) AS a
                                      WHERE t.kept IS NULL) a ON true
                 WHERE c.id = coalesce(v_woken[1], v_waiting[1])
                   AND t.turn_at > fairq.in_rotation() AND t.turn_at <= p_now  -- (a woken one may not be due)
                OFFSET 0) j;  -- (its place found once, not once for each use)
        IF v_lone.first THEN
            first_id := v_lone.id;
            first_pass := v_lone.pass;
            first_name := v_lone.name;
            first_capped := v_lone.capped;
            RETURN;
        ELSIF FOUND THEN
            UPDATE fairq.channel c
               SET due_at = CASE WHEN cardinality(v_woken) = 0 THEN c.due_at ELSE (v_folded[1]).due_at END,
                   idle_since = NULL,  -- (it has work)
                   turn_at = fairq.in_rotation(), turn_pass = v_lone.pass, turn_given_at = v_lone.turn_at,
                   turn_seq = nextval('fairq.turn_seq')
             WHERE c.id = v_lone.id;
            RETURN;
        END IF;
    END IF;
    PERFORM fairq.channels_join(v_woken, v_folded, v_waiting, p_queue_id, p_now, p_limit);
END
$$;

-- Writes, in one update per channel, what happens to channels whose rows the caller
-- holds (all of queue p_queue_id):
--   * the queued wakes of p_woken are applied: p_folded holds them as
--     fairq.folded_wakes left them (the caller folded them, spending the wakes);
--   * then, of p_woken and p_waiting, the first p_limit (earliest turn first) whose
--     wait is over by p_now join the rotation, each just ahead of the first channel
--     given its place after its wait ended (its pass less one), or else at the back
--     (one past the highest pass), whatever its weight: the weight counts from its
--     first turn on; one with a kept place (turns.sql) at fairq.kept_join_pass.
--     Those that join are given their places at their turn times.
-- A woken channel that joins is so written once, not once for its wakes and once
-- for its place.
CREATE FUNCTION fairq.channels_join(p_woken bigint[], p_folded fairq.folded_turn[], p_waiting bigint[],
                                    p_queue_id integer, p_now timestamptz, p_limit integer)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    -- (Each node of this statement's plan costs its start-up at every call, rows or
    -- not, so it has as few as placing needs.)
    WITH RECURSIVE ranked AS (  -- pos: the rank of each channel whose wait is over
        SELECT h.*,
               CASE WHEN h.waited
                    THEN row_number() OVER (PARTITION BY h.waited
                                            ORDER BY h.turn_at, h.turn_pass, h.turn_seq) END AS pos
          FROM (SELECT h.*, h.turn_at > fairq.in_rotation() AND h.turn_at <= p_now AS waited
                  FROM (SELECT c.id, false AS woken, c.due_at, c.turn_at, c.turn_seq,
                               c.turn_pass, c.turn_given_at
                          FROM fairq.channel c
                         WHERE c.id = ANY (p_waiting) AND NOT c.id = ANY (p_woken)
                        UNION ALL
                        SELECT f.* FROM unnest(p_folded) AS f) h) h
    ), joining AS MATERIALIZED (  -- (read once, not at each step of the recursion)
        -- The turns of those that join, by rank, and the latest place given.
        SELECT array_agg(r.turn_at ORDER BY r.pos) AS turn_ats,
               (SELECT max(g.turn_given_at) FROM fairq.channel g
                 WHERE g.queue_id = p_queue_id AND g.turn_at = fairq.in_rotation()) AS latest_given
          FROM ranked r WHERE r.pos <= p_limit
    ), after AS (
        -- By rank: the first place given after each one's turn (rotation_after), when
        -- some place was given later than that turn. Turns rise with rank, so a place
        -- found for one is the next one's too while its turn is earlier than that
        -- place was given; only then is it looked up again, from its own turn. (A
        -- lookup per channel walked the same entries each time: under load, those of
        -- the places served since, which only vacuum removes.) None found: none for
        -- those after it either, and the recursion ends.
        SELECT 0::bigint AS pos, '-infinity'::timestamptz AS given_at, NULL::bigint AS pass
        UNION ALL
        SELECT a.pos + 1, n.turn_given_at, n.turn_pass
          FROM after a
         CROSS JOIN joining j
         CROSS JOIN LATERAL (
               SELECT a.given_at, a.pass WHERE j.turn_ats[a.pos + 1] < a.given_at
               UNION ALL
               SELECT f.turn_given_at, f.turn_pass
                 FROM fairq.rotation_after(p_queue_id, j.turn_ats[a.pos + 1]) AS f
                WHERE j.turn_ats[a.pos + 1] >= a.given_at
                  AND j.turn_ats[a.pos + 1] < j.latest_given) n(turn_given_at, turn_pass)
         WHERE a.pos < cardinality(j.turn_ats)
    ), placed AS (
        SELECT p.*, count(*) FILTER (WHERE p.joins AND p.next_pass IS NULL AND p.turn_pass IS NULL)
                        OVER (ORDER BY p.pos) AS back_rank
          FROM (SELECT h.*, (h.pos <= p_limit) IS TRUE AS joins,
                       CASE WHEN h.pos <= p_limit THEN nextval('fairq.turn_seq') END AS joined_seq,
                       CASE WHEN h.pos <= p_limit THEN n.passes[h.pos] END AS next_pass
                  FROM (SELECT * FROM ranked ORDER BY pos OFFSET 0) h
                 CROSS JOIN (SELECT array_agg(a.pass ORDER BY a.pos) FILTER (WHERE a.pos > 0) AS passes
                               FROM after a) n) p
    )
    UPDATE fairq.channel c
       SET due_at = p.due_at,
           idle_since = CASE WHEN NOT p.woken THEN c.idle_since END,  -- a wake brings a due time
           turn_at = CASE WHEN p.joins THEN fairq.in_rotation() ELSE p.turn_at END,
           turn_pass = CASE WHEN NOT p.joins THEN p.turn_pass
                            WHEN p.turn_pass IS NOT NULL  -- a kept place
                            THEN fairq.kept_join_pass(
                                     p.turn_pass, (SELECT f.turn_pass FROM fairq.rotation_front(p_queue_id) AS f),
                                     (SELECT b.turn_pass FROM fairq.rotation_back(p_queue_id) AS b), c.weight)
                            -- (An empty rotation starts anywhere: passes are only
                            -- compared within it.)
                            ELSE coalesce(p.next_pass - 1,
                                          coalesce((SELECT b.turn_pass FROM fairq.rotation_back(p_queue_id) AS b), 0)
                                          + p.back_rank) END,
           turn_given_at = CASE WHEN p.joins THEN p.turn_at ELSE p.turn_given_at END,
           turn_seq = coalesce(p.joined_seq, p.turn_seq)
      FROM placed p
     WHERE c.id = ANY (p_woken || p_waiting) AND c.id = p.id
       AND (p.woken OR p.joins);
END
$$;

COMMENT ON FUNCTION fairq.in_rotation() IS
    'The turn_at of a channel in its queue''s rotation (''-infinity''); its place there is (turn_pass, turn_seq).';
