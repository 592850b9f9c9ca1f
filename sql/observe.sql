-- observe.sql — what operators read from psql.
--
-- Invariants:
--   * views read the tables as the extension's owner, so an observer needs SELECT on
--     the view only, never on the tables;
--   * fairq.check() reads everything in one snapshot and returns one row per broken
--     invariant: no rows means the counters, heads and turns are consistent.

CREATE VIEW fairq.channels AS
SELECT q.name AS queue,
       c.name AS channel,
       c.max_concurrency,
       c.release_interval_ms,
       c.max_size,
       c.max_attempts,
       c.weight,
       CASE WHEN c.paused_until > k.now THEN c.paused_until END AS paused_until,
       n.ready + n.scheduled + n.in_flight AS size,
       n.ready,
       n.scheduled,
       n.in_flight,
       -- In the rotation: now. A wake not yet applied gives its time; a paused queue
       -- serves nothing before its pause ends. Nothing pending, nothing to serve: a
       -- channel may keep its turn after its last pending message was cancelled,
       -- until a dequeue recomputes it (settle.sql).
       CASE WHEN w.turn_at IS NOT NULL AND n.ready + n.scheduled > 0
            THEN GREATEST(w.turn_at, k.now, CASE WHEN q.paused_until > k.now THEN q.paused_until END)
       END AS next_dequeue_at
  FROM fairq.channel c
  JOIN fairq.queue q ON q.id = c.queue_id
 -- A scalar subquery, evaluated once: joined as a table, the one-row clock_offset
 -- (never analyzed) would be costed at thousands of rows and drag in JIT.
 CROSS JOIN (SELECT (SELECT clock_timestamp() + shift FROM fairq.clock_offset) AS now) k
 CROSS JOIN LATERAL (
       SELECT (SELECT count(*) FROM fairq.message m
                WHERE m.channel_id = c.id AND m.status = 'ready')
            + (SELECT count(*) FROM fairq.message m
                WHERE m.channel_id = c.id AND m.status = 'scheduled' AND m.dequeue_at <= k.now) AS ready,
              (SELECT count(*) FROM fairq.message m
                WHERE m.channel_id = c.id AND m.status = 'scheduled' AND m.dequeue_at > k.now) AS scheduled,
              (SELECT count(*)::integer FROM fairq.message m
                WHERE m.channel_id = c.id AND m.status = 'locked') AS in_flight
       ) n
 CROSS JOIN LATERAL (
       SELECT coalesce(c.turn_at,
                       CASE WHEN c.max_concurrency IS NULL OR c.in_flight < c.max_concurrency
                            THEN (SELECT min(GREATEST(x.due_at, x.woken_at, c.paused_until))
                                    FROM fairq.channel_wake x WHERE x.channel_id = c.id) END) AS turn_at
       ) w
 -- An idle channel without policy or pause is only kept for the collector: not shown.
 WHERE c.has_policy OR c.paused_until > k.now OR n.ready + n.scheduled + n.in_flight > 0;

CREATE VIEW fairq.dead_letters AS
SELECT id, queue, channel, content, state, num_attempts, error, created_at, died_at
  FROM fairq.dead_letter;

-- The sums of fairq.channels per queue, without its per-channel lookups: every
-- message is read once, grouped by channel, so the view costs the same with 100 or
-- 100,000 channels. (A channel shows in fairq.channels when it has a policy, a pause
-- or a message.)
CREATE VIEW fairq.queues AS
WITH k AS (SELECT (SELECT clock_timestamp() + shift FROM fairq.clock_offset) AS now),
held AS (
    SELECT m.channel_id,
           count(*) AS size,
           count(*) FILTER (WHERE m.status = 'ready'
                               OR (m.status = 'scheduled' AND m.dequeue_at <= k.now)) AS ready,
           count(*) FILTER (WHERE m.status = 'scheduled' AND m.dequeue_at > k.now) AS scheduled,
           count(*) FILTER (WHERE m.status = 'locked') AS in_flight
      FROM fairq.message m CROSS JOIN k
     GROUP BY m.channel_id
), shown AS (
    SELECT c.queue_id, h.size, h.ready, h.scheduled, h.in_flight
      FROM fairq.channel c
      CROSS JOIN k
      LEFT JOIN held h ON h.channel_id = c.id
     WHERE c.has_policy OR c.paused_until > k.now OR h.channel_id IS NOT NULL
)
SELECT q.name AS queue,
       count(s.queue_id) AS channels,
       coalesce(sum(s.size), 0)::bigint AS size,
       coalesce(sum(s.ready), 0)::bigint AS ready,
       coalesce(sum(s.scheduled), 0)::bigint AS scheduled,
       coalesce(sum(s.in_flight), 0)::bigint AS in_flight,
       (SELECT count(*) FROM fairq.dead_letter d WHERE d.queue = q.name) AS dead,
       CASE WHEN q.paused_until > k.now THEN q.paused_until END AS paused_until
  FROM fairq.queue q
 CROSS JOIN k
  LEFT JOIN shown s ON s.queue_id = q.id
 GROUP BY q.id, q.name, q.paused_until, k.now;

CREATE FUNCTION fairq.history_prune(p_before timestamptz) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_deleted bigint;
BEGIN
    PERFORM fairq.require(p_before, 'p_before');
    DELETE FROM fairq.message_history WHERE settled_at < p_before;
    GET DIAGNOSTICS v_deleted = ROW_COUNT;
    RETURN v_deleted;
END
$$;

CREATE FUNCTION fairq.check() RETURNS TABLE(channel text, problem text)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    -- Messages, wakes and size changes are read once each, grouped by channel: per-channel lookups
    -- would read the whole message table once per channel (no index on channel_id
    -- alone covers every status).
    WITH held AS (
        SELECT m.channel_id,
               count(*) AS messages,
               count(*) FILTER (WHERE m.status = 'locked') AS locked,
               count(*) FILTER (WHERE (m.status = 'locked') <> (m.locked_until IS NOT NULL)) AS lock_mismatch,
               min(m.dequeue_at) FILTER (WHERE m.status IN ('ready', 'scheduled')) AS earliest_due
          FROM fairq.message m
         GROUP BY m.channel_id
    ), waking AS (
        SELECT w.channel_id, min(w.due_at) AS due_at FROM fairq.channel_wake w GROUP BY w.channel_id
    ), changed AS (
        SELECT x.channel_id, sum(x.delta) AS delta FROM fairq.channel_size_change x GROUP BY x.channel_id
    ), truth AS (
        SELECT c.*,
               coalesce(h.locked, 0) AS locked,
               coalesce(h.messages, 0) AS messages,
               coalesce(h.lock_mismatch, 0) AS lock_mismatch,
               h.earliest_due,
               s.size + coalesce(x.delta, 0) AS counted_size,
               x.channel_id IS NOT NULL AS size_changed,
               -- a queued wake (fairq.channels_wake) stands for due_at until applied
               LEAST(c.due_at, w.due_at) AS due_or_waking,
               (SELECT clock_timestamp() + shift FROM fairq.clock_offset) AS now
          FROM fairq.channel c
          LEFT JOIN held h ON h.channel_id = c.id
          LEFT JOIN waking w ON w.channel_id = c.id
          LEFT JOIN fairq.channel_size s ON s.channel_id = c.id
          LEFT JOIN changed x ON x.channel_id = c.id
    )
    SELECT t.name, p.problem
      FROM truth t
     CROSS JOIN LATERAL (VALUES
        (CASE WHEN t.in_flight <> fairq.slots(t.max_concurrency, t.locked::integer)
              THEN CASE WHEN t.max_concurrency IS NULL
                        THEN format('in_flight is %s but the channel has no max_concurrency: it should be 0',
                                    t.in_flight)
                        ELSE format('in_flight is %s but %s messages are locked (max_concurrency %s)',
                                    t.in_flight, t.locked, t.max_concurrency) END END),
        -- (Lock expiry and recovery find locked messages by locked_until alone.)
        (CASE WHEN t.lock_mismatch > 0
              THEN format('%s messages have a locked_until but are not locked, or are locked without one',
                          t.lock_mismatch) END),
        (CASE WHEN t.due_or_waking IS NULL AND t.earliest_due IS NOT NULL
              THEN 'pending messages but no due_at: they would never be delivered' END),
        (CASE WHEN t.due_or_waking > GREATEST(t.earliest_due, t.now)
              THEN format('due_at %s is later than the earliest pending message (%s)', t.due_or_waking, t.earliest_due) END),
        (CASE WHEN (t.turn_at IS NULL)
                   <> (t.due_at IS NULL OR coalesce(t.in_flight >= t.max_concurrency, false))
              THEN format('turn_at %s does not match due_at %s, in_flight %s and max_concurrency %s',
                          t.turn_at, t.due_at, t.in_flight, t.max_concurrency) END),
        (CASE WHEN (t.idle_since IS NULL) = (t.due_at IS NULL)
              THEN format('idle_since %s does not match due_at %s', t.idle_since, t.due_at) END),
        (CASE WHEN t.turn_at > fairq.in_rotation()
                   AND t.turn_at < t.last_release_at + fairq.ms(t.release_interval_ms)
              THEN 'next turn comes before the release interval has passed' END),
        (CASE WHEN (t.turn_at = fairq.in_rotation() AND t.turn_pass IS NULL)
                   OR (t.turn_at = fairq.in_rotation()) <> (t.turn_given_at IS NOT NULL)
              THEN format('turn_pass %s and turn_given_at %s do not match turn_at %s: a channel in the rotation has both, and no other a turn_given_at',
                          t.turn_pass, t.turn_given_at, t.turn_at) END),
        -- A kept place (turns.sql): outside the rotation only a channel full with work
        -- due, or freed and servable now, keeps a pass.
        (CASE WHEN t.turn_pass IS NOT NULL AND t.turn_at IS DISTINCT FROM fairq.in_rotation()
                   AND NOT coalesce(CASE WHEN t.turn_at IS NULL
                                         THEN t.due_at <= t.now AND t.in_flight >= t.max_concurrency
                                         ELSE t.turn_at <= t.now END, false)
              THEN format('turn_pass %s kept outside the rotation with turn_at %s, due_at %s, in_flight %s and max_concurrency %s: only a channel full with work due, or freed and servable now, keeps its place',
                          t.turn_pass, t.turn_at, t.due_at, t.in_flight, t.max_concurrency) END),
        (CASE WHEN t.turn_at > fairq.in_rotation() AND t.turn_at < t.paused_until
              THEN format('next turn %s comes before the pause ends (%s)', t.turn_at, t.paused_until) END),
        (CASE WHEN t.turn_at = fairq.in_rotation() AND t.paused_until > t.now
              THEN format('in the rotation while paused until %s', t.paused_until) END),
        (CASE WHEN t.weight NOT BETWEEN 1 AND 1000
              THEN format('weight %s is outside 1..1000', t.weight) END),
        (CASE WHEN t.max_size IS NOT NULL AND t.counted_size IS DISTINCT FROM t.messages
              THEN format('channel_size says %s but the channel holds %s messages', t.counted_size, t.messages) END),
        (CASE WHEN t.max_size IS NULL AND t.counted_size IS NOT NULL
              THEN 'channel_size row for a channel without max_size' END),
        (CASE WHEN t.max_size IS NULL AND t.size_changed
              THEN 'channel_size_change rows for a channel without max_size' END)
     ) AS p(problem)
     WHERE p.problem IS NOT NULL
    UNION ALL
    SELECT NULL, format('%s queued wakes belong to no channel', count(*))
      FROM fairq.channel_wake w
     WHERE NOT EXISTS (SELECT 1 FROM fairq.channel c WHERE c.id = w.channel_id)
    HAVING count(*) > 0
    UNION ALL
    SELECT NULL, format('%s messages count more deliveries since their last retry than in all', count(*))
      FROM fairq.message m
     WHERE m.attempts_at_retry > m.num_attempts
    HAVING count(*) > 0
    UNION ALL
    SELECT NULL, format('%s messages or wakes say another queue than their channel', count(*))
      FROM (SELECT m.channel_id, m.queue_id FROM fairq.message m
            UNION ALL
            SELECT w.channel_id, w.queue_id FROM fairq.channel_wake w) x
      JOIN fairq.channel c ON c.id = x.channel_id
     WHERE c.queue_id <> x.queue_id
    HAVING count(*) > 0
    UNION ALL
    SELECT NULL, format('%s messages belong to no channel', count(*))
      FROM fairq.message m
     WHERE NOT EXISTS (SELECT 1 FROM fairq.channel c WHERE c.id = m.channel_id)
    HAVING count(*) > 0
    UNION ALL
    SELECT NULL, format('%s channel_size_change rows belong to no channel', count(*))
      FROM fairq.channel_size_change x
     WHERE NOT EXISTS (SELECT 1 FROM fairq.channel c WHERE c.id = x.channel_id)
    HAVING count(*) > 0
$$;

COMMENT ON VIEW fairq.channels IS
    'Every channel with a policy, a pause or messages (idle channels kept for the collector are not shown), by queue, with its policy, weight and pause and its contents: size (all messages), ready (due), scheduled (future), in_flight, and next_dequeue_at (when it may next be served; NULL when nothing is pending or at max_concurrency).';
COMMENT ON VIEW fairq.queues IS
    'Every queue: its channels (as fairq.channels shows them), messages (size, ready, scheduled, in_flight), dead letters, and the end of its pause.';
COMMENT ON VIEW fairq.dead_letters IS
    'Messages that failed or ran out of attempts, by queue and channel, with the error and when they died.';
COMMENT ON FUNCTION fairq.history_prune(timestamptz) IS
    'Deletes message_history rows settled before p_before; returns how many.';
COMMENT ON FUNCTION fairq.check() IS
    'Operator''s invariant check: one row per inconsistency between counters, turns and messages; no rows means healthy.';
