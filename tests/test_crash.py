"""Database crash: PostgreSQL is killed (pg_ctl -m immediate) in the middle of the load.

The test runs on its own cluster with fsync and synchronous_commit on (the session
cluster runs with fsync off, which is not crash-safe). Producer and worker processes
(tests/queue_process.py), on two queues, record ids in files only after their commit
returned:
producers the ids they created, workers the ids they completed (workers also record
each completion in a table, in the same transaction as message_complete). After the
crash and restart:

* every message whose create committed is still queued or was completed;
* every completion whose commit returned is still recorded;
* nothing was completed twice, and fairq.check() is empty;
* the processes reconnect by themselves and drain the queue completely.

The crash is triggered by progress (200 committed creates, 60 committed
completions), and the producers wait after 300 of their 400 messages until the
crash, so it always lands mid-load with work still to create.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fairq.cluster import Cluster
from test_concurrency import spawn


@pytest.fixture
def crash_cluster() -> Iterator[Cluster]:
    cluster = Cluster(settings={"fsync": "on", "synchronous_commit": "on",
                                "full_page_writes": "on", "max_connections": "50"}).start()
    try:
        yield cluster
    finally:
        cluster.remove()


def ids_in(files: list[Path]) -> list[int]:
    out: list[int] = []
    for f in files:
        if f.exists():
            # A process killed mid-write may leave a partial last line: not a record.
            text = f.read_text()
            lines = text.split("\n")
            out += [int(x) for x in lines[:-1] if x]
    return out


QUEUES = ("default", "other")


def test_committed_work_survives_a_database_crash(crash_cluster: Cluster, tmp_path: Path) -> None:
    dsn = crash_cluster.dsn("postgres")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION fairq")
        conn.execute("CREATE TABLE completion (id bigint NOT NULL, channel text NOT NULL,"
                     " attempts bigint NOT NULL, recovered boolean NOT NULL, worker text NOT NULL,"
                     " queue text NOT NULL)")
        for queue in QUEUES:
            conn.execute("SELECT fairq.channel_set('capped', 2, p_queue => %s)", (queue,))

    channels = ["a", "b", "c", "capped"] + [f"x{i}" for i in range(20)]
    deadline = time.time() + 300  # a safety net: the processes stop on their own
    base = {"dsn": dsn, "deadline": deadline}
    produced = [tmp_path / f"p{i}.ids" for i in range(2)]
    completed = [tmp_path / f"w{i}.ids" for i in range(3)]
    # Producers stop after 300 of their 400 messages until the crash: whatever the
    # machine's speed, the crash comes before they are done, and they must reconnect.
    gate = tmp_path / "crashed"
    procs = [spawn({**base, "role": "producer", "name": f"p{i}", "seed": i, "channels": channels,
                    "queues": list(QUEUES), "count": 400, "ids_file": str(produced[i]),
                    "pause": 0.004, "gate_at": 300, "gate_file": str(gate)}, tmp_path)
             for i in range(2)]
    # Two workers on the default queue, one on the other: each queue drains on its own.
    procs += [spawn({**base, "role": "worker", "name": f"w{i}", "seed": 10 + i, "lock_ms": 2000,
                     "work_ms": 3, "defer_p": 0.03, "ids_file": str(completed[i]),
                     "queue": QUEUES[i % 2]}, tmp_path)
              for i in range(3)]
    try:
        # Crash in the middle of the load, by progress: once 200 creates and 60
        # completions have committed (the clock is only a failure net).
        assert _wait(lambda: len(ids_in(produced)) >= 200 and len(ids_in(completed)) >= 60, 120)
        crash_cluster.stop("immediate")
        created_before = set(ids_in(produced))
        completed_before = ids_in(completed)
        gate.touch()  # the producers go on: they must reconnect to finish
        crash_cluster.start()

        with psycopg.connect(dsn, autocommit=True) as conn:
            # One snapshot: queued and completed ids, right after recovery.
            present = {r[0] for r in conn.execute(
                "SELECT id FROM fairq.message UNION ALL SELECT id FROM completion")}
            missing = created_before - present
            recorded = {r[0] for r in conn.execute("SELECT id FROM completion")}
            forgotten = set(completed_before) - recorded
            problems_after_restart = conn.execute("SELECT * FROM fairq.check()").fetchall()

            # The processes reconnect by themselves; wait for the producers, then the drain.
            assert _wait(lambda: all(p.poll() is not None for p in procs[:2]), 120)
            drained = _wait(lambda: conn.execute("SELECT count(*) FROM fairq.message")
                            .fetchone() == (0,), 120)
            created_all = set(ids_in(produced))
            done = conn.execute("SELECT count(*), count(DISTINCT id) FROM completion").fetchone()
            assert done is not None
            lost = created_all - {r[0] for r in conn.execute("SELECT id FROM completion")}
            problems_at_end = conn.execute("SELECT * FROM fairq.check()").fetchall()
            dead = conn.execute("SELECT count(*) FROM fairq.dead_letter").fetchone()
            # Each queue was drained by its own workers.
            by_queue = dict(conn.execute("SELECT queue, count(*) FROM completion GROUP BY queue"
                                         ).fetchall())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    print(f"\ncrash: created before the crash {len(created_before)}, completed before the crash"
          f" {len(completed_before)}; after restart: committed creates missing {len(missing)},"
          f" committed completions forgotten {len(forgotten)}; at the end: created"
          f" {len(created_all)}, completions {done[0]}, lost {len(lost)}, duplicated"
          f" completions {done[0] - done[1]}, dead letters {dead[0] if dead else None},"
          f" drained {drained}")
    assert [p.returncode for p in procs[:2]] == [0, 0], (tmp_path / "p0.err").read_text()
    assert len(created_before) <= 600 and len(completed_before) >= 60  # mid-load, by construction
    assert missing == set()
    assert forgotten == set()
    assert problems_after_restart == []
    assert drained
    assert len(created_all) == 800
    assert lost == set()
    assert done[0] == done[1]
    assert set(by_queue) == set(QUEUES)  # both queues were served
    assert problems_at_end == []


def _wait(predicate: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())
