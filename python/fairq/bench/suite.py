"""The whole run: every scenario asked for, in order, against one database, into one
result with the machine's description and the targets met."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg

from fairq.bench.churn import churn_scenario
from fairq.bench.database import clean_up, connect, prepare_database, reset, table_stats
from fairq.bench.fairness import fairness_scenario
from fairq.bench.latency import channels_scenario, depth_scenario
from fairq.bench.machine import machine
from fairq.bench.pgbench import Pgbench, pgbench_binary
from fairq.bench.progress import Log, Progress
from fairq.bench.queues import queues_scenario, weights_scenario
from fairq.bench.sizes import Sizes
from fairq.bench.soak import soak_scenario
from fairq.bench.stats import ratio
from fairq.bench.targets import targets
from fairq.bench.tenants import tenants_scenario
from fairq.bench.throughput import describe, held_snapshot, throughput

__all__ = ["SCENARIOS", "run", "spark_scenario"]


SCENARIOS = ("throughput", "events", "batched", "held", "depth", "channels", "fairness", "soak",
             "tenants", "churn", "weights", "queues")


def run(dsn: str, sizes: Sizes, log: Log | None = None,
        scenarios: Sequence[str] = SCENARIOS, cluster: str = "external",
        profile: bool = False) -> dict[str, Any]:
    """Runs the scenarios against ``dsn`` and returns the results (see :mod:`fairq.bench`).

    With ``profile`` (the server must preload pg_stat_statements) each throughput
    scenario also reports its top statements, nested ones included."""
    log = log or Progress()
    binary = pgbench_binary()
    prepare_database(dsn)
    if profile:
        with connect(dsn) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    out: dict[str, Any] = {"machine": machine(dsn, binary, sizes, cluster)}
    details: dict[str, Any] = {}
    began = time.monotonic()
    # Leaves the database empty, whatever happens (an interrupted run left its rows and
    # the reference schema, and a --dsn database was then refused by the next run).
    try:
        with tempfile.TemporaryDirectory(prefix="fairq-bench-") as work:
            bench = Pgbench(dsn, binary, Path(work))

            def measure(key: str, kind: str, batched: bool, scale: Sizes = sizes,
                        **kw: Any) -> float:
                result = throughput(bench, kind, scale, batched, profile=profile, **kw)
                details[key] = result
                log(describe(key, result))
                return float(result["msgs_per_s"])

            if "throughput" in scenarios or "held" in scenarios:
                log(f"throughput, one message per call ({sizes.throughput_s} s each)")
                out["floor_msgs_per_s"] = measure("floor", "floor", False)
                out["cycle_msgs_per_s"] = measure("cycle", "fairq", False)
                out["cycle_vs_floor"] = ratio(out["cycle_msgs_per_s"], out["floor_msgs_per_s"])
            if "held" in scenarios:
                log("held REPEATABLE READ snapshot during the cycle")
                held = measure("cycle_held_snapshot", "fairq", False,
                               during=lambda: held_snapshot(dsn))
                with connect(dsn) as conn:
                    details["cycle_held_snapshot"]["table_stats_after"] = table_stats(conn)
                out["held_snapshot_ratio"] = ratio(held, out["cycle_msgs_per_s"])
                # Reference: the same snapshot against the plain-SQL floor. Its claims leave
                # dead entries in floor_ready_ix just as fairq's dequeues do in its indexes.
                floor_held = measure("floor_held_snapshot", "floor", False,
                                     during=lambda: held_snapshot(dsn))
                out["floor_held_snapshot_ratio"] = ratio(floor_held, out["floor_msgs_per_s"])
            if "throughput" in scenarios:
                out["fifo_msgs_per_s"] = measure("fifo", "fifo", False)
            if "events" in scenarios:
                log("reference: the fairq cycle with fairq.events = off (no NOTIFY)")
                measure("cycle_events_off", "fairq", False, options="-c fairq.events=off")
            if "batched" in scenarios:
                log(f"throughput, {sizes.batch} messages per call")
                out["batched_floor_msgs_per_s"] = measure("batched_floor", "floor", True)
                out["batched_msgs_per_s"] = measure("batched", "fairq", True)
                out["batched_vs_floor"] = ratio(out["batched_msgs_per_s"],
                                                out["batched_floor_msgs_per_s"])
                # Reference: with 100 channels one batch of 100 takes every channel (one call
                # of n is n single dequeues), so batch consumers run one at a time. Over more
                # channels than batches in flight they hold disjoint channels.
                wide = replace(sizes, channels=sizes.wide_channels)
                log(f"reference: {sizes.batch} messages per call over {wide.channels:,} channels")
                out["batched_wide_msgs_per_s"] = measure("batched_wide", "fairq", True, scale=wide)
                out["batched_wide_vs_floor"] = ratio(out["batched_wide_msgs_per_s"],
                                                     out["batched_floor_msgs_per_s"])
            if "depth" in scenarios:
                log(f"dequeue latency vs depth {sizes.depth_levels}")
                details["depth"] = depth_scenario(dsn, sizes, log)
                out["depth_latency_ratio"] = details["depth"]["ratio"]
            if "channels" in scenarios:
                log(f"dequeue latency vs non-empty channels {sizes.channel_levels}")
                details["channels"] = channels_scenario(dsn, sizes, log)
                out["channels_latency_ratio"] = details["channels"]["ratio"]
            if "fairness" in scenarios:
                log(f"fairness: {sizes.fair_light_tenants} light tenants at"
                    f" {sizes.fair_light_rate:g} msgs/s, {sizes.fair_consumers} consumers")
                details["fairness"] = fairness_scenario(dsn, sizes, log)
                out["fairness_wait_ratio"] = details["fairness"]["ratio"]
                out["jain_index"] = details["fairness"]["jain"]["index"]
            if "soak" in scenarios:
                log(f"soak: {sizes.soak_messages:,} messages, batches of {sizes.batch}")
                details["soak"] = soak_scenario(dsn, sizes, log)
                out["soak_ratio"] = details["soak"]["ratio"]
                out["soak_sizes"] = details["soak"]["sizes"]
                log(f"  soak: {details['soak']['msgs_per_s']:,.0f} msgs/s overall, first tenth"
                    f" {details['soak']['first_tenth_msgs_per_s']:,.0f}, last tenth"
                    f" {details['soak']['last_tenth_msgs_per_s']:,.0f}")
            if "tenants" in scenarios:
                log(f"tenant axis: channels {sizes.tenant_levels} and a Zipf spread, 1 and"
                    f" {sizes.batch} msgs per call, floor and fairq interleaved")
                out["tenants"], details["tenants"] = tenants_scenario(bench, sizes, log, profile)
            if "churn" in scenarios:
                log(f"churn: {sizes.churn_messages:,} messages to {sizes.churn_tenants:,} tenants,"
                    f" {sizes.churn_window:,} active at a time")
                churn = churn_scenario(dsn, sizes, log)
                details["churn"] = {key: churn.pop(key) for key in ("check", "table_stats")}
                out["churn"] = churn
            if "weights" in scenarios:
                log("weights: 10 backlogged channels of weights 1..10")
                out["weights"] = weights_scenario(dsn, sizes, log)
            if "queues" in scenarios:
                log(f"queues: a small queue's dequeue latency, alone and beside"
                    f" {sizes.queue_deep:,} messages in another queue")
                details["queues"] = queues_scenario(dsn, sizes, log)
                out["queue_isolation_latency_ratio"] = details["queues"]["ratio"]
    finally:
        with contextlib.suppress(psycopg.Error):
            clean_up(dsn)
    out["machine"]["load_average_end"] = list(os.getloadavg())
    out["machine"]["bench_seconds"] = time.monotonic() - began
    out["targets"] = targets(out)
    out["details"] = details
    return out


def spark_scenario(dsn: str, rows: int, results: dict[str, Any], log: Log) -> None:
    """``--spark``: enqueue ``rows`` DataFrame rows through fairq.spark (local[2]) and
    add ``spark_enqueue_rows_per_s`` and its target to ``results``."""
    from fairq.spark import bench_enqueue, local_session

    log(f"spark: enqueueing {rows:,} DataFrame rows (local[2])")
    reset(dsn)
    spark = local_session("local[2]")
    try:
        rate = bench_enqueue(spark, dsn, rows)
    finally:
        spark.stop()
        clean_up(dsn)
    log(f"  spark: {rate:,.0f} rows/s")
    results["spark_enqueue_rows_per_s"] = rate
    results.setdefault("targets", {}).update(targets(results, "spark_enqueue_rows_per_s"))
