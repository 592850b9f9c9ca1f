"""Where the demo runs: a throwaway cluster, or an existing database checked before and
left as it was found afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime, timedelta
from typing import TextIO

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from fairq.cluster import Cluster
from fairq.demo.queries import Connection, demo_backlog, demo_channels, foreign_channels
from fairq.demo.scenario import PREFIX, Scenario
from fairq.queue import Queue

__all__ = ["NO_JIT", "DemoError", "check_database", "cleanup", "purge", "throwaway_database",
           "with_options"]


class DemoError(Exception):
    """The demo cannot run here; the message says why."""


def with_options(dsn: str, *settings: str) -> str:
    """The conninfo with these settings for its sessions only."""
    params = conninfo_to_dict(dsn)
    options = " ".join([str(params.get("options") or ""), *(f"-c {s}" for s in settings)])
    return make_conninfo(dsn, options=options.strip())


# The demo polls fairq.channels twice a second. Its plan is estimated far above
# jit_above_cost (fairq.clock_offset is never analyzed), and JIT compilation then
# costs ~0.5 s per query: the demo's own sessions go without JIT.
NO_JIT = "jit=off"


def check_database(conn: Connection) -> None:
    found = conn.execute(
        "SELECT to_regproc('fairq.message_dequeue') IS NOT NULL").fetchone()
    if not found or not found[0]:
        raise DemoError("fairq is not installed in this database "
                        "(CREATE EXTENSION fairq, or `fairq install`)")
    others = foreign_channels(conn)
    if others:
        listed = ", ".join(f"{name} ({size})" for name, size in others[:5])
        raise DemoError(
            "other channels hold messages here: " + listed + (", ..." if len(others) > 5 else "")
            + ". The demo's workers would dequeue them too (a dequeue serves every channel); "
              "run it on an empty or scratch database, or without --dsn")


def purge(conn: Connection, deadline: float, scenario: Scenario) -> None:
    """Removes what the demo left in channels demo-*: queued messages (taken and
    completed, waiting for abandoned locks to expire) and dead letters (requeued, then
    cancelled). Only runs where no other channel holds messages."""
    if foreign_channels(conn):
        return
    queue: Queue[bytes] = Queue(conn)
    while demo_backlog(conn) and time.monotonic() < deadline:
        taken = queue.dequeue(timedelta(seconds=10), 100)
        for message in taken:
            if message.channel.startswith(PREFIX):
                message.complete()
            else:
                message.defer()
        if not taken:
            time.sleep(0.2)
    # Per tenant: the queue's oldest dead letters may all be others', and a look at
    # them found none of the demo's, which then stayed behind.
    for tenant in scenario.tenants:
        while dead := queue.dead_letters(tenant.name, limit=1000):
            for letter in dead:
                queue.dead_letter_retry(letter.id)
                queue.cancel(letter.id)
    for tenant in scenario.tenants:
        queue.channel_clear(tenant.name)
    # A cancel leaves its emptied channel for the next dequeue to collect: be it.
    for _ in range(5):
        if foreign_channels(conn) or not demo_channels(conn):
            break
        for message in queue.dequeue(timedelta(seconds=10), 1):
            if message.channel.startswith(PREFIX):
                message.complete()
            else:
                message.defer()


def cleanup(dsn: str, scenario: Scenario, since: datetime | None, out: TextIO) -> None:
    """Leaves an existing database as the demo found it (best effort, said aloud)."""
    with psycopg.connect(with_options(dsn, NO_JIT), autocommit=True) as conn:
        purge(conn, time.monotonic() + scenario.crash_lock.total_seconds() + 10, scenario)
        if since is not None:
            try:
                conn.execute("DELETE FROM fairq.message_history"
                             " WHERE channel LIKE 'demo-%%' AND settled_at >= %s", (since,))
            except psycopg.errors.InsufficientPrivilege:
                print("note: the demo's rows in fairq.message_history stay (no privilege to "
                      "delete them)", file=out)
        left = demo_backlog(conn)
        if left:
            print(f"note: {left} messages remain in channels demo-*", file=out)


@contextmanager
def throwaway_database(out: TextIO) -> Iterator[str]:
    cluster = Cluster()
    print(f"starting a throwaway {cluster.version} on 127.0.0.1 ...", file=out, flush=True)
    try:
        cluster.start()
        dsn = cluster.dsn("postgres")
        with psycopg.connect(dsn, autocommit=True) as conn:
            try:
                conn.execute("CREATE EXTENSION fairq")
            except psycopg.errors.UndefinedFile as exc:
                raise DemoError("the fairq extension is not installed in this PostgreSQL: "
                                "run `make install` (or `make demo`)") from exc
        print(f"PostgreSQL at {dsn} (removed at the end)", file=out, flush=True)
        yield dsn
    finally:
        with suppress(Exception):
            cluster.remove()
