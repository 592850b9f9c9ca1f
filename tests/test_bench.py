"""Smoke test of ``fairq bench``: every scenario at a tiny size, against the test database.

No timing assertions: the numbers only have to be there and be sane.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg
import pytest

from fairq import bench
from fairq.bench_plots import write_plots
from fairq.cluster import Cluster

KEYS = (
    "floor_msgs_per_s", "fifo_msgs_per_s", "cycle_msgs_per_s", "cycle_vs_floor",
    "batched_msgs_per_s", "batched_floor_msgs_per_s", "batched_vs_floor",
    "depth_latency_ratio", "channels_latency_ratio", "fairness_wait_ratio", "jain_index",
    "held_snapshot_ratio", "soak_ratio", "soak_sizes", "machine",
    "floor_held_snapshot_ratio", "batched_wide_msgs_per_s", "batched_wide_vs_floor",
)
POSITIVE = (
    "floor_msgs_per_s", "fifo_msgs_per_s", "cycle_msgs_per_s", "cycle_vs_floor",
    "batched_msgs_per_s", "batched_floor_msgs_per_s", "batched_vs_floor",
    "depth_latency_ratio", "channels_latency_ratio", "fairness_wait_ratio",
    "held_snapshot_ratio", "floor_held_snapshot_ratio", "batched_wide_msgs_per_s",
    "batched_wide_vs_floor",
)

pytestmark = pytest.mark.skipif(shutil.which("pgbench") is None, reason="pgbench not installed")


def test_every_scenario_reports_every_key(dsn: str, tmp_path: Path) -> None:
    sizes = dataclasses.replace(bench.TINY, depth_levels=(100, 400), latency_samples=20,
                                channel_levels=(5, 100), fair_phase_s=0.6, soak_messages=1_000)
    lines: list[str] = []
    results = bench.run(dsn, sizes, log=lines.append)

    for key in KEYS:
        assert key in results, key
    for key in POSITIVE:
        value = results[key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
    # A tiny soak may produce everything before its last tenth completes anything.
    assert math.isfinite(results["soak_ratio"]) and results["soak_ratio"] >= 0
    assert 0 < results["jain_index"] <= 1 + 1e-9
    assert results["machine"]["cores"] >= 1
    assert results["machine"]["settings"]["fsync"] in ("on", "off")
    for moment in ("before", "after"):
        assert results["soak_sizes"][moment]["fairq.message"]["table"] >= 0
    soak = results["details"]["soak"]
    assert soak["completed"] == sizes.soak_messages and soak["remaining"] == 0
    assert soak["check"] == []
    assert any("floor" in line for line in lines)

    # The run leaves the database as it found it: fairq consistent and empty.
    assert bench.check(dsn) == []
    # What main() writes: JSON (NaN-free), the table and the plots.
    text = json.dumps(bench._clean(results))
    assert "NaN" not in text
    assert "cycle / floor" in bench.table(results)
    written = write_plots(results, tmp_path / "plots")
    assert {p.name for p in written} == {
        "throughput.png", "latency_depth.png", "latency_channels.png", "fairness.png",
        "soak.png"}
    assert all(p.stat().st_size > 0 for p in written)


def test_main_rejects_unknown_scenarios() -> None:
    assert bench.main(["--only", "nonsense"]) == 2


def test_spark_flag_adds_the_dataframe_enqueue_rate(dsn: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert bench.main(["--dsn", dsn, "--sizes", "tiny", "--only", "depth", "--spark",
                       "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["spark_enqueue_rows_per_s"] > 0
    assert results["targets"]["spark_enqueue_rows_per_s"]["target"] == ">= 20000"
    with psycopg.connect(dsn) as conn:  # the bench cleans up after itself
        assert conn.execute("SELECT count(*) FROM fairq.message").fetchone() == (0,)


def test_producers_pause_while_the_backlog_is_at_its_bound(dsn: str, tmp_path: Path) -> None:
    """Throughput runs are a steady state: the gate holds batched producers (many
    times faster than consumers) back near ``throughput_backlog``; without it (a
    bound nothing reaches) the same run's backlog runs away."""
    pgbench = bench.Pgbench(dsn, bench.pgbench_binary(), tmp_path)
    bench.prepare_database(dsn)
    gated = dataclasses.replace(bench.TINY, throughput_s=2, throughput_backlog=500)
    unbounded = dataclasses.replace(gated, throughput_backlog=10_000_000)
    try:
        held = bench.throughput(pgbench, "floor", gated, batched=True)
        free = bench.throughput(pgbench, "floor", unbounded, batched=True)
    finally:
        bench.reset(dsn)
    assert held["consumed"] > 0 and free["consumed"] > 0
    # The bound is soft: producers may run on for a check interval, and longer when the
    # gate's own session waits for a core. Without the gate the backlog is everything
    # produced minus the little consumed (about 40 times the gated one here).
    assert held["backlog_after"] < held["produced"] / 3, held
    assert held["backlog_after"] * 5 < free["backlog_after"], (held, free)


def test_sigterm_removes_the_throwaway_cluster() -> None:
    """`kill` (or a CI timeout) ends a bench like Ctrl-C: its own cluster is stopped
    and its directory removed, not left running."""
    base = Path(tempfile.mkdtemp(prefix="fairq-bench-test-"))
    base.chmod(0o755)  # the cluster's files belong to the postgres user when run as root
    proc = None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fairq.bench", "--sizes", "tiny", "--only", "soak"],
            env={**os.environ, "TMPDIR": str(base)}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:  # wait until the cluster is up and the run has begun
            if "fairq bench (tiny) against" in line:
                break
        clusters = list(base.glob("fairq-pg-*"))
        assert len(clusters) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 130
        assert not clusters[0].exists()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        for left in base.glob("fairq-pg-*"):  # a failed run must not leak a server
            Cluster(base=left).remove()
        shutil.rmtree(base, ignore_errors=True)
