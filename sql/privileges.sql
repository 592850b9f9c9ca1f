-- privileges.sql — who may call what.
--
-- Invariants:
--   * nothing in schema fairq is granted to PUBLIC;
--   * the public functions are SECURITY DEFINER with a pinned search_path, so
--     callers need EXECUTE on them and USAGE on the schema, never table privileges;
--   * a producer can create and cancel messages but neither dequeue nor read
--     contents; a worker can dequeue and settle; an observer can read the views and
--     the history, and run fairq.check(); an operator can set policies, pause and
--     resume queues and channels, retry, delete and purge dead letters and prune the
--     history, and nothing else (it reads what it acts on with an observer's grant).
--     The test clock stays with the owner;
--   * fairq.revoke_producer / revoke_worker / revoke_observer / revoke_operator take
--     back exactly what the matching grant gave (one list of objects for both), except
--     USAGE on the schema, which another grant of the role may need.

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA fairq FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA fairq FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA fairq FROM PUBLIC;
REVOKE ALL ON TYPE fairq.message_status FROM PUBLIC;
REVOKE ALL ON TYPE fairq.folded_turn FROM PUBLIC;
REVOKE ALL ON SCHEMA fairq FROM PUBLIC;

-- What each kind of caller is granted: one list for the grant and the revoke.
CREATE FUNCTION fairq.producer_functions() RETURNS text[]
LANGUAGE sql IMMUTABLE
AS $$
    SELECT ARRAY[
        'FUNCTION fairq.message_create(text, bytea, timestamptz, integer, text, text)',
        'FUNCTION fairq.message_create_batch(text[], bytea[], timestamptz[], integer[], text[], text)',
        'FUNCTION fairq.message_cancel(bigint)']
$$;

CREATE FUNCTION fairq.worker_functions() RETURNS text[]
LANGUAGE sql IMMUTABLE
AS $$
    SELECT ARRAY[
        'FUNCTION fairq.message_dequeue(bigint, integer, text)',
        'FUNCTION fairq.message_complete(bigint, bigint)',
        'FUNCTION fairq.message_complete_batch(bigint[], bigint[])',
        'FUNCTION fairq.message_defer(bigint, bigint, timestamptz, bytea)',
        'FUNCTION fairq.message_heartbeat(bigint, bigint, bigint)',
        'FUNCTION fairq.message_fail(bigint, bigint, text)',
        'FUNCTION fairq.doorbell_hold(text)',
        'FUNCTION fairq.doorbell_quiet(text)',
        'FUNCTION fairq.doorbell_release(text)']
$$;

CREATE FUNCTION fairq.observer_relations() RETURNS text[]
LANGUAGE sql IMMUTABLE
AS $$
    SELECT ARRAY['fairq.queues', 'fairq.channels', 'fairq.dead_letters', 'fairq.message_history']
$$;

CREATE FUNCTION fairq.observer_functions() RETURNS text[]
LANGUAGE sql IMMUTABLE
AS $$
    SELECT ARRAY['FUNCTION fairq.check()']
$$;

CREATE FUNCTION fairq.operator_functions() RETURNS text[]
LANGUAGE sql IMMUTABLE
AS $$
    SELECT ARRAY[
        'FUNCTION fairq.queue_pause(text, timestamptz)',
        'FUNCTION fairq.queue_resume(text)',
        'FUNCTION fairq.channel_set(text, integer, bigint, integer, integer, integer, text)',
        'FUNCTION fairq.channel_clear(text, text)',
        'FUNCTION fairq.channel_pause(text, timestamptz, text)',
        'FUNCTION fairq.channel_resume(text, text)',
        'FUNCTION fairq.dead_letter_retry(bigint)',
        'FUNCTION fairq.dead_letter_delete(bigint)',
        'FUNCTION fairq.dead_letter_purge(timestamptz, text)',
        'FUNCTION fairq.history_prune(timestamptz)']
$$;

-- The name of role p_role, which must exist (an OID cast to regrole is not checked:
-- a dropped role's, say).
CREATE FUNCTION fairq.existing_role(p_role regrole) RETURNS name
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_role name := (SELECT rolname FROM pg_roles WHERE oid = fairq.require(p_role, 'p_role'));
BEGIN
    IF v_role IS NULL THEN
        RAISE EXCEPTION 'p_role must be an existing role, got OID %', p_role::oid USING ERRCODE = '42704';
    END IF;
    RETURN v_role;
END
$$;

-- Grants p_privileges on each of p_objects to the role, and USAGE on the schema
-- (identifiers quoted by format's %I, object signatures are fixed strings of this
-- file).
CREATE FUNCTION fairq.grant_to(p_role regrole, p_privileges text, p_objects text[]) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_role name := fairq.existing_role(p_role);
    v_object text;
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA fairq TO %I', v_role);
    FOREACH v_object IN ARRAY p_objects LOOP
        EXECUTE format('GRANT %s ON %s TO %I', p_privileges, v_object, v_role);
    END LOOP;
END
$$;

-- Revokes what fairq.grant_to granted, but not USAGE on the schema: another kind of
-- caller's grant may need it, and alone it gives nothing (nothing in the schema is
-- granted to PUBLIC).
CREATE FUNCTION fairq.revoke_from(p_role regrole, p_privileges text, p_objects text[]) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_role name := fairq.existing_role(p_role);
    v_object text;
BEGIN
    FOREACH v_object IN ARRAY p_objects LOOP
        EXECUTE format('REVOKE %s ON %s FROM %I', p_privileges, v_object, v_role);
    END LOOP;
END
$$;

CREATE FUNCTION fairq.grant_producer(p_role regrole) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT fairq.grant_to(p_role, 'EXECUTE', fairq.producer_functions())
$$;

CREATE FUNCTION fairq.grant_worker(p_role regrole) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT fairq.grant_to(p_role, 'EXECUTE', fairq.worker_functions())
$$;

CREATE FUNCTION fairq.grant_observer(p_role regrole) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT fairq.grant_to(p_role, 'SELECT', fairq.observer_relations());
    SELECT fairq.grant_to(p_role, 'EXECUTE', fairq.observer_functions());
$$;

CREATE FUNCTION fairq.grant_operator(p_role regrole) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT fairq.grant_to(p_role, 'EXECUTE', fairq.operator_functions())
$$;

CREATE FUNCTION fairq.revoke_producer(p_role regrole) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT fairq.revoke_from(p_role, 'EXECUTE', fairq.producer_functions())
$$;

CREATE FUNCTION fairq.revoke_worker(p_role regrole) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT fairq.revoke_from(p_role, 'EXECUTE', fairq.worker_functions())
$$;

CREATE FUNCTION fairq.revoke_observer(p_role regrole) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT fairq.revoke_from(p_role, 'SELECT', fairq.observer_relations());
    SELECT fairq.revoke_from(p_role, 'EXECUTE', fairq.observer_functions());
$$;

CREATE FUNCTION fairq.revoke_operator(p_role regrole) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT fairq.revoke_from(p_role, 'EXECUTE', fairq.operator_functions())
$$;

-- The functions above were created after the blanket REVOKE.
REVOKE ALL ON FUNCTION fairq.producer_functions() FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.worker_functions() FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.observer_relations() FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.observer_functions() FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.operator_functions() FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.existing_role(regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.grant_to(regrole, text, text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.revoke_from(regrole, text, text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.grant_producer(regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.grant_worker(regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.grant_observer(regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.grant_operator(regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.revoke_producer(regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.revoke_worker(regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.revoke_observer(regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION fairq.revoke_operator(regrole) FROM PUBLIC;

COMMENT ON FUNCTION fairq.grant_producer(regrole) IS
    'Lets a role create (single and batch) and cancel messages; it cannot dequeue or read contents.';
COMMENT ON FUNCTION fairq.grant_worker(regrole) IS
    'Lets a role dequeue, complete (single and batch), defer, heartbeat and fail messages, and hold a queue''s doorbell while it sleeps.';
COMMENT ON FUNCTION fairq.grant_observer(regrole) IS
    'Lets a role read fairq.queues, fairq.channels, fairq.dead_letters and fairq.message_history, and run fairq.check().';
COMMENT ON FUNCTION fairq.grant_operator(regrole) IS
    'Lets a role set and clear channel policies, pause and resume queues and channels, retry, delete and purge dead letters, and prune the history (grant_observer lets it see what it acts on).';
COMMENT ON FUNCTION fairq.revoke_producer(regrole) IS
    'Takes back what fairq.grant_producer gave the role (USAGE on the schema stays: another grant may need it).';
COMMENT ON FUNCTION fairq.revoke_worker(regrole) IS
    'Takes back what fairq.grant_worker gave the role (USAGE on the schema stays: another grant may need it).';
COMMENT ON FUNCTION fairq.revoke_observer(regrole) IS
    'Takes back what fairq.grant_observer gave the role (USAGE on the schema stays: another grant may need it).';
COMMENT ON FUNCTION fairq.revoke_operator(regrole) IS
    'Takes back what fairq.grant_operator gave the role (USAGE on the schema stays: another grant may need it).';
