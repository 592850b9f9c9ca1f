"""SPEC §2, behaviour 9: privileges.

Nothing is granted to PUBLIC; the public functions run as their owner with a pinned
search_path; grant_producer / grant_worker / grant_observer grant exactly what each
kind of caller needs; only the extension's owner can move the test clock.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from sqlq import Conn, call, create, dequeue_one

INSUFFICIENT_PRIVILEGE = "42501"

# The functions of SPEC §2 that callers use (the grant_* functions are the owner's).
SPEC_FUNCTIONS = (
    "channel_set", "channel_clear", "message_create", "message_create_batch",
    "message_dequeue", "message_complete", "message_complete_batch", "message_defer",
    "message_heartbeat", "message_fail", "message_cancel", "dead_letter_retry",
    "history_prune",
)
GRANT_FUNCTIONS = ("grant_producer", "grant_worker", "grant_observer", "grant_operator",
                   "revoke_producer", "revoke_worker", "revoke_observer", "revoke_operator")

# A valid call of each function that a privileged caller can make in any database.
CALLS = {
    "channel_set": "SELECT fairq.channel_set('priv')",
    "channel_clear": "SELECT fairq.channel_clear('priv')",
    "message_create": "SELECT * FROM fairq.message_create('priv', 'x')",
    "message_create_batch": "SELECT * FROM fairq.message_create_batch('{priv}', '{x}')",
    "message_dequeue": "SELECT * FROM fairq.message_dequeue(1000)",
    "message_complete": "SELECT fairq.message_complete(-1, 1)",
    "message_complete_batch": "SELECT * FROM fairq.message_complete_batch('{-1}', '{1}')",
    "message_defer": "SELECT fairq.message_defer(-1, 1)",
    "message_heartbeat": "SELECT fairq.message_heartbeat(-1, 1, 1000)",
    "message_fail": "SELECT fairq.message_fail(-1, 1)",
    "message_cancel": "SELECT fairq.message_cancel(-1)",
    "doorbell_hold": "SELECT * FROM fairq.doorbell_hold()",
    "doorbell_quiet": "SELECT * FROM fairq.doorbell_quiet()",
    "doorbell_release": "SELECT fairq.doorbell_release()",
    "dead_letter_retry": "SELECT fairq.dead_letter_retry(-1)",
    "dead_letter_delete": "SELECT fairq.dead_letter_delete(-1)",
    "dead_letter_purge": "SELECT fairq.dead_letter_purge(now(), 'priv')",
    "queue_pause": "SELECT fairq.queue_pause('priv')",
    "queue_resume": "SELECT fairq.queue_resume('priv')",
    "channel_pause": "SELECT fairq.channel_pause('priv')",
    "channel_resume": "SELECT fairq.channel_resume('priv')",
    "history_prune": "SELECT fairq.history_prune(now())",
    "grant_producer": "SELECT fairq.grant_producer(current_user::text::regrole)",
    "grant_worker": "SELECT fairq.grant_worker(current_user::text::regrole)",
    "grant_observer": "SELECT fairq.grant_observer(current_user::text::regrole)",
    "revoke_producer": "SELECT fairq.revoke_producer(current_user::text::regrole)",
    "revoke_worker": "SELECT fairq.revoke_worker(current_user::text::regrole)",
    "revoke_observer": "SELECT fairq.revoke_observer(current_user::text::regrole)",
    "grant_operator": "SELECT fairq.grant_operator(current_user::text::regrole)",
    "revoke_operator": "SELECT fairq.revoke_operator(current_user::text::regrole)",
    "clock_travel": "SELECT fairq.clock_travel(0)",
    "check": "SELECT * FROM fairq.check()",
}
READS = {
    "fairq.channels": "SELECT * FROM fairq.channels",
    "fairq.dead_letters": "SELECT * FROM fairq.dead_letters",
    "fairq.message_history": "SELECT * FROM fairq.message_history",
    "fairq.message": "SELECT content FROM fairq.message",
    "fairq.dead_letter": "SELECT content FROM fairq.dead_letter",
    "fairq.channel": "SELECT * FROM fairq.channel",
    "fairq.clock_offset": "SELECT * FROM fairq.clock_offset",
}

PRODUCER_FUNCTIONS = {"message_create", "message_create_batch", "message_cancel"}
WORKER_FUNCTIONS = {"message_dequeue", "message_complete", "message_complete_batch",
                    "message_defer", "message_heartbeat", "message_fail",
                    "doorbell_hold", "doorbell_quiet", "doorbell_release"}
OBSERVER_READS = {"fairq.queues", "fairq.channels", "fairq.dead_letters", "fairq.message_history"}
OPERATOR_FUNCTIONS = {"queue_pause", "queue_resume", "channel_set", "channel_clear",
                      "channel_pause", "channel_resume", "dead_letter_retry",
                      "dead_letter_delete", "dead_letter_purge", "history_prune"}


# -- Roles ---------------------------------------------------------------------------------


@pytest.fixture
def make_role(server: Any, dsn: str) -> Iterator[Callable[[str], str]]:
    """Creates login roles with unique names (roles are cluster-wide); drops them after."""
    created: list[str] = []

    def make(kind: str) -> str:
        name = f"fairq_{kind}_{uuid.uuid4().hex[:12]}"
        server.admin(f'CREATE ROLE "{name}" LOGIN')
        created.append(name)
        return name

    yield make
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in created:
            conn.execute(f'DROP OWNED BY "{name}"')
    for name in created:
        server.admin(f'DROP ROLE "{name}"')


def grant(conn: Conn, kind: str, role: str) -> None:
    conn.execute(f"SELECT fairq.grant_{kind}(%s::regrole)", (role,))


def outcome(conn: Conn, sql: str) -> str:
    """'ok' or the SQLSTATE the statement raised."""
    try:
        conn.execute(sql).fetchall()
    except psycopg.Error as e:
        return str(e.sqlstate)
    return "ok"


def outcomes_as(dsn: str, role: str, statements: dict[str, str]) -> dict[str, str]:
    with psycopg.connect(dsn, user=role, autocommit=True) as conn:
        assert conn.execute("SELECT current_user").fetchone() == (role,)
        return {name: outcome(conn, sql) for name, sql in statements.items()}


def expected(statements: dict[str, str], allowed: set[str]) -> dict[str, str]:
    return {name: "ok" if name in allowed else INSUFFICIENT_PRIVILEGE for name in statements}


def executable_functions(conn: Conn, role: str) -> set[str]:
    """Every function of schema fairq the role may execute (directly or through PUBLIC)."""
    rows = conn.execute(
        "SELECT p.proname FROM pg_proc p WHERE p.pronamespace = 'fairq'::regnamespace"
        "   AND has_function_privilege(%s, p.oid, 'EXECUTE')", (role,)).fetchall()
    return {r[0] for r in rows}


def table_privileges(conn: Conn, role: str) -> set[tuple[str, str]]:
    """(relation, privilege) for every privilege the role holds on a fairq relation."""
    rows = conn.execute(
        "SELECT c.oid::regclass::text, p.privilege FROM pg_class c"
        " CROSS JOIN unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE',"
        "                         'REFERENCES', 'TRIGGER']) AS p(privilege)"
        " WHERE c.relnamespace = 'fairq'::regnamespace AND c.relkind IN ('r', 'v', 'm', 'p', 'f')"
        "   AND has_table_privilege(%s, c.oid, p.privilege)", (role,)).fetchall()
    return {(r[0], r[1]) for r in rows}


# -- Catalog facts -------------------------------------------------------------------------


def test_nothing_in_schema_fairq_is_granted_to_public(conn: Conn) -> None:
    # A NULL ACL means the default privileges, and a function's default grants EXECUTE
    # to PUBLIC: compare the effective ACL (acldefault), not just the stored one.
    public_grants = conn.execute("""
        SELECT 'schema', n.nspname, a.privilege_type
          FROM pg_namespace n, aclexplode(coalesce(n.nspacl, acldefault('n', n.nspowner))) a
         WHERE n.nspname = 'fairq' AND a.grantee = 0
        UNION ALL
        SELECT 'function', p.oid::regprocedure::text, a.privilege_type
          FROM pg_proc p, aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
         WHERE p.pronamespace = 'fairq'::regnamespace AND a.grantee = 0
        UNION ALL
        SELECT 'relation', c.oid::regclass::text, a.privilege_type
          FROM pg_class c,
               aclexplode(coalesce(c.relacl, acldefault(CASE c.relkind WHEN 'S' THEN 's'
                                                         ELSE 'r' END::"char", c.relowner))) a
         WHERE c.relnamespace = 'fairq'::regnamespace AND a.grantee = 0
        UNION ALL
        -- Types that carry their own privileges: not array types (they follow their
        -- element type) and not the row types of tables and views (PostgreSQL offers
        -- no way to revoke those; the relation's own privileges guard its data).
        SELECT 'type', t.oid::regtype::text, a.privilege_type
          FROM pg_type t
          LEFT JOIN pg_class c ON c.oid = t.typrelid,
               aclexplode(coalesce(t.typacl, acldefault('T', t.typowner))) a
         WHERE t.typnamespace = 'fairq'::regnamespace AND a.grantee = 0
           AND NOT (t.typcategory = 'A' AND t.typelem <> 0)
           AND (t.typrelid = 0 OR c.relkind = 'c')
        UNION ALL
        SELECT 'default acl', d.defaclobjtype::text, a.privilege_type
          FROM pg_default_acl d, aclexplode(d.defaclacl) a
         WHERE d.defaclnamespace = 'fairq'::regnamespace AND a.grantee = 0
    """).fetchall()
    assert public_grants == []


def test_spec_functions_run_as_owner_with_a_pinned_search_path(conn: Conn) -> None:
    rows = conn.execute(
        "SELECT p.proname, p.prosecdef, p.proconfig FROM pg_proc p"
        " WHERE p.pronamespace = 'fairq'::regnamespace AND p.proname = ANY (%s)",
        (list(SPEC_FUNCTIONS + GRANT_FUNCTIONS),)).fetchall()
    found = {name: (secdef, config or []) for name, secdef, config in rows}
    assert sorted(found) == sorted(SPEC_FUNCTIONS + GRANT_FUNCTIONS)
    for name in SPEC_FUNCTIONS:
        assert found[name][0], f"{name} is not SECURITY DEFINER"
    for name, (_, config) in found.items():
        assert search_path_is_pinned(config), f"{name}: {config}"


def test_every_security_definer_function_pins_its_search_path(conn: Conn) -> None:
    rows = conn.execute(
        "SELECT p.oid::regprocedure::text, p.proconfig FROM pg_proc p"
        " WHERE p.pronamespace = 'fairq'::regnamespace AND p.prosecdef").fetchall()
    unpinned = [name for name, config in rows if not search_path_is_pinned(config or [])]
    assert unpinned == []


def search_path_is_pinned(config: list[str]) -> bool:
    """SET search_path is in the function's config, and names pg_temp explicitly and last
    (an unnamed pg_temp is searched *first*, letting a caller's temporary tables shadow
    the real ones inside a SECURITY DEFINER function)."""
    paths = [c.split("=", 1)[1] for c in config if c.startswith("search_path=")]
    if len(paths) != 1:
        return False
    schemas = [s.strip().strip('"') for s in paths[0].split(",")]
    return schemas[-1] == "pg_temp" and "$user" not in schemas and "public" not in schemas


# -- Callers -------------------------------------------------------------------------------


def test_role_without_grants_can_call_and_read_nothing(
    dsn: str, conn: Conn, make_role: Callable[[str], str]
) -> None:
    role = make_role("nobody")
    assert executable_functions(conn, role) == set()
    assert table_privileges(conn, role) == set()
    statements = {**CALLS, **READS}
    assert outcomes_as(dsn, role, statements) == expected(statements, set())


def test_producer_can_create_and_cancel_only(
    dsn: str, conn: Conn, make_role: Callable[[str], str]
) -> None:
    role = make_role("producer")
    grant(conn, "producer", role)
    assert executable_functions(conn, role) == PRODUCER_FUNCTIONS
    assert table_privileges(conn, role) == set()
    assert outcomes_as(dsn, role, CALLS) == expected(CALLS, PRODUCER_FUNCTIONS)
    # In particular it cannot read message contents, neither queued nor dead.
    assert outcomes_as(dsn, role, READS) == expected(READS, set())

    with psycopg.connect(dsn, user=role, autocommit=True) as producer:
        id_, status = create(producer, "orders", b"secret")
        assert status == "created"
        rows = producer.execute(
            "SELECT status FROM fairq.message_create_batch('{orders,orders}', '{a,b}')").fetchall()
        assert rows == [("created",), ("created",)]
        assert call(producer, "message_cancel", id_) == "cancelled"
    assert conn.execute("SELECT size FROM fairq.channels WHERE channel = 'orders'"
                        ).fetchone() == (2,)


def test_worker_can_dequeue_and_settle_only(
    dsn: str, conn: Conn, make_role: Callable[[str], str]
) -> None:
    role = make_role("worker")
    grant(conn, "worker", role)
    assert executable_functions(conn, role) == WORKER_FUNCTIONS
    assert table_privileges(conn, role) == set()
    assert outcomes_as(dsn, role, CALLS) == expected(CALLS, WORKER_FUNCTIONS)
    assert outcomes_as(dsn, role, READS) == expected(READS, set())

    for content in (b"one", b"two", b"three"):
        create(conn, "jobs", content)
    with psycopg.connect(dsn, user=role, autocommit=True) as worker:
        first = dequeue_one(worker)
        assert first is not None and first.content == b"one"
        assert call(worker, "message_heartbeat", first.id, first.num_attempts, 60_000) == (
            "heartbeated")
        assert call(worker, "message_defer", first.id, first.num_attempts) == "deferred"
        got = worker.execute("SELECT id, num_attempts FROM fairq.message_dequeue(60000, 3)"
                             ).fetchall()
        assert len(got) == 3
        assert call(worker, "message_fail", *got[0]) == "dead"
        assert call(worker, "message_complete", *got[1]) == "completed"
        assert worker.execute("SELECT status FROM fairq.message_complete_batch(%s, %s)",
                              ([got[2][0]], [got[2][1]])).fetchall() == [("completed",)]
    assert conn.execute("SELECT count(*) FROM fairq.message").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM fairq.dead_letter").fetchone() == (1,)


def test_observer_can_read_the_views_and_history_only(
    dsn: str, conn: Conn, make_role: Callable[[str], str]
) -> None:
    role = make_role("observer")
    grant(conn, "observer", role)
    assert executable_functions(conn, role) == {"check"}  # the operator's invariant check
    assert table_privileges(conn, role) == {(r, "SELECT") for r in OBSERVER_READS}
    assert outcomes_as(dsn, role, CALLS) == expected(CALLS, {"check"})
    assert outcomes_as(dsn, role, READS) == expected(READS, OBSERVER_READS)

    conn.execute("SET fairq.history = on")
    create(conn, "seen")
    d = dequeue_one(conn)
    assert d is not None
    assert call(conn, "message_fail", d.id, d.num_attempts, "why") == "dead"
    create(conn, "seen")
    with psycopg.connect(dsn, user=role, autocommit=True) as observer:
        def read(sql: str) -> list[tuple[Any, ...]]:
            return observer.execute(sql).fetchall()

        assert read("SELECT channel, size FROM fairq.channels") == [("seen", 1)]
        assert read("SELECT error FROM fairq.dead_letters") == [("why",)]
        assert read("SELECT outcome FROM fairq.message_history") == [("dead",)]
        assert read("SELECT * FROM fairq.check()") == []


def test_operator_can_set_policies_pause_and_handle_dead_letters_only(
    dsn: str, conn: Conn, make_role: Callable[[str], str]
) -> None:
    """Every owner-only call an operator needs, in one grant (before 0.7.38 they were
    granted one signature at a time, with USAGE on the schema, which the README's
    example once forgot): no message call, no read, no test clock."""
    role = make_role("operator")
    grant(conn, "operator", role)
    assert executable_functions(conn, role) == OPERATOR_FUNCTIONS
    assert table_privileges(conn, role) == set()
    assert outcomes_as(dsn, role, CALLS) == expected(CALLS, OPERATOR_FUNCTIONS)
    assert outcomes_as(dsn, role, READS) == expected(READS, set())

    create(conn, "held", b"x")
    d = dequeue_one(conn)
    assert d is not None
    assert call(conn, "message_fail", d.id, d.num_attempts, "why") == "dead"
    with psycopg.connect(dsn, user=role, autocommit=True) as operator:
        operator.execute("SELECT fairq.channel_set('held', p_max_concurrency => 2)")
        operator.execute("SELECT fairq.channel_pause('held')")
        assert call(operator, "dead_letter_retry", d.id) == "requeued"
    assert conn.execute("SELECT max_concurrency, paused_until = 'infinity' FROM fairq.channels"
                        " WHERE channel = 'held'").fetchone() == (2, True)


@pytest.mark.parametrize("kinds", [("producer",), ("worker",), ("observer",),
                                   ("producer", "worker", "observer")],
                         ids=["producer", "worker", "observer", "all three"])
def test_only_the_owner_can_move_the_clock(
    dsn: str, conn: Conn, make_role: Callable[[str], str], kinds: tuple[str, ...]
) -> None:
    role = make_role("_".join(k[0] for k in kinds))
    for kind in kinds:
        grant(conn, kind, role)
    before = conn.execute("SELECT shift FROM fairq.clock_offset").fetchall()
    assert outcomes_as(dsn, role, {
        "travel": "SELECT fairq.clock_travel(86400000)",
        "update": "UPDATE fairq.clock_offset SET shift = interval '1 day'",
        "insert": "INSERT INTO fairq.clock_offset VALUES (true, interval '1 day')",
        "delete": "DELETE FROM fairq.clock_offset",
    }) == dict.fromkeys(("travel", "update", "insert", "delete"), INSUFFICIENT_PRIVILEGE)
    assert conn.execute("SELECT shift FROM fairq.clock_offset").fetchall() == before
    # The owner (here the superuser that created the extension) can.
    assert conn.execute("SELECT extowner::regrole::text FROM pg_extension"
                        " WHERE extname = 'fairq'").fetchone() == ("postgres",)
    call(conn, "clock_travel", 0)


def test_unknown_or_public_role_cannot_be_granted_anything(conn: Conn) -> None:
    for kind in ("producer", "worker", "observer", "operator"):
        with pytest.raises(psycopg.errors.UndefinedObject):
            grant(conn, kind, "public")
    test_nothing_in_schema_fairq_is_granted_to_public(conn)


@pytest.mark.parametrize("kind", ["producer", "worker", "observer", "operator"])
def test_a_revoke_takes_back_exactly_what_its_grant_gave(
    dsn: str, conn: Conn, make_role: Callable[[str], str], kind: str
) -> None:
    """A role that was a producer, a worker, an observer and an operator, and stops
    being one kind of them: it keeps the other kinds' rights, and loses every right of the kind
    revoked (tried as the role). Revoking again, or from a role never granted, is a
    no-op; the schema's USAGE stays for the other grants."""
    kinds = {"producer": PRODUCER_FUNCTIONS, "worker": WORKER_FUNCTIONS, "observer": {"check"},
             "operator": OPERATOR_FUNCTIONS}
    role = make_role(f"was_{kind}")
    for each in kinds:
        grant(conn, each, role)
    for _ in range(2):
        conn.execute(f"SELECT fairq.revoke_{kind}(%s::regrole)", (role,))
    kept = set().union(*(functions for each, functions in kinds.items() if each != kind))
    assert executable_functions(conn, role) == kept
    reads = set() if kind == "observer" else OBSERVER_READS
    assert table_privileges(conn, role) == {(r, "SELECT") for r in reads}
    assert outcomes_as(dsn, role, CALLS) == expected(CALLS, kept)
    assert outcomes_as(dsn, role, READS) == expected(READS, reads)
    never = make_role("never")
    conn.execute(f"SELECT fairq.revoke_{kind}(%s::regrole)", (never,))
    assert executable_functions(conn, never) == set()
    test_nothing_in_schema_fairq_is_granted_to_public(conn)
