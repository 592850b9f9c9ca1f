"""A database worth looking at, for the dashboard's tests: three queues, a capped channel
at its cap, a paused channel, a channel named like a script, a scheduled message,
messages in flight (one recovered after its lock expired), dead letters with errors
that look like HTML, and history recorded for everything settled.

Built with fairq's own SQL functions as the owner, so the dashboard sees what a real
queue would show."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

__all__ = ["XSS", "Scene", "build_scene", "chromium_or_skip", "observer_dsn"]

XSS = "<script>alert(1)</script>"
ERROR_HTML = '<img src=x onerror=alert(2)> & "boom"'
CHROMIUM = "/usr/bin/chromium"


@dataclass(frozen=True)
class Scene:
    dead_ids: list[int]  # oldest death first, in queue emails
    in_flight_ids: list[int]
    recovered_id: int


def _ids(conn: psycopg.Connection[Any], query: str, params: tuple[object, ...]) -> list[int]:
    return [int(r[0]) for r in conn.execute(query, params)]  # type: ignore[arg-type]


def build_scene(dsn: str) -> Scene:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET fairq.history = on")
        send = "SELECT id FROM fairq.message_create(%s, 'x', p_queue => %s)"
        # default: tenant-a (3 ready + 1 scheduled), tenant-b capped at 1 and at its cap,
        # paused-c paused until resumed, and the script-named channel.
        conn.execute("SELECT fairq.channel_set('tenant-b', p_max_concurrency => 1)")
        for channel, count in (("tenant-b", 3), ("tenant-a", 3), ("paused-c", 2), (XSS, 1)):
            for _ in range(count):
                _ids(conn, send, (channel, "default"))
        conn.execute("SELECT fairq.message_create('tenant-a', 'later',"
                     " clock_timestamp() + interval '1 hour')")
        conn.execute("SELECT fairq.channel_pause('paused-c')")
        # Two deliveries, by turns in the order the channels woke: tenant-b (reaching
        # its cap) and tenant-a.
        in_flight = _ids(conn, "SELECT id FROM fairq.message_dequeue(600000, 2)", ())
        capped = conn.execute("SELECT in_flight FROM fairq.channels"
                              " WHERE channel = 'tenant-b'").fetchone()
        assert capped == (1,), capped
        # emails: a weighted, rate-limited channel; dead letters; a completed message;
        # a lock that expired and came back (recovered).
        conn.execute("SELECT fairq.channel_set('acme', p_release_interval_ms => 250,"
                     " p_weight => 3, p_queue => 'emails')")
        for channel in ("acme", "acme", "globex", "globex", "initech", "initech"):
            _ids(conn, send, (channel, "emails"))
        dead = []
        for error in (ERROR_HTML, "timeout after 30 s"):
            taken = conn.execute("SELECT id, num_attempts FROM fairq.message_dequeue("
                                 "600000, 1, 'emails')").fetchone()
            assert taken is not None
            conn.execute("SELECT fairq.message_fail(%s, %s, %s)", (taken[0], taken[1], error))
            dead.append(int(taken[0]))
        taken = conn.execute("SELECT id, num_attempts FROM fairq.message_dequeue(600000, 1,"
                             " 'emails')").fetchone()
        assert taken is not None
        conn.execute("SELECT fairq.message_complete(%s, %s)", (taken[0], taken[1]))
        # reports: one message whose 1 ms lock expires; the next dequeue that finds it
        # hands it out again, recovered (asked until it does: the lock must have expired).
        recovered_id = _ids(conn, send, ("nightly", "reports"))[0]
        conn.execute("SELECT fairq.message_dequeue(1, 1, 'reports')")
        while not _ids(conn, "SELECT id FROM fairq.message_dequeue(600000, 1, 'reports')"
                             " WHERE recovered", ()):
            pass
        in_flight.append(recovered_id)
    return Scene(dead, in_flight, recovered_id)


def observer_dsn(dsn: str, role: str = "fairq_watcher") -> str:
    """A role that may only observe (fairq.grant_observer), and a DSN that logs in as it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
        if not exists:
            conn.execute(f'CREATE ROLE "{role}" LOGIN')  # type: ignore[arg-type]
        conn.execute("SELECT fairq.grant_observer(%s)", (role,))
    return psycopg.conninfo.make_conninfo(dsn, user=role)


def chromium_or_skip() -> str:
    """Debian's Chromium for Playwright; a missing one skips, except on CI (CI=true),
    where .ci/run installs it and a skip would hide a broken install."""
    reason = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        reason = "playwright is not installed (pip install -e '.[test]')"
    if reason is None and not shutil.which(CHROMIUM):
        reason = f"no {CHROMIUM} (apt-get install chromium)"
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return CHROMIUM
