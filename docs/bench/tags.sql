-- tags.sql — a measuring device, not a queue: never load it where data matters.
--
-- Fair queueing the other way round from fairq's rotation: instead of a dequeue
-- writing the channel it served (its next turn), a create stamps each message with
-- its channel's next tag, and a dequeue takes the ready message with the least tag.
-- Run in a scratch database that has `CREATE EXTENSION fairq` (written against
-- 0.7.35), it adds message.tag and channel.last_tag, and puts in place of
-- message_create(_batch), message_dequeue and message_complete(_batch) (renamed to
-- *_real) the least this design does on fairq's tables:
--   * a create: the channel row moves on by one stride per message,
--     last_tag = greatest(last_tag, V) + 1,000,000 / weight, where V, the queue's
--     virtual time, is the least tag among its ready messages (so a channel idle for
--     a while joins just behind the messages now being served, and one with a
--     backlog keeps its place); the message is inserted with the new last_tag. The
--     producer holds its channel rows until it commits: that is what keeps two
--     producers of one channel from stamping the same tag;
--   * a batch create: its channels made if new, locked in id order, each moved on by
--     as many strides as it gets messages, then one insert;
--   * a dequeue of n: the n ready messages with the least tags (one index, SKIP
--     LOCKED), locked with the fencing token, in one statement; no channel write;
--   * a completion: the fenced delete (a batch, one statement).
-- Messages made by a real call (the bench's prefill, a channel not made yet) are
-- tagged by a trigger. Everything else falls back to the real call: a dequeue that
-- finds nothing, a create with a schedule, a priority array or a dedup key, or on a
-- channel with a policy. What it drops: argument checks, recovery, pauses, caps, rate
-- limits, max_attempts, schedules, priority within a channel, sizes, history, events
-- and the collector. docs/bench.md, "Measured after 0.7.35: fair queueing by tags on
-- messages", has what it measured, and how.

ALTER TABLE fairq.message ADD COLUMN tag bigint;
ALTER TABLE fairq.channel ADD COLUMN last_tag bigint NOT NULL DEFAULT 0;
CREATE INDEX message_tag_ix ON fairq.message (queue_id, tag, id) WHERE status = 'ready';

-- Messages made by the real calls (the bench's prefill) get their tag here.
CREATE FUNCTION fairq.tag_untagged() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE fairq.channel c
       SET last_tag = greatest(c.last_tag,
                               coalesce((SELECT s.tag FROM fairq.message s
                                          WHERE s.queue_id = NEW.queue_id AND s.status = 'ready'
                                          ORDER BY s.tag, s.id LIMIT 1), 0))
                      + 1000000 / c.weight
     WHERE c.id = NEW.channel_id
    RETURNING c.last_tag INTO NEW.tag;
    RETURN NEW;
END
$$;
CREATE TRIGGER message_tag BEFORE INSERT ON fairq.message
    FOR EACH ROW WHEN (NEW.tag IS NULL) EXECUTE FUNCTION fairq.tag_untagged();

ALTER FUNCTION fairq.message_dequeue(bigint, integer, text) RENAME TO message_dequeue_real;
ALTER FUNCTION fairq.message_create(text, bytea, timestamptz, integer, text, text) RENAME TO message_create_real;
ALTER FUNCTION fairq.message_complete(bigint, bigint) RENAME TO message_complete_real;
ALTER FUNCTION fairq.message_create_batch(text[], bytea[], timestamptz[], integer[], text[], text) RENAME TO message_create_batch_real;
ALTER FUNCTION fairq.message_complete_batch(bigint[], bigint[]) RENAME TO message_complete_batch_real;

CREATE FUNCTION fairq.message_dequeue(p_lock_ms bigint, p_max_messages integer DEFAULT 1,
                                      p_queue text DEFAULT 'default')
RETURNS TABLE(id bigint, channel text, content bytea, state bytea, num_attempts bigint,
              priority integer, dequeue_at timestamptz, recovered boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
BEGIN
    IF p_max_messages <> 1 THEN
        RETURN QUERY
            UPDATE fairq.message m
               SET status = 'locked', locked_until = clock_timestamp() + p_lock_ms * interval '1 ms',
                   num_attempts = m.num_attempts + 1
             WHERE m.id IN (SELECT s.id FROM fairq.message s
                             WHERE s.queue_id = (SELECT q.id FROM fairq.queue q WHERE q.name = p_queue)
                               AND s.status = 'ready'
                             ORDER BY s.tag, s.id
                             LIMIT p_max_messages
                               FOR UPDATE SKIP LOCKED)
            RETURNING m.id, (SELECT c.name FROM fairq.channel c WHERE c.id = m.channel_id), m.content,
                      m.state, m.num_attempts, m.priority, m.dequeue_at, m.recovered;
        IF NOT FOUND THEN
            RETURN QUERY SELECT * FROM fairq.message_dequeue_real(p_lock_ms, p_max_messages, p_queue);
        END IF;
        RETURN;
    END IF;
    RETURN QUERY
        UPDATE fairq.message m
           SET status = 'locked', locked_until = clock_timestamp() + p_lock_ms * interval '1 ms',
               num_attempts = m.num_attempts + 1
         WHERE m.id = (SELECT s.id FROM fairq.message s
                        WHERE s.queue_id = (SELECT q.id FROM fairq.queue q WHERE q.name = p_queue)
                          AND s.status = 'ready'
                        ORDER BY s.tag, s.id
                        LIMIT 1
                          FOR UPDATE SKIP LOCKED)
        RETURNING m.id, (SELECT c.name FROM fairq.channel c WHERE c.id = m.channel_id), m.content,
                  m.state, m.num_attempts, m.priority, m.dequeue_at, m.recovered;
    IF NOT FOUND THEN
        RETURN QUERY SELECT * FROM fairq.message_dequeue_real(p_lock_ms, 1, p_queue);
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
    v_tag bigint;
BEGIN
    IF p_dequeue_at IS NOT NULL OR p_dedup_key IS NOT NULL THEN
        RETURN QUERY SELECT * FROM fairq.message_create_real(p_channel, p_content, p_dequeue_at,
                                                             p_priority, p_dedup_key, p_queue);
        RETURN;
    END IF;
    UPDATE fairq.channel c
       SET last_tag = greatest(c.last_tag,
                               coalesce((SELECT s.tag FROM fairq.message s
                                          WHERE s.queue_id = c.queue_id AND s.status = 'ready'
                                          ORDER BY s.tag, s.id LIMIT 1), 0))
                      + 1000000 / c.weight
     WHERE c.queue_id = (SELECT q.id FROM fairq.queue q WHERE q.name = p_queue)
       AND c.name = p_channel AND NOT c.has_policy
    RETURNING c.id, c.queue_id, c.last_tag INTO v_channel_id, v_queue_id, v_tag;
    IF NOT FOUND THEN
        RETURN QUERY SELECT * FROM fairq.message_create_real(p_channel, p_content, p_dequeue_at,
                                                             p_priority, p_dedup_key, p_queue);
        RETURN;
    END IF;
    INSERT INTO fairq.message (channel_id, status, priority, dequeue_at, created_at, content, queue_id, tag)
    VALUES (v_channel_id, 'ready', coalesce(p_priority, 0), clock_timestamp(), clock_timestamp(),
            p_content, v_queue_id, v_tag)
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

-- A batch create: each channel's row locked in id order (no deadlocks between
-- batches), moved on by as many strides as it gets messages, one insert.
CREATE FUNCTION fairq.message_create_batch(p_channels text[], p_contents bytea[],
    p_dequeue_ats timestamptz[] DEFAULT NULL, p_priorities integer[] DEFAULT NULL,
    p_dedup_keys text[] DEFAULT NULL, p_queue text DEFAULT 'default')
RETURNS TABLE(ord integer, id bigint, status text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_queue_id integer;
    v_virtual bigint;
    v_found integer;
BEGIN
    v_queue_id := (SELECT q.id FROM fairq.queue q WHERE q.name = p_queue);
    IF p_dequeue_ats IS NOT NULL OR p_priorities IS NOT NULL OR p_dedup_keys IS NOT NULL
       OR v_queue_id IS NULL THEN
        RETURN QUERY SELECT * FROM fairq.message_create_batch_real(p_channels, p_contents, p_dequeue_ats,
                                                                   p_priorities, p_dedup_keys, p_queue);
        RETURN;
    END IF;
    -- Channels not made yet are made here (plain rows, no policy), not by the real call.
    INSERT INTO fairq.channel (name, queue_id)
    SELECT DISTINCT x, v_queue_id FROM unnest(p_channels) x
     WHERE NOT EXISTS (SELECT FROM fairq.channel c WHERE c.queue_id = v_queue_id AND c.name = x)
     ORDER BY 1
    ON CONFLICT DO NOTHING;
    SELECT count(*) INTO v_found FROM (
        SELECT 1 FROM fairq.channel c
         WHERE c.queue_id = v_queue_id AND c.name = ANY (p_channels) AND NOT c.has_policy
         ORDER BY c.id FOR NO KEY UPDATE) l;
    IF v_found <> (SELECT count(DISTINCT x) FROM unnest(p_channels) x) THEN
        RETURN QUERY SELECT * FROM fairq.message_create_batch_real(p_channels, p_contents, p_dequeue_ats,
                                                                   p_priorities, p_dedup_keys, p_queue);
        RETURN;
    END IF;
    v_virtual := coalesce((SELECT s.tag FROM fairq.message s
                            WHERE s.queue_id = v_queue_id AND s.status = 'ready'
                            ORDER BY s.tag, s.id LIMIT 1), 0);
    RETURN QUERY
    WITH input AS (
        SELECT i.ord::integer AS ord, i.name, i.content,
               row_number() OVER (PARTITION BY i.name ORDER BY i.ord) AS nth,
               count(*) OVER (PARTITION BY i.name) AS per_channel
          FROM unnest(p_channels, p_contents) WITH ORDINALITY i(name, content, ord)),
    moved AS (
        UPDATE fairq.channel c
           SET last_tag = greatest(c.last_tag, v_virtual) + n.per_channel * (1000000 / c.weight)
          FROM (SELECT DISTINCT name, per_channel FROM input) n
         WHERE c.queue_id = v_queue_id AND c.name = n.name
        RETURNING c.id, c.name, c.last_tag, 1000000 / c.weight AS stride),
    made AS (
        INSERT INTO fairq.message (channel_id, status, priority, dequeue_at, created_at, content,
                                   queue_id, tag)
        SELECT m.id, 'ready', 0, clock_timestamp(), clock_timestamp(), i.content, v_queue_id,
               m.last_tag - (i.per_channel - i.nth) * m.stride
          FROM input i JOIN moved m ON m.name = i.name
         ORDER BY i.ord
        RETURNING fairq.message.id)
    SELECT (row_number() OVER ())::integer, made.id, 'created'::text FROM made;
END
$$;

CREATE FUNCTION fairq.message_complete_batch(p_ids bigint[], p_num_attempts bigint[])
RETURNS TABLE(id bigint, status text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH gone AS (
        DELETE FROM fairq.message m
         USING unnest(p_ids, p_num_attempts) u(id, att)
         WHERE m.id = u.id AND m.status = 'locked' AND m.num_attempts = u.att
        RETURNING m.id)
    SELECT u.id, CASE WHEN g.id IS NULL THEN 'stale' ELSE 'completed' END
      FROM unnest(p_ids) u(id) LEFT JOIN gone g ON g.id = u.id;
END
$$;
