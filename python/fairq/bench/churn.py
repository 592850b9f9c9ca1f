"""The churn soak: ``churn_messages`` messages to ``churn_tenants`` tenants that come
and go: a window of ``churn_window`` tenants receives messages and moves forward, so
each tenant gets a few messages and then falls silent for good. Throughput per tenth
of the run, and at the end of each tenth the size of fairq.channel and its indexes and
its row count: the table should level off, not grow with every tenant ever seen.
"""

from __future__ import annotations

import bisect
import math
import queue
import random
from typing import Any

from fairq.bench.database import Conn, check, connect, reset, scalar, table_stats
from fairq.bench.progress import Log
from fairq.bench.sizes import Sizes
from fairq.bench.soak import batch_run
from fairq.bench.stats import ratio
from fairq.bench.threads import Threads

__all__ = ["channel_sample", "churn_channel", "churn_scenario"]


RELATED = ("fairq.channel_size", "fairq.channel_wake")  # per-channel side tables, if any


def churn_channel(sizes: Sizes, i: int, rng: random.Random) -> str:
    """The tenant of message i (0 .. churn_messages - 1), drawn uniformly from a window
    of ``churn_window`` tenants whose first tenant moves from 0 (first message) to
    ``churn_tenants - churn_window`` (last message). A tenant stays in the window for
    about ``churn_messages * churn_window / churn_tenants`` messages and gets about
    ``churn_messages / churn_tenants`` of them (the first and last tenants fewer)."""
    return f"churn-{_window_start(sizes, i) + rng.randrange(_window(sizes))}"


def _window(sizes: Sizes) -> int:
    return max(1, min(sizes.churn_window, sizes.churn_tenants))


def _window_start(sizes: Sizes, i: int) -> int:
    return i * (sizes.churn_tenants - _window(sizes)) // max(1, sizes.churn_messages - 1)


def _tenants_seen(sizes: Sizes, messages: int) -> int:
    """How many tenants the window has reached once ``messages`` were created (the
    window's last tenant + 1)."""
    if messages <= 0:
        return 0
    return _window_start(sizes, messages - 1) + _window(sizes)


def channel_sample(conn: Conn) -> dict[str, Any]:
    """fairq.channel now: rows, heap bytes, total bytes (heap, indexes, TOAST), each
    index's bytes; the message backlog; total bytes of the per-channel side tables."""
    indexes = {str(name): int(size) for name, size in conn.execute(
        "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid)"
        "  FROM pg_index WHERE indrelid = 'fairq.channel'::regclass ORDER BY 1")}
    related: dict[str, int] = {}
    for rel in RELATED:
        size = scalar(conn, "SELECT pg_total_relation_size(to_regclass(%s))", (rel,))
        if size is not None:
            related[rel] = int(size)
    return {"rows": int(scalar(conn, "SELECT count(*) FROM fairq.channel")),
            "bytes": int(scalar(conn, "SELECT pg_relation_size('fairq.channel')")),
            "total_bytes": int(scalar(conn, "SELECT pg_total_relation_size('fairq.channel')")),
            "index_bytes": indexes,
            "backlog": int(scalar(conn, "SELECT count(*) FROM fairq.message")),
            "related_total_bytes": related}


def churn_scenario(dsn: str, sizes: Sizes, log: Log) -> dict[str, Any]:
    """The churn soak (see the module doc), driven like the soak (``batch_run``: soak
    producers and consumers, batches of ``batch``, at most ``soak_backlog`` ahead).

    A tenth ends when the creates of its tenth of the messages have returned; its
    throughput is the completions since the previous tenth ended (the first tenth:
    since the first completion), per second. The channel sample of a tenth is taken
    just after it ends, by a separate session."""
    reset(dsn)
    total = sizes.churn_messages
    ends = [total * k // 10 for k in range(1, 11)]
    tenth_end_s: list[float] = []
    pending: queue.Queue[int | None] = queue.Queue()
    samples: list[dict[str, Any]] = []

    def on_created(created: int, seconds: float) -> None:  # under batch_run's lock
        while len(tenth_end_s) < len(ends) and created >= ends[len(tenth_end_s)]:
            tenth_end_s.append(seconds)
            pending.put(len(tenth_end_s))

    def sampler() -> None:
        with connect(dsn) as conn:
            while pending.get() is not None:
                samples.append(channel_sample(conn))

    def channels_for(first: int, count: int, rng: random.Random) -> list[str]:
        return [churn_channel(sizes, i, rng) for i in range(first, first + count)]

    with connect(dsn) as conn:
        before = channel_sample(conn)
    watcher = Threads()
    watcher.start(sampler)
    try:
        run = batch_run(dsn, sizes, log, "churn", total, channels_for, sizes.churn_max_s,
                        on_created)
    finally:
        pending.put(None)
        watcher.join(120)
    with connect(dsn) as conn:
        after = channel_sample(conn)
        stats = table_stats(conn)
    problems = check(dsn)

    # Each completion counts in the tenth during which it happened.
    start = run.events[0][0] if run.events else math.inf
    counts = [0] * len(tenth_end_s)
    for t, done in run.events:
        k = bisect.bisect_left(tenth_end_s, t)
        if k < len(counts):
            counts[k] += done
    rates: list[float] = []
    for k, end in enumerate(tenth_end_s):
        lo = max(tenth_end_s[k - 1] if k else 0.0, start)
        rates.append(counts[k] / (end - lo) if end > lo else math.nan)
    names = sorted({name for s in samples for name in s["index_bytes"]})
    related = sorted({name for s in samples for name in s["related_total_bytes"]})
    tenths = len(samples)
    result = {
        "messages": total, "tenants": sizes.churn_tenants,
        "window": _window(sizes),
        "messages_per_tenant": total / max(1, sizes.churn_tenants),
        "completed": run.completed, "remaining": after["backlog"],
        "deadlocks_retried": run.deadlocks, "stopped_by_time_cap": run.completed < total,
        "seconds": run.seconds,
        "msgs_per_s": run.completed / run.seconds if run.seconds else math.nan,
        "tenth_end_s": tenth_end_s[:tenths],
        "tenants_seen": [_tenants_seen(sizes, e) for e in ends[:tenths]],
        "tenth_msgs_per_s": rates[:tenths],
        "channel_rows": [s["rows"] for s in samples],
        "channel_bytes": [s["bytes"] for s in samples],
        "channel_total_bytes": [s["total_bytes"] for s in samples],
        "channel_index_bytes": {n: [s["index_bytes"].get(n) for s in samples] for n in names},
        "backlog": [s["backlog"] for s in samples],
        "related_total_bytes": {n: [s["related_total_bytes"].get(n) for s in samples]
                                for n in related},
        "before": before, "after": after,
        "last_vs_first": ratio(rates[tenths - 1], rates[0]) if tenths >= 2 else math.nan,
        "check": [list(p) for p in problems], "table_stats": stats,
    }
    if tenths:
        log(f"  churn: {result['msgs_per_s']:,.0f} msgs/s overall, first tenth"
            f" {rates[0]:,.0f}, last tenth {rates[tenths - 1]:,.0f};"
            f" fairq.channel {samples[0]['rows']:,} -> {samples[-1]['rows']:,} rows,"
            f" {samples[0]['total_bytes'] / 1e6:.1f} -> {samples[-1]['total_bytes'] / 1e6:.1f}"
            f" MB total ({result['tenants_seen'][-1]:,} tenants seen)")
    return result
