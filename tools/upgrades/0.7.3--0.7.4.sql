-- 0.7.3 -> 0.7.4: the doorbell (fairq.events = doorbell). Functions only; the hand-
-- written part gives the new worker functions to every role that may dequeue, as
-- fairq.grant_worker now does.
-- @after
DO $grant$
DECLARE
    v_role name;
    v_function text;
BEGIN
    FOR v_role IN
        SELECT r.rolname
          FROM pg_catalog.pg_proc p CROSS JOIN LATERAL pg_catalog.aclexplode(p.proacl) a
          JOIN pg_catalog.pg_roles r ON r.oid = a.grantee
         WHERE p.oid = 'fairq.message_dequeue(bigint, integer, text)'::regprocedure
           AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner
    LOOP
        FOREACH v_function IN ARRAY ARRAY['fairq.doorbell_hold(text)', 'fairq.doorbell_quiet(text)',
                                          'fairq.doorbell_release(text)'] LOOP
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', v_function, v_role);
        END LOOP;
    END LOOP;
END
$grant$;
