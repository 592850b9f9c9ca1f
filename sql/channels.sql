-- channels.sql — channel policy, pauses and lifecycle (turns: turns.sql; locks:
-- locks.sql).
--
-- Invariants:
--   * producers never lock a channel row: they hold the channel's producer lock (a
--     transaction-level advisory lock on the queue and channel name, shared among
--     producers), which dequeues and settlements never wait for, and an idle
--     channel's wake is queued (fairq.channels_wake), so an open producer
--     transaction never hides or blocks its channel. Only a change that would make a
--     channel *less* eligible needs to know that no producer is mid-insert, and it
--     learns that by trying a lock exclusively, never by waiting: removal tries the
--     producer lock; going idle (or waiting for a later message) tries the settle
--     lock, which a producer only tries, shared, and when it finds it taken queues a
--     wake instead: so producers never wait for dequeues either (locks.sql). (Row
--     share locks would do the same job, but the MultiXacts they create make even
--     SKIP LOCKED wait, and deadlock, when it follows a row's update chain.)
--   * a channel with no policy and nothing in it stays, idle, until the collector
--     removes it (fairq.collect_idle_channels): a tenant that sends again soon finds
--     its row, and no settlement has to delete one;
--   * a paused channel keeps its messages, policy, locks and row (the collector
--     leaves it alone until the pause is over); its turn waits for the pause's end
--     and it then joins the rotation like any channel whose wait is over.

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

-- When each of the locked channels p_channel_ids (named p_names, all of queue
-- p_queue_id) has its earliest pending message due, for a caller about to write them
-- back; p_due_ats: what the caller has just read (fairq.pending_due_at), in its
-- snapshot, after locking them. A channel due by p_now keeps that. Making a channel
-- less eligible (nothing due now, or nothing at all) first takes its settle lock (in
-- the channels' order) and then looks again, in a new snapshot: a producer holding
-- it (one that relies on the channel staying due) means "keep it due now", and one
-- that committed just before the lock is seen by the second look. In the same
-- snapshot those channels' queued wakes are dropped, as spent (the caller holds the
-- rows, as fairq.join_rotation would): a producer that found the settle lock taken
-- queued its wake anyway, and if it commits after that snapshot its wake is not
-- seen, so it stays queued with its message. One statement for all the channels
-- settled, none when none is: a dequeue of many sparse tenants settles most of the
-- channels it serves, and a statement each cost more than the rest of their writes.
CREATE FUNCTION fairq.settled_due_ats(p_channel_ids bigint[], p_names text[], p_due_ats timestamptz[],
                                      p_queue_id integer, p_now timestamptz)
RETURNS timestamptz[]
LANGUAGE plpgsql
AS $$
DECLARE
    v_due_ats timestamptz[] := p_due_ats;
    v_settling bigint[] := '{}';  -- the channels whose settle locks this call took,
    v_settling_at integer[] := '{}';  -- at these positions
    v_settled timestamptz[];
BEGIN
    FOR i IN 1 .. cardinality(p_channel_ids) LOOP
        CONTINUE WHEN p_due_ats[i] <= p_now;
        IF fairq.settle_lock_try(p_queue_id, p_names[i]) THEN
            v_settling := v_settling || p_channel_ids[i];
            v_settling_at := v_settling_at || i;
        ELSE
            v_due_ats[i] := p_now;
        END IF;
    END LOOP;
    IF cardinality(v_settling) > 0 THEN
        WITH spent AS (DELETE FROM fairq.channel_wake w WHERE w.channel_id = ANY (v_settling))
        SELECT ARRAY(SELECT (SELECT p.due_at FROM fairq.pending_due_at(s.id) AS p)
                       FROM unnest(v_settling) AS s(id))  -- (in order: a scan of one array)
          INTO v_settled;
        FOR i IN 1 .. cardinality(v_settling) LOOP
            v_due_ats[v_settling_at[i]] := v_settled[i];
        END LOOP;
    END IF;
    RETURN v_due_ats;
END
$$;

-- The collector: removes channels that have no policy and have held nothing (and
-- been unpaused) for at least the setting fairq.idle_channel_ttl (default 10 s; a
-- PostgreSQL interval), longest idle first, at most p_limit, whatever their queue.
-- Dequeues call it once a second (see fairq.message_dequeue), so the channel table
-- holds the tenants active lately, not every tenant ever seen. A channel is removed
-- only when, under its producer lock (taken by trying, never waiting) and in a
-- snapshot taken after that lock, it holds no message and no queued wake: a producer
-- that committed a message or a wake just before is seen, and one that comes later
-- waits for the lock and then creates the channel anew. Rows another transaction
-- holds are skipped. What it locks stays locked until the dequeue's transaction
-- ends, so it locks as little as it can of what it will keep: channels with a message
-- in flight (idle, with nothing pending) are left out before their rows are locked,
-- so their settlements never wait for it; and a channel whose producer lock is taken
-- but its queue's bulk producer lock is not lets go of the first (fairq.channel_quiet).
-- Returns how many it removed.
CREATE FUNCTION fairq.collect_idle_channels(p_now timestamptz, p_limit integer) RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    v_ttl interval := fairq.setting_duration('fairq.idle_channel_ttl', interval '10 s');
    v_quiet bigint[];
    v_in_flight bigint[];
    v_removed integer;
BEGIN
    v_quiet := ARRAY(
        SELECT c.id FROM (SELECT c.id, c.queue_id, c.name FROM fairq.channel c
                           WHERE GREATEST(c.idle_since, c.paused_until) <= p_now - v_ttl
                             AND c.idle_since IS NOT NULL AND NOT c.has_policy
                             -- (A scalar subquery, one lookup per channel: as NOT
                             -- EXISTS it was planned as an anti-join that read every
                             -- lock for each channel.)
                             AND (SELECT m.id FROM fairq.message m
                                   WHERE m.channel_id = c.id AND m.status = 'locked' LIMIT 1) IS NULL
                           ORDER BY GREATEST(c.idle_since, c.paused_until)
                           LIMIT p_limit
                             FOR NO KEY UPDATE SKIP LOCKED) c
         WHERE fairq.channel_quiet(c.queue_id, c.name));
    IF cardinality(v_quiet) = 0 THEN
        RETURN 0;
    END IF;
    -- The channels with a message in flight, in one statement (one index lookup per
    -- channel: see message_locked_channel_ix): a message may have been handed out
    -- between the look above and the row lock. No message of these channels can be
    -- locked after this: their rows are held here.
    v_in_flight := ARRAY(SELECT DISTINCT m.channel_id FROM fairq.message m
                          WHERE m.channel_id = ANY (v_quiet) AND m.status = 'locked');
    -- (Scalar subqueries by status: each is one lookup in a partial index, whatever
    -- the planner thinks of those indexes' sizes.)
    DELETE FROM fairq.channel c
     WHERE c.id = ANY (v_quiet) AND NOT c.id = ANY (v_in_flight)
       AND (SELECT p.due_at FROM fairq.pending_due_at(c.id) AS p) IS NULL
       AND (SELECT w.channel_id FROM fairq.channel_wake w WHERE w.channel_id = c.id LIMIT 1) IS NULL;
    GET DIAGNOSTICS v_removed = ROW_COUNT;
    RETURN v_removed;
END
$$;

-- The channel rows of queue p_queue_id for a producer, created with the default
-- policy on first use, under each channel's producer lock (shared, taken in name
-- order; and for a channel made here its creation lock) or, for a transaction gone
-- bulk, its queue's bulk producer lock: either keeps them from being collected
-- until this transaction ends. made: this call inserted the row, so until this
-- transaction commits nobody else sees it. p_made_due_ats, by position in p_names:
-- when the caller's messages on that name fall due (each name's earliest counts;
-- NULL for a message that will not be created). A row is made due at its earliest,
-- with the turn its wake would give as of p_now (fairq.channels_wake queues no wake
-- for it): nothing can refuse a message on a channel just made (no policy, nothing
-- in it, nobody else sees it), so every first message on a made row is created, and
-- the row is written once. p_in_bulk: what fairq.producing_in_bulk answered the
-- caller for these names (which then holds their producer locks unless it said
-- yes); NULL: ask it here.
CREATE FUNCTION fairq.channels_for_producer(p_queue_id integer, p_names text[],
                                            p_made_due_ats timestamptz[], p_now timestamptz,
                                            p_in_bulk boolean DEFAULT NULL)
RETURNS TABLE(channel fairq.channel, made boolean)
LANGUAGE plpgsql
AS $$
DECLARE
    v_missing bigint;  -- names with no committed row at the creation locks' look (NULL: not looked)
    v_made bigint[] := '{}';
    v_names integer;  -- how many distinct names
BEGIN
    -- (Every look for the names below is a lookup per name: OFFSET 0 keeps each a
    -- subplan keyed by the name. Planned while the table was small, as a session's
    -- cached plan may be, an anti-join, or "name = ANY (p_names)" filtered out of a
    -- scan by queue, read every channel of the queue at each call: one transaction
    -- making n new channels took time in n².)
    IF p_in_bulk IS NULL THEN
        v_names := (SELECT count(DISTINCT u.name)::integer FROM unnest(p_names) AS u(name));
        p_in_bulk := fairq.producing_in_bulk(p_queue_id, v_names);  -- (inlined: a plain argument)
        IF NOT p_in_bulk THEN
            PERFORM pg_advisory_xact_lock_shared(fairq.producer_lock_class(),
                                                 fairq.producer_lock_key(p_queue_id, n.name))
               FROM (SELECT DISTINCT u.name FROM unnest(p_names) AS u(name) ORDER BY u.name) n;
        END IF;
    END IF;
    IF NOT p_in_bulk THEN
        -- A channel is made by one producer at a time: the others wait for its commit
        -- here, then the next statement sees its row. Left to the unique index, a
        -- second producer waited inside its INSERT for the first, and then for any
        -- dequeue updating the new row (a unique check waits for a transaction that
        -- may delete the key's row): in the churn soak, producers waited on
        -- transactions more than they worked.
        PERFORM pg_advisory_xact_lock(fairq.creation_lock_class(),
                                      fairq.producer_lock_key(p_queue_id, n.name))
           FROM (SELECT DISTINCT u.name FROM unnest(p_names) AS u(name)
                  WHERE NOT EXISTS (SELECT 1 FROM fairq.channel c
                                     WHERE c.queue_id = p_queue_id AND c.name = u.name
                                    OFFSET 0)
                  ORDER BY u.name) n;
        GET DIAGNOSTICS v_missing = ROW_COUNT;
    END IF;
    -- (Nothing missing at that look, nothing to make: the rows seen stay, under the
    -- producer locks.) A name inserted concurrently (by a transaction gone bulk) is
    -- waited for, then left alone: the next statement's snapshot sees it either way.
    IF v_missing IS DISTINCT FROM 0 THEN
        WITH inserted AS (
            INSERT INTO fairq.channel (queue_id, name, idle_since, due_at, turn_at, turn_seq)
            SELECT p_queue_id, n.name, CASE WHEN n.due_at IS NULL THEN fairq.clock() END, n.due_at,
                   -- (A new row: no release yet, no interval, nothing in flight, no
                   -- cap, no pause.)
                   fairq.next_turn(NULL, n.due_at, NULL, 0, 0, NULL, NULL, p_now),
                   CASE WHEN n.due_at IS NOT NULL THEN nextval('fairq.turn_seq') END  -- (in name order, as the ids)
              FROM (SELECT u.name, min(u.due_at) AS due_at
                      FROM unnest(p_names, p_made_due_ats) AS u(name, due_at)
                     WHERE NOT EXISTS (SELECT 1 FROM fairq.channel c
                                        WHERE c.queue_id = p_queue_id AND c.name = u.name OFFSET 0)
                     GROUP BY u.name
                     ORDER BY u.name OFFSET 0) n
            ON CONFLICT (queue_id, name) DO NOTHING
            RETURNING fairq.channel.id
        )
        SELECT coalesce(array_agg(i.id), '{}') INTO v_made FROM inserted i;
    END IF;
    RETURN QUERY SELECT c.channel, (c.channel).id = ANY (v_made)
                   FROM (SELECT DISTINCT u.name FROM unnest(p_names) AS u(name)) u
                  CROSS JOIN LATERAL (SELECT c AS channel FROM fairq.channel c
                                       WHERE c.queue_id = p_queue_id AND c.name = u.name OFFSET 0) c
                  ORDER BY (c.channel).id;
END
$$;

-- The channel row, locked for a change, its queued wakes folded in. Callers already
-- hold the message they act on (lock order: message, then channel).
CREATE FUNCTION fairq.channel_lock(p_channel_id bigint) RETURNS fairq.channel
LANGUAGE plpgsql
AS $$
DECLARE
    v_channel fairq.channel;
BEGIN
    SELECT * INTO v_channel FROM fairq.channel WHERE id = p_channel_id FOR NO KEY UPDATE;
    RETURN fairq.channel_with_wakes(v_channel);
END
$$;

-- The due time a producer's new message is compared with (fairq.needs_wake): the
-- channel's due_at, or its turn when a dequeue put it off for a message another
-- transaction holds (fairq.channel_retire: its turn is then later than fairq.next_turn
-- gives it for its due messages, pause and release interval). A message created
-- meanwhile brings that turn forward like one on an idle channel, by a wake: it was
-- kept waiting for the rest of the put-off, up to 5 s (0.7.33). (The first test
-- spares a channel in the rotation, the busy case, the second; a full channel has no
-- turn to compare.)
CREATE FUNCTION fairq.due_for_producers(p_due_at timestamptz, p_turn_at timestamptz,
                                        p_paused_until timestamptz, p_last_release_at timestamptz,
                                        p_release_interval_ms bigint, p_now timestamptz)
RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN p_turn_at > p_now
                     AND p_turn_at > fairq.next_turn(NULL, p_due_at, p_last_release_at, p_release_interval_ms,
                                                     0, NULL, p_paused_until, p_now)
                THEN p_turn_at ELSE p_due_at END
$$;

-- Whether a message due at p_due_at must bring its channel's turn forward: the
-- channel has nothing pending, or only messages due later that are not yet due (with
-- p_channel_due_at from fairq.due_for_producers: or it is put off).
CREATE FUNCTION fairq.needs_wake(p_channel_due_at timestamptz, p_due_at timestamptz,
                                 p_now timestamptz) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT p_channel_due_at IS NULL OR (p_due_at < p_channel_due_at AND p_channel_due_at > p_now)
$$;

-- True when this transaction's top level wrote the row version whose xmin is p_xmin
-- (a subtransaction's rows have xmins of their own, and may roll back alone).
CREATE FUNCTION fairq.written_here(p_xmin xid) RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT p_xmin::text = (pg_current_xact_id()::text::bigint % 4294967296)::text $$;

-- True when this transaction itself queued a wake of channel p_channel_id that brings
-- its turn to p_due_at or earlier, or wrote the channel's row with a due time by
-- p_due_at (made it: fairq.channels_wake; or changed it, and so holds it). Such a
-- wake is committed with the messages that need it, or with none of them, and such
-- a row cannot be made less eligible before they are seen; either serves them as
-- well as a second wake would (a transaction gone bulk relies on nothing else:
-- without this, one that loaded a million messages in batches queued a wake per
-- channel per batch, and each batch read more of them). Only the top transaction's
-- rows count (fairq.written_here): a wake queued by another transaction may be
-- applied before the messages commit. Only the latest wake due by p_due_at is looked
-- at (one index probe): other transactions' wakes can be thousands, and when one of
-- them is the latest, a wake queued now is the latest at this transaction's next
-- call.
CREATE FUNCTION fairq.woken_here(p_channel_id bigint, p_due_at timestamptz) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT coalesce((SELECT fairq.written_here(w.xmin)
                       FROM fairq.channel_wake w
                      WHERE w.channel_id = p_channel_id AND w.due_at <= p_due_at
                      ORDER BY w.due_at DESC LIMIT 1), false)
        OR coalesce((SELECT fairq.written_here(c.xmin) AND c.due_at <= p_due_at
                       FROM fairq.channel c WHERE c.id = p_channel_id), false)
$$;

-- The channels p_channel_ids as the next dequeue will see them at p_now, with the
-- due times p_due_ats that producers' new messages need: their pending due time
-- (fairq.due_for_producers) includes the wakes already queued (those of producers
-- still open are not seen; a second wake is harmless: applied, it only moves a turn
-- earlier). An SQL table function, inlined into its callers' statements.
CREATE FUNCTION fairq.wake_candidates(p_channel_ids bigint[], p_due_ats timestamptz[], p_now timestamptz)
RETURNS TABLE(id bigint, queue_id integer, name text, due_at timestamptz,
              pending_due_at timestamptz)
LANGUAGE sql STABLE
AS $$
    SELECT c.id, c.queue_id, c.name, e.due_at,
           LEAST(fairq.due_for_producers(c.due_at, c.turn_at, c.paused_until, c.last_release_at,
                                         c.release_interval_ms, p_now),
                 (SELECT min(w.due_at) FROM fairq.channel_wake w WHERE w.channel_id = c.id))
      FROM fairq.channel c
      JOIN unnest(p_channel_ids, p_due_ats) AS e(id, due_at) ON e.id = c.id
     WHERE c.id = ANY (p_channel_ids)
    OFFSET 0  -- (needs_wake then gets a plain column, and is inlined)
$$;

-- For a producer holding the channels' producer locks (create, dead-letter retry):
-- the channels among p_channel_ids, all of queue p_queue_id (each with the earliest
-- due time its new messages need), whose turn those messages must bring forward
-- (fairq.needs_wake). Their wakes
-- are queued in fairq.channel_wake, committed with the messages, and the next
-- dequeues apply them (fairq.join_rotation) with the turn_seq given here, in id order.
-- A channel that seems to need no wake (it is due already) is relied on to stay due:
-- its settle lock is tried shared first, and the look that decides comes after, in a
-- new snapshot. Where that lock is taken, or the queue is being settled in bulk (a
-- call is deciding whether the channel goes idle, and may not see these messages),
-- the wake is queued anyway, and so is it for
-- a channel that needed one at the first look, and by a transaction gone bulk (which
-- takes no channel's lock) unless it queued one itself or holds the row
-- (fairq.woken_here): a second wake is harmless, and the producer never waits.
-- A producer never locks a channel row: one that did, for a wake, kept it until
-- commit, so an open producer transaction hid the channel's other messages from
-- workers and made its completions wait. A row the producer made (p_made, among
-- p_channel_ids) was made due by fairq.channels_for_producer, with the turn its wake
-- would give, and gets no wake: the next dequeues find it waiting to join, with no
-- wake to apply and none to delete (so a call's made channels take their turns
-- before the wakes it queues). Returns the channels woken, the made ones included.
-- (message_create queues its one channel's wake itself, by these rules.)
CREATE FUNCTION fairq.channels_wake(p_queue_id integer, p_channel_ids bigint[], p_due_ats timestamptz[],
                                    p_now timestamptz, p_made bigint[] DEFAULT '{}') RETURNS bigint[]
LANGUAGE plpgsql
AS $$
DECLARE
    v_forced bigint[];  -- channels woken whatever the second look says
    v_woken bigint[] := '{}';
BEGIN
    IF cardinality(p_made) < cardinality(p_channel_ids) THEN
        v_forced := ARRAY(SELECT k.id FROM fairq.wake_candidates(p_channel_ids, p_due_ats, p_now) AS k
                           WHERE NOT k.id = ANY (p_made)
                             AND (fairq.needs_wake(k.pending_due_at, k.due_at, p_now)
                                  OR CASE WHEN fairq.gone_bulk(fairq.producer_locks_setting())
                                          THEN NOT fairq.woken_here(k.id, k.due_at)
                                          ELSE NOT fairq.settle_lock_try_shared(k.queue_id, k.name) END));
        -- With the settle locks held: one settling in bulk would not see them.
        IF cardinality(v_forced) + cardinality(p_made) < cardinality(p_channel_ids)
           AND fairq.bulk_settling(p_queue_id) THEN
            v_forced := p_channel_ids;
        END IF;
        WITH queued AS (
            INSERT INTO fairq.channel_wake (channel_id, due_at, woken_at, turn_seq, queue_id)
            SELECT n.id, n.due_at, p_now, nextval('fairq.turn_seq'), n.queue_id
              FROM (SELECT k.id, k.due_at, k.queue_id
                      FROM fairq.wake_candidates(p_channel_ids, p_due_ats, p_now) AS k
                     WHERE NOT k.id = ANY (p_made)
                       AND (k.id = ANY (v_forced) OR fairq.needs_wake(k.pending_due_at, k.due_at, p_now))
                     ORDER BY k.id
                    OFFSET 0) n
            RETURNING channel_id)
        SELECT coalesce(array_agg(q.channel_id), '{}') INTO v_woken FROM queued q;
    END IF;
    RETURN v_woken || p_made;
END
$$;

-- Each of channels p_channel_ids, whose rows the caller holds, as its queued wakes
-- leave it; the wakes are deleted (woken: it had some). Each wake is applied as if
-- when it was queued, in order, as of its woken_at (the keep-turn rule): the
-- channel's due_at moves to the earliest wake's; its turn becomes the earliest any
-- wake gives, or stays the earlier one it had (in the rotation: its place), with the
-- turn_seq of the first wake that gave it. A wake committed after this statement's
-- snapshot waits for a later caller. Nothing is written to the channels: the caller
-- writes them (fairq.fold_wakes, or fairq.join_rotation and fairq.channels_join with
-- their places).
CREATE FUNCTION fairq.folded_wakes(p_channel_ids bigint[]) RETURNS SETOF fairq.folded_turn
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
BEGIN
    -- (Every step below is a scan, a sort or a window over the rows before it, never a
    -- lookup of one CTE per row of another: that made a fold of 100 channels cost
    -- 10,000 row visits.)
    RETURN QUERY
    WITH held AS (
        -- (Each channel looked up once, by id: planned while the table was small, a
        -- join with the table read every channel to find the woken ones, and a lookup
        -- per wake reads a channel as often as it has wakes.)
        SELECT c.* FROM (SELECT DISTINCT u.id FROM unnest(p_channel_ids) AS u(id)) u
         CROSS JOIN LATERAL (SELECT c.* FROM fairq.channel c WHERE c.id = u.id OFFSET 0) c
    ), taken AS (
        DELETE FROM fairq.channel_wake w WHERE w.channel_id = ANY (p_channel_ids)
        RETURNING w.channel_id, w.due_at, w.woken_at, w.turn_seq
    ), folded AS (  -- each wake's turn, applied after the ones queued before it
        SELECT t.channel_id, t.turn_seq, f.due_at,
               fairq.next_turn(NULL, f.due_at, c.last_release_at, c.release_interval_ms,
                               c.in_flight, c.max_concurrency, c.paused_until, t.woken_at) AS turn_at
          FROM (SELECT t.*, min(t.due_at) OVER (PARTITION BY t.channel_id ORDER BY t.turn_seq) AS due_so_far
                  FROM taken t) t
          JOIN held c ON c.id = t.channel_id
         CROSS JOIN LATERAL (SELECT LEAST(c.due_at, t.due_so_far) AS due_at) f
    ), woken AS (  -- per channel: the earliest turn, the earliest due time
        SELECT DISTINCT ON (f.channel_id) f.channel_id, f.turn_at, f.turn_seq,
               min(f.due_at) OVER (PARTITION BY f.channel_id) AS due_at
          FROM folded f
         ORDER BY f.channel_id, f.turn_at NULLS LAST, f.turn_seq
    )
    SELECT c.id, w.channel_id IS NOT NULL, coalesce(w.due_at, c.due_at), n.turn_at,
           fairq.kept_turn_seq(c.turn_at, n.turn_at, c.turn_seq, w.turn_seq),
           fairq.kept_pass(c.turn_at, n.turn_at, c.turn_pass, NULL),  -- (a wake frees no slot)
           fairq.kept_place(c.turn_at, n.turn_at, c.turn_given_at)
      FROM held c
      LEFT JOIN woken w ON w.channel_id = c.id
     CROSS JOIN LATERAL (SELECT LEAST(c.turn_at, w.turn_at) AS turn_at) n;
END
$$;

-- Writes the queued wakes of channels whose rows the caller holds into those rows
-- (fairq.folded_wakes): a channel in the rotation keeps its place there, a waiting one
-- the earlier of its turns. Every caller that locks a channel row to change its turn
-- folds its wakes in first (fairq.channel_lock, the dequeue's pick, recovery,
-- completions), so a wake never acts after a later change; the dequeue's join folds
-- them as it places the channels (fairq.channels_join).
CREATE FUNCTION fairq.fold_wakes(p_channel_ids bigint[]) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    UPDATE fairq.channel c
       SET due_at = w.due_at, idle_since = NULL,  -- a wake brings a due time
           turn_at = w.turn_at, turn_seq = w.turn_seq, turn_pass = w.turn_pass,
           turn_given_at = w.turn_given_at
      FROM fairq.folded_wakes(p_channel_ids) w
     WHERE c.id = ANY (p_channel_ids) AND c.id = w.id AND w.woken;
END
$$;

-- For a dequeue of queue p_queue_id, before it picks (fairq.join_rotation): the woken
-- channels it takes (taken), the channels of p_waiting it takes (waiting), their rows
-- locked, and how many of p_limit places are left (wanted). p_waiting are channels
-- waiting to join, earliest first, not locked yet: one that a woken channel passes
-- is left to other calls, not held. It reads the due wakes in windows of p_limit + 8
-- (by due and woken time: an index range, so a burst of wakes costs each dequeue no
-- more). Of a window's channels it takes those that, with p_waiting, are the
-- p_limit eligible earliest (so the pick sees every channel whose turn is among the
-- next p_limit, and the other wakes stay queued, not written), and those that stay
-- ineligible (at max_concurrency, rate-limited or paused past now), which no dequeue
-- could serve now anyway: a dequeue holds no more servable channel rows than it may
-- serve. Rows held by others are skipped; when that leaves it short, it reads the
-- next window (at most 8 in all), so concurrent dequeues take the wakes after each
-- other's instead of waiting for them. A rate-limited channel's wake can make it
-- eligible later than its place in the window says: then a channel woken just after
-- the window may take its turn one dequeue late.
CREATE FUNCTION fairq.woken_to_take(p_queue_id integer, p_now timestamptz, p_limit integer,
                                    p_waiting bigint[], OUT taken bigint[], OUT waiting bigint[],
                                    OUT wanted integer)
LANGUAGE plpgsql
AS $$
DECLARE
    -- Wakes read beyond p_limit, room for those other calls hold; and how many
    -- windows a call reads before it leaves the rest to later calls.
    v_slack CONSTANT integer := 8;
    v_max_windows CONSTANT integer := 8;
    -- (p_limit is at most a call's p_max_messages, which may be as large as an
    -- integer goes: no window reads more than that many wakes anyway.)
    v_window_size CONSTANT integer := LEAST(p_limit, 2147483647 - v_slack) + v_slack;
    v_seen bigint[] := '{}';   -- channels of the windows read so far
    v_from timestamptz := '-infinity';  -- where the next window starts
    v_read integer;            -- wakes the window read
    v_eligible bigint[];       -- channels the window's wakes make eligible, earliest first,
    v_turn_ats timestamptz[];  -- with their turns
    v_turn_seqs bigint[];
    v_ineligible bigint[];     -- the others: at max_concurrency, or rate-limited past now
    v_joined bigint[];         -- woken channels the window lets join
    v_joined_waiting bigint[]; -- and waiting ones
    v_joining integer;
BEGIN
    taken := '{}';
    waiting := '{}';
    wanted := p_limit;  -- eligible channels still to take
    FOR v_window IN 1 .. v_max_windows LOOP
        SELECT coalesce(array_agg(t.channel_id ORDER BY t.turn_at, t.turn_seq)
                            FILTER (WHERE t.turn_at <= p_now), '{}'),
               coalesce(array_agg(t.turn_at ORDER BY t.turn_at, t.turn_seq)
                            FILTER (WHERE t.turn_at <= p_now), '{}'),
               coalesce(array_agg(t.turn_seq ORDER BY t.turn_at, t.turn_seq)
                            FILTER (WHERE t.turn_at <= p_now), '{}'),
               coalesce(array_agg(t.channel_id) FILTER (WHERE t.turn_at IS NULL OR t.turn_at > p_now), '{}'),
               coalesce(sum(t.wakes), 0), max(t.last_key)
          INTO v_eligible, v_turn_ats, v_turn_seqs, v_ineligible, v_read, v_from
          FROM (SELECT w.channel_id, min(k.turn_at) AS turn_at, min(w.turn_seq) AS turn_seq,
                       count(*) AS wakes, max(w.key) AS last_key
                  FROM (SELECT w.*, GREATEST(w.due_at, w.woken_at) AS key FROM fairq.channel_wake w
                         WHERE w.queue_id = p_queue_id
                           AND GREATEST(w.due_at, w.woken_at) >= v_from
                           AND GREATEST(w.due_at, w.woken_at) <= p_now
                           AND w.channel_id <> ALL (v_seen)
                         ORDER BY GREATEST(w.due_at, w.woken_at), w.turn_seq
                         LIMIT v_window_size) w
                 CROSS JOIN LATERAL (
                       SELECT fairq.next_turn(NULL, LEAST(k.due_at, w.due_at), k.last_release_at,
                                              k.release_interval_ms, k.in_flight,
                                              k.max_concurrency, k.paused_until, w.woken_at) AS turn_at
                         FROM fairq.channel k WHERE k.id = w.channel_id
                       OFFSET 0) k  -- one lookup by id per wake
                 GROUP BY w.channel_id) t;
        -- Of these and the waiting channels, the first wanted that are free, then every
        -- free ineligible one. The waiting channels count in the first window only: a
        -- later one is read only when all of them joined.
        WITH joining AS (
            SELECT c.id, m.woken
              FROM (SELECT u.id, u.turn_at, u.turn_seq, u.woken
                      FROM (SELECT e.id, e.turn_at, e.turn_seq, true AS woken
                              FROM unnest(v_eligible, v_turn_ats, v_turn_seqs) AS e(id, turn_at, turn_seq)
                            UNION ALL
                            SELECT k.id, k.turn_at, k.turn_seq, false
                              FROM fairq.channel k
                             WHERE v_window = 1 AND k.id = ANY (p_waiting)
                               AND k.id <> ALL (v_eligible)) u
                     ORDER BY u.turn_at, u.turn_seq
                    OFFSET 0) m  -- (sorted first: the rows are then locked one by one, in order)
              JOIN fairq.channel c ON c.id = m.id
             ORDER BY m.turn_at, m.turn_seq
             LIMIT wanted
               FOR NO KEY UPDATE OF c SKIP LOCKED)
        SELECT coalesce(array_agg(j.id) FILTER (WHERE j.woken), '{}'),
               coalesce(array_agg(j.id) FILTER (WHERE NOT j.woken), '{}'), count(*)
          INTO v_joined, v_joined_waiting, v_joining
          FROM joining j;
        waiting := waiting || v_joined_waiting;
        taken := taken || v_joined;
        IF cardinality(v_ineligible) > 0 THEN
            taken := taken || ARRAY(SELECT c.id FROM fairq.channel c WHERE c.id = ANY (v_ineligible)
                                     ORDER BY c.id
                                       FOR NO KEY UPDATE SKIP LOCKED);
        END IF;
        wanted := wanted - v_joining;
        EXIT WHEN wanted <= 0 OR v_read < v_window_size;
        v_seen := v_seen || v_eligible || v_ineligible;
    END LOOP;
END
$$;

-- A channel row the caller has just locked, with its queued wakes folded in.
CREATE FUNCTION fairq.channel_with_wakes(p_channel fairq.channel) RETURNS fairq.channel
LANGUAGE plpgsql
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM fairq.channel_wake w WHERE w.channel_id = p_channel.id) THEN
        PERFORM fairq.fold_wakes(ARRAY[p_channel.id]);
        SELECT * INTO p_channel FROM fairq.channel WHERE id = p_channel.id;
    END IF;
    RETURN p_channel;
END
$$;

-- A channel whose due_at may be too early: a dequeue picked it and found nothing to
-- hand out (a cancelled or concurrently taken head). Recompute its turn from what it
-- holds (taking p_turn_seq, or the next value). When it still holds a message due
-- now, which the pick could not lock, another transaction holds that message: a
-- cancel not yet committed, whose delete this snapshot does not see. Kept due now,
-- the channel would be picked and retired again by every dequeue while that
-- transaction is open, its row rewritten each time (a transaction that cancelled the
-- last messages of a thousand channels made each dequeue slower than the one
-- before); so a dequeue looks at it again only after fairq.held_message_wait(): by
-- then the cancel has committed (the channel goes idle) or rolled back (the message
-- is served, that much late; a message created on the channel meanwhile wakes it:
-- fairq.due_for_producers). The wait grows with how long the
-- message has been due, so a long transaction costs a look every few seconds, not one
-- at every call; and it ends no later than the channel's next scheduled message
-- falls due. (A channel a producer relies on staying due waits the shortest time; one
-- with a due message free again is not put off.)
CREATE FUNCTION fairq.held_message_wait(p_due_for interval) RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT LEAST(GREATEST(p_due_for, interval '100 milliseconds'), interval '5 seconds') $$;

CREATE FUNCTION fairq.channel_retire(p_channel_id bigint, p_now timestamptz, p_turn_seq bigint)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_channel fairq.channel := fairq.channel_lock(p_channel_id);
    v_pending_due_at timestamptz := (SELECT p.due_at FROM fairq.pending_due_at(v_channel.id) AS p);
    v_look_at timestamptz := p_now;  -- the time its next turn is reckoned from
    v_due_for interval;  -- how long the held message has been due, as the put-off counts it
BEGIN
    v_channel.due_at := (fairq.settled_due_ats(ARRAY[v_channel.id], ARRAY[v_channel.name],
                                               ARRAY[v_pending_due_at], v_channel.queue_id, p_now))[1];
    -- The put-off is decided under the channel's settle lock. A producer that relies
    -- on the channel staying due (fairq.channels_wake) holds it, and then the
    -- channel is put off only for the shortest wait: kept due, it was looked at again
    -- by every dequeue for as long as that producer stayed open (a transaction that
    -- cancels a channel's message and creates its replacement is one). Then, in the
    -- new snapshot of a statement after the lock, a due message that is free again
    -- (committed since the pick) keeps the channel due now.
    IF v_pending_due_at <= p_now THEN
        v_due_for := CASE WHEN fairq.settle_lock_try(v_channel.queue_id, v_channel.name)
                          THEN p_now - v_pending_due_at ELSE interval '0' END;
        PERFORM FROM fairq.message m
         WHERE m.channel_id = v_channel.id AND m.status = 'ready'
         LIMIT 1 FOR KEY SHARE SKIP LOCKED;
        IF NOT FOUND THEN
            PERFORM FROM fairq.message m
             WHERE m.channel_id = v_channel.id AND m.status = 'scheduled' AND m.dequeue_at <= p_now
             LIMIT 1 FOR KEY SHARE SKIP LOCKED;
        END IF;
        IF NOT FOUND THEN
            v_look_at := LEAST(p_now + fairq.held_message_wait(v_due_for),
                               (SELECT m.dequeue_at FROM fairq.message m
                                 WHERE m.channel_id = v_channel.id AND m.status = 'scheduled'
                                   AND m.dequeue_at > p_now
                                 ORDER BY m.dequeue_at, m.id LIMIT 1));
        END IF;
    END IF;
    PERFORM fairq.channel_store(v_channel, v_look_at, false, p_turn_seq);
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
    PERFORM fairq.channel_store(p_channel, p_now, true);
END
$$;

-- Keeps channel_size right for a bounded channel: p_delta messages more or fewer.
-- With p_enforce (a producer, holding the channel's producer lock), admits only what
-- fits under max_size and returns how many of p_delta (> 0) were admitted, under the
-- channel_size row's lock (held to commit: producers of a channel queue there).
-- Without it (removals, operator retries) the change is recorded in
-- channel_size_change, which waits for nobody: a settlement never waits for an open
-- producer transaction.
-- (SQL, inlined into its callers: an unbounded channel, the common case, costs no
-- call.)
CREATE FUNCTION fairq.channel_resize(p_channel fairq.channel, p_delta integer, p_enforce boolean)
RETURNS integer
LANGUAGE sql
AS $$
    SELECT CASE WHEN p_channel.max_size IS NULL THEN p_delta
                ELSE fairq.bounded_channel_resize(p_channel, p_delta, p_enforce) END
$$;

-- fairq.channel_resize of a channel that has a max_size.
CREATE FUNCTION fairq.bounded_channel_resize(p_channel fairq.channel, p_delta integer, p_enforce boolean)
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    v_size integer;
    v_folded integer;  -- the changes recorded since the last producer (NULL: none)
    v_admitted integer;
BEGIN
    IF NOT p_enforce THEN
        IF p_delta <> 0 THEN
            INSERT INTO fairq.channel_size_change (channel_id, delta) VALUES (p_channel.id, p_delta);
        END IF;
        RETURN p_delta;
    END IF;
    SELECT size INTO v_size FROM fairq.channel_size WHERE channel_id = p_channel.id FOR UPDATE;
    -- (After the lock: a snapshot taken before a wait for another producer would miss
    -- the changes it folded, and fold them twice.)
    WITH folded AS (
        DELETE FROM fairq.channel_size_change d WHERE d.channel_id = p_channel.id RETURNING d.delta
    )
    SELECT sum(f.delta) INTO v_folded FROM folded f;
    v_size := v_size + coalesce(v_folded, 0);
    v_admitted := LEAST(p_delta, GREATEST(0, p_channel.max_size - v_size));
    IF v_admitted <> 0 OR v_folded IS NOT NULL THEN
        UPDATE fairq.channel_size SET size = v_size + v_admitted WHERE channel_id = p_channel.id;
    END IF;
    RETURN v_admitted;
END
$$;

-- The channel row for a change of policy or pause, created on first use, with its
-- producer lock, its queue's bulk producer lock, its policy lock and its queue's bulk
-- policy lock held exclusively, then the row itself (its wakes folded in). Waiting
-- out producers mid-insert, bulk ones too, makes them and channel_size agree on
-- max_size; waiting out completions, bulk ones too, makes them and in_flight agree
-- on max_concurrency. (The row stays: collecting it would need the producer lock
-- held here.)
-- A worker's transaction may complete a message and then produce on its channel
-- (policy lock, then producer lock), or the other way round, and no single order of
-- the two kinds suits both: holding one kind while waiting for the other deadlocked
-- with one of them. So each round waits for one lock as long as it takes, holding
-- nothing else, and then for every other one only fairq.second_lock_wait() (well
-- below PostgreSQL's deadlock_timeout); past that, everything taken is let go and
-- the next round waits first for another of them: the channel's producer lock, its
-- policy lock, the queue's bulk producer lock, the queue's bulk policy lock, in
-- turn. A transaction that needs a lock held here then waits at most that long, and
-- a holder that needs nothing more is waited for in full, in its round. (Until
-- 0.7.36 the bulk locks were waited for in full while the channel's lock was held: a
-- bulk producer left open held up every producer of the channel for as long, and
-- one that then waited for such a producer's new channel row deadlocked with it.)
-- The channel's row is a further thing such a transaction may hold (its settlement
-- wrote it) before it produces on the channel: each round first waits out the row's
-- holder while holding nothing, and every later wait for the row (the insert's
-- unique check, the row lock) is bounded like the others. (0.7.31 waited for the
-- row holding the producer lock: with a worker that deferred, failed or completed a
-- capped channel's message and then produced on it, that deadlocked.)
CREATE FUNCTION fairq.second_lock_wait() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT interval '50 milliseconds' $$;

CREATE FUNCTION fairq.channel_for_policy(p_queue_id integer, p_channel text) RETURNS fairq.channel
LANGUAGE plpgsql
AS $$
DECLARE
    v_caller_lock_timeout CONSTANT text := current_setting('lock_timeout');
    -- The caller's own lock_timeout still bounds every wait, the second's too.
    v_second_lock_timeout CONSTANT text :=
        CASE WHEN v_caller_lock_timeout::interval > interval '0'
                  AND v_caller_lock_timeout::interval < fairq.second_lock_wait()
             THEN v_caller_lock_timeout
             ELSE (extract(epoch FROM fairq.second_lock_wait()) * 1000)::bigint || 'ms' END;
    v_round integer := 0;  -- which lock this round waits for in full (0 to 3, above)
    v_waiting_for_second boolean;
    v_first_id bigint;  -- the row whose policy lock a round of the policy lock took first
    v_row_id bigint;    -- the row there is under the producer lock
    v_channel fairq.channel;
BEGIN
    LOOP
        v_waiting_for_second := false;
        BEGIN
            PERFORM FROM fairq.channel c WHERE c.queue_id = p_queue_id AND c.name = p_channel
               FOR NO KEY UPDATE;
            RAISE EXCEPTION USING ERRCODE = 'FQ001';  -- lets go of the row at once
        EXCEPTION WHEN SQLSTATE 'FQ001' THEN
            NULL;
        END;
        BEGIN  -- a subtransaction: its rollback lets go of the locks taken in it
            CASE v_round
                WHEN 0 THEN
                    PERFORM pg_advisory_xact_lock(fairq.producer_lock_class(),
                                                  fairq.producer_lock_key(p_queue_id, p_channel));
                WHEN 1 THEN
                    -- (A channel not made yet has nothing in flight: no completion to wait for.)
                    v_first_id := (SELECT c.id FROM fairq.channel c
                                    WHERE c.queue_id = p_queue_id AND c.name = p_channel);
                    PERFORM pg_advisory_xact_lock(fairq.policy_lock_class(), fairq.policy_lock_key(v_first_id))
                     WHERE v_first_id IS NOT NULL;
                WHEN 2 THEN
                    PERFORM pg_advisory_xact_lock(fairq.bulk_producer_lock_class(), p_queue_id);
                ELSE
                    PERFORM pg_advisory_xact_lock(fairq.bulk_policy_lock_class(), p_queue_id);
            END CASE;
            -- The rest, in the usual order (a lock this round already holds is taken
            -- again at once), each waited for briefly.
            v_waiting_for_second := true;
            PERFORM set_config('lock_timeout', v_second_lock_timeout, true);
            PERFORM pg_advisory_xact_lock(fairq.producer_lock_class(), fairq.producer_lock_key(p_queue_id, p_channel));
            PERFORM pg_advisory_xact_lock(fairq.bulk_producer_lock_class(), p_queue_id);
            INSERT INTO fairq.channel (queue_id, name) VALUES (p_queue_id, p_channel)
            ON CONFLICT (queue_id, name) DO NOTHING;
            -- (The row now, under the producer lock: the channel may have been collected,
            -- or made, since a round of the policy lock looked it up.)
            v_row_id := (SELECT c.id FROM fairq.channel c
                          WHERE c.queue_id = p_queue_id AND c.name = p_channel);
            PERFORM pg_advisory_xact_lock(fairq.policy_lock_class(), fairq.policy_lock_key(v_row_id));
            PERFORM pg_advisory_xact_lock(fairq.bulk_policy_lock_class(), p_queue_id);
            v_channel := fairq.channel_lock(v_row_id);
            PERFORM set_config('lock_timeout', v_caller_lock_timeout, true);
            RETURN v_channel;
        EXCEPTION WHEN lock_not_available THEN
            IF NOT v_waiting_for_second THEN
                RAISE;
            END IF;
        END;
        v_round := (v_round + 1) % 4;
    END LOOP;
END
$$;

-- Writes back a channel whose policy or pause a call changed (fairq.channel_store,
-- the turn recomputed), and tells sleeping workers where that brought its turn
-- earlier: a channel that had none (paused until resumed, full) or a later one. A
-- pause until resumed gives a sleeping worker no time to wake at (doorbell_quiet's
-- next_turn_at), so until 0.7.37 a resume woke nobody before the next poll.
CREATE FUNCTION fairq.channel_store_policy(p_channel fairq.channel, p_now timestamptz) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_stored fairq.channel := fairq.channel_store(p_channel, p_now, false);
BEGIN
    IF v_stored.turn_at IS NOT NULL AND (p_channel.turn_at IS NULL OR v_stored.turn_at < p_channel.turn_at)
       AND fairq.events_wanted(true) THEN
        IF fairq.worker_sleeps(v_stored.queue_id) THEN
            PERFORM fairq.notify_event('policy', v_stored.queue_id, v_stored.name, NULL, v_stored.turn_at);
        END IF;
    END IF;
END
$$;

CREATE FUNCTION fairq.channel_set(
    p_channel text,
    p_max_concurrency integer DEFAULT NULL,
    p_release_interval_ms bigint DEFAULT 0,
    p_max_size integer DEFAULT NULL,
    p_max_attempts integer DEFAULT NULL,
    p_weight integer DEFAULT 1,
    p_queue text DEFAULT 'default'
) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require_read_committed('fairq.channel_set'),
            fairq.require_channel_name(p_channel, 'p_channel');
    PERFORM fairq.require_limit(p_max_concurrency, 'p_max_concurrency');
    PERFORM fairq.require_duration(p_release_interval_ms, 0, 'p_release_interval_ms');
    PERFORM fairq.require_limit(p_max_size, 'p_max_size');
    PERFORM fairq.require_limit(p_max_attempts, 'p_max_attempts');
    PERFORM fairq.require_weight(p_weight, 'p_weight');
    v_channel := fairq.channel_for_policy(fairq.queue_for_producer(p_queue, 'p_queue'), p_channel);

    -- Completions of an uncapped channel do not lock its row but hold its policy
    -- lock (shared), so the count of locked messages below is exact.
    UPDATE fairq.channel
       SET has_policy = true, max_concurrency = p_max_concurrency,
           release_interval_ms = p_release_interval_ms, max_size = p_max_size,
           max_attempts = p_max_attempts, weight = p_weight,
           in_flight = CASE WHEN p_max_concurrency IS NULL THEN 0 ELSE
                           (SELECT count(*) FROM fairq.message m
                             WHERE m.channel_id = v_channel.id AND m.status = 'locked') END
     WHERE id = v_channel.id
    RETURNING * INTO v_channel;

    IF p_max_size IS NULL THEN
        DELETE FROM fairq.channel_size WHERE channel_id = v_channel.id;
        DELETE FROM fairq.channel_size_change WHERE channel_id = v_channel.id;
    ELSE
        INSERT INTO fairq.channel_size (channel_id, size)
        SELECT v_channel.id, count(*) FROM fairq.message WHERE channel_id = v_channel.id
        ON CONFLICT (channel_id) DO NOTHING;
    END IF;
    -- New limits apply from now: the turn is recomputed (a raised release interval
    -- moves it later, a lowered one brings it to now; the channel joins the rotation
    -- again at the back).
    PERFORM fairq.channel_store_policy(v_channel, v_now);
END
$$;

CREATE FUNCTION fairq.channel_clear(p_channel text, p_queue text DEFAULT 'default') RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_queue_id integer;
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require_read_committed('fairq.channel_clear'),
            fairq.require_channel_name(p_channel, 'p_channel');
    v_queue_id := (fairq.queue_lookup(p_queue, 'p_queue')).id;
    IF v_queue_id IS NULL OR NOT EXISTS (
            SELECT 1 FROM fairq.channel c
             WHERE c.queue_id = v_queue_id AND c.name = p_channel
               AND (c.has_policy OR c.paused_until > v_now)) THEN
        RETURN false;
    END IF;
    v_channel := fairq.channel_for_policy(v_queue_id, p_channel);
    DELETE FROM fairq.channel_size WHERE channel_id = v_channel.id;
    DELETE FROM fairq.channel_size_change WHERE channel_id = v_channel.id;
    UPDATE fairq.channel
       SET has_policy = false, max_concurrency = NULL, release_interval_ms = 0,
           max_size = NULL, max_attempts = NULL, in_flight = 0, weight = 1, paused_until = NULL
     WHERE id = v_channel.id
    RETURNING * INTO v_channel;
    PERFORM fairq.channel_store_policy(v_channel, v_now);
    RETURN true;
END
$$;

-- A pause changes when the channel may be served, nothing else: its turn waits for
-- p_until (fairq.next_turn), then it joins the rotation at the back.
CREATE FUNCTION fairq.channel_pause(p_channel text, p_until timestamptz DEFAULT 'infinity',
                                    p_queue text DEFAULT 'default') RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require_read_committed('fairq.channel_pause'),
            fairq.require_channel_name(p_channel, 'p_channel');
    PERFORM fairq.require_future(p_until, v_now, 'p_until');
    v_channel := fairq.channel_for_policy(fairq.queue_for_producer(p_queue, 'p_queue'), p_channel);
    v_channel.paused_until := p_until;
    UPDATE fairq.channel SET paused_until = p_until WHERE id = v_channel.id;
    PERFORM fairq.channel_store_policy(v_channel, v_now);
END
$$;

CREATE FUNCTION fairq.channel_resume(p_channel text, p_queue text DEFAULT 'default') RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := fairq.clock();
    v_queue_id integer;
    v_channel fairq.channel;
BEGIN
    PERFORM fairq.require_read_committed('fairq.channel_resume'),
            fairq.require_channel_name(p_channel, 'p_channel');
    v_queue_id := (fairq.queue_lookup(p_queue, 'p_queue')).id;
    IF v_queue_id IS NULL OR NOT EXISTS (
            SELECT 1 FROM fairq.channel c
             WHERE c.queue_id = v_queue_id AND c.name = p_channel AND c.paused_until > v_now) THEN
        RETURN false;
    END IF;
    v_channel := fairq.channel_for_policy(v_queue_id, p_channel);
    v_channel.paused_until := NULL;
    UPDATE fairq.channel SET paused_until = NULL WHERE id = v_channel.id;
    PERFORM fairq.channel_store_policy(v_channel, v_now);
    RETURN true;
END
$$;

COMMENT ON FUNCTION fairq.channel_set(text, integer, bigint, integer, integer, integer, text) IS
    'Upserts a channel''s policy: p_max_concurrency messages in flight at once, p_max_size messages held (in flight included), p_max_attempts deliveries before dead-lettering (NULL: unlimited), p_release_interval_ms minimum gap between fresh releases (0: none), p_weight (1-1000) its share of turns.';
COMMENT ON FUNCTION fairq.channel_clear(text, text) IS
    'Forgets a channel''s explicit policy and any pause (true if it had one); the channel reverts to no limits and disappears when empty.';
COMMENT ON FUNCTION fairq.channel_pause(text, timestamptz, text) IS
    'Hands out no message of the channel before p_until (default: until resumed); it keeps its messages, policy and locks.';
COMMENT ON FUNCTION fairq.channel_resume(text, text) IS
    'Ends a channel''s pause (true if it was paused); it joins the rotation like a channel that just became eligible.';
