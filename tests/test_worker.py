"""fairq.Worker against a real database: in a thread, and as a `fairq worker` process."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TypedDict

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import ConnectionPool

from fairq import Backoff, CreateStatus, Message, NewMessage, Queue, SettleStatus, Worker
from tcp_proxy import Proxy

TESTS = Path(__file__).parent
FAIRQ = Path(sys.executable).parent / "fairq"


class _Fast(TypedDict):
    poll_interval: timedelta
    grace_period: timedelta


FAST: _Fast = {"poll_interval": timedelta(milliseconds=200), "grace_period": timedelta(seconds=5)}


def eventually(condition: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Polls until ``condition()`` is truthy, returning it; fails after ``timeout`` s
    (a failure net only: tests wait for conditions, not for time to pass)."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
    return result


@contextmanager
def running(worker: Worker[Any]) -> Iterator[None]:
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        yield
    finally:
        worker.stop()
        thread.join(10)
        assert not thread.is_alive()


@pytest.fixture
def queue(dsn: str) -> Iterator[Queue[bytes]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER DATABASE {} SET fairq.history = on")
                     .format(sql.Identifier(conn.info.dbname)))
    with Queue(dsn) as q:
        yield q


def completions(dsn: str) -> list[tuple[int, int]]:
    """(id, num_attempts) of every completion, from fairq.message_history."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT id, num_attempts FROM fairq.message_history"
                            " WHERE outcome = 'completed' ORDER BY id").fetchall()
    return [(int(i), int(n)) for i, n in rows]


def test_heartbeat_keeps_a_short_lock_through_a_long_handler(queue: Queue[bytes],
                                                              dsn: str) -> None:
    sent = queue.send("long", b"job")
    attempts: list[int] = []
    release = threading.Event()
    # Heartbeats every second: a loaded machine that runs one late keeps the lock (with
    # a 1 s lock, one 0.7 s late let the thief below take the message).
    lock = timedelta(seconds=3)

    def handler(message: Message[bytes]) -> None:
        attempts.append(message.num_attempts)
        assert release.wait(120), "never released"

    def lock_state() -> tuple[Any, Any]:
        """(locked_until of the message, fairq.clock()) in one statement."""
        with psycopg.connect(dsn) as conn:
            row = conn.execute("SELECT locked_until, fairq.clock() FROM fairq.message"
                               " WHERE id = %s", (sent.id,)).fetchone()
        assert row is not None
        return row[0], row[1]

    worker = Worker(queue, handler, lock=lock, **FAST)
    with running(worker), Queue(dsn) as thief:
        eventually(lambda: attempts)
        first_until, _ = lock_state()
        # The handler runs until the database clock is a lock length past the first
        # lock's expiry. Until then (and once more after), a consumer tries to take the
        # message: had the lock lapsed, it would get it.
        renewed_until, now = first_until, None
        deadline = time.monotonic() + 120  # a failure net
        while now is None or now <= first_until + lock:
            assert time.monotonic() < deadline, "the database clock did not advance"
            renewed_until, now = lock_state()
            assert thief.dequeue(timedelta(seconds=10)) == []
            time.sleep(0.05)
        release.set()
        eventually(lambda: completions(dsn))
    assert renewed_until > first_until + lock  # heartbeats renewed it, more than once
    assert attempts == [1]
    assert completions(dsn) == [(sent.id, 1)]


def test_a_message_back_while_its_first_handler_runs_is_its_own_delivery(
        queue: Queue[bytes], dsn: str) -> None:
    """A handler may defer its own message (with state: a next step) and run on while
    the same id comes back to the worker. 0.7.26's worker tracked running handlers by
    id: the first one's end took the second out of the heartbeats, its short lock
    lapsed and a third delivery ran beside it."""
    sent = queue.send("steps", b"job")
    attempts: list[int] = []
    second_started = threading.Event()
    lock = timedelta(seconds=3)  # heartbeats every second: a loaded machine keeps it

    def handler(message: Message[bytes]) -> None:
        attempts.append(message.num_attempts)
        if message.num_attempts == 1:
            assert message.defer(state=b"step-2") is SettleStatus.DEFERRED
            assert second_started.wait(60), "never delivered again"
            return  # the worker's completion answers stale: it was deferred
        second_started.set()
        time.sleep(2 * lock.total_seconds())  # outlives its lock: only heartbeats keep it

    worker = Worker(queue, handler, concurrency=2, lock=lock, **FAST)
    with running(worker):
        eventually(lambda: completions(dsn))
    assert attempts == [1, 2]
    assert completions(dsn) == [(sent.id, 2)]


def test_a_rate_limited_channel_is_served_at_its_pace_not_at_the_poll(queue: Queue[bytes],
                                                                       dsn: str) -> None:
    """The doorbell says when a waiting channel may be served next; 0.7.26's worker
    heard it once, then slept a whole poll interval between releases (and a due time
    that had come hid every later one)."""
    queue.channel_set("paced", release_interval=timedelta(milliseconds=300))
    for _ in range(4):
        queue.send("paced", b"x")
    worker = Worker(queue, lambda message: None, concurrency=2, lock=timedelta(seconds=30),
                    poll_interval=timedelta(hours=1), grace_period=timedelta(seconds=5))
    started = time.monotonic()
    with running(worker):
        eventually(lambda: len(completions(dsn)) == 4)
        took = time.monotonic() - started
    # Three intervals of 300 ms; at the poll's pace it takes three polls, three hours.
    assert took < 20, f"4 messages 300 ms apart took {took:.1f} s"


def test_the_doorbell_works_east_of_utc_beside_a_channel_paused_until_datetime_max(
        queue: Queue[bytes], dsn: str) -> None:
    """In a session east of UTC the doorbell's next_turn_at for a channel paused until
    datetime.max is in the year 10000: 0.7.31's worker could not load it, took that for
    a lost connection and never held the doorbell, so producers sent it no events and
    work waited for the poll (an hour here)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER DATABASE {} SET timezone = 'Asia/Tokyo'")
                     .format(sql.Identifier(conn.info.dbname)))
    queue.send("paused", b"p")
    queue.channel_pause("paused", datetime.max.replace(tzinfo=timezone.utc))
    handled: list[bytes] = []
    worker = Worker(queue, lambda message: handled.append(message.content),
                    poll_interval=timedelta(hours=1), grace_period=timedelta(seconds=5))
    with running(worker), psycopg.connect(dsn, autocommit=True) as conn:
        eventually(lambda: conn.execute(LISTENING).fetchone() == (1,))
        eventually(lambda: conn.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
            " WHERE d.datname = current_database() AND l.locktype = 'advisory'"
            " AND l.mode = 'ShareLock' AND l.granted").fetchone() == (1,), timeout=20)
        queue.send("other", b"x")
        eventually(lambda: handled == [b"x"])


def test_a_row_held_by_a_handlers_transaction_holds_up_no_other_heartbeat(
        queue: Queue[bytes], dsn: str) -> None:
    """Handler A completes its message in its own transaction and works on before
    committing: a heartbeat of A waits for that row. Heartbeats run one after another,
    and 0.7.31's waited for it, so B's lock lapsed while B's handler ran and another
    worker was handed B."""
    a_holds_row, release = threading.Event(), threading.Event()
    b_running = threading.Event()

    def handler(message: Message[bytes]) -> None:
        if message.content == b"A":
            with queue.transaction() as tx:
                message.complete(conn=tx)
                a_holds_row.set()
                release.wait(60)
        else:
            b_running.set()
            release.wait(60)

    a = queue.send("a", b"A")
    b = queue.send("b", b"B")
    worker = Worker(queue, handler, concurrency=2, lock=timedelta(seconds=3), **FAST)
    try:
        with running(worker), psycopg.connect(dsn, autocommit=True) as conn:
            assert a_holds_row.wait(60) and b_running.wait(60)
            held_since = conn.execute("SELECT clock_timestamp()").fetchone()
            # A heartbeat of B after A's row was held: B's lock then ends 3 s after it.
            eventually(lambda: conn.execute(
                "SELECT locked_until > %s + interval '3 s' FROM fairq.message WHERE id = %s",
                (held_since[0] if held_since else None, b.id)).fetchone() == (True,),
                timeout=20)
            release.set()
    finally:
        release.set()
    assert sorted(completions(dsn)) == sorted([(a.id, 1), (b.id, 1)])


def test_a_coroutine_returned_by_a_plain_handler_fails_its_message(queue: Queue[bytes],
                                                                    dsn: str) -> None:
    """An async handler given to Worker (behind a decorator that hides it) returns a
    coroutine it never runs: its message must not be completed unrun."""
    sent = queue.send("c", b"x")

    async def body(message: Message[bytes]) -> None:
        raise AssertionError("never awaited")

    def handler(message: Message[bytes]) -> Any:
        return body(message)

    worker = Worker(queue, handler, max_attempts=1, **FAST)
    with running(worker), psycopg.connect(dsn) as conn:
        dead = eventually(lambda: conn.execute(
            "SELECT id, error FROM fairq.dead_letters").fetchall())
    assert dead[0][0] == sent.id and "AsyncWorker" in dead[0][1]
    assert completions(dsn) == []


def test_a_handler_that_exits_fails_its_message_and_stops_the_worker(queue: Queue[bytes],
                                                                      dsn: str) -> None:
    """sys.exit() in a handler thread ended that thread silently: the next message was
    taken and never run, and heartbeated for as long as the worker ran."""
    first = queue.send("c", b"exit")
    worker = Worker(queue, lambda message: sys.exit(3), max_attempts=1, **FAST)
    thread = threading.Thread(target=worker.run, daemon=True)  # (a build with the bug never stops)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the worker did not stop"
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT id, error FROM fairq.dead_letters").fetchall() == [
            (first.id, "SystemExit: 3")]


def test_run_leaves_no_thread_behind(queue: Queue[bytes]) -> None:
    """0.7.26 left its handler threads waiting for work forever once run() returned:
    a process that runs workers one after another gathered them."""
    worker = Worker(queue, lambda message: None, concurrency=3, **FAST)
    with running(worker):
        pass
    def left() -> list[str]:  # (the pool's own threads are the queue's, still open)
        return [t.name for t in threading.enumerate()
                if t.name.startswith(("fairq-handler", "fairq-heartbeat", "fairq-listen"))]
    assert eventually(lambda: not left(), timeout=10), left()


def test_a_worker_runs_again_after_it_returned(queue: Queue[bytes], dsn: str) -> None:
    handled: list[bytes] = []
    worker = Worker(queue, lambda message: handled.append(message.content), **FAST)
    for content in (b"first", b"second"):
        queue.send("c", content)
        with running(worker):
            eventually(lambda content=content: content in handled)
    assert handled == [b"first", b"second"]


def test_a_worker_runs_again_beside_a_handler_it_handed_back(queue: Queue[bytes]) -> None:
    """A handler that outlived the grace period runs on after run() returned; its
    message was handed back and is no longer the worker's. 0.7.31 still counted it in
    flight, so run() again took nothing while it ran (and heartbeated it), and the
    end-of-run signal left for its thread ended the next run's thread instead."""
    release, started = threading.Event(), threading.Event()
    handled: list[bytes] = []

    def handler(message: Message[bytes]) -> None:
        if message.num_attempts == 1 and message.content == b"long":
            started.set()
            release.wait(120)  # (longer than the failure net below)
        handled.append(message.content)

    worker = Worker(queue, handler, poll_interval=timedelta(milliseconds=200),
                    grace_period=timedelta(0))
    queue.send("a", b"long")
    try:
        with running(worker):
            assert started.wait(60)
        queue.send("b", b"next")
        with running(worker):
            eventually(lambda: b"next" in handled, timeout=30)
    finally:
        release.set()


def test_failures_back_off_then_give_up(queue: Queue[bytes]) -> None:
    sent = queue.send("flaky", b"job")
    calls: list[tuple[int, float]] = []

    def handler(message: Message[bytes]) -> None:
        calls.append((message.num_attempts, time.monotonic()))
        raise ValueError("nope")

    backoff = Backoff(base=timedelta(milliseconds=200), cap=timedelta(seconds=1))
    worker = Worker(queue, handler, max_attempts=3, backoff=backoff, **FAST)
    with running(worker):
        [dead] = eventually(queue.dead_letters)
    assert (dead.id, dead.num_attempts, dead.error) == (sent.id, 3, "ValueError: nope")
    assert [n for n, _ in calls] == [1, 2, 3]
    # Equal jitter: at least half the doubling delay (0.2 s, then 0.4 s) passes.
    assert calls[1][1] - calls[0][1] >= 0.1
    assert calls[2][1] - calls[1][1] >= 0.2


def test_a_transient_failure_is_retried_and_completed(queue: Queue[bytes], dsn: str) -> None:
    sent = queue.send("flaky", b"job")

    def handler(message: Message[bytes]) -> None:
        if message.num_attempts == 1:
            raise ConnectionError("try again")

    backoff = Backoff(base=timedelta(milliseconds=50))
    with running(Worker(queue, handler, backoff=backoff, **FAST)):
        eventually(lambda: completions(dsn))
    assert completions(dsn) == [(sent.id, 2)]
    assert queue.dead_letters() == []


def test_a_stale_message_is_not_completed(queue: Queue[bytes], dsn: str,
                                          caplog: pytest.LogCaptureFixture) -> None:
    sent = queue.send("s", b"job")
    handled = threading.Event()

    def handler(message: Message[bytes]) -> None:
        # Someone else takes the message away mid-handler (as an expired lock would).
        with Queue(dsn) as other:
            assert other.defer(message, delay=timedelta(hours=1)) is SettleStatus.DEFERRED
        handled.set()

    with caplog.at_level(logging.WARNING, logger="fairq.worker"), \
            running(Worker(queue, handler, **FAST)):
        eventually(handled.is_set)
        eventually(lambda: "lock lost" in caplog.text)
    assert completions(dsn) == []
    [stats] = queue.channels("s")
    assert (stats.scheduled, stats.in_flight) == (1, 0)
    assert sent.id is not None


def test_a_handler_that_settles_its_own_message_is_no_lost_lock(
        queue: Queue[bytes], caplog: pytest.LogCaptureFixture) -> None:
    """A handler may settle its message itself (defer it to go on later): the worker's
    own completion then answers STALE, which 0.7.31 logged as a lost lock."""
    queue.send("s", b"job")

    def handler(message: Message[bytes]) -> None:
        assert message.defer(delay=timedelta(hours=1)) is SettleStatus.DEFERRED

    with caplog.at_level(logging.DEBUG, logger="fairq.worker"), \
            running(Worker(queue, handler, **FAST)):
        eventually(lambda: "its handler settled it (deferred)" in caplog.text)
    assert "lock lost" not in caplog.text
    [stats] = queue.channels("s")
    assert (stats.scheduled, stats.in_flight) == (1, 0)


def test_a_heartbeat_answered_after_the_completion_committed_is_no_lost_lock(
        queue: Queue[bytes], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A heartbeat that waited for the row of a completion under way (or that went out
    once it had committed, before the worker took the message off its list) answered
    not_found, which 0.7.39 logged as "lock lost while its handler runs": after a
    restart, each completion sent again logged it every heartbeat until the pool was
    back, and short handlers logged it now and then in normal operation. The
    completion's own answer says whether the lock was lost."""
    import fairq.worker

    real_settle = fairq.worker.settle
    real_heartbeat = queue.heartbeat
    heartbeats = 0
    counted = threading.Condition()

    def counted_heartbeat(*args: Any, **kwargs: Any) -> SettleStatus:
        nonlocal heartbeats
        status = real_heartbeat(*args, **kwargs)
        with counted:
            heartbeats += 1
            counted.notify_all()
        return status

    def settle_then_wait(message: Message[bytes], settlement: Any, conn: Any = None) -> Any:
        status = real_settle(message, settlement, conn)
        # Committed, the message still on the worker's list: the heartbeat round that
        # starts second from now has let the first one finish (its report included).
        with counted:
            since = heartbeats
            assert counted.wait_for(lambda: heartbeats >= since + 2, 60)
        settled.set()
        return status

    settled = threading.Event()
    monkeypatch.setattr(queue, "heartbeat", counted_heartbeat)
    monkeypatch.setattr(fairq.worker, "settle", settle_then_wait)
    queue.send("s", b"job")
    with caplog.at_level(logging.DEBUG, logger="fairq.worker"), \
            running(Worker(queue, lambda message: None, lock=timedelta(milliseconds=300),
                           **FAST)):
        eventually(settled.is_set)
    assert queue.stats().size == 0
    assert "lock lost" not in caplog.text


def test_concurrency_runs_handlers_in_parallel(queue: Queue[bytes], dsn: str) -> None:
    queue.send_many([NewMessage(f"c{i}", b"job") for i in range(4)])
    running_now: list[int] = []
    peak = [0]
    guard = threading.Lock()
    all_running = threading.Event()

    def handler(message: Message[bytes]) -> None:
        with guard:
            running_now.append(message.id)
            peak[0] = max(peak[0], len(running_now))
            if peak[0] == 4:
                all_running.set()
        # Each handler runs until all four run at once (or a failure net expires):
        # a worker running them one after another never gets there.
        all_running.wait(20)
        with guard:
            running_now.remove(message.id)

    with running(Worker(queue, handler, concurrency=4, **FAST)):
        eventually(lambda: len(completions(dsn)) == 4)
    assert peak[0] == 4


def test_periodic_schedule_enqueues_work_each_tick(queue: Queue[bytes], dsn: str) -> None:
    interval = timedelta(milliseconds=300)
    first = queue.schedule_periodic("report", interval, "reports", b"make report")
    assert first.status is CreateStatus.CREATED
    again = queue.schedule_periodic("report", interval, "reports", b"other")
    assert (again.status, again.id) == (CreateStatus.DUPLICATE, first.id)

    # A worker that took the driver and crashed: the schedule survives its lock.
    [driver] = queue.dequeue(timedelta(milliseconds=300))
    assert driver.channel == "fairq.periodic"

    work: list[bytes] = []
    with running(Worker(queue, lambda m: work.append(m.content), **FAST)):
        eventually(lambda: len(work) >= 3)
    assert set(work) == {b"make report"}
    [stats] = queue.channels("fairq.periodic")
    assert stats.size == 1  # the driver never completes


def _probe(queue: str | None, id_: int) -> str:
    """A payload as fairq sends it (without a queue: as the extension before named
    queues sends it), for the worker's probe ``id_``."""
    doc: dict[str, Any] = {"event": "message_create", "channel": "probe", "id": id_,
                           "dequeue_at": None}
    if queue is not None:
        doc["queue"] = queue
    return json.dumps(doc)


class Phases(logging.Handler):
    """Records what the worker logged about each probe, and moves ``phase`` on as it
    does, synchronously in the listener (before the wake it may cause): so each dequeue
    can be attributed to the last event heard before it."""

    def __init__(self, phases: dict[int, str]) -> None:
        super().__init__(logging.DEBUG)
        self.phases = phases
        self.phase = "start"
        self.heard: dict[int, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if (isinstance(record.msg, str) and record.msg.startswith("NOTIFY")
                and isinstance(record.args, tuple) and len(record.args) >= 2):
            id_ = record.args[1]
            if id_ in self.phases:
                self.heard[id_] = record.getMessage()
                self.phase = self.phases[id_]


@contextmanager
def phases_logged(phases: dict[int, str]) -> Iterator[Phases]:
    handler = Phases(phases)
    logger = logging.getLogger("fairq.worker")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


LISTENING = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
             " AND query = 'LISTEN fairq' AND state = 'idle'")


def test_wakes_on_its_queues_notify_and_not_on_another_queues(queue: Queue[bytes],
                                                              dsn: str) -> None:
    """With polling out of the picture (an hour), only NOTIFY wakes the worker: a
    message sent (its event names no queue: "default") is handled, while an event of
    the queue "emails" heard before it caused no dequeue."""
    calls: list[str] = []  # the phase of each dequeue, when it was called
    dequeue = queue.dequeue

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(log.phase)
        return dequeue(*args, **kwargs)

    queue.dequeue = counting  # type: ignore[method-assign]
    handled = threading.Event()

    def notify(payload: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_notify('fairq', %s)", (payload,))

    def listening() -> bool:
        with psycopg.connect(dsn) as conn:
            row = conn.execute(LISTENING).fetchone()
        return bool(row and row[0])

    worker = Worker(queue, lambda m: handled.set(), poll_interval=timedelta(hours=1),
                    grace_period=timedelta(seconds=5))
    with phases_logged({-1: "ready", -2: "foreign"}) as log, running(worker):
        eventually(listening)
        # A probe of the default queue: once a dequeue followed it, the worker has
        # nothing pending and sleeps for an hour.
        notify(_probe(None, -1))
        eventually(lambda: "ready" in calls)
        notify(_probe("emails", -2))
        eventually(lambda: -2 in log.heard)
        log.phase = "send"
        sent = queue.send("a", b"job")  # its NOTIFY wakes the worker
        assert handled.wait(60)
    assert "ignored" in log.heard[-2], log.heard
    assert "foreign" not in calls, calls
    eventually(lambda: completions(dsn))
    assert [i for i, _ in completions(dsn)] == [sent.id]


def _worker_process(dsn: str, marks: Path, *options: str,
                    handler: str = "worker_handlers:gated") -> subprocess.Popen[bytes]:
    """A `fairq worker` process running worker_handlers.gated (or ``handler``): each
    delivery runs until the test creates ``marks/release``. Its log goes to
    ``marks/worker.log``. The child imports fairq from where this process does."""
    path = os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "FAIRQ_TEST_MARKS": str(marks)}
    with open(marks / "worker.log", "ab") as log:  # the child keeps its own copy
        return subprocess.Popen([str(FAIRQ), "--dsn", dsn, "worker", handler,
                                 "--poll", "0.2", *options], env=env, stderr=log)


def _log(marks: Path) -> str:
    return (marks / "worker.log").read_text()


def _marks(marks: Path, kind: str) -> set[int]:
    return {int(p.name.split("-")[1]) for p in marks.glob(f"{kind}-*")}


def test_sigterm_finishes_in_flight_work_and_loses_nothing(queue: Queue[bytes], dsn: str,
                                                          tmp_path: Path) -> None:
    sent = queue.send_many([NewMessage(f"t{i}", b"120") for i in range(5)])
    ids = {r.id for r in sent}
    # (A 3 s lock: heartbeats every second, so one run late on a loaded machine does not
    # let a held message's lock lapse and its completion answer stale.)
    proc = _worker_process(dsn, tmp_path, "--concurrency", "2", "--lock", "3", "--grace", "60")
    try:
        # Both handlers are running (and held there) when SIGTERM arrives; they are let
        # go only once the worker has taken the signal.
        eventually(lambda: len(_marks(tmp_path, "started")) >= 2)
        proc.send_signal(signal.SIGTERM)
        eventually(lambda: "received SIGTERM" in _log(tmp_path))
        in_flight = _marks(tmp_path, "started")
        (tmp_path / "release").touch()
        assert proc.wait(timeout=60) == 0, _log(tmp_path)
    finally:
        proc.kill()
    done = completions(dsn)
    completed = {i for i, _ in done}
    assert len(done) == len(completed)  # each completed once
    assert len(in_flight) == 2
    assert _marks(tmp_path, "started") == in_flight  # nothing new taken after SIGTERM
    assert in_flight <= completed  # in-flight work finished in grace
    left = queue.dequeue(timedelta(seconds=30), 10)
    assert {m.id for m in left} == ids - completed  # the rest is back in the queue
    assert all(m.num_attempts == 1 and not m.recovered for m in left)


def test_stop_is_prompt_with_the_database_out_of_reach(dsn: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """With the database gone, stop() waited for the dequeue's connection (the pool's
    timeout, 30 s here as by default) and then for one per message it handed back (30 s
    each): minutes, where Kubernetes kills a pod 30 s after SIGTERM. Now the dequeue
    looks between short waits whether the worker stops, and the first hand-back that
    gets no connection leaves the rest to their locks."""
    proxy = Proxy(dsn)
    pool: ConnectionPool[Any] = ConnectionPool(proxy.dsn, min_size=1, max_size=10, timeout=30,
                                               kwargs={"autocommit": True}, open=True)
    release = threading.Event()
    started: list[int] = []

    def handler(message: Message[bytes]) -> None:
        started.append(message.id)
        release.wait()

    try:
        queue = Queue(pool)
        queue.send_many([NewMessage(f"t{i}", b"job") for i in range(3)])
        # A thread left free: the dequeue loop goes on asking for work.
        worker = Worker(queue, handler, concurrency=4, lock=timedelta(minutes=1),
                        grace_period=timedelta(milliseconds=200),
                        poll_interval=timedelta(milliseconds=100), listen=False)
        thread = threading.Thread(target=worker.run, daemon=True)
        with caplog.at_level(logging.WARNING, logger="fairq.worker"):
            thread.start()
            eventually(lambda: len(started) == 3)
            proxy.cut()
            # The pool's connection is gone and it cannot make another: the dequeue
            # waits for one.
            eventually(lambda: proxy.refused and pool.get_stats().get("requests_waiting"))
            began = time.monotonic()
            worker.stop()
            # (Well below the pool's 30 s that a stop waiting for it takes at least;
            # a fraction of a second here, and a loaded machine is given the rest.)
            thread.join(20)
            took = time.monotonic() - began
            assert not thread.is_alive(), "stop() is waiting for the pool"
        assert took < 20
        assert "could not hand back 3 message(s)" in caplog.text
    finally:
        release.set()
        pool.close()  # (ends the waits of a worker that did not stop)
        proxy.close()


def test_sigterm_hands_back_work_that_outlives_the_grace_period(queue: Queue[bytes], dsn: str,
                                                               tmp_path: Path) -> None:
    sent = queue.send("t", b"120")  # never released: it outlives any grace period
    proc = _worker_process(dsn, tmp_path, "--lock", "30", "--grace", "0.3")
    try:
        eventually(lambda: _marks(tmp_path, "started"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, _log(tmp_path)
    finally:
        proc.kill()
    # Back at once (deferred, not waiting 30 s for the lock), its attempt counted.
    [msg] = queue.dequeue(timedelta(seconds=30))
    assert (msg.id, msg.num_attempts, msg.recovered) == (sent.id, 2, False)
    assert completions(dsn) == []


@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGTERM),
                                           (signal.SIGINT, signal.SIGINT)])
def test_a_second_signal_ends_the_grace_period(queue: Queue[bytes], dsn: str, tmp_path: Path,
                                              first: signal.Signals,
                                              second: signal.Signals) -> None:
    """An operator's second Ctrl-C (or SIGTERM) hands back what still runs at once,
    rather than after a grace period of a minute (until 0.7.38 it was ignored)."""
    sent = queue.send("t", b"120")  # never released: it outlives any grace period
    proc = _worker_process(dsn, tmp_path, "--lock", "30", "--grace", "600")
    try:
        eventually(lambda: _marks(tmp_path, "started"))
        proc.send_signal(first)
        eventually(lambda: f"received {first.name}: stopping" in _log(tmp_path))
        proc.send_signal(second)
        assert proc.wait(timeout=60) == 0, _log(tmp_path)
    finally:
        proc.kill()
    assert f"received {second.name} again" in _log(tmp_path)
    [msg] = queue.dequeue(timedelta(seconds=30))
    assert (msg.id, msg.num_attempts, msg.recovered) == (sent.id, 2, False)
    assert completions(dsn) == []


def _functions_running(thread: threading.Thread) -> set[str]:
    frame = sys._current_frames().get(thread.ident or 0)
    names = set()
    while frame is not None:
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    return names


def test_stop_now_hands_back_what_runs_without_waiting(queue: Queue[bytes]) -> None:
    release = threading.Event()
    started = threading.Event()

    def handler(message: Message[bytes]) -> None:
        started.set()
        release.wait(120)

    sent = queue.send("t", b"job")
    worker = Worker(queue, handler, lock=timedelta(minutes=1), grace_period=timedelta(hours=1),
                    poll_interval=timedelta(milliseconds=100), listen=False)
    thread = threading.Thread(target=worker.run, daemon=True)
    try:
        thread.start()
        assert started.wait(60)
        worker.stop()
        # (Once run() waits in its drain for the handler: the wait is what ends.)
        eventually(lambda: "_drain" in _functions_running(thread))
        worker.stop(now=True)
        thread.join(60)
        assert not thread.is_alive(), "stop(now=True) waited for the grace period"
    finally:
        release.set()
    [msg] = queue.dequeue(timedelta(seconds=30))
    assert (msg.id, msg.num_attempts) == (sent.id, 2)


def test_stop_now_leaves_a_finished_handlers_settlement_to_it(
        queue: Queue[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler that has returned, its completion not yet sent, when stop(now=True)
    ends the grace period: the drain handed the message back as if it still ran, the
    hand-back landed first, the completion came back stale, and the finished work was
    handed out again. Its settlement is left to it now."""
    import fairq.worker
    from fairq._work import SUCCESS

    settling, go = threading.Event(), threading.Event()
    real_settle = fairq.worker.settle

    def held_settle(message: Message[bytes], settlement: Any, conn: Any = None) -> Any:
        if settlement is SUCCESS:  # the handler's completion (not the drain's hand-back)
            settling.set()
            assert go.wait(60)
        return real_settle(message, settlement, conn)

    monkeypatch.setattr(fairq.worker, "settle", held_settle)
    queue.send("t", b"job")
    worker = Worker(queue, lambda message: None, lock=timedelta(minutes=1),
                    grace_period=timedelta(hours=1),
                    poll_interval=timedelta(milliseconds=100), listen=False)
    thread = threading.Thread(target=worker.run, daemon=True)
    try:
        thread.start()
        assert settling.wait(60)
        worker.stop(now=True)
        thread.join(60)
        assert not thread.is_alive()
    finally:
        go.set()
    eventually(lambda: queue.stats().size == 0)  # completed, not back on its channel


@pytest.mark.parametrize("closer", ["another thread", "a handler"])
def test_closing_the_queue_while_run_goes_on_hands_the_work_back_first(
        dsn: str, caplog: pytest.LogCaptureFixture, closer: str) -> None:
    """``Queue.close()`` (leaving ``with Queue(dsn)``) while a Worker's run() goes on
    in another thread: the pool closed under it, every hand-back then failed ("could
    not hand back ... the pool is already closed") and the messages waited for their
    5 min locks. close() has the worker hand them back and stop first, as
    AsyncQueue.close() does, also when a handler closes the queue."""
    queue: Queue[bytes] = Queue(dsn)
    sent = queue.send_many([NewMessage(f"t{i}", b"job") for i in range(3)])
    release = threading.Event()
    started = threading.Semaphore(0)

    def handler(message: Message[bytes]) -> None:
        started.release()
        release.wait(120)

    def closing_handler(message: Message[bytes]) -> None:
        for _ in range(2):
            assert started.acquire(timeout=60)
        queue.close()

    handlers = iter([handler, handler, closing_handler] if closer == "a handler"
                    else [handler] * 3)
    worker = Worker(queue, lambda message: next(handlers)(message), concurrency=3,
                    lock=timedelta(minutes=5), grace_period=timedelta(hours=1),
                    poll_interval=timedelta(milliseconds=100), listen=False)
    thread = threading.Thread(target=worker.run, daemon=True)
    try:
        with caplog.at_level(logging.WARNING, logger="fairq.worker"):
            thread.start()
            if closer == "another thread":
                for _ in range(3):
                    assert started.acquire(timeout=60)
                queue.close()
            thread.join(60)
            assert not thread.is_alive(), "run() went on after close()"
    finally:
        release.set()
    # Once their handlers return, the handed-back messages are not settled: they were,
    # through the pool the queue had closed ("could not be settled", an error).
    for handler_thread in threading.enumerate():
        if handler_thread.name.startswith("fairq-handler"):
            handler_thread.join(60)
    assert "could not" not in caplog.text
    assert caplog.text.count("handed back as the worker stops (deferred)") == 3, caplog.text
    with Queue(dsn) as again:  # back now, once each, not in 5 min
        assert sorted((m.id, m.num_attempts) for m in again.dequeue(timedelta(seconds=30), 10)) \
            == [(r.id, 2) for r in sent]


def test_sigkill_message_returns_after_its_lock_and_completes_once(queue: Queue[bytes],
                                                                  dsn: str,
                                                                  tmp_path: Path) -> None:
    sent = queue.send("k", b"120")  # never released: killed while it runs
    proc = _worker_process(dsn, tmp_path, "--lock", "1")
    try:
        eventually(lambda: _marks(tmp_path, "started"))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert queue.channels("k")[0].in_flight == 1  # still locked by the dead worker

    seen: list[tuple[int, bool]] = []
    worker = Worker(queue, lambda m: seen.append((m.num_attempts, m.recovered)), **FAST)
    with running(worker):
        eventually(lambda: completions(dsn))  # once its lock of 1 s has expired
    assert seen == [(2, True)]
    assert completions(dsn) == [(sent.id, 2)]


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no words for it")


def test_a_handler_error_that_cannot_be_printed_still_fails_its_message(
        queue: Queue[bytes], dsn: str) -> None:
    """Formatting the error raised inside the worker: the message was never settled,
    came back at each lock expiry and ran past max_attempts for ever."""
    ran: list[int] = []

    def handler(message: Message[bytes]) -> None:
        ran.append(message.num_attempts)
        raise _Unprintable

    sent = queue.send("tenant-a", b"x")
    worker = Worker(queue, handler, max_attempts=1, lock=timedelta(seconds=2), **FAST)
    with running(worker):
        eventually(lambda: queue.dead_letters())
    (dead,) = queue.dead_letters()
    assert (dead.id, dead.error) == (sent.id, "_Unprintable (its message could not be read)")
    assert ran == [1]


def test_run_refuses_a_second_run_at_once_and_each_run_has_its_own_heartbeat(
        queue: Queue[bytes]) -> None:
    """Two run()s at once took each other's messages past concurrency. And a heartbeat
    thread in the middle of a round when run() returned missed the stop flag the next
    run() cleared, so heartbeat threads piled up over runs: each run now has its own
    flag (the race needs a slow round; this checks that every run's thread ends)."""
    worker = Worker(queue, lambda message: None, lock=timedelta(seconds=3), **FAST)
    with running(worker):
        eventually(lambda: worker._running.locked())
        with pytest.raises(RuntimeError, match="already running"):
            worker.run()
    for _ in range(3):
        with running(worker):
            eventually(lambda: worker._running.locked())
    beating = [t for t in threading.enumerate() if t.name == "fairq-heartbeat"]
    for thread in beating:
        thread.join(5)  # each run's own quits within its interval
    assert not any(t.is_alive() for t in beating)


def test_heartbeats_go_on_while_handlers_hold_every_pooled_connection(dsn: str) -> None:
    """A handler that does its work in a transaction of the queue's pool and settles the
    message in it holds a connection throughout; with every pooled connection held,
    heartbeats waited for the pool while the lock lapsed, and another worker ran the
    message again. They go on a connection of their own."""
    lock = timedelta(seconds=3)  # heartbeats every second: one run late keeps it
    with Queue(dsn, pool_size=1) as queue, psycopg.connect(dsn, autocommit=True) as watch:
        sent = queue.send("tenant-a", b"x")
        checked: list[bool] = []

        def handler(message: Message[bytes]) -> None:
            with queue.transaction() as tx:  # the pool's only connection
                first = watch.execute("SELECT locked_until FROM fairq.message WHERE id = %s",
                                      (message.id,)).fetchone()
                assert first is not None
                # A heartbeat extends the lock while this holds the pool (by progress: the
                # 20 s are a failure net, heartbeats come every lock / 3). Before, none
                # could come until the handler let go, and the lock lapsed.
                deadline = time.monotonic() + 20
                row = None
                while time.monotonic() < deadline and row != (True,):
                    time.sleep(0.05)
                    row = watch.execute("SELECT locked_until > %s FROM fairq.message WHERE id = %s",
                                        (first[0], message.id)).fetchone()
                checked.append(row == (True,))
                message.complete(conn=tx)

        with running(Worker(queue, handler, lock=lock, **FAST)):
            eventually(lambda: checked)
            eventually(lambda: watch.execute("SELECT count(*) FROM fairq.message").fetchone() == (0,))
    assert checked == [True]
    assert sent.id is not None
