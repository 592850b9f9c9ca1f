"""Dequeue latency: sequential dequeues against queue depth and against the number of
non-empty channels."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from fairq.bench.database import LOCK_MS, PAYLOAD, connect, load, reset, scalar, settle
from fairq.bench.progress import Log
from fairq.bench.sizes import Sizes
from fairq.bench.stats import quantile, ratio

__all__ = ["channels_scenario", "depth_scenario", "dequeue_latencies", "latency_summary"]


DEQUEUE_ONE = f"SELECT id, channel, num_attempts FROM fairq.message_dequeue({LOCK_MS}, 1, %s)"


def dequeue_latencies(dsn: str, samples: int, warmup: int = 30,
                      queue: str = "default") -> list[float]:
    """Sequential dequeues of ``queue`` on one connection (seconds each). After each
    timed dequeue the message is completed and a new one created on its channel, so
    the depth and the number of channels stay what they were."""
    out: list[float] = []
    with connect(dsn) as conn:
        for i in range(warmup + samples):
            began = time.perf_counter()
            rows = conn.execute(DEQUEUE_ONE, (queue,)).fetchall()
            took = time.perf_counter() - began
            if not rows:
                raise RuntimeError("dequeue latency: the queue ran empty")
            row = rows[0]
            if i >= warmup:
                out.append(took)
            conn.execute("SELECT fairq.message_complete(%s, %s)", (row[0], row[2]))
            conn.execute("SELECT 1 FROM fairq.message_create(%s, %s, p_queue => %s)",
                         (row[1], PAYLOAD, queue))
    return out


def latency_summary(values: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(values) * 1e3, "p90_ms": quantile(values, 0.9) * 1e3,
            "p99_ms": quantile(values, 0.99) * 1e3, "samples": len(values)}


def depth_scenario(dsn: str, sizes: Sizes, log: Log) -> dict[str, Any]:
    reset(dsn)
    levels: list[dict[str, Any]] = []
    have = 0
    for depth in sizes.depth_levels:
        rate = load(dsn, lambda i: f"depth-{i % sizes.depth_channels}", depth - have, sizes,
                    log, f"depth {depth:,}")
        have = depth
        with connect(dsn) as conn:
            settle(conn)
        summary = latency_summary(dequeue_latencies(dsn, sizes.latency_samples))
        summary.update(depth=depth, channels=sizes.depth_channels, load_rows_per_s=rate)
        levels.append(summary)
        log(f"  depth {depth:>9,}: median dequeue {summary['median_ms']:.3f} ms"
            f" (p90 {summary['p90_ms']:.3f} ms)")
    return {"levels": levels,
            "ratio": ratio(levels[-1]["median_ms"], levels[0]["median_ms"])}


def _spread(prefix: str, count: int) -> Callable[[int], str]:
    """Message i goes to channel ``prefix-(i mod count)``."""
    def channel_of(i: int) -> str:
        return f"{prefix}-{i % count}"
    return channel_of


def channels_scenario(dsn: str, sizes: Sizes, log: Log) -> dict[str, Any]:
    """The same number of messages (the largest channel level) spread over more and
    more channels; every channel non-empty."""
    total = max(sizes.channel_levels)
    levels: list[dict[str, Any]] = []
    for count in sizes.channel_levels:
        reset(dsn)
        load(dsn, _spread("chan", count), total, sizes, log, f"{count:,} channels")
        with connect(dsn) as conn:
            settle(conn)
            live = int(scalar(conn, "SELECT count(*) FROM fairq.channel"))
        summary = latency_summary(dequeue_latencies(dsn, sizes.latency_samples))
        summary.update(channels=live, messages=total)
        levels.append(summary)
        log(f"  channels {live:>8,}: median dequeue {summary['median_ms']:.3f} ms"
            f" (p90 {summary['p90_ms']:.3f} ms)")
    return {"levels": levels,
            "ratio": ratio(levels[-1]["median_ms"], levels[0]["median_ms"])}
