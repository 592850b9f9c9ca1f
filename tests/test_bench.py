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
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from fairq import bench
from fairq.bench.churn import churn_channel
from fairq.bench.database import SCHEMA, DatabaseInUse, check, prepare_database, reset
from fairq.bench.fairness import UNSERVED_LIGHT_WAITS, backlogged_tenants
from fairq.bench.output import clean, table
from fairq.bench.plots import write_plots
from fairq.bench.stats import jain
from fairq.bench.suite import SCENARIOS
from fairq.bench.targets import targets
from fairq.bench.throughput import _gatekeeper, sustained
from fairq.bench.workloads import _channel_sql
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

# The tenant axis and the churn soak have a test of their own (below).
CLASSIC = tuple(s for s in SCENARIOS if s not in ("tenants", "churn", "weights", "queues"))
TENANT_KEYS = ("single_vs_floor", "batched_vs_floor", "single_msgs_per_s", "batched_msgs_per_s",
               "floor_single_msgs_per_s", "floor_batched_msgs_per_s")

needs_pgbench = pytest.mark.skipif(shutil.which("pgbench") is None,
                                   reason="pgbench not installed")


@needs_pgbench
def test_every_scenario_reports_every_key(dsn: str, tmp_path: Path) -> None:
    sizes = dataclasses.replace(bench.TINY, depth_levels=(100, 400), latency_samples=20,
                                channel_levels=(5, 100), fair_phase_s=0.6, soak_messages=1_000)
    lines: list[str] = []
    results = bench.run(dsn, sizes, log=lines.append, scenarios=CLASSIC)

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
    assert check(dsn) == []
    # What main() writes: JSON (NaN-free), the table and the plots.
    text = json.dumps(clean(results))
    assert "NaN" not in text
    assert "cycle / floor" in table(results)
    written = write_plots(results, tmp_path / "plots")
    assert {p.name for p in written} == {
        "throughput.png", "latency_depth.png", "latency_channels.png", "fairness.png",
        "soak.png"}
    assert all(p.stat().st_size > 0 for p in written)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


@needs_pgbench
def test_tenant_axis_and_churn_soak_report_their_keys(dsn: str, tmp_path: Path) -> None:
    sizes = dataclasses.replace(bench.TINY, tenant_levels=(10, 100), churn_messages=1_000,
                                churn_tenants=100, churn_window=10, soak_backlog=200)
    lines: list[str] = []
    results = clean(bench.run(dsn, sizes, log=lines.append,
                                     scenarios=("tenants", "churn")))

    tenants = results["tenants"]
    assert set(tenants) == {"10", "100", "zipf"}
    for name, level in tenants.items():
        for key in TENANT_KEYS:
            assert _finite(level[key]) and level[key] > 0, (name, key, level[key])
        assert level["channels"] == (100 if name == "zipf" else int(name))
        runs = results["details"]["tenants"][name]
        assert set(runs) == {"floor_single", "fairq_single", "floor_batched", "fairq_batched"}
    assert tenants["zipf"]["spread"] == "zipf"

    churn = results["churn"]
    assert churn["completed"] == 1_000 and churn["remaining"] == 0
    assert results["details"]["churn"]["check"] == []
    # Every tenth reached: a list of ten per measure, sizes of every index of the table.
    for key in ("tenth_end_s", "tenants_seen", "tenth_msgs_per_s", "channel_rows",
                "channel_bytes", "channel_total_bytes", "backlog"):
        assert len(churn[key]) == 10, key
    assert churn["tenants_seen"][-1] == 100
    # A tiny run may create its first tenth before anything completes (rate null).
    assert all(r is None or (_finite(r) and r >= 0) for r in churn["tenth_msgs_per_s"])
    assert _finite(churn["msgs_per_s"]) and churn["msgs_per_s"] > 0
    assert all(rows >= 0 for rows in churn["channel_rows"])
    assert all(b > 0 for b in churn["channel_total_bytes"])
    assert any(name.endswith("_pkey") for name in churn["channel_index_bytes"])
    for sizes_by_tenth in churn["channel_index_bytes"].values():
        assert len(sizes_by_tenth) == 10 and all(b > 0 for b in sizes_by_tenth)
    assert churn["last_vs_first"] is None or churn["last_vs_first"] >= 0
    assert any("churn:" in line for line in lines)
    assert check(dsn) == []

    assert "Zipf 100 ch., batched / floor" in table(results)
    written = write_plots(results, tmp_path / "plots")
    assert {p.name for p in written} == {"tenants.png", "churn.png"}
    assert "NaN" not in json.dumps(results)


def test_targets_resolve_nested_keys_and_relative_thresholds() -> None:
    results: dict[str, object] = {
        "held_snapshot_ratio": 0.45, "floor_held_snapshot_ratio": 0.40,
        "tenants": {"100": {"batched_vs_floor": 0.3},
                    "1000": {"single_vs_floor": 0.6, "batched_vs_floor": 0.45}},
        "churn": {"last_vs_first": 0.95}}
    found = targets(results)
    assert found["tenants.1000.single_vs_floor"]["met"] is True
    assert found["tenants.1000.batched_vs_floor"] == {
        "target": ">= 0.5", "value": 0.45, "met": False}
    assert "tenants.100.batched_vs_floor" not in found  # reported, no target
    assert "tenants.100000.single_vs_floor" not in found  # level not measured
    assert found["held_snapshot_ratio"] == {
        "target": ">= floor_held_snapshot_ratio", "value": 0.45, "threshold": 0.40,
        "met": True}
    assert found["churn.last_vs_first"]["met"] is True
    # Without its reference a relative target is neither met nor missed.
    del results["floor_held_snapshot_ratio"]
    assert targets(results)["held_snapshot_ratio"]["met"] is None
    assert "batched_vs_floor" not in {key for key, _, _ in bench.TARGETS}
    assert "batched_msgs_per_s" not in {key for key, _, _ in bench.TARGETS}


def test_a_run_is_not_credited_with_the_backlog_it_drained() -> None:
    # Producers slower than consumers: the prefilled backlog eaten into is not throughput.
    assert sustained(consumed=3150, produced=1580) == 1580
    # Producers faster (the gate holds the backlog): what was consumed.
    assert sustained(consumed=11278, produced=13138) == 11278


def test_churn_tenants_come_and_go() -> None:
    """Every message goes to a tenant of the current window; the window moves forward
    so that, over the run, every tenant is seen and none comes back."""
    import random

    sizes = dataclasses.replace(bench.TINY, churn_messages=10_000, churn_tenants=1_000,
                                churn_window=50)
    rng = random.Random(1)
    tenants = [int(churn_channel(sizes, i, rng).split("-")[1]) for i in range(10_000)]
    assert set(tenants) <= set(range(1_000))
    # The tenants at either end are in the window for a few messages only.
    assert len(set(tenants)) > 950 and max(tenants) >= 990
    last_seen = {t: i for i, t in enumerate(tenants)}
    first_seen: dict[int, int] = {}
    for i, t in enumerate(tenants):
        first_seen.setdefault(t, i)
    # A tenant's messages span about a window's worth of the run (10,000 * 50 / 950).
    assert max(last_seen[t] - first_seen[t] for t in first_seen) < 600


def test_jain_counts_a_backlogged_tenant_that_got_nothing() -> None:
    """A tenant left backlogged with no delivery in the window vanished from the index
    (a paused bulk tenant: 0.99999, "met"); a drained one is named, not counted."""
    backlogged, drained = backlogged_tenants(
        {"bulk-0": 10, "bulk-1": 1125, "heavy": 50, "bulk-2": 0, "light-3": 1},
        {"bulk-0": 300, "heavy": 310, "bulk-2": 40, "light-3": 5})
    assert backlogged == {"bulk-0": 300, "bulk-1": 0, "heavy": 310}
    assert drained == {"bulk-2"}
    assert jain(list(backlogged.values())) < 0.7


def test_light_messages_never_handed_out_count_with_the_wait_they_had(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT fairq.message_create('light-0', 'x',"
                     " clock_timestamp() - interval '2 s')")
        conn.execute("SELECT fairq.message_create('heavy', 'x')")
        waits = [w for (w,) in conn.execute(UNSERVED_LIGHT_WAITS)]
    assert len(waits) == 1 and waits[0] >= 2


def test_producers_spread_messages_uniformly(dsn: str) -> None:
    """The batched producers rounded a random number: channels 1 and c got half the
    share of the others."""
    sizes = dataclasses.replace(bench.QUICK, channels=10)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT setseed(0.25)")
        counts = dict(conn.execute(f"SELECT ch, count(*) FROM (SELECT {_channel_sql(sizes)} AS ch"
                                   " FROM generate_series(1, 100000)) d GROUP BY 1").fetchall())
    assert sorted(counts) == list(range(1, 11))
    assert min(counts.values()) > 9000 and max(counts.values()) < 11000


def test_a_database_holding_any_fairq_data_is_refused(dsn: str) -> None:
    """Only messages and channels were looked at: dead letters, history and paused
    queues were wiped."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT fairq.queue_pause('billing')")
    with pytest.raises(DatabaseInUse, match=r"fairq\.queue"):
        prepare_database(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM fairq.queue").fetchone() == (1,)


def test_main_rejects_unknown_scenarios() -> None:
    assert bench.main(["--only", "nonsense"]) == 2


@needs_pgbench
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
    prepare_database(dsn)

    def gate_reaches(conn: psycopg.Connection[tuple[object, ...]], is_open: bool) -> None:
        deadline = time.monotonic() + 30  # a failure net only
        while conn.execute(f"SELECT open FROM {SCHEMA}.gate").fetchone() != (is_open,):
            assert time.monotonic() < deadline, f"the gate never became open={is_open}"
            time.sleep(0.01)

    try:
        with psycopg.connect(dsn, autocommit=True) as conn, \
                _gatekeeper(dsn, "floor", 100):
            conn.execute(f"INSERT INTO {SCHEMA}.floor (channel, content)"
                         " SELECT 1, 'x' FROM generate_series(1, 99)")
            gate_reaches(conn, True)
            conn.execute(f"INSERT INTO {SCHEMA}.floor (channel, content) VALUES (1, 'x')")
            gate_reaches(conn, False)  # at the bound
            conn.execute(f"DELETE FROM {SCHEMA}.floor"
                         f" WHERE id = (SELECT min(id) FROM {SCHEMA}.floor)")
            gate_reaches(conn, True)  # below it again
            conn.execute(f"INSERT INTO {SCHEMA}.floor (channel, content) VALUES (1, 'x')")
            gate_reaches(conn, False)
        # Leaving a run opens the gate for the next one.
        with psycopg.connect(dsn, autocommit=True) as conn:
            gate_reaches(conn, True)
    finally:
        reset(dsn)


@needs_pgbench
@pytest.mark.parametrize(("stop", "signals"), [
    (signal.SIGTERM, 1), (signal.SIGTERM, 2), (signal.SIGINT, 2)])
def test_sigterm_removes_the_throwaway_cluster(stop: signal.Signals, signals: int) -> None:
    """`kill` (or a CI timeout) ends a bench like Ctrl-C: its own cluster is stopped
    and its directory removed, not left running — also when a second signal comes
    while the cluster is being removed."""
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
        proc.send_signal(stop)
        if signals == 2:
            for line in proc.stdout:
                if "removing the throwaway cluster" in line:
                    proc.send_signal(stop)
                    break
        assert proc.wait(60) == 130
        assert not clusters[0].exists()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        for left in base.glob("fairq-pg-*"):  # a failed run must not leak a server
            Cluster(base=left).remove()
        shutil.rmtree(base, ignore_errors=True)


@needs_pgbench
def test_weights_and_queue_isolation_report_their_keys(dsn: str) -> None:
    lines: list[str] = []
    results = clean(bench.run(dsn, bench.TINY, log=lines.append, scenarios=("weights", "queues")))
    weights = results["weights"]
    # SPEC behaviour 1: any 55 consecutive deliveries hold each weight +- 1.
    assert weights["max_window_deviation"] <= 1
    for mode in ("single", "batched"):
        assert weights[mode]["deliveries"] == 3 * 55
        assert abs(sum(weights[mode]["shares"].values()) - 1) < 1e-9
    assert _finite(results["queue_isolation_latency_ratio"])
    assert results["details"]["queues"]["deep_messages"] == bench.TINY.queue_deep
    assert "small queue latency" in table(results)
    assert check(dsn) == []


def test_threads_still_running_get_one_grace_together_and_are_reported() -> None:
    """Threads that end when asked end the join quietly; those that ignore ``stop`` are
    waited for one grace period in all (not one each) and reported."""
    import threading

    from fairq.bench.threads import Threads

    polite = Threads()
    for _ in range(3):
        polite.start(polite.stop.wait)
    polite.join(0)

    never = threading.Event()
    stuck = Threads()
    for _ in range(3):
        stuck.start(never.wait)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="3 of 3 threads did not stop within 2 s"):
        stuck.join(0, grace=2.0)
    assert time.monotonic() - started < 5.0  # one grace (2 s), not three (6 s)
    never.set()


@pytest.fixture
def python_ctrl_c() -> Iterator[None]:
    """Python's own Ctrl-C handler for the test. A process started in the background
    by a non-interactive shell (`pytest ... &`) begins with SIGINT ignored, and Python
    then installs no handler: the tests' SIGINT did nothing, and the runs they
    interrupt ran to their end."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_when(dsn: str, sql: str) -> threading.Thread:
    """Ctrl-C for the main thread (a real SIGINT, as a terminal sends) as soon as ``sql``
    returns true: by the run's progress, not after some time."""
    main = threading.main_thread().ident
    assert main is not None

    def watch() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            deadline = time.monotonic() + 60  # a failure net only
            while conn.execute(sql).fetchone() != (True,):
                assert time.monotonic() < deadline
                time.sleep(0.01)
        signal.pthread_kill(main, signal.SIGINT)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return watcher


# Under way: messages are being created (the sequence is not reset between runs).
UNDER_WAY = "SELECT last_value >= 500 FROM fairq.message_id_seq"


@pytest.mark.parametrize(("scenario", "progress"), [
    ("soak", UNDER_WAY),  # the soak's producer and consumer threads
    ("depth", UNDER_WAY),  # a bulk load's threads
    # The fairness scenario's light producer and its consumers.
    ("fairness", "SELECT EXISTS (SELECT FROM fairq.channel WHERE name LIKE 'light-%')"),
], ids=["soak", "load", "fairness"])
@pytest.mark.usefixtures("python_ctrl_c")
def test_an_interrupted_run_stops_its_threads_before_emptying_the_database(
        dsn: str, scenario: str, progress: str) -> None:
    """Ctrl-C during a run on --dsn: the bench empties the database on its way out, but
    its threads went on creating messages after that (until the process exited), and
    the next run refused the database as holding fairq data."""
    sizes = dataclasses.replace(bench.TINY, soak_messages=1_000_000, soak_max_s=120.0,
                                depth_levels=(1_000_000,), load_chunk=100, fair_phase_s=120.0)
    before = set(threading.enumerate())
    watcher = _interrupt_when(dsn, progress)
    with pytest.raises(KeyboardInterrupt):
        bench.run(dsn, sizes, log=lambda line: None, scenarios=(scenario,))
    watcher.join(10)
    left = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == [], "threads of the run still working on the database"
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM fairq.message").fetchone() == (0,)
    prepare_database(dsn)  # the next run accepts the database


def test_a_database_it_cannot_reach_is_one_line_and_exit_1(
        capsys: pytest.CaptureFixture[str]) -> None:
    """An unreachable --dsn (a typo, a server down) ended in a psycopg traceback."""
    import socket

    # A port bound and not listened on: refused, and nobody else can take it meanwhile
    # (closed before the call, another process could start listening on it).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        dsn = f"host=127.0.0.1 port={port} user=bench password=s3cret dbname=bench"
        assert bench.main(["--dsn", dsn, "--sizes", "tiny", "--only", "depth"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "s3cret" not in err
    assert "fairq bench: failed: connection failed:" in err and "Connection refused" in err


@needs_pgbench
def test_pgbench_is_not_given_the_password_on_its_command_line(dsn: str, tmp_path: Path) -> None:
    """Every local user can read a process's command line (ps, /proc): the --dsn's
    password was on pgbench's. It goes in pgbench's environment instead."""
    from fairq.bench.pgbench import Pgbench, pgbench_binary

    secret = psycopg.conninfo.make_conninfo(dsn, password="s3cret-pw")
    runner = Pgbench(secret, pgbench_binary(), tmp_path)
    proc = runner.start("probe", "SELECT 1;\n", 1, 1)
    try:
        # (Popen may return before the child has exec'd pgbench: wait until it has.)
        deadline = time.monotonic() + 30  # a failure net only
        while b"pgbench" not in (cmdline := Path(f"/proc/{proc.pid}/cmdline").read_bytes()):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
    finally:
        output = Pgbench.finish(proc, 1)  # (the test server trusts: any password will do)
    assert b"s3cret-pw" not in cmdline
    assert b"PGPASSWORD=s3cret-pw" in environ.split(b"\0")
    assert "tps =" in output


def test_a_json_path_it_cannot_write_is_refused_before_the_run(
        dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json under a regular file: the whole run (an hour, full size) went by and then
    ended in a traceback, its results and table lost."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    assert bench.main(["--dsn", dsn, "--sizes", "tiny", "--only", "soak",
                       "--json", str(blocker / "bench.json")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--json" in err
    assert "soak" not in err  # refused before anything ran
    # No message was ever made (the bench empties the database after a run, but leaves
    # the id sequence as it was): read from the database, not from how long it took.
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT is_called FROM fairq.message_id_seq").fetchone() == (False,)


@needs_pgbench
@pytest.mark.parametrize(("stop", "handler"), [
    (signal.SIGINT, "python"),  # Python's own Ctrl-C handler, as for bench.run() from code
    (signal.SIGTERM, "bench"),  # fairq bench's handler (cli), which SIGINT shares
], ids=["SIGINT", "SIGTERM"])
@pytest.mark.usefixtures("python_ctrl_c")
def test_an_interrupt_right_after_pgbench_starts_still_ends_it(
        dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: signal.Signals,
        handler: str) -> None:
    """A signal between Popen's return and the bench listing the process: nobody ended
    that pgbench, and it went on writing to the database (or the throwaway cluster)
    that the interrupted bench was emptying (or removing) on its way out. A real signal
    right after the fork, by a hook in Popen: not a race against the clock."""
    from fairq.bench import pgbench as pgbench_module
    from fairq.bench.cli import _interrupt
    from fairq.bench.pgbench import Pgbench, pgbench_binary
    from fairq.bench.throughput import throughput

    started: list[subprocess.Popen[str]] = []
    real_popen = subprocess.Popen

    def popen_then_signal(*args: object, **kwargs: object) -> subprocess.Popen[str]:
        proc: subprocess.Popen[str] = real_popen(*args, **kwargs)  # type: ignore[call-overload]
        started.append(proc)
        signal.raise_signal(stop)  # (its handler runs before raise_signal returns)
        return proc

    prepare_database(dsn)
    runner = Pgbench(dsn, pgbench_binary(), tmp_path)
    # A minute of -T: a pgbench left running is still running when it is looked at.
    sizes = dataclasses.replace(bench.TINY, throughput_s=60)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(pgbench_module.subprocess, "Popen", popen_then_signal)
    try:
        if handler == "bench":
            for s in previous:
                signal.signal(s, _interrupt)
        with pytest.raises(KeyboardInterrupt):
            throughput(runner, "floor", sizes, batched=False)
        assert len(started) == 1  # the producers' pgbench; the consumers' never started
        assert started[0].poll() is not None, "a pgbench outlived the interrupted run"
        assert runner.running == []
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for proc in started:  # a failed run must not leak a pgbench
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
