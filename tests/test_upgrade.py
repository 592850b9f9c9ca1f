"""Upgrades: installing an old released version and running ALTER EXTENSION fairq
UPDATE yields exactly the catalog of a fresh install of the current version, for
every released version: every object's definition read from the catalog (CATALOG).
(`pg_dump --schema-only` leaves an extension's member objects out, so it would
compare two empty schemas; schema_dump serves tests/test_install.py, whose plain
installs it does show.)

Released versions are the ones listed in extension/SHA256SUMS (their scripts are
frozen; tests/test_sql_package.py checks the sums).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conftest import Server
from fairq.cluster import pg_bindir

ROOT = Path(__file__).resolve().parent.parent
EXTENSION = ROOT / "extension"


def current_version() -> str:
    control = (EXTENSION / "fairq.control").read_text()
    match = re.search(r"default_version\s*=\s*'([^']+)'", control)
    assert match
    return match.group(1)


def released_versions() -> list[str]:
    sums = EXTENSION / "SHA256SUMS"
    if not sums.exists():
        return []
    return [m.group(1) for m in re.finditer(r"fairq--(\d+\.\d+\.\d+)\.sql", sums.read_text())]


def upgrade_scripts() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for p in EXTENSION.glob("fairq--*--*.sql")
            if (m := re.fullmatch(r"fairq--(.+)--(.+)\.sql", p.name))]


def schema_dump(server: Server, dbname: str) -> str:
    out = subprocess.run(
        [str(pg_bindir() / "pg_dump"), "--schema-only", "--no-owner", "--schema", "fairq",
         "-d", server.dsn(dbname)],
        check=True, capture_output=True, text=True).stdout
    # Newer pg_dump prints a random \restrict token; nothing else may differ.
    return "\n".join(line for line in out.splitlines() if not line.startswith("\\restrict")
                     and not line.startswith("\\unrestrict"))


# What pg_dump leaves out of an extension's schema: its member objects (the dump of
# an extension-installed fairq is "CREATE SCHEMA fairq" and nothing else). Each row
# describes one thing of schema fairq as PostgreSQL defines it; two installs are the
# same when their rows are. (Column order counts: `SELECT *` and the row types that
# functions return follow it. An ACL is compared as the privileges it grants: a NULL
# one grants its kind's defaults, which for a function include PUBLIC's EXECUTE.)
CATALOG = """
    WITH s AS (SELECT oid FROM pg_namespace WHERE nspname = 'fairq'),
    member AS (SELECT classid, objid FROM pg_depend
                WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e')
    SELECT format('schema acl=%s member=%s', coalesce(n.nspacl, acldefault('n', n.nspowner)),
                  EXISTS (SELECT 1 FROM member m WHERE m.classid = 'pg_namespace'::regclass
                                                   AND m.objid = n.oid))
      FROM pg_namespace n WHERE n.oid = (SELECT oid FROM s)
    UNION ALL
    SELECT format('relation %s kind=%s persistence=%s options=%s acl=%s comment=%s member=%s',
                  c.oid::regclass, c.relkind, c.relpersistence, c.reloptions,
                  coalesce(c.relacl, acldefault(CASE c.relkind WHEN 'S' THEN 's' ELSE 'r' END::"char", c.relowner)),
                  obj_description(c.oid, 'pg_class'),
                  EXISTS (SELECT 1 FROM member m WHERE m.classid = 'pg_class'::regclass
                                                   AND m.objid = c.oid))
      FROM pg_class c WHERE c.relnamespace = (SELECT oid FROM s)
    UNION ALL
    SELECT format('column %s #%s %s %s not_null=%s default=%s identity=%s comment=%s',
                  c.oid::regclass,
                  row_number() OVER (PARTITION BY c.oid ORDER BY a.attnum), a.attname,
                  format_type(a.atttypid, a.atttypmod), a.attnotnull,
                  pg_get_expr(d.adbin, d.adrelid), a.attidentity, col_description(c.oid, a.attnum))
      FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid
      LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
     WHERE c.relnamespace = (SELECT oid FROM s) AND a.attnum > 0 AND NOT a.attisdropped
    UNION ALL
    SELECT format('index %s', pg_get_indexdef(i.indexrelid))
      FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
     WHERE c.relnamespace = (SELECT oid FROM s)
    UNION ALL
    SELECT format('constraint %s %s %s', c.conrelid::regclass, c.conname, pg_get_constraintdef(c.oid))
      FROM pg_constraint c WHERE c.connamespace = (SELECT oid FROM s)
    UNION ALL
    SELECT format('trigger %s', pg_get_triggerdef(t.oid))
      FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
     WHERE c.relnamespace = (SELECT oid FROM s) AND NOT t.tgisinternal
    UNION ALL
    SELECT format('view %s %s', c.oid::regclass, pg_get_viewdef(c.oid))
      FROM pg_class c WHERE c.relnamespace = (SELECT oid FROM s) AND c.relkind IN ('v', 'm')
    UNION ALL
    SELECT format('sequence %s %s start=%s increment=%s min=%s max=%s cycle=%s owned_by=%s',
                  q.seqrelid::regclass, format_type(q.seqtypid, NULL), q.seqstart, q.seqincrement,
                  q.seqmin, q.seqmax, q.seqcycle,
                  (SELECT format('%s.%s', d.refobjid::regclass, a.attname)
                     FROM pg_depend d JOIN pg_attribute a ON a.attrelid = d.refobjid
                                                          AND a.attnum = d.refobjsubid
                    WHERE d.classid = 'pg_class'::regclass AND d.objid = q.seqrelid
                      AND d.deptype = 'a'))
      FROM pg_sequence q JOIN pg_class c ON c.oid = q.seqrelid
     WHERE c.relnamespace = (SELECT oid FROM s)
    UNION ALL
    SELECT format('function %s acl=%s comment=%s member=%s %s', p.oid::regprocedure,
                  coalesce(p.proacl, acldefault('f', p.proowner)),
                  obj_description(p.oid, 'pg_proc'),
                  EXISTS (SELECT 1 FROM member m WHERE m.classid = 'pg_proc'::regclass
                                                   AND m.objid = p.oid),
                  pg_get_functiondef(p.oid))
      FROM pg_proc p WHERE p.pronamespace = (SELECT oid FROM s)
    UNION ALL
    SELECT format('type %s kind=%s labels=%s acl=%s comment=%s member=%s', t.oid::regtype,
                  t.typtype,
                  (SELECT array_agg(e.enumlabel ORDER BY e.enumsortorder)
                     FROM pg_enum e WHERE e.enumtypid = t.oid),
                  coalesce(t.typacl, acldefault('T', t.typowner)), obj_description(t.oid, 'pg_type'),
                  EXISTS (SELECT 1 FROM member m WHERE m.classid = 'pg_type'::regclass
                                                   AND m.objid = t.oid))
      FROM pg_type t
     WHERE t.typnamespace = (SELECT oid FROM s) AND t.typtype <> 'c'
       AND NOT EXISTS (SELECT 1 FROM pg_type e WHERE e.typarray = t.oid)
    UNION ALL
    SELECT format('extension %s config=%s conditions=%s', e.extversion,
                  (SELECT array_agg(c::regclass::text ORDER BY c::regclass::text)
                     FROM unnest(e.extconfig) AS c),
                  (SELECT array_agg(x ORDER BY x) FROM unnest(e.extcondition) AS x))
      FROM pg_extension e WHERE e.extname = 'fairq'
    ORDER BY 1
"""


def catalog(server: Server, dbname: str) -> list[str]:
    """Every object of schema fairq, described from the catalog (see CATALOG)."""
    with psycopg.connect(server.dsn(dbname)) as conn:
        return [str(row[0]) for row in conn.execute(CATALOG)]


def test_every_upgrade_script_starts_from_a_released_version() -> None:
    released = set(released_versions())
    for source, target in upgrade_scripts():
        assert source in released, f"fairq--{source}--{target}.sql upgrades an unreleased version"
    if not upgrade_scripts():
        # Nothing to upgrade from yet: then the current version is the only script.
        assert [p.name for p in EXTENSION.glob("fairq--*.sql")] == [f"fairq--{current_version()}.sql"]


@pytest.mark.parametrize("old", [v for v in released_versions() if v != current_version()])
def test_upgraded_install_equals_fresh_install(server: Server, old: str) -> None:
    fresh, upgraded = server.create_database(), server.create_database()
    try:
        with psycopg.connect(server.dsn(upgraded), autocommit=True) as conn:
            conn.execute("DROP EXTENSION fairq")
            conn.execute("DROP SCHEMA fairq")
            conn.execute(f"CREATE EXTENSION fairq VERSION '{old}'")
            conn.execute("SELECT fairq.channel_set('capped', 1)")
            for channel in ("held", "capped", "kept"):
                conn.execute("SELECT * FROM fairq.message_create(%s, 'across the upgrade')",
                             (channel,))
            held = conn.execute("SELECT id, num_attempts FROM fairq.message_dequeue(60000, 2)"
                                ).fetchall()
            conn.execute("ALTER EXTENSION fairq UPDATE")
            assert conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'fairq'"
                                ).fetchone() == (current_version(),)
            assert conn.execute("SELECT * FROM fairq.check()").fetchall() == []
            got = conn.execute("SELECT channel, content FROM fairq.message_dequeue(1000)").fetchall()
            assert got == [("kept", b"across the upgrade")]
            for message_id, attempts in held:  # messages handed out before the upgrade
                assert conn.execute("SELECT fairq.message_complete(%s, %s)",
                                    (message_id, attempts)).fetchone() == ("completed",)
            assert conn.execute("SELECT * FROM fairq.check()").fetchall() == []
        assert catalog(server, upgraded) == catalog(server, fresh)
    finally:
        server.drop_database(fresh)
        server.drop_database(upgraded)


def channel_set_signature(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SELECT p.oid::regprocedure::text FROM pg_proc p"
                       " WHERE p.oid = 'fairq.channel_set'::regproc").fetchone()
    assert row is not None
    return str(row[0])


# The last two releases: 0.7.0 changed signatures (named queues), later ones did not.
@pytest.mark.parametrize("previous", [v for v in released_versions() if v != current_version()][-2:])
def test_upgrade_keeps_every_grant_and_the_messages_in_flight(server: Server, previous: str) -> None:
    """Roles granted on a recent release can still call what they could after the
    upgrade, also the functions whose signature changed (they are created anew), and
    messages held in several channels across it complete."""
    name = server.create_database()
    roles = {kind: f"fairq_upgrade_{kind}_{name[-8:]}" for kind in ("producer", "worker",
                                                                  "observer", "operator")}
    try:
        with psycopg.connect(server.dsn(name), autocommit=True) as conn:
            conn.execute("DROP EXTENSION fairq")
            conn.execute("DROP SCHEMA fairq")
            conn.execute(f"CREATE EXTENSION fairq VERSION '{previous}'")
            for kind, role in roles.items():
                conn.execute(f'CREATE ROLE "{role}"')  # type: ignore[arg-type]
                if kind != "operator":
                    conn.execute(f"SELECT fairq.grant_{kind}(%s)", (role,))  # type: ignore[arg-type]
            conn.execute(f'GRANT USAGE ON SCHEMA fairq TO "{roles["operator"]}"')  # type: ignore[arg-type]
            conn.execute(f"GRANT EXECUTE ON FUNCTION {channel_set_signature(conn)}"  # type: ignore[arg-type]
                         f' TO "{roles["operator"]}" WITH GRANT OPTION')
            conn.execute("SET fairq.history = on")
            for channel in ("a", "b", "c"):
                conn.execute("SELECT * FROM fairq.message_create(%s, 'x')", (channel,))
            held = conn.execute("SELECT id, num_attempts FROM fairq.message_dequeue(60000, 3)"
                                ).fetchall()
            assert len(held) == 3
            # A wake in flight: an idle channel's message that no dequeue has seen yet.
            conn.execute("SELECT * FROM fairq.message_create('a', 'woken')")
            assert conn.execute("SELECT count(*) FROM fairq.channel_wake").fetchone() == (1,)
            conn.execute("ALTER EXTENSION fairq UPDATE")

            def can(role: str, sql: str, *args: object) -> bool:
                with conn.transaction(force_rollback=True):
                    conn.execute(f'SET LOCAL ROLE "{role}"')  # type: ignore[arg-type]
                    try:
                        with conn.transaction():
                            conn.execute(sql, args)  # type: ignore[arg-type]
                    except psycopg.errors.InsufficientPrivilege:
                        return False
                return True

            producer, worker, observer, operator = roles.values()
            assert can(producer, "SELECT * FROM fairq.message_create('d', 'y')")
            assert can(producer, "SELECT * FROM fairq.message_create_batch('{d}', '{y}')")
            assert not can(producer, "SELECT * FROM fairq.message_dequeue(1000)")
            assert can(worker, "SELECT * FROM fairq.message_dequeue(1000)")
            assert not can(worker, "SELECT * FROM fairq.message_create('d', 'y')")
            assert can(observer, "SELECT * FROM fairq.channels")
            assert can(observer, "SELECT * FROM fairq.dead_letters")
            assert can(observer, "SELECT * FROM fairq.message_history")
            assert can(observer, "SELECT * FROM fairq.queues")
            assert not can(observer, "SELECT * FROM fairq.message_dequeue(1000)")
            assert can(operator, "SELECT fairq.channel_set('a', 2)")
            assert not can(operator, "SELECT fairq.channel_pause('a')")  # new: the owner's
            grantable = conn.execute(
                "SELECT a.is_grantable FROM pg_proc p, aclexplode(p.proacl) a"
                " WHERE p.oid = 'fairq.channel_set'::regproc AND a.grantee = %s::regrole",
                (operator,)).fetchall()
            assert grantable == [(True,)]
            for message_id, attempts in held:
                assert conn.execute("SELECT fairq.message_complete(%s, %s)",
                                    (message_id, attempts)).fetchone() == ("completed",)
            assert conn.execute("SELECT channel, content FROM fairq.message_dequeue(60000, 10)"
                                ).fetchall() == [("a", b"woken")]
            assert conn.execute("SELECT queue, count(*) FROM fairq.message_history GROUP BY 1"
                                ).fetchall() == [("default", 3)]
            assert conn.execute("SELECT * FROM fairq.check()").fetchall() == []
    finally:
        server.drop_database(name)
        for role in roles.values():
            server.admin(f'DROP ROLE IF EXISTS "{role}"')
