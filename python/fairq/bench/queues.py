"""Named queues and weights: the shares weighted channels get, and what a deep queue
costs a small one beside it."""

from __future__ import annotations

from collections import Counter
from typing import Any

from fairq.bench.database import LOCK_MS, connect, load, reset, settle
from fairq.bench.latency import dequeue_latencies, latency_summary
from fairq.bench.progress import Log
from fairq.bench.sizes import Sizes
from fairq.bench.stats import ratio

__all__ = ["queues_scenario", "weights_scenario"]

WEIGHTS = {f"weight-{w}": w for w in range(1, 11)}  # 55 turns a round
SMALL_QUEUE = "bench-small"


def weights_scenario(dsn: str, sizes: Sizes, log: Log) -> dict[str, Any]:
    """Ten backlogged channels of weights 1..10; ``weight_rounds`` rounds of 55
    deliveries, one per call and then ``batch`` per call. Reports, for every window of
    55 consecutive deliveries, the largest distance between a channel's deliveries and
    its weight (SPEC: at most 1), and each channel's share of the whole run."""
    out: dict[str, Any] = {}
    round_size = sum(WEIGHTS.values())
    backlog = [channel for channel, weight in WEIGHTS.items()
               for _ in range(weight * (sizes.weight_rounds + 1))]
    for mode, per_call in (("single", 1), ("batched", sizes.batch)):
        reset(dsn)
        with connect(dsn) as conn:
            for channel, weight in WEIGHTS.items():
                conn.execute("SELECT fairq.channel_set(%s, p_weight => %s)", (channel, weight))
        load(dsn, backlog.__getitem__, len(backlog), sizes)
        served: list[str] = []
        with connect(dsn) as conn:
            while len(served) < sizes.weight_rounds * round_size:
                rows = conn.execute(f"SELECT channel FROM fairq.message_dequeue({LOCK_MS}, %s)",
                                    (per_call,)).fetchall()
                if not rows:
                    raise RuntimeError("weights: the queue ran empty")
                served += [r[0] for r in rows]
        served = served[:sizes.weight_rounds * round_size]
        deviation = max(abs(Counter(served[start:start + round_size])[channel] - weight)
                        for start in range(len(served) - round_size + 1)
                        for channel, weight in WEIGHTS.items())
        total = Counter(served)
        shares = {channel: total[channel] / len(served) for channel in WEIGHTS}
        out[mode] = {
            "max_window_deviation": deviation,
            "shares": shares,
            "max_share_error": max(abs(shares[c] - w / round_size) for c, w in WEIGHTS.items()),
            "deliveries": len(served),
        }
        log(f"  weights, {per_call} per call: every {round_size} consecutive deliveries within"
            f" {deviation} of the weights; largest share error"
            f" {out[mode]['max_share_error']:.4f}")
    out["max_window_deviation"] = max(out[m]["max_window_deviation"] for m in ("single", "batched"))
    return out


def queues_scenario(dsn: str, sizes: Sizes, log: Log) -> dict[str, Any]:
    """Dequeue latency of a small queue (100 channels, 1,000 messages) alone, then
    beside a deep default queue of ``queue_deep`` messages in 1,000 channels, some of
    them in flight with expired locks."""
    reset(dsn)
    load(dsn, lambda i: f"small-{i % 100}", 1_000, sizes, queue=SMALL_QUEUE)
    with connect(dsn) as conn:
        settle(conn)
    alone = latency_summary(dequeue_latencies(dsn, sizes.latency_samples, queue=SMALL_QUEUE))
    load(dsn, lambda i: f"deep-{i % 1_000}", sizes.queue_deep, sizes, log,
         f"deep queue {sizes.queue_deep:,}")
    with connect(dsn) as conn:
        conn.execute("SELECT count(*) FROM fairq.message_dequeue(1, 100)")  # expired locks
        settle(conn)
    beside = latency_summary(dequeue_latencies(dsn, sizes.latency_samples, queue=SMALL_QUEUE))
    out = {"alone": alone, "beside_deep": beside, "deep_messages": sizes.queue_deep,
           "ratio": ratio(beside["median_ms"], alone["median_ms"])}
    log(f"  small queue alone: median dequeue {alone['median_ms']:.3f} ms; beside"
        f" {sizes.queue_deep:,} messages: {beside['median_ms']:.3f} ms")
    return out
