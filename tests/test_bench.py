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
import time
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


def test_the_gate_closes_at_the_backlog_bound_and_opens_below_it(dsn: str) -> None:
    """Throughput runs are a steady state: producers call only while the gate is open,
    and the gatekeeper closes it while the backlog is at ``throughput_backlog``. Checked
    by progress (the gate's state is polled), not by how much a timed run produced."""
    bench.prepare_database(dsn)

    def gate_reaches(conn: psycopg.Connection[tuple[object, ...]], is_open: bool) -> None:
        deadline = time.monotonic() + 30  # a failure net only
        while conn.execute(f"SELECT open FROM {bench.SCHEMA}.gate").fetchone() != (is_open,):
            assert time.monotonic() < deadline, f"the gate never became open={is_open}"
            time.sleep(0.01)

    try:
        with psycopg.connect(dsn, autocommit=True) as conn, \
                bench._gatekeeper(dsn, "floor", 100):
            conn.execute(f"INSERT INTO {bench.SCHEMA}.floor (channel, content)"
                         " SELECT 1, 'x' FROM generate_series(1, 99)")
            gate_reaches(conn, True)
            conn.execute(f"INSERT INTO {bench.SCHEMA}.floor (channel, content) VALUES (1, 'x')")
            gate_reaches(conn, False)  # at the bound
            conn.execute(f"DELETE FROM {bench.SCHEMA}.floor"
                         f" WHERE id = (SELECT min(id) FROM {bench.SCHEMA}.floor)")
            gate_reaches(conn, True)  # below it again
            conn.execute(f"INSERT INTO {bench.SCHEMA}.floor (channel, content) VALUES (1, 'x')")
            gate_reaches(conn, False)
        # Leaving a run opens the gate for the next one.
        with psycopg.connect(dsn, autocommit=True) as conn:
            gate_reaches(conn, True)
    finally:
        bench.reset(dsn)


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
