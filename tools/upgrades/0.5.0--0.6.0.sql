-- Written by hand: what tools/upgrade_script.py cannot derive from the functions.
-- Idle channels are kept, then collected in bulk (see tables.sql): since when each
-- channel has had nothing pending, for channels that have nothing pending now.
ALTER TABLE fairq.channel ADD COLUMN idle_since timestamptz;
UPDATE fairq.channel SET idle_since = fairq.clock() WHERE due_at IS NULL;
CREATE INDEX channel_idle_ix ON fairq.channel (idle_since)
    WHERE idle_since IS NOT NULL AND NOT has_policy;
CREATE TABLE fairq.channel_collection (
    singleton    boolean     NOT NULL DEFAULT true PRIMARY KEY CHECK (singleton),
    collected_at timestamptz NOT NULL DEFAULT '-infinity'
);
INSERT INTO fairq.channel_collection DEFAULT VALUES;
REVOKE ALL ON fairq.channel_collection FROM PUBLIC;
COMMENT ON TABLE fairq.channel_collection IS
    'When idle channels (no policy, nothing in them) were last collected; dequeues collect them once a second.';
-- Every wake is queued now, and applied earliest turn first.
CREATE INDEX channel_wake_turn_ix ON fairq.channel_wake ((GREATEST(due_at, woken_at)), turn_seq);
COMMENT ON TABLE fairq.channel_wake IS
    'Wakes of idle channels that producers queued (producers never lock a channel row); the next dequeues apply them, oldest first.';
-- The view hides idle channels now (its new definition follows).
COMMENT ON VIEW fairq.channels IS
    'Every channel with a policy or messages (idle channels kept for the collector are not shown), with its policy and contents: size (all messages), ready (due), scheduled (future), in_flight, and next_dequeue_at (when its next turn comes; NULL when empty or at max_concurrency).';
-- Their results or arguments change.
DROP FUNCTION fairq.channels_wake(bigint[], timestamptz[], timestamptz);
DROP FUNCTION fairq.apply_wakes();
