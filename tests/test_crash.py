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

On the same kind of cluster, a long outage (the server stopped while workers wait
for work): once the server is back, a Worker and an AsyncWorker on queues that own
their pools take work again within seconds, not after the pool's growing backoff.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fairq import AsyncMessage, AsyncQueue, AsyncWorker, Message, Queue, Worker
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


def test_workers_take_work_within_seconds_of_the_end_of_a_long_outage(
        crash_cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    dsn = crash_cluster.dsn("postgres")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION fairq")
    handled: dict[bytes, float] = {}  # content -> monotonic time its handler ran

    def handle(message: Message[bytes]) -> None:
        handled[message.content] = time.monotonic()

    async def ahandle(message: AsyncMessage[bytes]) -> None:
        handled[message.content] = time.monotonic()

    poll = timedelta(milliseconds=500)
    queue = Queue(dsn, name="sync")
    worker = Worker(queue, handle, poll_interval=poll)
    aworkers: list[AsyncWorker[bytes]] = []

    async def run_async_worker() -> None:
        async with AsyncQueue(dsn, name="async") as aqueue:
            aworkers.append(AsyncWorker(aqueue, ahandle, poll_interval=poll))
            await aworkers[0].run()

    # A producer's call made while the server is down waits in its pool's queue (the
    # pool's timeout: 30 s) all through the outage, with no new call to start new
    # connect attempts, and must go through once the server is back.
    producer = Queue(dsn, name="producer")
    producer_met: list[str | float] = []  # errors, then when a send went through
    finished = threading.Event()

    def send_through_the_outage() -> None:
        while not finished.is_set():
            try:
                producer.send("c", b"x")
            except psycopg.OperationalError as exc:  # (PoolTimeout is one)
                producer_met.append(type(exc).__name__)
            else:
                producer_met.append(time.monotonic())
                return

    threads = [threading.Thread(target=worker.run),
               threading.Thread(target=asyncio.run, args=(run_async_worker(),), name="aio")]
    for thread in threads:
        thread.start()

    def send_both(content: bytes) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for name in ("sync", "async"):
                Queue(conn, name=name).send(name, content + name.encode())

    def connects_failing_since(seconds: float) -> bool:
        """Whether each pool's connects have failed for ``seconds``, and its attempts
        span 13 s (those of the async pool are logged from its loop's thread)."""
        failed: dict[bool, list[float]] = {True: [], False: []}
        for record in caplog.records:
            if record.getMessage().startswith("error connecting in 'fairq'"):
                failed[record.threadName == "aio"].append(record.created)
        return all(times and time.time() - times[0] >= seconds and times[-1] - times[0] >= 13
                   for times in failed.values())

    try:
        send_both(b"before-")
        producer.send("c", b"x")
        assert _wait(lambda: {b"before-sync", b"before-async"} <= set(handled), 30)
        with caplog.at_level(logging.WARNING, logger="psycopg.pool"):
            crash_cluster.stop("fast")
            down = time.monotonic()
            threads.append(threading.Thread(target=send_through_the_outage))
            threads[-1].start()
            # psycopg_pool's own backoff tries at 0, 1, 3, 7, 15 and 31 s (+-10%) of a
            # series; the worker's retries start a few series within a second or two
            # of each other. At 18 s each has made its 15 s attempt and waits for its
            # 31 s one: the pools of 0.7.39 came back 10-13.5 s after the server, these
            # within 1 s.
            assert _wait(lambda: connects_failing_since(18), 60)
            crash_cluster.start()
            up = time.monotonic()
            send_both(b"after-")
            assert _wait(lambda: {b"after-sync", b"after-async"} <= set(handled), 30)
            assert _wait(lambda: producer_met and isinstance(producer_met[-1], float), 30)
        back = {name: round(handled[b"after-" + name.encode()] - up, 1)
                for name in ("sync", "async")}
        sent = producer_met[-1]
        assert isinstance(sent, float)
        print(f"\noutage of {up - down:.1f} s: work taken again {back} s after the server,"
              f" the producer's send went through {sent - up:.1f} s after it"
              f" (after {producer_met[:-1]})")
        assert back["sync"] < 6 and back["async"] < 6, back
        assert "PoolTimeout" not in producer_met and sent - up < 6, producer_met
    finally:
        finished.set()
        worker.stop(now=True)
        for aworker in aworkers:
            aworker.stop(now=True)
        for thread in threads:
            thread.join(30)
        queue.close()
        producer.close()


def _wait(predicate: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())
