"""The throughput harness: producers and consumers side by side under pgbench, in a
steady state (the backlog gate), and messages consumed per second."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg

from fairq.bench.database import (
    PAYLOAD_SQL,
    SCHEMA,
    Conn,
    connect,
    load,
    reset,
    scalar,
    settle,
)
from fairq.bench.pgbench import Pgbench, pgbench_summary
from fairq.bench.sizes import Sizes
from fairq.bench.threads import Threads
from fairq.bench.workloads import channel_number, consumer_script, producer_script

__all__ = ["describe", "held_snapshot", "sustained", "throughput", "top_statements"]


_COUNTERS = {
    "floor": (f"{SCHEMA}.floor_id_seq", f"{SCHEMA}.floor"),
    "fifo": (f"{SCHEMA}.message_id_seq", f"{SCHEMA}.message"),
    "fairq": ("fairq.message_id_seq", "fairq.message"),
}


def _counts(conn: Conn, kind: str) -> tuple[int, int]:
    """(messages ever created, messages still present) for a queue kind."""
    seq, table = _COUNTERS[kind]
    made = scalar(conn, f"SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END"
                        f" FROM {seq}")
    left = scalar(conn, f"SELECT count(*) FROM {table}")
    return int(made), int(left)


def sustained(consumed: int, produced: int) -> int:
    """The messages a run counts: those consumed, but no more than were produced.

    A queue's throughput is the rate at which messages go through it. When producers
    are the slower side, consumers also eat into the prefilled backlog, and counting
    that would credit the run with messages nobody produced in it: a rate that lasts
    only until the backlog is gone. The gate bounds the other side (a backlog that
    grows is not counted)."""
    return min(consumed, produced)


def _prefill(dsn: str, kind: str, sizes: Sizes) -> None:
    with connect(dsn) as conn:
        n, c = sizes.prefill, sizes.channels
        if kind == "floor":
            conn.execute(f"INSERT INTO {SCHEMA}.floor (channel, content)"
                         f" SELECT 1 + i % {c}, {PAYLOAD_SQL} FROM generate_series(1, {n}) i")
        elif kind == "fifo":
            conn.execute(f"INSERT INTO {SCHEMA}.message (content)"
                         f" SELECT {PAYLOAD_SQL} FROM generate_series(1, {n})")
    if kind == "fairq" and sizes.channel_spread == "zipf":
        rng = random.Random(11)
        names = [f"bench-{channel_number(sizes, rng)}" for _ in range(sizes.prefill)]
        load(dsn, names.__getitem__, sizes.prefill, sizes)
    elif kind == "fairq":
        load(dsn, lambda i: f"bench-{1 + i % sizes.channels}", sizes.prefill, sizes)
    with connect(dsn) as conn:
        settle(conn)


@contextlib.contextmanager
def _gatekeeper(dsn: str, kind: str, limit: int) -> Iterator[None]:
    """Closes the producers' gate while the backlog is at ``limit`` or above.

    A queue's throughput is the rate it sustains, so a run measures producers and
    consumers in a steady state. Unthrottled producers (a batched producer is 20 times
    faster than a consumer) would fill the table without bound and take the CPU from
    the consumers, and the result would say more about how the scheduler splits two
    cores than about the queue. The backlog is counted every 50 ms (up to ``limit``
    rows), the same way for floor, FIFO and fairq."""
    table = _COUNTERS[kind][1]
    stop = threading.Event()
    threads = Threads()

    def keep() -> None:
        with connect(dsn) as conn:
            is_open = True
            while not stop.wait(0.05):
                backlog = scalar(conn, f"SELECT count(*) FROM (SELECT FROM {table}"
                                       " LIMIT %s) b", (limit,))
                if (backlog < limit) != is_open:
                    is_open = not is_open
                    conn.execute(f"UPDATE {SCHEMA}.gate SET open = %s", (is_open,))
            conn.execute(f"UPDATE {SCHEMA}.gate SET open = true")

    threads.start(keep)
    try:
        yield
    finally:
        stop.set()
        threads.join(30)


def throughput(bench: Pgbench, kind: str, sizes: Sizes, batched: bool,
               during: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
               options: str = "", profile: bool = False) -> dict[str, Any]:
    """Producers and consumers side by side for ``sizes.throughput_s`` seconds."""
    reset(bench.dsn)
    _prefill(bench.dsn, kind, sizes)
    producer = producer_script(kind, sizes, batched)
    consumer = consumer_script(kind, sizes, batched)
    seconds = sizes.throughput_s
    with connect(bench.dsn) as conn:
        made0, left0 = _counts(conn, kind)
        if profile:
            conn.execute("SELECT pg_stat_statements_reset()")
        ctx = during() if during is not None else contextlib.nullcontext()
        with ctx, _gatekeeper(bench.dsn, kind, sizes.throughput_backlog):
            began = time.monotonic()
            try:
                procs = [bench.start(f"{kind}-producer", producer, sizes.producers, seconds,
                                     options),
                         bench.start(f"{kind}-consumer", consumer, sizes.consumers, seconds,
                                     options)]
                outputs = [Pgbench.finish(p, seconds) for p in procs]
            finally:
                # Every pgbench the runner started, not only those this frame got back:
                # one interrupted before its start() returned was never ended. (An
                # interrupt or a failed pgbench left the other running, ungated, for
                # the rest of its -T.)
                bench.stop_all()
            elapsed = time.monotonic() - began
        made1, left1 = _counts(conn, kind)
        statements = top_statements(conn) if profile else None
    produced = made1 - made0
    consumed = produced - (left1 - left0)
    # pgbench's -T window (its own clock), not the connection set-up around it.
    window = float(seconds) if elapsed > seconds else elapsed
    return {"msgs_per_s": sustained(consumed, produced) / window,
            "consumed_per_s": consumed / window, "produced_per_s": produced / window,
            "consumed": consumed, "produced": produced, "seconds": window,
            "backlog_before": left0, "backlog_after": left1,
            "pgbench": {"producer": pgbench_summary(outputs[0]),
                        "consumer": pgbench_summary(outputs[1])},
            **({"top_statements": statements} if statements is not None else {})}


def top_statements(conn: Conn, limit: int = 25) -> list[dict[str, Any]]:
    """pg_stat_statements (track = all, so statements inside functions too), by total time."""
    return [{"calls": int(calls), "total_ms": round(float(total), 1),
             "mean_ms": round(float(mean), 4), "rows": int(rows), "query": str(query)[:300]}
            for calls, total, mean, rows, query in conn.execute(
                "SELECT calls, total_exec_time, mean_exec_time, rows,"
                "       regexp_replace(query, '\\s+', ' ', 'g')"
                "  FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT %s", (limit,))]


@contextlib.contextmanager
def held_snapshot(dsn: str) -> Iterator[None]:
    """Another session holding a REPEATABLE READ snapshot open the whole time."""
    with psycopg.connect(dsn) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT count(*) FROM fairq.channel")
        try:
            yield
        finally:
            conn.rollback()


def describe(key: str, result: dict[str, Any]) -> str:
    """The progress line of one throughput run."""
    return (f"  {key}: {result['msgs_per_s']:,.0f} msgs/s"
            f" (produced {result['produced_per_s']:,.0f}/s,"
            f" consumed {result['consumed_per_s']:,.0f}/s,"
            f" backlog {result['backlog_before']:,} -> {result['backlog_after']:,})")
