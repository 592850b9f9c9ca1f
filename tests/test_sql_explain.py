"""Index lookups only (SPEC §2.6): every statement a dequeue or a settlement runs is
served by index scans, with 100k messages queued in 10k channels.

The plans are the real ones: auto_explain logs each statement nested inside the
fairq functions (as NOTICEs to this session), so the test reads what PostgreSQL
actually executed, not a hand-copied query.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import psycopg
import pytest

from conftest import Server
from sqlq import Conn, call, create, dequeue, dequeue_one, travel

SCAN = re.compile(r"\b(Seq Scan|Bitmap Heap Scan|Index Scan|Index Only Scan)\b(?: Backward)?(?: using \S+)? on (\S+)")


@pytest.fixture(scope="module")
def loaded_dsn(server: Server) -> Iterator[str]:
    """One database for the module: loading 100k messages takes a while."""
    name = server.create_database()
    with psycopg.connect(server.dsn(name), autocommit=True) as conn:
        conn.execute("SET fairq.events = off")
        for chunk in range(10):
            conn.execute(
                "SELECT fairq.message_create_batch(array_agg('tenant-' || (i %% 10000)),"
                " array_agg('x'::bytea), NULL, array_agg(i %% 3))"
                " FROM generate_series(%s::int, %s::int) AS i", (chunk * 10_000, chunk * 10_000 + 9_999)
            )
        conn.execute("ANALYZE")
    try:
        yield server.dsn(name)
    finally:
        server.drop_database(name)


@pytest.fixture
def loaded(loaded_dsn: str) -> Iterator[Conn]:
    with psycopg.connect(loaded_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM fairq.message").fetchone()[0] >= 99_000  # type: ignore[index]
        yield conn


def plans_of(conn: Conn, sql: str, params: tuple[object, ...] = ()) -> list[str]:
    """Runs sql with auto_explain on and returns the plan of every nested statement."""
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    conn.execute("LOAD 'auto_explain'")
    conn.execute("SET auto_explain.log_min_duration = 0")
    conn.execute("SET auto_explain.log_nested_statements = on")
    conn.execute("SET auto_explain.log_level = notice")
    try:
        conn.execute(sql, params)  # type: ignore[arg-type]
    finally:
        conn.execute("SET auto_explain.log_min_duration = -1")
    return [n for n in notices if "Query Text" in n or "Scan" in n]


def scans(plans: list[str]) -> list[tuple[str, str]]:
    return [(kind, table) for plan in plans for kind, table in SCAN.findall(plan)]


def assert_index_only(plans: list[str]) -> None:
    found = scans(plans)
    assert found, "auto_explain reported no scans"
    queue_tables = ("channel", "message", "channel_size", "dead_letter")
    bad = [(kind, table) for kind, table in found
           if kind in ("Seq Scan", "Bitmap Heap Scan") and table.split(".")[-1] in queue_tables]
    assert not bad, "\n\n".join(p for p in plans if "Seq Scan" in p or "Bitmap" in p)


def test_dequeue_uses_index_scans_only(loaded: Conn) -> None:
    plans = plans_of(loaded, "SELECT * FROM fairq.message_dequeue(30000, 10)")
    assert_index_only(plans)
    text = "\n".join(plans)
    assert "channel_turn_ix" in text and "message_ready_ix" in text and "message_locked_ix" in text


def test_settlements_use_index_scans_only(loaded: Conn) -> None:
    got = dequeue(loaded, n=4)
    a, b, c, d = got
    assert_index_only(plans_of(loaded, "SELECT fairq.message_complete(%s, %s)", (a.id, a.num_attempts)))
    assert_index_only(plans_of(loaded, "SELECT fairq.message_defer(%s, %s)", (b.id, b.num_attempts)))
    assert_index_only(plans_of(loaded, "SELECT fairq.message_heartbeat(%s, %s, 1000)", (c.id, c.num_attempts)))
    assert_index_only(plans_of(loaded, "SELECT fairq.message_fail(%s, %s)", (d.id, d.num_attempts)))


def test_create_and_cancel_use_index_scans_only(loaded: Conn) -> None:
    assert_index_only(plans_of(loaded, "SELECT * FROM fairq.message_create('tenant-7', 'y', p_dedup_key => 'k')"))
    assert_index_only(plans_of(loaded, "SELECT * FROM fairq.message_create('brand-new', 'y')"))
    mid, _ = create(loaded, "tenant-8", b"z")
    assert_index_only(plans_of(loaded, "SELECT fairq.message_cancel(%s)", (mid,)))


def test_recovery_and_scheduled_promotion_use_index_scans_only(loaded: Conn) -> None:
    call(loaded, "channel_set", "tenant-1", None, 0, 100000, 5)
    dequeue(loaded, lock_ms=10, n=20)
    loaded.execute("SELECT fairq.message_create('tenant-2', 'later', fairq.clock() + interval '1 second')")
    travel(loaded, 5_000)
    plans = plans_of(loaded, "SELECT * FROM fairq.message_dequeue(30000, 20)")
    assert_index_only(plans)
    assert dequeue_one(loaded) is not None
