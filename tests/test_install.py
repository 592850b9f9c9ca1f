"""`fairq install` / `fairq upgrade`: the extension's SQL as a plain schema.

After installing into a database without the extension, a representative run of
the SPEC §2 contract shows that the plain schema behaves like the extension.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conftest import Server
from fairq import CreateStatus, NewMessage, Queue, RetryStatus, SettleStatus
from fairq.install import InstallError, Scripts, install, installed_version, upgrade
from test_upgrade import released_versions, schema_dump

LOCK = timedelta(seconds=30)
CURRENT = Scripts.bundled().default_version


def later(count: int) -> list[str]:
    """The next ``count`` patch versions after the current one (fake future releases)."""
    major, minor, patch = (int(part) for part in CURRENT.split("."))
    return [f"{major}.{minor}.{patch + i}" for i in range(1, count + 1)]


_names = itertools.count()


@pytest.fixture
def plain_dsn(server: Server) -> Iterator[str]:
    """A fresh database WITHOUT the fairq extension."""
    name = f"fairq_plain_{os.getpid()}_{next(_names)}"
    server.admin(f'CREATE DATABASE "{name}"')
    try:
        yield server.dsn(name)
    finally:
        server.drop_database(name)


def _installed(dsn: str, scripts: Scripts | None = None) -> str:
    with psycopg.connect(dsn) as conn:
        return install(conn, scripts)


def upgrade_dir(tmp_path: Path, chain: list[str]) -> Scripts:
    """The current scripts plus fake upgrades along ``chain`` (each adds a function)."""
    directory = tmp_path / "extension"
    shutil.copytree(Scripts.bundled().directory, directory)
    control = directory / "fairq.control"
    control.write_text(control.read_text().replace(f"'{CURRENT}'", f"'{chain[-1]}'"))
    for source, target in zip([CURRENT, *chain], chain, strict=False):
        suffix = target.replace(".", "_")
        (directory / f"fairq--{source}--{target}.sql").write_text(
            '\\echo Use "ALTER EXTENSION fairq UPDATE" to load this file. \\quit\n'
            f"CREATE FUNCTION fairq.v{suffix}() RETURNS text LANGUAGE sql"
            f" AS $$ SELECT '{target}' $$;\n")
    return Scripts(directory)


def test_install_creates_the_schema_and_records_the_version(plain_dsn: str) -> None:
    assert _installed(plain_dsn) == CURRENT
    with psycopg.connect(plain_dsn) as conn:
        assert installed_version(conn) == CURRENT
        assert conn.execute("SELECT count(*) FROM pg_extension WHERE extname = 'fairq'"
                            ).fetchone() == (0,)
        # The same objects as the extension: every SPEC function is there.
        functions = {r[0] for r in conn.execute(
            "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = 'fairq'")}
    assert {"channel_set", "channel_clear", "message_create", "message_create_batch",
            "message_dequeue", "message_complete", "message_complete_batch", "message_defer",
            "message_heartbeat", "message_fail", "message_cancel", "dead_letter_retry",
            "history_prune", "grant_producer", "grant_worker", "grant_observer"} <= functions


def test_installed_schema_keeps_the_queue_contract(plain_dsn: str) -> None:
    _installed(plain_dsn)
    with Queue(plain_dsn) as queue:
        queue.channel_set("limited", max_attempts=1)
        queue.send_many([NewMessage(ch, f"{ch}{i}".encode())
                         for ch in ("a", "b", "c") for i in range(3)])
        # Fairness: any three consecutive deliveries come from three channels.
        batch = queue.dequeue(LOCK, 9)
        assert [m.channel for m in batch] == [batch[0].channel, batch[1].channel,
                                             batch[2].channel] * 3
        assert len({m.channel for m in batch[:3]}) == 3
        assert all(r.status is SettleStatus.COMPLETED for r in queue.complete_batch(batch[1:]))

        assert batch[0].defer(delay=timedelta(hours=1)) is SettleStatus.DEFERRED
        assert queue.dequeue(LOCK) == []  # a future message waits
        assert queue.channels(batch[0].channel)[0].scheduled == 1

        queue.send("limited", b"poison")
        [poison] = queue.dequeue(LOCK)
        assert poison.fail("bad") is SettleStatus.DEAD
        [dead] = queue.dead_letters()
        assert (dead.id, dead.error) == (poison.id, "bad")
        assert queue.dead_letter_retry(dead.id) is RetryStatus.REQUEUED
        [again] = queue.dequeue(LOCK)
        assert (again.id, again.num_attempts) == (poison.id, 2)  # the token goes on counting
        assert again.complete() is SettleStatus.COMPLETED
    with psycopg.connect(plain_dsn) as conn:
        assert conn.execute("SELECT * FROM fairq.check()").fetchall() == []


def test_installed_grants_give_each_role_what_it_needs(plain_dsn: str, server: Server) -> None:
    _installed(plain_dsn)
    roles = {kind: f"fairq_{kind}_{next(_names)}" for kind in ("producer", "worker", "observer")}
    for role in roles.values():
        server.admin(f'CREATE ROLE "{role}"')
    try:
        with psycopg.connect(plain_dsn, autocommit=True) as conn:
            for kind, role in roles.items():
                conn.execute(f"SELECT fairq.grant_{kind}(%s)", (role,))  # type: ignore[arg-type]
            _act_as(conn, roles["producer"])
            assert Queue(conn).send("p", b"secret").status is CreateStatus.CREATED
            for forbidden in ("SELECT * FROM fairq.message_dequeue(1000)",
                              "SELECT content FROM fairq.message",
                              "SELECT * FROM fairq.channels"):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(forbidden)  # type: ignore[arg-type]
            _act_as(conn, roles["observer"])
            assert [s.size for s in Queue(conn).channels()] == [1]
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT * FROM fairq.message_dequeue(1000)")
            _act_as(conn, roles["worker"])
            [msg] = Queue(conn).dequeue(LOCK)
            assert (msg.raw, msg.complete()) == (b"secret", SettleStatus.COMPLETED)
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT fairq.message_create('p', 'x')")
            conn.execute("RESET ROLE")
            conn.execute("DROP OWNED BY " + ", ".join(f'"{r}"' for r in roles.values()))  # type: ignore[arg-type]
    finally:
        for role in roles.values():
            server.admin(f'DROP ROLE IF EXISTS "{role}"')


def _act_as(conn: psycopg.Connection[Any], role: str) -> None:
    conn.execute("RESET ROLE")
    conn.execute(f'SET ROLE "{role}"')  # type: ignore[arg-type]


def test_install_refuses_a_database_with_the_extension(dsn: str) -> None:
    with pytest.raises(InstallError, match="extension"):
        _installed(dsn)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT to_regclass('fairq.installed_version')").fetchone() == (None,)


def test_install_refuses_to_run_twice(plain_dsn: str) -> None:
    _installed(plain_dsn)
    with pytest.raises(InstallError, match="already installed"):
        _installed(plain_dsn)


def test_upgrade_applies_scripts_in_order(plain_dsn: str, tmp_path: Path) -> None:
    _installed(plain_dsn)
    first, second = later(2)
    scripts = upgrade_dir(tmp_path, [first, second])
    with psycopg.connect(plain_dsn) as conn:
        applied = upgrade(conn, scripts)
        assert [p.name for p in applied] == [f"fairq--{CURRENT}--{first}.sql",
                                             f"fairq--{first}--{second}.sql"]
        assert installed_version(conn) == second
        functions = [f"fairq.v{v.replace('.', '_')}()" for v in (first, second)]
        assert conn.execute(f"SELECT {', '.join(functions)}").fetchone() == (first, second)
        assert upgrade(conn, scripts) == []  # already there


def test_an_operator_planted_on_the_search_path_is_not_bound_into_fairq(plain_dsn: str) -> None:
    """The install ran with the installer's search_path: an `=` on (anyenum, text) in
    public won overload resolution in the index predicates and views, and ran as the
    owner at every message written (whoever could create in public became superuser)."""
    with psycopg.connect(plain_dsn, autocommit=True) as conn:
        conn.execute("CREATE FUNCTION public.planted_eq(anyenum, text) RETURNS boolean"
                     " LANGUAGE sql IMMUTABLE AS $$ SELECT $1::text = $2 $$")
        conn.execute("CREATE OPERATOR public.= (LEFTARG = anyenum, RIGHTARG = text,"
                     " FUNCTION = public.planted_eq)")
    _installed(plain_dsn)
    with psycopg.connect(plain_dsn, autocommit=True) as conn:
        bound = conn.execute(
            "SELECT count(*) FROM pg_depend WHERE refobjid = 'public.planted_eq(anyenum, text)'"
            "::regprocedure OR refobjid = (SELECT oid FROM pg_operator WHERE oprname = '='"
            " AND oprnamespace = 'public'::regnamespace)").fetchone()
        assert bound == (1,)  # the operator's own dependency on its function, nothing else


def test_a_script_runs_as_create_extension_runs_it(plain_dsn: str, tmp_path: Path) -> None:
    """Function bodies are not checked as they are created (CREATE EXTENSION turns
    check_function_bodies off): an SQL function may call one created after it."""
    _installed(plain_dsn)
    [following] = later(1)
    scripts = upgrade_dir(tmp_path, [following])
    (scripts.directory / f"fairq--{CURRENT}--{following}.sql").write_text(
        '\\echo Use "ALTER EXTENSION fairq UPDATE" to load this file. \\quit\n'
        "CREATE FUNCTION fairq.asks() RETURNS text LANGUAGE sql AS $$ SELECT fairq.answers() $$;\n"
        "CREATE FUNCTION fairq.answers() RETURNS text LANGUAGE sql AS $$ SELECT 'yes' $$;\n")
    with psycopg.connect(plain_dsn) as conn:
        upgrade(conn, scripts)
        assert conn.execute("SELECT fairq.asks(), current_setting('check_function_bodies')"
                            ).fetchone() == ("yes", "on")


def test_upgrade_without_a_path_or_an_install_changes_nothing(plain_dsn: str,
                                                            tmp_path: Path) -> None:
    with psycopg.connect(plain_dsn) as conn, pytest.raises(InstallError, match="not installed"):
        upgrade(conn)
    _installed(plain_dsn)
    with psycopg.connect(plain_dsn) as conn:
        with pytest.raises(InstallError, match="no upgrade path"):
            upgrade(conn, Scripts.bundled(), target="9.9.9")
        assert installed_version(conn) == CURRENT


def test_upgrade_refuses_a_downgrade_and_says_which_package_to_install(
        plain_dsn: str, tmp_path: Path) -> None:
    """A database upgraded by a newer package, then reached by an older one (a rollback
    of the application, say): "no upgrade path from X to Y" read like a missing script."""
    _installed(plain_dsn)
    [newer] = later(1)
    with psycopg.connect(plain_dsn) as conn:
        upgrade(conn, upgrade_dir(tmp_path, [newer]))
        with pytest.raises(InstallError) as refused:
            upgrade(conn)
        assert str(refused.value) == (
            f"this database has fairq {newer}, newer than this package's {CURRENT}:"
            f" downgrades are not supported; install the fairq package {newer} or later")
        with pytest.raises(InstallError, match=f"newer than {CURRENT}, the version asked for"):
            upgrade(conn, target=CURRENT)
        assert installed_version(conn) == newer


def test_an_upgrade_runs_as_the_owner_of_fairq_and_keeps_its_version_private(
        server: Server, tmp_path: Path) -> None:
    """A plain install made by a role that is not a superuser (a managed database's
    admin), upgraded by a superuser. Until 0.7.36 the objects the upgrade created were
    the superuser's, and the owner's functions could not use them (every call failed);
    an operator that the owner had put in schema fairq ran as the superuser (fairq came
    before pg_catalog on the upgrade's search_path); and fairq.installed_version took
    the owner's default privileges, here ALL to PUBLIC."""
    old = "0.7.23"  # its upgrade to 0.7.24 compares intervals with `<>`
    released = tmp_path / "extension"
    shutil.copytree(Scripts.bundled().directory, released)
    control = released / "fairq.control"
    control.write_text(control.read_text().replace(f"'{CURRENT}'", f"'{old}'"))
    owner = f"fairq_owner_{next(_names)}"
    server.admin(f'CREATE ROLE "{owner}"')
    database = server.create_database("template0")
    try:
        server.admin(f'GRANT CREATE ON DATABASE "{database}" TO "{owner}"')
        with psycopg.connect(server.dsn(database), autocommit=True) as conn:
            _act_as(conn, owner)
            conn.execute("ALTER DEFAULT PRIVILEGES GRANT ALL ON TABLES TO PUBLIC")
            assert install(conn, Scripts(released)) == old
            conn.execute("CREATE TABLE fairq.ran_as (role text)")
            conn.execute("CREATE FUNCTION fairq.planted_ne(interval, interval) RETURNS boolean"
                         " LANGUAGE plpgsql AS $$ BEGIN INSERT INTO fairq.ran_as"
                         " VALUES (current_user); RETURN $1 OPERATOR(pg_catalog.<>) $2; END $$")
            conn.execute("CREATE OPERATOR fairq.<> (LEFTARG = interval, RIGHTARG = interval,"
                         " FUNCTION = fairq.planted_ne)")
            conn.execute("RESET ROLE")  # the superuser upgrades
            assert upgrade(conn)
            assert conn.execute("SELECT count(*) FROM fairq.ran_as").fetchone() == (0,)
            others = conn.execute("""
                SELECT count(*) FROM (
                    SELECT proowner AS owner FROM pg_proc WHERE pronamespace = 'fairq'::regnamespace
                    UNION ALL SELECT relowner FROM pg_class WHERE relnamespace = 'fairq'::regnamespace
                    UNION ALL SELECT typowner FROM pg_type WHERE typnamespace = 'fairq'::regnamespace
                ) o WHERE owner <> %s::regrole""", (owner,)).fetchone()
            assert others == (0,)
            assert conn.execute("SELECT has_table_privilege('public', 'fairq.installed_version',"
                                " 'SELECT, UPDATE, DELETE')").fetchone() == (False,)
            _act_as(conn, owner)
            assert Queue(conn).send("a", b"x").status is CreateStatus.CREATED
            [message] = Queue(conn).dequeue(LOCK)
            assert message.complete() is SettleStatus.COMPLETED
    finally:
        server.drop_database(database)
        server.admin(f'DROP ROLE IF EXISTS "{owner}"')


def test_an_upgrade_by_a_role_that_cannot_become_the_owner_is_refused(
        plain_dsn: str, server: Server, tmp_path: Path) -> None:
    """A producer (USAGE on schema fairq, nothing it owns) is told whom to run it as."""
    _installed(plain_dsn)
    stranger = f"fairq_stranger_{next(_names)}"
    server.admin(f'CREATE ROLE "{stranger}"')
    try:
        with psycopg.connect(plain_dsn) as conn:
            conn.execute("SELECT fairq.grant_producer(%s)", (stranger,))
            conn.commit()
            _act_as(conn, stranger)
            with pytest.raises(InstallError, match="run `fairq upgrade` as"):
                upgrade(conn, upgrade_dir(tmp_path, later(1)))
            conn.rollback()
            conn.execute("RESET ROLE")
            assert installed_version(conn) == CURRENT
            conn.execute(f'DROP OWNED BY "{stranger}"')  # type: ignore[arg-type]
            conn.commit()
    finally:
        server.admin(f'DROP ROLE IF EXISTS "{stranger}"')


@pytest.mark.parametrize("old", [v for v in released_versions() if v != CURRENT])
def test_a_plain_install_upgraded_from_a_release_equals_a_fresh_one(
        server: Server, tmp_path: Path, old: str) -> None:
    """`fairq upgrade` runs the extension's own upgrade scripts on a plain schema: the
    result dumps like a fresh `fairq install`, and messages in flight survive it."""
    released = tmp_path / "extension"
    shutil.copytree(Scripts.bundled().directory, released)
    control = released / "fairq.control"
    control.write_text(control.read_text().replace(f"'{CURRENT}'", f"'{old}'"))
    # template0 has no fairq: plain databases.
    upgraded, fresh = server.create_database("template0"), server.create_database("template0")
    try:
        with psycopg.connect(server.dsn(upgraded), autocommit=True) as conn:
            assert install(conn, Scripts(released)) == old
            for channel in ("held", "kept"):
                conn.execute("SELECT * FROM fairq.message_create(%s, 'x')", (channel,))
            held = conn.execute("SELECT id, num_attempts FROM fairq.message_dequeue(60000)"
                                ).fetchone()
            # One script per release on the way, as ALTER EXTENSION would run them.
            released = released_versions()  # in release order
            chain = [v for v in released[released.index(old):] if v != CURRENT] + [CURRENT]
            assert [p.name for p in upgrade(conn)] == [
                f"fairq--{a}--{b}.sql" for a, b in itertools.pairwise(chain)]
            assert conn.execute("SELECT fairq.message_complete(%s, %s)", held
                                ).fetchone() == ("completed",)
            assert conn.execute("SELECT channel FROM fairq.message_dequeue(60000)"
                                ).fetchall() == [("kept",)]
            assert conn.execute("SELECT * FROM fairq.check()").fetchall() == []
        with psycopg.connect(server.dsn(fresh), autocommit=True) as conn:
            install(conn)
        assert schema_dump(server, upgraded) == schema_dump(server, fresh)
    finally:
        server.drop_database(upgraded)
        server.drop_database(fresh)
