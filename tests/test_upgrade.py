"""Upgrades: installing an old released version and running ALTER EXTENSION fairq
UPDATE yields exactly the catalog of a fresh install of the current version
(compared as `pg_dump --schema-only`), for every released version.

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
        assert schema_dump(server, upgraded) == schema_dump(server, fresh)
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
