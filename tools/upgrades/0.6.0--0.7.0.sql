-- Written by hand: what tools/upgrade_script.py cannot derive from the functions.
-- Functions whose signature changes are dropped and created anew, and two views
-- change their columns: every grant made on them is kept here and given again on
-- the new objects at the end (-- @after).
CREATE TABLE fairq.upgrade_grant AS
SELECT p.proname::text AS object, 'FUNCTION' AS kind, a.grantee, a.privilege_type, a.is_grantable
  FROM pg_catalog.pg_proc p CROSS JOIN LATERAL pg_catalog.aclexplode(p.proacl) a
 WHERE p.oid IN ('fairq.message_create(text, bytea, timestamptz, integer, text)'::regprocedure,
                 'fairq.message_create_batch(text[], bytea[], timestamptz[], integer[], text[])'::regprocedure,
                 'fairq.message_dequeue(bigint, integer)'::regprocedure,
                 'fairq.channel_set(text, integer, bigint, integer, integer)'::regprocedure,
                 'fairq.channel_clear(text)'::regprocedure)
   AND a.grantee <> p.proowner AND a.grantee <> 0
UNION ALL
SELECT c.relname::text, 'RELATION', a.grantee, a.privilege_type, a.is_grantable
  FROM pg_catalog.pg_class c CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) a
 WHERE c.oid IN ('fairq.channels'::regclass, 'fairq.dead_letters'::regclass,
                 'fairq.message_history'::regclass)
   AND a.grantee <> c.relowner AND a.grantee <> 0;

-- Named queues. Everything that exists belongs to the queue 'default' (id 1).
CREATE SEQUENCE fairq.queue_id_seq AS integer;
CREATE TABLE fairq.queue (
    id           integer     NOT NULL DEFAULT nextval('fairq.queue_id_seq') PRIMARY KEY,
    name         text        NOT NULL UNIQUE,
    paused_until timestamptz
);
ALTER SEQUENCE fairq.queue_id_seq OWNED BY fairq.queue.id;
REVOKE ALL ON fairq.queue FROM PUBLIC;
REVOKE ALL ON SEQUENCE fairq.queue_id_seq FROM PUBLIC;
INSERT INTO fairq.queue (name) VALUES ('default');
COMMENT ON TABLE fairq.queue IS
    'One row per named queue (created on first use): its id and, while it is paused, until when.';

-- Channels: queue, weight, pause, and the pass that orders the rotation. Every
-- channel that had a turn now waits to join the rotation at that time.
ALTER TABLE fairq.channel ADD COLUMN queue_id integer NOT NULL DEFAULT 1,
                          ADD COLUMN weight integer NOT NULL DEFAULT 1,
                          ADD COLUMN paused_until timestamptz,
                          ADD COLUMN turn_pass bigint,
                          ADD COLUMN turn_given_at timestamptz;
ALTER TABLE fairq.channel ALTER COLUMN queue_id DROP DEFAULT;
ALTER TABLE fairq.channel DROP CONSTRAINT channel_name_key,
                          ADD CONSTRAINT channel_queue_id_name_key UNIQUE (queue_id, name);
DROP INDEX fairq.channel_turn_ix;
CREATE INDEX channel_turn_ix ON fairq.channel (queue_id, turn_at, turn_pass, turn_seq)
    WHERE turn_at IS NOT NULL;
CREATE INDEX channel_turn_given_ix ON fairq.channel (queue_id, turn_given_at, turn_pass)
    WHERE turn_at = '-infinity';
DROP INDEX fairq.channel_idle_ix;
CREATE INDEX channel_idle_ix ON fairq.channel ((GREATEST(idle_since, paused_until)))
    WHERE idle_since IS NOT NULL AND NOT has_policy;

ALTER TABLE fairq.channel_wake ADD COLUMN queue_id integer NOT NULL DEFAULT 1;
ALTER TABLE fairq.channel_wake ALTER COLUMN queue_id DROP DEFAULT;
DROP INDEX fairq.channel_wake_turn_ix;
CREATE INDEX channel_wake_turn_ix ON fairq.channel_wake (queue_id, (GREATEST(due_at, woken_at)), turn_seq);

ALTER TABLE fairq.message ADD COLUMN queue_id integer NOT NULL DEFAULT 1;
ALTER TABLE fairq.message ALTER COLUMN queue_id DROP DEFAULT;
DROP INDEX fairq.message_locked_ix;
CREATE INDEX message_locked_ix ON fairq.message (queue_id, locked_until)
    WHERE status = 'locked';

ALTER TABLE fairq.dead_letter ADD COLUMN queue text NOT NULL DEFAULT 'default';
ALTER TABLE fairq.dead_letter ALTER COLUMN queue DROP DEFAULT;
CREATE INDEX dead_letter_queue_died_at_ix ON fairq.dead_letter (queue, died_at);

-- The history's queue comes second (SPEC), so the table is built anew.
CREATE TABLE fairq.message_history_0_7 (
    id                bigint      NOT NULL,
    queue             text        NOT NULL,
    channel           text        NOT NULL,
    priority          integer     NOT NULL,
    created_at        timestamptz NOT NULL,
    first_dequeued_at timestamptz,
    settled_at        timestamptz NOT NULL,
    num_attempts      bigint      NOT NULL,
    outcome           text        NOT NULL CHECK (outcome IN ('completed', 'dead', 'cancelled'))
);
INSERT INTO fairq.message_history_0_7
SELECT id, 'default', channel, priority, created_at, first_dequeued_at, settled_at, num_attempts, outcome
  FROM fairq.message_history;
-- (Leaving the extension first also takes it off the tables pg_dump backs up. A
-- plain install, `fairq upgrade`, has no extension.)
DO $leave$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'fairq') THEN
        ALTER EXTENSION fairq DROP TABLE fairq.message_history;
    END IF;
END
$leave$;
DROP TABLE fairq.message_history;
ALTER TABLE fairq.message_history_0_7 RENAME TO message_history;
ALTER TABLE fairq.message_history RENAME CONSTRAINT message_history_0_7_outcome_check
                                               TO message_history_outcome_check;
CREATE INDEX message_history_settled_at_ix ON fairq.message_history (settled_at);
CREATE INDEX message_history_id_ix ON fairq.message_history (id);
REVOKE ALL ON fairq.message_history FROM PUBLIC;
-- Queue data is user data (see tables.sql).
DO $config_dump$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'fairq') THEN
        PERFORM pg_catalog.pg_extension_config_dump('fairq.queue', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.queue_id_seq', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.message_history', '');
    END IF;
END
$config_dump$;
COMMENT ON TABLE fairq.message_history IS
    'One row per settled message (completed, dead, cancelled) while the setting fairq.history is on; read by the Spark report, trimmed by fairq.history_prune.';

-- Views whose columns change (their new definitions follow).
DROP VIEW fairq.channels;
DROP VIEW fairq.dead_letters;

-- Their arguments change.
DROP FUNCTION fairq.message_create(text, bytea, timestamptz, integer, text);
DROP FUNCTION fairq.message_create_batch(text[], bytea[], timestamptz[], integer[], text[]);
DROP FUNCTION fairq.message_dequeue(bigint, integer);
DROP FUNCTION fairq.channel_set(text, integer, bigint, integer, integer);
DROP FUNCTION fairq.channel_clear(text);
DROP FUNCTION fairq.notify_event(text, text, bigint, timestamptz);
DROP FUNCTION fairq.channels_for_producer(text[]);
DROP FUNCTION fairq.settled_due_at(bigint, text, timestamptz);
DROP FUNCTION fairq.apply_wakes(timestamptz, integer);
DROP FUNCTION fairq.recover_expired(timestamptz, integer);
DROP FUNCTION fairq.wait_for_release(timestamptz);
DROP FUNCTION fairq.next_turn(timestamptz, timestamptz, timestamptz, bigint, integer, integer, timestamptz);
DROP FUNCTION fairq.producer_lock_key(text);
DROP FUNCTION fairq.channel_quiet(text);

-- A database with nothing in it has no queue yet, as a fresh install.
DELETE FROM fairq.queue q
 WHERE NOT EXISTS (SELECT 1 FROM fairq.channel c WHERE c.queue_id = q.id)
   AND NOT EXISTS (SELECT 1 FROM fairq.dead_letter d WHERE d.queue = q.name)
   AND NOT EXISTS (SELECT 1 FROM fairq.message_history h WHERE h.queue = q.name);

-- @after
-- The views created anew, described again.
COMMENT ON VIEW fairq.channels IS
    'Every channel with a policy, a pause or messages (idle channels kept for the collector are not shown), by queue, with its policy, weight and pause and its contents: size (all messages), ready (due), scheduled (future), in_flight, and next_dequeue_at (when it may next be served; NULL when empty or at max_concurrency).';
COMMENT ON VIEW fairq.queues IS
    'Every queue: its channels (as fairq.channels shows them), messages (size, ready, scheduled, in_flight), dead letters, and the end of its pause.';
COMMENT ON VIEW fairq.dead_letters IS
    'Messages that failed or ran out of attempts, by queue and channel, with the error and when they died.';
-- The grants kept at the start, given again on the objects created anew; who could
-- read fairq.channels may read the new fairq.queues, its summary.
INSERT INTO fairq.upgrade_grant
SELECT 'queues', g.kind, g.grantee, g.privilege_type, g.is_grantable
  FROM fairq.upgrade_grant g WHERE g.object = 'channels';
DO $regrant$
DECLARE
    v_grant record;
BEGIN
    FOR v_grant IN
        SELECT g.*, r.rolname,
               (SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p
                 WHERE p.pronamespace = 'fairq'::regnamespace AND p.proname = g.object) AS function
          FROM fairq.upgrade_grant g JOIN pg_catalog.pg_roles r ON r.oid = g.grantee
    LOOP
        EXECUTE format('GRANT %s ON %s TO %I%s', v_grant.privilege_type,
                       CASE v_grant.kind WHEN 'FUNCTION' THEN 'FUNCTION ' || v_grant.function
                                         ELSE format('TABLE %I.%I', 'fairq', v_grant.object) END,
                       v_grant.rolname,
                       CASE WHEN v_grant.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END
$regrant$;
DROP TABLE fairq.upgrade_grant;
