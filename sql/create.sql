-- create.sql — putting messages on channels.
--
-- Invariants:
--   * a producer holds its channel row only FOR KEY SHARE, and takes the row for an
--     update only when its message must bring the channel's turn forward (the
--     channel had nothing due before it); on a backlogged channel, producers and
--     workers never wait for one another;
--   * a dequeue never makes a channel less eligible while a producer holds that
--     share lock (see channels.sql), so a message committed later is never stranded;
--   * a bounded channel admits a message only while its count is below max_size;
--   * at most one message per (channel, dedup_key) exists at a time;
--   * channels are visited in name order, so concurrent batches cannot deadlock.
-- message_create is message_create_batch of one element: one code path. In both, a
-- NULL dequeue_at means now and a NULL priority means 0.

CREATE FUNCTION fairq.message_create_batch(
    p_channels text[],
    p_contents bytea[],
    p_dequeue_ats timestamptz[] DEFAULT NULL,
    p_priorities integer[] DEFAULT NULL,
    p_dedup_keys text[] DEFAULT NULL
) RETURNS TABLE(ord integer, id bigint, status text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := fairq.clock();
    v_count integer := cardinality(fairq.require(p_channels, 'p_channels'));
    v_ids bigint[];
    v_statuses text[];
    v_row record;
    v_channel fairq.channel;
    v_id bigint;
    v_wake_at timestamptz;
    v_first_id bigint;
    v_bad integer;
BEGIN
    PERFORM fairq.require(p_contents, 'p_contents');
    IF array_ndims(p_channels) > 1 OR cardinality(p_contents) <> v_count
       OR cardinality(p_dequeue_ats) <> v_count OR cardinality(p_priorities) <> v_count
       OR cardinality(p_dedup_keys) <> v_count THEN
        RAISE EXCEPTION 'p_contents, p_dequeue_ats, p_priorities and p_dedup_keys must be NULL or one-dimensional arrays as long as p_channels (%)', v_count
            USING ERRCODE = '22023';
    END IF;
    SELECT min(u.i) INTO v_bad
      FROM unnest(p_channels) WITH ORDINALITY AS u(channel, i)
     WHERE u.channel IS NULL OR u.channel = '' OR octet_length(u.channel) > 255;
    IF v_bad IS NOT NULL THEN
        PERFORM fairq.require_channel_name(p_channels[v_bad], format('p_channels[%s]', v_bad));
    END IF;
    SELECT min(u.i) INTO v_bad FROM unnest(p_contents) WITH ORDINALITY AS u(content, i)
     WHERE u.content IS NULL;
    IF v_bad IS NOT NULL THEN
        PERFORM fairq.require(p_contents[v_bad], format('p_contents[%s]', v_bad));
    END IF;
    SELECT min(u.i) INTO v_bad FROM unnest(p_dedup_keys) WITH ORDINALITY AS u(dedup_key, i)
     WHERE octet_length(u.dedup_key) > 1024;
    IF v_bad IS NOT NULL THEN
        PERFORM fairq.require_dedup_key(p_dedup_keys[v_bad], format('p_dedup_keys[%s]', v_bad));
    END IF;

    v_ids := array_fill(NULL::bigint, ARRAY[v_count]);
    v_statuses := array_fill(NULL::text, ARRAY[v_count]);
    FOR v_row IN
        SELECT u.i, u.channel, u.content, coalesce(u.dequeue_at, v_now) AS dequeue_at,
               coalesce(u.priority, 0) AS priority, u.dedup_key,
               min(coalesce(u.dequeue_at, v_now)) OVER (PARTITION BY u.channel) AS channel_due_at,
               u.channel IS DISTINCT FROM lead(u.channel) OVER (ORDER BY u.channel, u.i) AS last_of_channel
          FROM unnest(p_channels, p_contents, p_dequeue_ats, p_priorities, p_dedup_keys)
               WITH ORDINALITY AS u(channel, content, dequeue_at, priority, dedup_key, i)
         ORDER BY u.channel, u.i
    LOOP
        IF v_channel.name IS DISTINCT FROM v_row.channel THEN
            v_channel := fairq.channel_for_producer(v_row.channel);
            v_wake_at := NULL;
            v_first_id := NULL;
            -- Only messages due before everything the channel already holds need its
            -- turn moved; otherwise the share lock suffices. Moving it first keeps the
            -- lock order (channel, then size) and is harmless if nothing is created:
            -- a dequeue that finds nothing recomputes the channel.
            IF v_channel.due_at IS NULL
               OR (v_row.channel_due_at < v_channel.due_at AND v_channel.due_at > v_now) THEN
                PERFORM fairq.channel_wake(v_channel.id, v_row.channel_due_at, v_now);
            END IF;
        END IF;

        <<place>>
        LOOP
            IF v_row.dedup_key IS NOT NULL THEN
                SELECT m.id INTO v_id FROM fairq.message m
                 WHERE m.channel_id = v_channel.id AND m.dedup_key = v_row.dedup_key;
                IF FOUND THEN
                    v_ids[v_row.i] := v_id;
                    v_statuses[v_row.i] := 'duplicate';
                    EXIT place;
                END IF;
            END IF;
            IF fairq.channel_resize(v_channel, 1, true) = 0 THEN
                v_statuses[v_row.i] := 'dropped';
                EXIT place;
            END IF;
            INSERT INTO fairq.message
                (channel_id, status, priority, dequeue_at, created_at, dedup_key, content)
            VALUES (v_channel.id,
                    CASE WHEN v_row.dequeue_at <= v_now THEN 'ready' ELSE 'scheduled' END::fairq.message_status,
                    v_row.priority, v_row.dequeue_at, v_now, v_row.dedup_key, v_row.content)
            ON CONFLICT (channel_id, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING
            RETURNING fairq.message.id INTO v_id;
            IF FOUND THEN
                v_ids[v_row.i] := v_id;
                v_statuses[v_row.i] := 'created';
                v_wake_at := LEAST(v_wake_at, v_row.dequeue_at);
                v_first_id := coalesce(v_first_id, v_id);
                EXIT place;
            END IF;
            -- A concurrent producer committed the same dedup key meanwhile: undo the
            -- count and report that message as the duplicate.
            PERFORM fairq.channel_resize(v_channel, -1, false);
        END LOOP;

        IF v_row.last_of_channel AND v_first_id IS NOT NULL THEN
            PERFORM fairq.notify_event('created', v_channel.name, v_first_id, v_wake_at);
        END IF;
    END LOOP;

    RETURN QUERY SELECT g.i::integer, v_ids[g.i], v_statuses[g.i] FROM generate_series(1, v_count) AS g(i);
END
$$;

CREATE FUNCTION fairq.message_create(
    p_channel text,
    p_content bytea,
    p_dequeue_at timestamptz DEFAULT NULL,
    p_priority integer DEFAULT 0,
    p_dedup_key text DEFAULT NULL
) RETURNS TABLE(id bigint, status text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    PERFORM fairq.require_channel_name(p_channel, 'p_channel');
    PERFORM fairq.require(p_content, 'p_content');
    PERFORM fairq.require_dedup_key(p_dedup_key, 'p_dedup_key');
    RETURN QUERY
        SELECT b.id, b.status
          FROM fairq.message_create_batch(ARRAY[p_channel], ARRAY[p_content], ARRAY[p_dequeue_at],
                                          ARRAY[p_priority], ARRAY[p_dedup_key]) AS b;
END
$$;

COMMENT ON FUNCTION fairq.message_create(text, bytea, timestamptz, integer, text) IS
    'Puts a message on a channel (created on first use). Returns (id, created), (id of the existing message, duplicate) for a live dedup key, or (NULL, dropped) when the channel is at max_size.';
COMMENT ON FUNCTION fairq.message_create_batch(text[], bytea[], timestamptz[], integer[], text[]) IS
    'message_create for many messages at once: one row per input element (ord = 1-based position). NULL elements of the optional arrays mean the defaults.';
