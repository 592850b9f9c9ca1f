"""The soak: a long batched run through Python threads, throughput of its first tenth
against its last, table and index sizes before and after. Its driver, ``batch_run``,
also drives the churn soak."""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fairq.bench.database import (
    LOCK_MS,
    PAYLOAD,
    check,
    connect,
    relation_sizes,
    reset,
    retrying,
    scalar,
    table_stats,
)
from fairq.bench.progress import Log
from fairq.bench.sizes import Sizes
from fairq.bench.stats import ratio
from fairq.bench.threads import Threads

__all__ = ["BatchRun", "batch_run", "soak_scenario"]


@dataclass
class BatchRun:
    """What ``batch_run`` did; times are seconds since its start."""

    total: int
    produced: int = 0               # messages claimed by producers
    created: int = 0                # messages whose create call has returned
    completed: int = 0
    events: list[tuple[float, int]] = field(default_factory=list)  # (time, completed)
    produced_until: float = 0.0     # when the last create call returned
    deadlocks: int = 0
    seconds: float = 0.0


def batch_run(dsn: str, sizes: Sizes, log: Log, label: str, total: int,
              channels_for: Callable[[int, int, random.Random], list[str]], max_s: float,
              on_created: Callable[[int, float], None] | None = None) -> BatchRun:
    """``total`` messages through soak_producers and soak_consumers threads in batches
    of ``sizes.batch``; producers stay at most ``soak_backlog`` ahead of consumers.

    ``channels_for(first, count, rng)`` names the channels of messages first ..
    first + count - 1 (a producer's own seeded ``rng``). ``on_created(created,
    seconds)`` is called after every create call (under the run's lock: keep it short).
    Stops after ``max_s`` seconds, and then reports what it did."""
    n = sizes.batch
    lock = threading.Lock()
    run = BatchRun(total)
    produced = [0]
    completed = [0]
    deadlocks = [0]
    threads = Threads()
    began = time.monotonic()
    deadline = began + max_s

    def producer(seed: int) -> None:
        rng = random.Random(seed)
        with connect(dsn) as conn:
            while not threads.stop.is_set() and time.monotonic() < deadline:
                with lock:
                    if produced[0] >= total:
                        break
                    if produced[0] - completed[0] > sizes.soak_backlog:
                        wait = True
                    else:
                        wait = False
                        first = produced[0]
                        take = min(n, total - first)
                        produced[0] += take
                if wait:
                    time.sleep(0.002)
                    continue
                channels = channels_for(first, take, rng)
                retrying(conn,
                         "SELECT count(*) FROM fairq.message_create_batch(%s::text[], %s::bytea[])",
                         (channels, [PAYLOAD] * take), deadlocks, lock)
                with lock:
                    now = time.monotonic() - began
                    run.produced_until = max(run.produced_until, now)
                    run.created += take
                    if on_created is not None:
                        on_created(run.created, now)

    def consumer() -> None:
        with connect(dsn) as conn:
            while not threads.stop.is_set() and time.monotonic() < deadline:
                with lock:
                    if completed[0] >= total:
                        break
                rows = retrying(
                    conn, f"SELECT id, num_attempts FROM fairq.message_dequeue({LOCK_MS}, {n})",
                    (), deadlocks, lock)
                if not rows:
                    time.sleep(0.001)
                    continue
                retrying(conn,
                         "SELECT count(*) FROM fairq.message_complete_batch(%s::bigint[],"
                         " %s::bigint[])", ([r[0] for r in rows], [r[1] for r in rows]),
                         deadlocks, lock)
                with lock:
                    completed[0] += len(rows)
                    run.events.append((time.monotonic() - began, len(rows)))

    def reporter() -> None:
        last = 0
        while not threads.stop.wait(10):
            with lock:
                done = completed[0]
            if done >= total:
                return
            log(f"  {label}: {done:,}/{total:,} completed ({(done - last) / 10:,.0f} msgs/s)")
            last = done

    for i in range(sizes.soak_producers):
        threads.start(producer, i)
    for _ in range(sizes.soak_consumers):
        threads.start(consumer)
    report = threading.Thread(target=reporter, daemon=True)
    report.start()
    try:
        threads.join(deadline - time.monotonic() + 60)
    finally:
        threads.stop.set()
        report.join(5)
    run.seconds = time.monotonic() - began
    run.produced, run.completed, run.deadlocks = produced[0], completed[0], deadlocks[0]
    if run.completed < total:
        log(f"  {label} stopped at its time cap ({max_s:g} s):"
            f" {run.completed:,} of {total:,} messages completed")
    return run


def soak_scenario(dsn: str, sizes: Sizes, log: Log) -> dict[str, Any]:
    """A long batched run: producers stay at most soak_backlog ahead of consumers."""
    reset(dsn)
    with connect(dsn) as conn:
        before = relation_sizes(conn)
    total = sizes.soak_messages

    def channels_for(first: int, count: int, rng: random.Random) -> list[str]:
        return [f"soak-{rng.randrange(sizes.channels)}" for _ in range(count)]

    # Generous time cap: 200 messages/s would be a pathological collapse.
    run = batch_run(dsn, sizes, log, "soak", total, channels_for, sizes.soak_max_s)
    events, elapsed = run.events, run.seconds
    with connect(dsn) as conn:
        after = relation_sizes(conn)
        stats = table_stats(conn)
        remaining = int(scalar(conn, "SELECT count(*) FROM fairq.message"))
    problems = check(dsn)

    # Throughput over the producing period, from the first completion (connections and
    # the first batches are set up) to the last creation (the final drain is not steady
    # state): the first tenth of that span against the last tenth.
    start = events[0][0] if events else 0.0
    end = run.produced_until if run.produced_until > start else elapsed
    tenth = (end - start) / 10 or math.nan
    first = sum(k for t, k in events if start <= t <= start + tenth) / tenth
    last = sum(k for t, k in events if end - tenth < t <= end) / tenth
    span = end
    bucket = max(span / 100, 0.5)
    series: list[tuple[float, float]] = []
    for b in range(math.ceil(elapsed / bucket)):
        lo, hi = b * bucket, (b + 1) * bucket
        series.append((round(hi, 3), sum(k for t, k in events if lo < t <= hi) / bucket))
    return {"messages": total, "completed": run.completed, "remaining": remaining,
            "produced": run.produced, "deadlocks_retried": run.deadlocks,
            "stopped_by_time_cap": run.completed < total,
            "seconds": elapsed, "producing_seconds": span, "measured_from_s": start,
            "msgs_per_s": run.completed / elapsed if elapsed else math.nan,
            "first_tenth_msgs_per_s": first, "last_tenth_msgs_per_s": last,
            "ratio": ratio(last, first), "sizes": {"before": before, "after": after},
            "table_stats": stats, "check": [list(p) for p in problems],
            "series": series}
