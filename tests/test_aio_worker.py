"""fairq.AsyncWorker against a real database, each scenario driven with ``asyncio.run``.

Like tests/test_worker.py, the tests wait for progress (a handler started, a row
appeared, the worker logged an event), never for time to pass: handlers are gated
with events the test sets.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from fairq import (
    AsyncMessage,
    AsyncQueue,
    AsyncWorker,
    Backoff,
    NewMessage,
    Queue,
    SettleStatus,
)
from fairq.types import CreateStatus
from tcp_proxy import Proxy
from test_worker import FAST, LISTENING, _log, _marks, _probe, _worker_process, phases_logged

TIMEOUT = 60.0  # a failure net only


async def until(condition: Callable[[], Any] | Callable[[], Awaitable[Any]],
                timeout: float = TIMEOUT) -> Any:
    """Polls until ``condition()`` (maybe a coroutine) is truthy and returns it."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def fetch(dsn: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(query, params)  # type: ignore[arg-type]
        return await cur.fetchall()


async def completions(dsn: str) -> list[tuple[int, int]]:
    """(id, num_attempts) of every completion, from fairq.message_history."""
    rows = await fetch(dsn, "SELECT id, num_attempts FROM fairq.message_history"
                            " WHERE outcome = 'completed' ORDER BY id")
    return [(int(i), int(n)) for i, n in rows]


@asynccontextmanager
async def running(worker: AsyncWorker[Any]) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(worker.run())
    try:
        yield task
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)


@pytest.fixture
def hdsn(dsn: str) -> str:
    """The test database, with fairq.history on for every session."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER DATABASE {} SET fairq.history = on")
                     .format(sql.Identifier(conn.info.dbname)))
    return dsn


def test_handlers_run_as_concurrent_tasks_and_complete(hdsn: str) -> None:
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            sent = await queue.send_many([NewMessage(f"c{i}", b"job") for i in range(4)])
            now_running: set[int] = set()
            peak = 0
            all_running = asyncio.Event()

            async def handler(message: AsyncMessage[bytes]) -> None:
                nonlocal peak
                now_running.add(message.id)
                peak = max(peak, len(now_running))
                if peak == 4:
                    all_running.set()
                # Each runs until all four run at once: one after another never gets there.
                await asyncio.wait_for(all_running.wait(), 20)
                now_running.remove(message.id)

            async with running(AsyncWorker(queue, handler, concurrency=4, **FAST)):
                await until(lambda: _count_is(completions(hdsn), 4))
            assert peak == 4
            assert sorted(await completions(hdsn)) == sorted((r.id, 1) for r in sent)
    asyncio.run(scenario())


async def _count_is(rows: Awaitable[list[Any]], n: int) -> bool:
    return len(await rows) == n


def test_failures_back_off_then_give_up(hdsn: str) -> None:
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            sent = await queue.send("flaky", b"job")
            calls: list[tuple[int, float]] = []

            async def handler(message: AsyncMessage[bytes]) -> None:
                calls.append((message.num_attempts, time.monotonic()))
                raise ValueError("nope")

            backoff = Backoff(base=timedelta(milliseconds=200), cap=timedelta(seconds=1))
            async with running(AsyncWorker(queue, handler, max_attempts=3, backoff=backoff,
                                           **FAST)):
                [dead] = await until(queue.dead_letters)
            assert (dead.id, dead.num_attempts, dead.error) == (sent.id, 3, "ValueError: nope")
            assert [n for n, _ in calls] == [1, 2, 3]
            # Equal jitter: at least half the doubling delay (0.2 s, then 0.4 s) passes.
            assert calls[1][1] - calls[0][1] >= 0.1
            assert calls[2][1] - calls[1][1] >= 0.2
    asyncio.run(scenario())


def test_a_transient_failure_is_retried_and_completed(hdsn: str) -> None:
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            sent = await queue.send("flaky", b"job")

            async def handler(message: AsyncMessage[bytes]) -> None:
                if message.num_attempts == 1:
                    raise ConnectionError("try again")

            backoff = Backoff(base=timedelta(milliseconds=50))
            async with running(AsyncWorker(queue, handler, backoff=backoff, **FAST)):
                await until(lambda: completions(hdsn))
            assert await completions(hdsn) == [(sent.id, 2)]
            assert await queue.dead_letters() == []
    asyncio.run(scenario())


def test_heartbeat_keeps_a_short_lock_through_a_long_handler(hdsn: str) -> None:
    # Heartbeats every second: a loaded loop that runs one late keeps the lock (with a
    # 1 s lock, one 0.7 s late let the thief below take the message).
    lock = timedelta(seconds=3)

    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue, AsyncQueue(hdsn) as thief:
            sent = await queue.send("long", b"job")
            attempts: list[int] = []
            release = asyncio.Event()

            async def handler(message: AsyncMessage[bytes]) -> None:
                attempts.append(message.num_attempts)
                await asyncio.wait_for(release.wait(), 120)

            async def lock_state() -> tuple[Any, Any]:
                """(locked_until of the message, fairq.clock()) in one statement."""
                [row] = await fetch(hdsn, "SELECT locked_until, fairq.clock() FROM fairq.message"
                                          " WHERE id = %s", sent.id)
                return row[0], row[1]

            async with running(AsyncWorker(queue, handler, lock=lock, **FAST)):
                await until(lambda: attempts)
                first_until, _ = await lock_state()
                # The handler runs until the database clock is a lock length past the
                # first lock's expiry; meanwhile a consumer tries to take the message.
                renewed_until, now = first_until, None
                deadline = time.monotonic() + 120  # a failure net
                while now is None or now <= first_until + lock:
                    assert time.monotonic() < deadline, "the database clock did not advance"
                    renewed_until, now = await lock_state()
                    assert await thief.dequeue(timedelta(seconds=10)) == []
                    await asyncio.sleep(0.05)
                release.set()
                await until(lambda: completions(hdsn))
            assert renewed_until > first_until + lock  # renewed by heartbeats, more than once
            assert attempts == [1]
            assert await completions(hdsn) == [(sent.id, 1)]
    asyncio.run(scenario())


def test_a_stale_message_is_not_completed(hdsn: str, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue, AsyncQueue(hdsn) as other:
            await queue.send("s", b"job")
            handled = asyncio.Event()

            async def handler(message: AsyncMessage[bytes]) -> None:
                # Someone else takes the message away mid-handler (as an expired lock would).
                status = await other.defer(message, delay=timedelta(hours=1))
                assert status is SettleStatus.DEFERRED
                handled.set()

            async with running(AsyncWorker(queue, handler, **FAST)):
                await until(handled.is_set)
                await until(lambda: "lock lost" in caplog.text)
            assert await completions(hdsn) == []
            [stats] = await queue.channels("s")
            assert (stats.scheduled, stats.in_flight) == (1, 0)

    with caplog.at_level(logging.WARNING, logger="fairq.worker"):
        asyncio.run(scenario())


def test_a_heartbeat_answered_after_the_completion_committed_is_no_lost_lock(
        hdsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """As tests/test_worker.py's twin: a heartbeat that answered not_found once the
    completion had committed, the message still on the worker's list, was logged as
    "lock lost while its handler runs"."""
    import fairq.aio_worker

    real_settle = fairq.aio_worker.settle

    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            real_heartbeat = queue.heartbeat
            heartbeats = 0

            async def counted_heartbeat(*args: Any, **kwargs: Any) -> SettleStatus:
                nonlocal heartbeats
                status = await real_heartbeat(*args, **kwargs)
                heartbeats += 1
                return status

            async def settle_then_wait(message: AsyncMessage[bytes], settlement: Any,
                                       conn: Any = None) -> Any:
                status = await real_settle(message, settlement, conn)
                # Committed, the message still on the worker's list: the heartbeat
                # round that starts second from now has let the first one finish.
                since = heartbeats
                await until(lambda: heartbeats >= since + 2)
                settled.set()
                return status

            async def handler(message: AsyncMessage[bytes]) -> None:
                pass

            settled = asyncio.Event()
            monkeypatch.setattr(queue, "heartbeat", counted_heartbeat)
            monkeypatch.setattr(fairq.aio_worker, "settle", settle_then_wait)
            await queue.send("s", b"job")
            async with running(AsyncWorker(queue, handler, lock=timedelta(milliseconds=300),
                                           **FAST)):
                await asyncio.wait_for(settled.wait(), TIMEOUT)
            assert (await queue.stats()).size == 0

    with caplog.at_level(logging.DEBUG, logger="fairq.worker"):
        asyncio.run(scenario())
    assert "lock lost" not in caplog.text


def test_stop_lets_running_handlers_finish_and_takes_nothing_new(hdsn: str) -> None:
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            sent = await queue.send_many([NewMessage(f"g{i}", b"job") for i in range(3)])
            started: list[int] = []
            release = asyncio.Event()

            async def handler(message: AsyncMessage[bytes]) -> None:
                started.append(message.id)
                await asyncio.wait_for(release.wait(), 60)

            worker = AsyncWorker(queue, handler, concurrency=2, **FAST)
            task = asyncio.create_task(worker.run())
            await until(lambda: len(started) == 2)
            worker.stop()
            # The handlers are let go only once the worker has been told to stop.
            release.set()
            await asyncio.wait_for(task, 30)
            done = await completions(hdsn)
            assert sorted(i for i, _ in done) == sorted(started)
            [left] = await queue.dequeue(timedelta(seconds=30), 10)
            assert {left.id} == {r.id for r in sent} - set(started)
            assert (left.num_attempts, left.recovered) == (1, False)  # never taken before
    asyncio.run(scenario())


class Endless:
    """A handler that never finishes by itself; it records that it started and that it
    was cancelled (make it inside the running loop)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def __call__(self, message: AsyncMessage[bytes]) -> None:
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def test_work_that_outlives_the_grace_period_is_handed_back_and_cancelled(hdsn: str) -> None:
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            sent = await queue.send("t", b"job")
            handler = Endless()
            started, cancelled = handler.started, handler.cancelled
            worker = AsyncWorker(queue, handler, lock=timedelta(seconds=30),
                                 grace_period=timedelta(milliseconds=300),
                                 poll_interval=FAST["poll_interval"])
            task = asyncio.create_task(worker.run())
            await asyncio.wait_for(started.wait(), TIMEOUT)
            worker.stop()
            await asyncio.wait_for(task, 30)
            assert cancelled.is_set()
            # Back at once (deferred, not waiting 30 s for its lock), its attempt counted.
            [msg] = await queue.dequeue(timedelta(seconds=30))
            assert (msg.id, msg.num_attempts, msg.recovered) == (sent.id, 2, False)
            assert await completions(hdsn) == []
    asyncio.run(scenario())


def _awaiting(task: asyncio.Task[Any]) -> set[str]:
    """The coroutines ``task`` is suspended in, by name."""
    names = set()
    awaited: Any = task.get_coro()
    while awaited is not None:
        code = getattr(awaited, "cr_code", None)
        if code is not None:
            names.add(code.co_name)
        awaited = getattr(awaited, "cr_await", None)
    return names


def test_stop_now_ends_the_grace_period(hdsn: str) -> None:
    """stop(now=True) after stop() hands back what still runs at once (a second
    SIGTERM/SIGINT does this), rather than after a grace period of an hour."""
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            sent = await queue.send("t", b"job")
            handler = Endless()
            worker = AsyncWorker(queue, handler, lock=timedelta(seconds=30),
                                 grace_period=timedelta(hours=1),
                                 poll_interval=FAST["poll_interval"])
            task = asyncio.create_task(worker.run())
            await asyncio.wait_for(handler.started.wait(), TIMEOUT)
            worker.stop()
            # (Once run() waits in its drain for the handler: the wait is what ends.)
            await until(lambda: "_drain" in _awaiting(task))
            worker.stop(now=True)
            await asyncio.wait_for(task, 30)
            assert handler.cancelled.is_set()
            [msg] = await queue.dequeue(timedelta(seconds=30))
            assert (msg.id, msg.num_attempts, msg.recovered) == (sent.id, 2, False)
            assert await completions(hdsn) == []
    asyncio.run(scenario())


def test_stop_now_leaves_a_finished_handlers_settlement_to_it(
        hdsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """As tests/test_worker.py's twin: a handler that has returned, its completion
    under way, when stop(now=True) ends the grace period. The drain handed the message
    back and cancelled the completion, and the finished work was handed out again."""
    import fairq.aio_worker
    from fairq._work import SUCCESS

    real_settle = fairq.aio_worker.settle

    async def scenario() -> None:
        settling, go = asyncio.Event(), asyncio.Event()

        async def held_settle(message: AsyncMessage[bytes], settlement: Any,
                              conn: Any = None) -> Any:
            if settlement is SUCCESS:  # the handler's completion (not a hand-back)
                settling.set()
                await go.wait()
            return await real_settle(message, settlement, conn)

        monkeypatch.setattr(fairq.aio_worker, "settle", held_settle)
        async with AsyncQueue(hdsn) as queue:
            sent = await queue.send("t", b"job")

            async def handler(message: AsyncMessage[bytes]) -> None:
                pass

            worker = AsyncWorker(queue, handler, lock=timedelta(minutes=1),
                                 grace_period=timedelta(hours=1),
                                 poll_interval=FAST["poll_interval"])
            task = asyncio.create_task(worker.run())
            await asyncio.wait_for(settling.wait(), TIMEOUT)
            worker.stop(now=True)
            await until(lambda: "_drain" in _awaiting(task))
            go.set()
            await asyncio.wait_for(task, 30)
            assert (await queue.stats()).size == 0  # completed, not back on its channel
            assert await completions(hdsn) == [(sent.id, 1)]
    asyncio.run(scenario())


def test_stop_is_prompt_with_the_database_out_of_reach(
        dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """As tests/test_worker.py's twin: with the database gone, stop() waited for the
    dequeue's connection (the pool's timeout) and then for one per message handed back."""
    async def scenario() -> None:
        proxy = Proxy(dsn)
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            proxy.dsn, min_size=1, max_size=10, timeout=30, kwargs={"autocommit": True},
            open=False)
        await pool.open()
        handlers = [Endless() for _ in range(3)]
        started = iter(handlers)

        async def handler(message: AsyncMessage[bytes]) -> None:
            await next(started)(message)

        task: asyncio.Task[None] | None = None
        try:
            queue = AsyncQueue(pool)
            await queue.send_many([NewMessage(f"t{i}", b"job") for i in range(3)])
            # A slot left free: the dequeue loop goes on asking for work.
            worker = AsyncWorker(queue, handler, concurrency=4, lock=timedelta(minutes=1),
                                 grace_period=timedelta(milliseconds=200),
                                 poll_interval=timedelta(milliseconds=100), listen=False)
            task = asyncio.create_task(worker.run())
            await until(lambda: all(h.started.is_set() for h in handlers))
            proxy.cut()
            # The pool's connection is gone and it cannot make another: the dequeue
            # waits for one.
            await until(lambda: proxy.refused and pool.get_stats().get("requests_waiting"))
            began = time.monotonic()
            worker.stop()
            # (Well below the pool's 30 s that a stop waiting for it takes at least;
            # a fraction of a second here, and a loaded machine is given the rest.)
            await asyncio.wait({task}, timeout=20)
            took = time.monotonic() - began
            assert task.done(), "stop() is waiting for the pool"
            assert took < 20
            assert all(h.cancelled.is_set() for h in handlers)
            assert "could not hand back 3 message(s)" in caplog.text
        finally:
            await pool.close()  # (ends the waits of a worker that did not stop)
            proxy.close()
            if task is not None:
                await asyncio.wait_for(task, 30)
    with caplog.at_level(logging.WARNING, logger="fairq.worker"):
        asyncio.run(scenario())


def test_cancelling_run_hands_running_work_back_at_once(hdsn: str) -> None:
    """run() cancelled from outside (a TaskGroup, wait_for, an application's shutdown):
    0.7.26 cancelled only its own loops and left the handlers running unheartbeated,
    their messages locked until the lock lapsed."""
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            sent = await queue.send("t", b"job")
            handler = Endless()
            started, cancelled = handler.started, handler.cancelled
            worker = AsyncWorker(queue, handler, lock=timedelta(seconds=30), **FAST)
            task = asyncio.create_task(worker.run())
            await asyncio.wait_for(started.wait(), TIMEOUT)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 30)
            assert cancelled.is_set()
            [msg] = await queue.dequeue(timedelta(seconds=30))  # back now, not in 30 s
            assert (msg.id, msg.num_attempts, msg.recovered) == (sent.id, 2, False)
    asyncio.run(scenario())


def test_cancelling_run_as_its_dequeue_is_answered_hands_the_messages_back(hdsn: str) -> None:
    """A cancellation that arrives once the server has handed messages out but before
    the worker read the answer: psycopg reads it and raises CancelledError anyway, and
    0.7.31 dropped the messages, locked until their lock lapsed. The dequeue is held on
    a table lock until the worker waits for it; from the lock's release to the cancel
    the test never yields, so the worker cannot read the answer first."""
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            sent = await queue.send("t", b"job")
            handled: list[int] = []

            async def handler(message: AsyncMessage[bytes]) -> None:
                handled.append(message.id)

            with psycopg.connect(hdsn) as locker, psycopg.connect(hdsn, autocommit=True) as watch:
                locker.execute("LOCK TABLE fairq.message IN ACCESS EXCLUSIVE MODE")
                worker = AsyncWorker(queue, handler, lock=timedelta(minutes=5), listen=False)
                task = asyncio.create_task(worker.run())
                await until(lambda: watch.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE '%%message_dequeue%%'").fetchone() == (1,))
                locker.commit()
                deadline = time.monotonic() + TIMEOUT
                while watch.execute("SELECT status::text FROM fairq.message WHERE id = %s",
                                    (sent.id,)).fetchone() != ("locked",):
                    assert time.monotonic() < deadline
                    time.sleep(0.001)  # (not asyncio.sleep: the worker must not run)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(task, 30)
            assert handled == []
            [msg] = await queue.dequeue(timedelta(seconds=30))  # back now, not in 5 min
            assert (msg.id, msg.num_attempts) == (sent.id, 2)
    asyncio.run(scenario())


def test_a_second_cancellation_of_run_does_not_cut_the_hand_back_short(hdsn: str) -> None:
    """run() cancelled twice (an application's shutdown, then its own timeout): 0.7.32
    let the second cancellation interrupt the hand-back, so the message stayed locked
    until its lock lapsed and the handler ran on after run() was gone. The hand-back
    is held on the channel's row until the second cancellation has been delivered."""
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            sent = await queue.send("t", b"job")
            handler = Endless()
            worker = AsyncWorker(queue, handler, lock=timedelta(minutes=5), **FAST)
            task = asyncio.create_task(worker.run())
            await asyncio.wait_for(handler.started.wait(), TIMEOUT)
            with psycopg.connect(hdsn) as locker, psycopg.connect(hdsn, autocommit=True) as watch:
                locker.execute("SELECT FROM fairq.channel WHERE name = 't' FOR UPDATE")
                task.cancel()
                await until(lambda: watch.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE '%%message_defer%%'").fetchone() == (1,))
                task.cancel()
                for _ in range(10):
                    await asyncio.sleep(0)  # the second cancellation reaches run()
                locker.commit()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 30)
            assert handler.cancelled.is_set()
            [msg] = await queue.dequeue(timedelta(seconds=30))  # back now, not in 5 min
            assert (msg.id, msg.num_attempts) == (sent.id, 2)
    asyncio.run(scenario())


def test_a_second_cancellation_as_the_dequeue_is_answered_does_not_cut_its_hand_back_short(
        hdsn: str) -> None:
    """run() cancelled once the server has answered its dequeue, then again while the
    messages are being handed back: 0.7.36 let the second cancellation interrupt the
    hand-back, and the messages stayed locked until their lock lapsed. The dequeue is
    held on a table lock as above, and the hand-back on the channel's row until the
    second cancellation has been delivered."""
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            sent = await queue.send_many([NewMessage("t", b"job") for _ in range(3)])
            handled: list[int] = []

            async def handler(message: AsyncMessage[bytes]) -> None:
                handled.append(message.id)

            with psycopg.connect(hdsn) as locker, psycopg.connect(hdsn) as row_locker, \
                    psycopg.connect(hdsn, autocommit=True) as watch:
                locker.execute("LOCK TABLE fairq.message IN ACCESS EXCLUSIVE MODE")
                worker = AsyncWorker(queue, handler, concurrency=3, lock=timedelta(minutes=5),
                                     listen=False)
                task = asyncio.create_task(worker.run())
                await until(lambda: _waits_on_lock(watch, "message_dequeue"))
                locker.commit()
                deadline = time.monotonic() + TIMEOUT
                while watch.execute("SELECT count(*) FROM fairq.message"
                                    " WHERE status = 'locked'").fetchone() != (3,):
                    assert time.monotonic() < deadline
                    time.sleep(0.001)  # (not asyncio.sleep: the worker must not run)
                row_locker.execute("SELECT FROM fairq.channel WHERE name = 't' FOR UPDATE")
                task.cancel()
                await until(lambda: _waits_on_lock(watch, "message_defer"))
                task.cancel()
                for _ in range(10):
                    await asyncio.sleep(0)  # the second cancellation reaches run()
                row_locker.commit()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(task, 30)
            assert handled == []
            back = await queue.dequeue(timedelta(seconds=30), 10)  # now, not in 5 min
            assert sorted((m.id, m.num_attempts) for m in back) == [(r.id, 2) for r in sent]
            assert await queue.dead_letters() == []
    asyncio.run(scenario())


def _waits_on_lock(watch: psycopg.Connection[Any], function: str) -> bool:
    row = watch.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND query LIKE %s", (f"%{function}%",)).fetchone()
    return row == (1,)


def test_cancelling_run_while_its_dequeue_waits_for_a_connection_is_prompt(dsn: str) -> None:
    """0.7.36 shielded the wait for the pool's connection from run()'s cancellation: it
    ended only when a connection came or ConnectionWait.LIMIT (30 s) was over; stop()
    ended it within ConnectionWait.SLICE."""
    async def scenario() -> None:
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            dsn, min_size=1, max_size=1, kwargs={"autocommit": True}, open=False)
        await pool.open()
        task: asyncio.Task[None] | None = None
        try:
            queue = AsyncQueue(pool)
            sent = await queue.send("t", b"job")
            async with queue.connection():  # the pool's only connection is busy
                worker = AsyncWorker(queue, Endless(), listen=False)
                task = asyncio.create_task(worker.run())
                await until(lambda: pool.get_stats().get("requests_waiting"))
                task.cancel()
                # (Well below ConnectionWait.LIMIT, 30 s, that the shielded wait took.)
                await asyncio.wait({task}, timeout=20)
                assert task.done(), "the cancellation waits for the pool"
            with pytest.raises(asyncio.CancelledError):
                await task
            # Nothing was taken: the message is there for the next dequeue, first attempt.
            [msg] = await queue.dequeue(timedelta(seconds=30))
            assert (msg.id, msg.num_attempts) == (sent.id, 1)
        finally:
            await pool.close()
            if task is not None:
                await asyncio.wait({task}, timeout=30)
    asyncio.run(scenario())


def test_a_handler_task_cancelled_from_outside_is_handed_back_not_failed(hdsn: str) -> None:
    """A handler's task cancelled by someone else than the worker (asyncio.run cancels
    every task left when its coroutine returns): 0.7.36 took it for the handler's
    failure, deferred with back-off or, here on the last allowed attempt,
    dead-lettered as "CancelledError". It is handed back, due now, its attempt
    counted; the worker, still running, takes it again."""
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            sent = await queue.send_many([NewMessage(f"t{i}", b"job") for i in range(3)])
            first: set[int] = set()
            attempts: list[tuple[int, int]] = []
            cancelled = 0

            async def handler(message: AsyncMessage[bytes]) -> None:
                nonlocal cancelled
                attempts.append((message.id, message.num_attempts))
                if message.num_attempts == 1:
                    first.add(message.id)
                    try:
                        await asyncio.sleep(3600)
                    except asyncio.CancelledError:
                        cancelled += 1
                        raise

            worker = AsyncWorker(queue, handler, concurrency=3, max_attempts=1,
                                 lock=timedelta(minutes=5), **FAST)
            async with running(worker):
                await until(lambda: len(first) == 3)
                for task in asyncio.all_tasks():
                    if task.get_name().startswith("fairq-message-"):
                        task.cancel()
                await until(lambda: _settled(hdsn, 3))
            assert cancelled == 3
            assert await queue.dead_letters() == []
            assert sorted(await completions(hdsn)) == sorted((r.id, 2) for r in sent)
            assert sorted(attempts) == sorted((r.id, n) for r in sent for n in (1, 2))
    asyncio.run(scenario())


async def _settled(dsn: str, n: int) -> bool:
    """Whether ``n`` messages are done with: completed or dead-lettered."""
    [(count,)] = await fetch(dsn, "SELECT (SELECT count(*) FROM fairq.message_history"
                                  " WHERE outcome = 'completed')"
                                  " + (SELECT count(*) FROM fairq.dead_letter)")
    return int(count) == n


def test_run_and_its_handlers_cancelled_at_once_hand_each_message_back_once(
        hdsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """As asyncio.run's shutdown does: run() and the handlers' tasks cancelled
    together. Each message is handed back once, by run() or by its own task, and none
    is failed."""
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            sent = await queue.send_many([NewMessage(f"t{i}", b"job") for i in range(3)])
            handlers = [Endless() for _ in range(3)]
            started = iter(handlers)

            async def handler(message: AsyncMessage[bytes]) -> None:
                await next(started)(message)

            worker = AsyncWorker(queue, handler, concurrency=3, max_attempts=1,
                                 lock=timedelta(minutes=5), **FAST)
            task = asyncio.create_task(worker.run())
            await until(lambda: all(h.started.is_set() for h in handlers))
            tasks = [task, *(t for t in asyncio.all_tasks()
                             if t.get_name().startswith("fairq-message-"))]
            assert len(tasks) == 4
            for t in tasks:
                t.cancel()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
            assert all(h.cancelled.is_set() for h in handlers)
            back = await queue.dequeue(timedelta(seconds=30), 10)  # now, not in 5 min
            assert sorted((m.id, m.num_attempts) for m in back) == [(r.id, 2) for r in sent]
            assert await queue.dead_letters() == []
    with caplog.at_level(logging.WARNING, logger="fairq.worker"):
        asyncio.run(scenario())
    assert caplog.text.count("handed back as the worker stops (deferred)") == 3, caplog.text
    assert "stale" not in caplog.text


@pytest.mark.parametrize("ending", ["asyncio.run's shutdown", "stop(), awaited after"])
def test_closing_the_queue_while_run_goes_on_hands_the_work_back_first(
        hdsn: str, caplog: pytest.LogCaptureFixture, ending: str) -> None:
    """``async with AsyncQueue(dsn)`` left while the worker's run() goes on in a task
    of its own (the application ended, or stop() was not awaited): 0.7.38 handed back
    only after the queue's pool had closed, when asyncio.run's shutdown cancelled the
    tasks left (or run() drained): every hand-back failed ("could not hand back ...
    their locks will expire"), and the messages waited for their 5 min locks.
    close() has the worker hand them back first, and run() stop."""
    handlers: list[Endless] = []
    leftover: list[asyncio.Task[None]] = []

    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            await queue.send_many([NewMessage(f"t{i}", b"job") for i in range(2)])
            handlers.extend(Endless() for _ in range(2))
            started = iter(handlers)

            async def handler(message: AsyncMessage[bytes]) -> None:
                await next(started)(message)

            worker = AsyncWorker(queue, handler, concurrency=2, lock=timedelta(minutes=5),
                                 **FAST)
            task = asyncio.create_task(worker.run())
            await until(lambda: all(h.started.is_set() for h in handlers))
            if ending != "asyncio.run's shutdown":
                worker.stop()
                leftover.append(task)
        for task in leftover:
            await asyncio.wait_for(task, 30)  # it returns, as after stop(now=True)

    with caplog.at_level(logging.WARNING, logger="fairq.worker"):
        asyncio.run(scenario())
    assert all(h.cancelled.is_set() for h in handlers)
    assert "could not" not in caplog.text
    assert caplog.text.count("handed back as the worker stops (deferred)") == 2, caplog.text
    with Queue(hdsn) as queue:  # back now, not in 5 min
        assert sorted(m.num_attempts for m in queue.dequeue(timedelta(seconds=30), 10)) == [2, 2]


def test_a_handler_closing_the_queue_through_tasks_of_its_own_does_not_hang(
        hdsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """A handler that closes the queue under ``asyncio.gather`` (or ``wait_for``, a
    task of its own before 3.12), twice at once: close() waited for every handler's
    task but the closer's own, the handler waited for the gather, which waited for
    close(): run() and close() for ever. Each message is handed back once."""
    seen: list[int] = []

    async def scenario() -> None:
        queue = AsyncQueue(hdsn)
        await queue.open()
        await queue.send_many([NewMessage(f"t{i}", b"job") for i in range(3)])
        handlers = [Endless() for _ in range(2)]

        async def handler(message: AsyncMessage[bytes]) -> None:
            seen.append(message.id)
            if len(seen) < 3:
                await handlers[len(seen) - 1](message)
            else:
                await until(lambda: all(h.started.is_set() for h in handlers))
                await asyncio.gather(queue.close(), queue.close())

        worker = AsyncWorker(queue, handler, concurrency=3, lock=timedelta(minutes=5), **FAST)
        await worker.run()
        assert all(h.cancelled.is_set() for h in handlers)

    failed: list[BaseException] = []

    def checked() -> None:  # (a hang must fail the test, not the session)
        try:
            asyncio.run(scenario())
        except BaseException as exc:
            failed.append(exc)

    with caplog.at_level(logging.WARNING, logger="fairq.worker"):
        thread = threading.Thread(target=checked, daemon=True)
        thread.start()
        thread.join(TIMEOUT)
    assert not thread.is_alive(), "close() from a handler's task hung"
    if failed:
        raise failed[0]
    assert len(seen) == 3
    assert "could not" not in caplog.text
    assert caplog.text.count("handed back as the worker stops (deferred)") == 3, caplog.text
    with Queue(hdsn) as queue:  # back now, once each, not in 5 min
        assert sorted((m.id, m.num_attempts) for m in queue.dequeue(timedelta(seconds=30), 10)) \
            == [(i, 2) for i in sorted(seen)]


def test_a_handler_raising_a_base_exception_fails_its_message(hdsn: str) -> None:
    """A BaseException that is neither an Exception nor one the worker knows
    (CancelledError, SystemExit, KeyboardInterrupt): Worker fails the message, 0.7.36's
    AsyncWorker let it end the task unsettled, locked until its lock lapsed."""
    class Abort(BaseException):
        pass

    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            sent = await queue.send("t", b"job")
            raised = asyncio.Event()

            async def handler(message: AsyncMessage[bytes]) -> None:
                raised.set()
                raise Abort("boom")

            worker = AsyncWorker(queue, handler, max_attempts=1, lock=timedelta(minutes=5),
                                 **FAST)
            async with running(worker):
                await asyncio.wait_for(raised.wait(), TIMEOUT)
                await until(lambda: not worker._running)  # settled, or given up
            assert [(d.id, d.error) for d in await queue.dead_letters()] == [
                (sent.id, "Abort: boom")]
            assert await queue.dequeue(timedelta(seconds=30)) == []
    asyncio.run(scenario())


def test_a_plain_function_handler_completes_and_is_reported_once(
        hdsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """A handler without `async`: its body runs and returns, and 0.7.36 then failed on
    awaiting its None, retried it (running it again) and dead-lettered it."""
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            sent = await queue.send_many([NewMessage(f"t{i}", b"job") for i in range(2)])
            runs: list[tuple[int, int]] = []

            def handler(message: AsyncMessage[bytes]) -> None:
                runs.append((message.id, message.num_attempts))

            backoff = Backoff(base=timedelta(milliseconds=10), cap=timedelta(milliseconds=20))
            worker = AsyncWorker(queue, handler, max_attempts=3,  # type: ignore[arg-type]
                                 backoff=backoff, **FAST)
            async with running(worker):
                await until(lambda: _settled(hdsn, 2))
            assert sorted(runs) == sorted((r.id, 1) for r in sent)
            assert sorted(await completions(hdsn)) == sorted((r.id, 1) for r in sent)
            assert await queue.dead_letters() == []
    with caplog.at_level(logging.ERROR, logger="fairq.worker"):
        asyncio.run(scenario())
    assert caplog.text.count("is not async") == 1, caplog.text


def test_sigterm_stops_every_worker_of_the_loop_and_the_handlers_are_put_back(
        hdsn: str) -> None:
    """Two AsyncWorkers in one loop of the main thread: each installed its own handler,
    the loop keeps one per signal, so 0.7.36's SIGTERM stopped only the worker started
    last, and once that one returned the signals were ignored (asyncio's no-op handler
    was put back). The test sends itself SIGTERM only while a Python handler is there."""
    async def scenario() -> None:
        before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

        async def handler(message: AsyncMessage[bytes]) -> None:
            pass

        async def sigterm() -> None:
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
            os.kill(os.getpid(), signal.SIGTERM)

        async with AsyncQueue(hdsn, name="q1") as q1, AsyncQueue(hdsn, name="q2") as q2:
            workers = [AsyncWorker(q, handler, listen=False) for q in (q1, q2)]
            tasks: list[asyncio.Task[None]] = []
            try:
                # Both running: one SIGTERM stops both.
                tasks = [asyncio.create_task(w.run()) for w in workers]
                await until(lambda: signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM])
                await asyncio.sleep(0)  # both have joined
                await sigterm()
                await asyncio.wait(tasks, timeout=10)
                assert [t.done() for t in tasks] == [True, True]
                assert {sig: signal.getsignal(sig) for sig in before} == before
                # The worker started last returns first: SIGTERM still stops the other.
                tasks = [asyncio.create_task(w.run()) for w in workers]
                await until(lambda: signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM])
                await asyncio.sleep(0)
                workers[1].stop()
                await asyncio.wait_for(tasks[1], 10)
                await sigterm()
                await asyncio.wait(tasks, timeout=10)
                assert tasks[0].done(), "SIGTERM ignored once the other worker returned"
                assert {sig: signal.getsignal(sig) for sig in before} == before
            finally:
                for worker in workers:
                    worker.stop()
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    asyncio.run(scenario())


def test_a_handler_raising_cancelled_error_of_its_own_fails_its_message(hdsn: str) -> None:
    """A handler that awaited something cancelled elsewhere raises CancelledError
    though nobody cancelled it: a failure like any other. 0.7.31 took it for the
    worker's own cancellation and left the message locked, past the worker's
    max_attempts, until its lock lapsed."""
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            sent = await queue.send("t", b"job")

            async def handler(message: AsyncMessage[bytes]) -> None:
                cancelled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                cancelled.cancel()
                await cancelled

            worker = AsyncWorker(queue, handler, lock=timedelta(minutes=5), max_attempts=1,
                                 **FAST)
            async with running(worker):
                dead = await until(lambda: fetch(hdsn, "SELECT id, error FROM fairq.dead_letters"))
            assert dead == [(sent.id, "CancelledError: ")]
    asyncio.run(scenario())


def test_a_message_back_while_its_first_handler_runs_is_its_own_delivery(hdsn: str) -> None:
    """As for Worker: keyed by id, the first handler's end took the second delivery
    out of the heartbeats, and a third ran beside it once its lock lapsed."""
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            sent = await queue.send("steps", b"job")
            attempts: list[int] = []
            second_started = asyncio.Event()
            lock = timedelta(seconds=3)  # heartbeats every second: a loaded loop keeps it

            async def handler(message: AsyncMessage[bytes]) -> None:
                attempts.append(message.num_attempts)
                if message.num_attempts == 1:
                    assert await message.defer(state=b"step-2") is SettleStatus.DEFERRED
                    await asyncio.wait_for(second_started.wait(), TIMEOUT)
                    return
                second_started.set()
                await asyncio.sleep(2 * lock.total_seconds())  # only heartbeats keep it

            worker = AsyncWorker(queue, handler, concurrency=2, lock=lock, **FAST)
            async with running(worker):
                await until(lambda: completions(hdsn))
            assert attempts == [1, 2]
            assert await completions(hdsn) == [(sent.id, 2)]
    asyncio.run(scenario())


def test_an_async_worker_runs_again_after_it_returned(hdsn: str) -> None:
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            handled: list[bytes] = []

            async def handler(message: AsyncMessage[bytes]) -> None:
                handled.append(message.content)

            worker = AsyncWorker(queue, handler, **FAST)
            for content in (b"first", b"second"):
                await queue.send("c", content)
                async with running(worker):
                    await until(lambda content=content: content in handled)
            assert handled == [b"first", b"second"]
    asyncio.run(scenario())


def test_periodic_drivers_are_ticked_not_handed_to_the_handler(hdsn: str) -> None:
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            first = await queue.schedule_periodic("report", timedelta(milliseconds=300),
                                                  "reports", b"make report")
            assert first.status is CreateStatus.CREATED
            work: list[tuple[str, bytes]] = []

            async def handler(message: AsyncMessage[bytes]) -> None:
                work.append((message.channel, message.content))

            async with running(AsyncWorker(queue, handler, **FAST)):
                await until(lambda: len(work) >= 3)
            assert set(work) == {("reports", b"make report")}
            [stats] = await queue.channels("fairq.periodic")
            assert stats.size == 1  # the driver never completes
    asyncio.run(scenario())


# -- NOTIFY -----------------------------------------------------------------------------

def test_wakes_on_its_queues_notify_and_not_on_another_queues(hdsn: str) -> None:
    """With polling out of the picture (an hour), only NOTIFY wakes the worker: a
    message sent (its event names no queue: "default") is handled, while an event of
    the queue "emails" heard before it caused no dequeue."""
    async def scenario() -> None:
        async with AsyncQueue(hdsn) as queue:
            calls: list[str] = []  # the phase of each dequeue, when it was called
            dequeue = queue.dequeue

            async def counting(*args: Any, **kwargs: Any) -> Any:
                calls.append(log.phase)
                return await dequeue(*args, **kwargs)

            queue.dequeue = counting  # type: ignore[method-assign]
            handled = asyncio.Event()

            async def handler(message: AsyncMessage[bytes]) -> None:
                handled.set()

            worker = AsyncWorker(queue, handler, poll_interval=timedelta(hours=1),
                                 grace_period=timedelta(seconds=5))
            with phases_logged({-1: "ready", -2: "foreign"}) as log:
                async with running(worker):
                    await until(lambda: _first_count(fetch(hdsn, LISTENING)))
                    # A probe of the default queue: once a dequeue followed it, the
                    # worker has nothing pending and sleeps for an hour.
                    await fetch(hdsn, "SELECT pg_notify('fairq', %s)", _probe(None, -1))
                    await until(lambda: "ready" in calls)
                    await fetch(hdsn, "SELECT pg_notify('fairq', %s)", _probe("emails", -2))
                    await until(lambda: -2 in log.heard)
                    log.phase = "send"
                    sent = await queue.send("a", b"job")  # its NOTIFY wakes the worker
                    await asyncio.wait_for(handled.wait(), TIMEOUT)
            assert "ignored" in log.heard[-2], log.heard
            assert "foreign" not in calls, calls
            assert [i for i, _ in await completions(hdsn)] == [sent.id]
    asyncio.run(scenario())


async def _first_count(rows: Awaitable[list[tuple[Any, ...]]]) -> bool:
    return bool((await rows)[0][0])


# -- the CLI ----------------------------------------------------------------------------

def test_fairq_worker_runs_a_coroutine_handler_and_stops_on_sigterm(hdsn: str,
                                                                    tmp_path: Path) -> None:
    """`fairq worker module:coroutine` runs an AsyncWorker; SIGTERM (taken by the event
    loop's signal handler) lets the running handler finish and takes nothing new."""
    with Queue(hdsn) as setup:
        ids = [r.id for r in setup.send_many([NewMessage(f"t{i}", b"120") for i in range(3)])]
    # (A 3 s lock: heartbeats every second, so one run late on a loaded machine does not
    # let a held message's lock lapse and its completion answer stale.)
    proc = _worker_process(hdsn, tmp_path, "--concurrency", "2", "--lock", "3", "--grace", "60",
                           handler="worker_handlers:gated_async")
    try:
        deadline = time.monotonic() + TIMEOUT
        while len(_marks(tmp_path, "started")) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, _log(tmp_path)
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        while "received SIGTERM" not in _log(tmp_path):
            assert time.monotonic() < deadline and proc.poll() is None, _log(tmp_path)
            time.sleep(0.05)
        in_flight = _marks(tmp_path, "started")
        (tmp_path / "release").touch()
        assert proc.wait(timeout=60) == 0, _log(tmp_path)
    finally:
        proc.kill()
    assert len(in_flight) == 2
    assert _marks(tmp_path, "done") == in_flight  # finished within the grace period
    with psycopg.connect(hdsn) as conn:
        done = {r[0] for r in conn.execute("SELECT id FROM fairq.message_history"
                                           " WHERE outcome = 'completed'")}
        left = {r[0] for r in conn.execute("SELECT id FROM fairq.message")}
    assert done == in_flight
    assert left == set(ids) - in_flight


def test_fairq_worker_hands_back_coroutines_on_a_second_sigint(hdsn: str,
                                                             tmp_path: Path) -> None:
    with Queue(hdsn) as setup:
        sent = setup.send("t", b"120")  # never released: it outlives any grace period
    proc = _worker_process(hdsn, tmp_path, "--lock", "30", "--grace", "600",
                           handler="worker_handlers:gated_async")
    try:
        deadline = time.monotonic() + TIMEOUT
        while not _marks(tmp_path, "started"):
            assert time.monotonic() < deadline and proc.poll() is None, _log(tmp_path)
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        while "received SIGINT: stopping" not in _log(tmp_path):
            assert time.monotonic() < deadline and proc.poll() is None, _log(tmp_path)
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, _log(tmp_path)
    finally:
        proc.kill()
    assert "received SIGINT again" in _log(tmp_path)
    with Queue(hdsn) as check:
        [msg] = check.dequeue(timedelta(seconds=30))
    assert (msg.id, msg.num_attempts, msg.recovered) == (sent.id, 2, False)


def test_run_refuses_a_second_run_at_once(dsn: str) -> None:
    """Two run()s of one worker at once took each other's messages past concurrency."""
    async def handler(message: AsyncMessage[bytes]) -> None:
        return None

    async def scenario() -> None:
        async with AsyncQueue(dsn) as queue:
            worker = AsyncWorker(queue, handler, **FAST)
            async with running(worker):
                await until(lambda: worker._loop is not None)
                with pytest.raises(RuntimeError, match="already running"):
                    await worker.run()
            async with running(worker):  # once returned, it runs again
                await until(lambda: worker._loop is not None)
    asyncio.run(scenario())
