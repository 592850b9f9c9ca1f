"""The Python binding, sync and async, against a real database.

Each round-trip test runs the same scenario twice: through ``Queue`` and through
``AsyncQueue`` (driven with ``asyncio.run``), since both must speak the same SQL.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import date, datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from fairq import (
    AsyncQueue,
    CancelStatus,
    CreateStatus,
    HistoryOutcome,
    JsonCodec,
    Message,
    NewMessage,
    Queue,
    RetryStatus,
    SettleStatus,
    TextCodec,
    __version__,
    _pools,
    _work,
)

LOCK = timedelta(seconds=30)


def test_channels_round_trip(dsn: str) -> None:
    with Queue(dsn) as queue:
        queue.channel_set("a", max_concurrency=2, release_interval=timedelta(milliseconds=250),
                          max_size=10, max_attempts=3)
        queue.send("a", b"x")
        queue.send("b", b"y", delay=timedelta(hours=1))
        stats = {s.channel: s for s in queue.channels()}
        assert set(stats) == {"a", "b"}
        a = stats["a"]
        assert (a.max_concurrency, a.release_interval, a.max_size, a.max_attempts) == (
            2, timedelta(milliseconds=250), 10, 3)
        assert (a.size, a.ready, a.scheduled, a.in_flight) == (1, 1, 0, 0)
        assert (stats["b"].ready, stats["b"].scheduled, stats["b"].max_size) == (0, 1, None)
        assert [s.channel for s in queue.channels("b")] == ["b"]
        assert queue.channel_clear("a") is True
        assert queue.channel_clear("a") is False
        assert queue.channels("a")[0].max_concurrency is None


def test_async_channels_round_trip(dsn: str) -> None:
    async def scenario() -> None:
        async with AsyncQueue(dsn) as queue:
            await queue.channel_set("a", max_concurrency=1, max_attempts=2)
            await queue.send("a", b"x")
            [a] = await queue.channels("a")
            assert (a.max_concurrency, a.max_attempts, a.size) == (1, 2, 1)
            assert await queue.channel_clear("a") is True
            assert (await queue.channels("a"))[0].max_concurrency is None
    asyncio.run(scenario())


def test_message_lifecycle(dsn: str) -> None:
    with Queue(dsn, codec=JsonCodec()) as queue:
        created = queue.send("t1", {"n": 1}, priority=5, dedup_key="k")
        assert created.status is CreateStatus.CREATED and created.id is not None
        again = queue.send("t1", {"n": 2}, dedup_key="k")
        assert again.status is CreateStatus.DUPLICATE and again.id == created.id

        [msg] = queue.dequeue(LOCK)
        assert (msg.id, msg.channel, msg.content, msg.priority) == (created.id, "t1", {"n": 1}, 5)
        assert (msg.num_attempts, msg.recovered, msg.state) == (1, False, None)
        assert msg.dequeue_at.tzinfo is not None
        assert queue.dequeue(LOCK) == []

        assert msg.heartbeat(timedelta(minutes=5)) is SettleStatus.HEARTBEATED
        assert msg.defer(state=b"half done") is SettleStatus.DEFERRED
        assert msg.complete() is SettleStatus.STALE  # the lock went with the defer

        [again_msg] = queue.dequeue(LOCK)
        assert (again_msg.id, again_msg.num_attempts, again_msg.state) == (msg.id, 2, b"half done")
        assert again_msg.complete() is SettleStatus.COMPLETED
        assert again_msg.complete() is SettleStatus.NOT_FOUND
        assert queue.channels() == []  # a channel without policy or messages disappears


def test_async_message_lifecycle(dsn: str) -> None:
    async def scenario() -> None:
        async with AsyncQueue(dsn, codec=TextCodec()) as queue:
            created = await queue.send("t1", "héllo", dedup_key="k")
            assert created.status is CreateStatus.CREATED
            assert (await queue.send("t1", "x", dedup_key="k")).id == created.id
            [msg] = await queue.dequeue(LOCK)
            assert (msg.id, msg.content, msg.num_attempts) == (created.id, "héllo", 1)
            assert await msg.heartbeat(timedelta(minutes=1)) is SettleStatus.HEARTBEATED
            assert await msg.defer(state=b"s") is SettleStatus.DEFERRED
            [msg2] = await queue.dequeue(LOCK)
            assert (msg2.num_attempts, msg2.state) == (2, b"s")
            assert await msg.complete() is SettleStatus.STALE
            assert await msg2.complete() is SettleStatus.COMPLETED
            assert await queue.channels() == []
    asyncio.run(scenario())


def test_send_many_dequeue_batch_complete_batch(dsn: str) -> None:
    future = datetime.now(timezone.utc) + timedelta(hours=1)
    with Queue(dsn) as queue:
        queue.channel_set("full", max_size=1)
        results = queue.send_many([
            NewMessage("a", b"1"), NewMessage("b", b"2"), NewMessage("a", b"3", dedup_key="d"),
            NewMessage("a", b"4", dedup_key="d"), NewMessage("full", b"5"),
            NewMessage("full", b"6"), NewMessage("c", b"7", dequeue_at=future),
            NewMessage("c", b"8", delay=timedelta(hours=1)),
        ])
        assert [r.status for r in results] == [
            CreateStatus.CREATED, CreateStatus.CREATED, CreateStatus.CREATED,
            CreateStatus.DUPLICATE, CreateStatus.CREATED, CreateStatus.DROPPED,
            CreateStatus.CREATED, CreateStatus.CREATED]
        assert results[3].id == results[2].id and results[5].id is None
        assert queue.send_many([]) == []

        batch = queue.dequeue(LOCK, 10)
        # Fair: the first three deliveries come from three distinct channels.
        assert len({m.channel for m in batch[:3]}) == 3
        assert sorted(m.raw for m in batch) == [b"1", b"2", b"3", b"5"]
        assert queue.channels("c")[0].scheduled == 2  # the future messages wait

        outcome = queue.complete_batch([*batch, batch[0]])
        assert [r.status for r in outcome[:4]] == [SettleStatus.COMPLETED] * 4
        assert outcome[4].status is SettleStatus.NOT_FOUND


def test_async_send_many_and_complete_batch(dsn: str) -> None:
    async def scenario() -> None:
        async with AsyncQueue(dsn) as queue:
            results = await queue.send_many([NewMessage("a", b"1"), NewMessage("b", b"2")])
            assert [r.status for r in results] == [CreateStatus.CREATED] * 2
            batch = await queue.dequeue(LOCK, 5)
            assert sorted(m.raw for m in batch) == [b"1", b"2"]
            done = await queue.complete_batch(batch)
            assert [r.status for r in done] == [SettleStatus.COMPLETED] * 2
    asyncio.run(scenario())


def test_fail_dead_letters_retry_and_cancel(dsn: str) -> None:
    with Queue(dsn) as queue:
        sent = queue.send("a", b"poison")
        waiting = queue.send("a", b"later", delay=timedelta(hours=1))
        [msg] = queue.dequeue(LOCK)
        assert queue.cancel(msg.id) is CancelStatus.LOCKED
        assert msg.fail("boom") is SettleStatus.DEAD
        [dead] = queue.dead_letters()
        assert (dead.id, dead.channel, dead.content, dead.num_attempts, dead.error) == (
            sent.id, "a", b"poison", 1, "boom")
        assert queue.dead_letters("other") == []
        assert queue.dead_letter_retry(dead.id) is RetryStatus.REQUEUED
        assert queue.dead_letter_retry(dead.id) is RetryStatus.NOT_FOUND
        [back] = queue.dequeue(LOCK)
        assert (back.id, back.num_attempts) == (sent.id, 2)  # the fencing token goes on counting

        assert waiting.id is not None
        assert queue.cancel(waiting.id) is CancelStatus.CANCELLED
        assert queue.cancel(waiting.id) is CancelStatus.NOT_FOUND


def test_async_fail_dead_letters_retry_and_cancel(dsn: str) -> None:
    async def scenario() -> None:
        async with AsyncQueue(dsn) as queue:
            sent = await queue.send("a", b"x")
            other = await queue.send("a", b"y", delay=timedelta(hours=1))
            [msg] = await queue.dequeue(LOCK)
            assert await queue.cancel(msg.id) is CancelStatus.LOCKED
            assert await msg.fail("boom") is SettleStatus.DEAD
            [dead] = await queue.dead_letters()
            assert (dead.id, dead.error) == (sent.id, "boom")
            assert await queue.dead_letter_retry(dead.id) is RetryStatus.REQUEUED
            assert other.id is not None
            assert await queue.cancel(other.id) is CancelStatus.CANCELLED
    asyncio.run(scenario())


def _history_on(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        dbname = conn.info.dbname
        conn.execute(f'ALTER DATABASE "{dbname}" SET fairq.history = on')  # type: ignore[arg-type]


def test_history_and_prune(dsn: str) -> None:
    _history_on(dsn)
    with Queue(dsn) as queue:
        queue.send("a", b"1")
        queue.send("a", b"2")
        first, second = queue.dequeue(LOCK, 2)
        first.complete()
        second.fail("no")
        records = queue.history()
        assert [(r.id, r.outcome, r.num_attempts) for r in records] == [
            (first.id, HistoryOutcome.COMPLETED, 1), (second.id, HistoryOutcome.DEAD, 1)]
        assert records[0].first_dequeued_at is not None
        assert queue.history("b") == []
        assert queue.history_prune(records[0].settled_at) == 0
        assert queue.history_prune(datetime.now(timezone.utc) + timedelta(seconds=1)) == 2
        assert queue.history() == []


def test_async_history_and_prune(dsn: str) -> None:
    _history_on(dsn)

    async def scenario() -> None:
        async with AsyncQueue(dsn) as queue:
            await queue.send("a", b"1")
            [msg] = await queue.dequeue(LOCK)
            await msg.complete()
            [record] = await queue.history()
            assert (record.id, record.outcome) == (msg.id, HistoryOutcome.COMPLETED)
            later = datetime.now(timezone.utc) + timedelta(seconds=1)
            assert await queue.history_prune(later) == 1
    asyncio.run(scenario())


def test_transactional_send_rolls_back_with_caller(dsn: str) -> None:
    with Queue(dsn) as queue, psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE orders (id int)")
        conn.commit()
        with pytest.raises(RuntimeError), conn.transaction():
            conn.execute("INSERT INTO orders VALUES (1)")
            queue.send("orders", b"ship 1", conn=conn)
            raise RuntimeError("business failure")
        assert queue.channels() == []
        with conn.transaction():
            conn.execute("INSERT INTO orders VALUES (2)")
            queue.send("orders", b"ship 2", conn=conn)
            assert queue.channels() == []  # not visible before the caller commits
        [msg] = queue.dequeue(LOCK)
        assert msg.raw == b"ship 2"


def test_async_transactional_send_rolls_back_with_caller(dsn: str) -> None:
    async def scenario() -> None:
        async with AsyncQueue(dsn) as queue, await psycopg.AsyncConnection.connect(dsn) as conn:
            with pytest.raises(RuntimeError):
                async with conn.transaction():
                    await queue.send("a", b"no", conn=conn)
                    raise RuntimeError("business failure")
            async with conn.transaction():
                await queue.send("a", b"yes", conn=conn)
            [msg] = await queue.dequeue(LOCK)
            assert msg.raw == b"yes"
    asyncio.run(scenario())


@pytest.mark.parametrize("autocommit", [True, False])
def test_queue_on_a_connection(dsn: str, autocommit: bool) -> None:
    with psycopg.connect(dsn, autocommit=autocommit) as conn:
        queue = Queue(conn)
        queue.send("a", b"1")
        [msg] = queue.dequeue(LOCK)
        # Committed: another session sees the lock.
        with Queue(dsn) as other:
            assert other.channels("a")[0].in_flight == 1
        assert msg.complete() is SettleStatus.COMPLETED
        assert queue.conninfo is not None and "dbname" in queue.conninfo


def test_queue_on_pools(dsn: str) -> None:
    with ConnectionPool(dsn, min_size=1, max_size=2, open=True) as pool:
        queue: Queue[Any] = Queue(pool, codec=JsonCodec())
        queue.send("a", [1, 2])
        [msg] = queue.dequeue(LOCK)
        assert msg.content == [1, 2]
        assert msg.complete() is SettleStatus.COMPLETED

    async def scenario() -> None:
        async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False) as apool, \
                await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            for source in (apool, aconn):
                aqueue = AsyncQueue(source, codec=JsonCodec())
                await aqueue.send("a", {"k": "v"})
                [amsg] = await aqueue.dequeue(LOCK)
                assert amsg.content == {"k": "v"}
                assert await amsg.complete() is SettleStatus.COMPLETED
    asyncio.run(scenario())


def _frames(thread: threading.Thread) -> set[str]:
    frame = sys._current_frames().get(thread.ident or 0)
    names = set()
    while frame is not None:
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    return names


def test_two_queues_on_one_connection_take_turns_with_a_transaction(dsn: str) -> None:
    """Queues "a" and "b" on one connection: with a transaction() of "a" open in one
    thread, a send of "b" in another ran inside it (each queue had its own lock on the
    connection): "b" answered created, and the message went with "a"'s rollback. It
    waits for the block now, and is its own."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        first, second = Queue(conn, name="a"), Queue(conn, name="b")
        inside, go = threading.Event(), threading.Event()
        results: list[Any] = []

        def rolled_back() -> None:
            with pytest.raises(RuntimeError), first.transaction():
                first.send("x", b"a")
                inside.set()
                assert go.wait(60)
                raise RuntimeError("roll back")

        block = threading.Thread(target=rolled_back, daemon=True)
        block.start()
        assert inside.wait(60)
        other = threading.Thread(target=lambda: results.append(second.send("y", b"b")),
                                 daemon=True)
        other.start()
        # Until "b"'s send has run (before) or waits for the connection (now).
        deadline = time.monotonic() + 60
        while other.is_alive() and "connection" not in _frames(other):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        go.set()
        block.join(60)
        other.join(60)
        assert [r.status for r in results] == [CreateStatus.CREATED]
        assert (first.stats().size, second.stats().size) == (0, 1)


def test_two_async_queues_on_one_connection_take_turns_with_a_transaction(dsn: str) -> None:
    """As the sync twin above: a task's send of "b" ran inside another task's
    transaction() block of "a", and went with its rollback."""
    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            afirst, asecond = AsyncQueue(aconn, name="a"), AsyncQueue(aconn, name="b")
            inside, go = asyncio.Event(), asyncio.Event()

            async def rolled_back() -> None:
                with pytest.raises(RuntimeError):
                    async with afirst.transaction():
                        await afirst.send("x", b"a")
                        inside.set()
                        await go.wait()
                        raise RuntimeError("roll back")

            block = asyncio.create_task(rolled_back())
            await inside.wait()
            other = asyncio.create_task(asecond.send("y", b"b"))
            for _ in range(100):  # its send runs (before) or waits for the lock (now)
                await asyncio.sleep(0)
            go.set()
            await block
            assert (await other).status is CreateStatus.CREATED
            assert ((await afirst.stats()).size, (await asecond.stats()).size) == (0, 1)
    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_call_without_conn_inside_a_transaction_on_a_shared_connection_joins_it(
        dsn: str) -> None:
    """It waited for the lock its own block held, for ever: run where a hang fails."""
    def body() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            queue = Queue(conn)
            with pytest.raises(RuntimeError, match="roll back"), queue.transaction():
                queue.send("a", b"1")  # no conn=: joins the open transaction
                raise RuntimeError("roll back")
            assert queue.dequeue(LOCK) == []  # rolled back with the block

    failed: list[BaseException] = []

    def checked() -> None:  # a thread's failed assertion only warns: keep it for below
        try:
            body()
        except BaseException as exc:
            failed.append(exc)

    done = threading.Thread(target=checked, daemon=True)
    done.start()
    done.join(30)
    assert not done.is_alive(), "the call waited for its own transaction's lock"
    if failed:
        raise failed[0]

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            aqueue = AsyncQueue(aconn)
            with pytest.raises(RuntimeError, match="roll back"):
                async with aqueue.transaction():
                    await aqueue.send("a", b"2")
                    raise RuntimeError("roll back")
            assert await aqueue.dequeue(LOCK) == []
    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_calls_from_tasks_started_inside_an_async_transaction_on_a_shared_connection_join_it(
        dsn: str) -> None:
    """A call under ``asyncio.wait_for`` (a task of its own before Python 3.12) or
    ``gather`` inside ``AsyncQueue.transaction()`` on one connection: it waited for
    the lock its own block held, the block waited for it: wait_for's TimeoutError
    (whatever the call), and gather for ever. They join the transaction now, as the
    same calls made directly do (and as on 3.12, where wait_for makes no task). A task
    that calls only after the block ended waits for the connection as any other."""
    async def scenario(autocommit: bool) -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit) as aconn:
            aqueue = AsyncQueue(aconn)
            await aqueue.send("held", b"0")
            [held] = await aqueue.dequeue(LOCK)
            block_over = asyncio.Event()

            async def after_the_block() -> None:
                await block_over.wait()
                await aqueue.send("later", b"own transaction")

            with pytest.raises(RuntimeError, match="roll back"):
                async with aqueue.transaction():
                    later = asyncio.create_task(after_the_block())
                    # (The net: before, each of these waited for the block until it.)
                    assert await asyncio.wait_for(
                        aqueue.heartbeat(held, LOCK, lock_wait=timedelta(seconds=1)),
                        10) is SettleStatus.HEARTBEATED
                    await asyncio.wait_for(aqueue.send("a", b"1"), 10)
                    await asyncio.wait_for(
                        asyncio.gather(aqueue.send("b", b"2"), aqueue.send("c", b"3"),
                                       aqueue.channels()), 10)
                    raise RuntimeError("roll back")
            block_over.set()
            await asyncio.wait_for(later, 10)
            # Rolled back with the block: besides "held", only the later task's message.
            assert sorted(c.channel for c in await aqueue.channels() if c.size) == ["held", "later"]
    for autocommit in (True, False):
        asyncio.run(scenario(autocommit))


@pytest.mark.parametrize("autocommit", [True, False])
def test_calls_joined_to_an_async_transaction_end_inside_it(dsn: str, autocommit: bool) -> None:
    """Tasks started inside ``AsyncQueue.transaction()`` whose calls are under way or
    waiting their turn when the block's body raises: they ran once the transaction was
    over. With autocommit, the one waiting was committed on its own, outside the
    rollback; without, the block's exit failed with OutOfOrderTransactionNesting (the
    call's savepoint still open) instead of the block's own error. They end inside the
    transaction now, and roll back with it."""
    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit) as aconn:
            aqueue = AsyncQueue(aconn)
            calls: list[asyncio.Task[Any]] = []
            with pytest.raises(RuntimeError, match="roll back"):
                async with aqueue.transaction():
                    calls = [asyncio.create_task(aqueue.send(c, b"x")) for c in "ab"]
                    # One step each: the first call's statement is sent, the second
                    # waits for its turn (asyncio runs ready tasks in order).
                    await asyncio.sleep(0)
                    assert not any(call.done() for call in calls)
                    raise RuntimeError("roll back")
            assert all(call.done() for call in calls)  # the block ended once they had
            for call in calls:
                assert call.result().status is CreateStatus.CREATED
            assert aconn.info.transaction_status is psycopg.pq.TransactionStatus.IDLE
            assert [c.channel for c in await aqueue.channels() if c.size] == []
    asyncio.run(asyncio.wait_for(scenario(), 30))


@pytest.mark.parametrize("autocommit", [True, False])
def test_an_async_transaction_cancelled_while_a_joined_call_runs_rolls_back_after_it(
        dsn: str, autocommit: bool) -> None:
    """The block's task cancelled while a call that joined it waits for a table lock:
    the transaction ended under that call, whose exit then failed; the connection
    went to the next user with the call still running on it. The block now lets the
    joined calls end, then rolls back and raises the CancelledError."""
    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit) as aconn, \
                await psycopg.AsyncConnection.connect(dsn) as locker, \
                await psycopg.AsyncConnection.connect(dsn, autocommit=True) as watch:
            aqueue = AsyncQueue(aconn)
            await locker.execute("LOCK TABLE fairq.message IN ACCESS EXCLUSIVE MODE")
            calls: list[asyncio.Task[Any]] = []
            ending = asyncio.Event()

            async def block() -> None:
                async with aqueue.transaction():
                    calls.extend(asyncio.create_task(aqueue.send(c, b"x")) for c in "ab")
                    ending.set()

            task = asyncio.create_task(block())
            await ending.wait()
            deadline = time.monotonic() + 30
            while await (await watch.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE '%%message_create%%'")).fetchone() != (1,):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.sleep(0)  # the cancellation is delivered, the call still waits
            assert not task.done() and not calls[0].done()
            await locker.commit()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 30)
            assert [call.result().status for call in calls] == [CreateStatus.CREATED] * 2
            assert aconn.info.transaction_status is psycopg.pq.TransactionStatus.IDLE
            assert [c.channel for c in await aqueue.channels() if c.size] == []
            await aqueue.send("after", b"y")
            assert [c.channel for c in await aqueue.channels() if c.size] == ["after"]
    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_an_async_dequeue_cancelled_after_the_server_answered_hands_its_messages_back(
        dsn: str) -> None:
    """A dequeue under asyncio.timeout (or wait_for, or a cancelled task) whose answer
    arrives after the cancellation: psycopg reads the committed answer and raises
    anyway, and 0.7.36 left the messages locked for the whole lock with nobody to
    handle them. The dequeue is held on a table lock until it waits for it; from the
    lock's release to the cancellation the test never yields, so the dequeue cannot
    read its answer first."""
    async def scenario() -> None:
        async with AsyncQueue(dsn) as queue:
            sent = await queue.send_many([NewMessage("c", b"x") for _ in range(3)])
            with psycopg.connect(dsn) as locker, psycopg.connect(dsn, autocommit=True) as watch:
                locker.execute("LOCK TABLE fairq.message IN ACCESS EXCLUSIVE MODE")
                call = asyncio.create_task(queue.dequeue(timedelta(minutes=5), 10))
                deadline = time.monotonic() + 30
                while watch.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND query LIKE '%%message_dequeue%%'").fetchone() != (1,):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                locker.commit()
                while watch.execute("SELECT count(*) FROM fairq.message"
                                    " WHERE status = 'locked'").fetchone() != (3,):
                    assert time.monotonic() < deadline
                    time.sleep(0.001)  # (not asyncio.sleep: the dequeue must not run)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(call, 30)
            back = await queue.dequeue(LOCK, 10)  # now, not in 5 minutes
            assert sorted((m.id, m.num_attempts) for m in back) == [(r.id, 2) for r in sent]
    asyncio.run(scenario())


def _drop_sessions(dsn: str) -> None:
    """Ends every other session of the test's database, as a server restart would."""
    others = ("SELECT pid FROM pg_stat_activity"
              " WHERE datname = current_database() AND pid <> pg_backend_pid()")
    with psycopg.connect(dsn, autocommit=True) as admin:
        # Until none is left: a pool may open a connection meanwhile (to replace one
        # it found dead), and waiting for that one to go waited for ever.
        while admin.execute(f"SELECT pg_terminate_backend(pid) FROM ({others}) o").fetchone():
            time.sleep(0.01)


def test_an_owned_pool_replaces_a_connection_the_server_dropped(
        dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """As after a server restart: the pooled connection is dead, and the next call
    still goes through (each pooled connection failed once)."""
    monkeypatch.setattr(_pools, "CHECK_AFTER_S", 0.0)  # every return counts as idle long
    with Queue(dsn) as queue:
        queue.send("a", b"1")
        _drop_sessions(dsn)
        assert queue.send("a", b"2").status is CreateStatus.CREATED

    async def scenario() -> None:
        async with AsyncQueue(dsn) as aqueue:
            await aqueue.send("a", b"3")
            _drop_sessions(dsn)
            assert (await aqueue.send("a", b"4")).status is CreateStatus.CREATED
    asyncio.run(scenario())


def test_a_settlement_whose_connection_the_server_dropped_is_sent_again(
        dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy pool hands its connections out unchecked (each used within CHECK_AFTER_S),
    so after a restart every message in flight failed its completion, stayed locked,
    and its handler ran again once the lock expired. A fenced settlement or heartbeat
    is sent once more, after the pool replaced the connections the server dropped
    (one that did commit would answer not_found, changing nothing); a send is not,
    since it might have created its message."""
    monkeypatch.setattr(_pools, "CHECK_AFTER_S", 3600.0)  # as in a busy pool: none checked
    batch = [NewMessage(channel, b"x") for channel in "abcde"]
    with Queue(dsn) as queue:
        queue.send_many(batch)
        first, second, third, fourth, fifth = queue.dequeue(LOCK, 5)
        settlements = [lambda: queue.heartbeat(first, LOCK), lambda: queue.complete(first),
                       lambda: queue.defer(second), lambda: queue.fail(third, "x"),
                       lambda: [r.status for r in queue.complete_batch([fourth, fifth])]]
        answers = []
        for settle in settlements:
            _drop_sessions(dsn)
            answers.append(settle())
        assert answers == [SettleStatus.HEARTBEATED, SettleStatus.COMPLETED,
                           SettleStatus.DEFERRED, SettleStatus.DEAD, [SettleStatus.COMPLETED] * 2]
        _drop_sessions(dsn)
        with pytest.raises(psycopg.OperationalError):
            queue.send("f", b"x")

    async def scenario() -> None:
        async with AsyncQueue(dsn) as aqueue:
            await aqueue.send_many(batch)
            messages = await aqueue.dequeue(LOCK, 10)
            assert len(messages) == 6  # (with the one deferred above)
            for message in messages:
                _drop_sessions(dsn)
                assert await aqueue.complete(message) is SettleStatus.COMPLETED
            _drop_sessions(dsn)
            with pytest.raises(psycopg.OperationalError):
                await aqueue.send("f", b"x")
    asyncio.run(scenario())


def test_invalid_arguments_raise_with_sqlstate(dsn: str) -> None:
    with Queue(dsn) as queue:
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="p_channel"):
            queue.send("", b"x")
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="p_max_messages"):
            queue.dequeue(LOCK, 0)


def test_a_due_time_is_dequeue_at_or_delay_never_both(dsn: str) -> None:
    both = {"dequeue_at": datetime.now(timezone.utc), "delay": timedelta(seconds=1)}
    with Queue(dsn) as queue:
        with pytest.raises(ValueError, match="not both"):
            queue.send("a", b"x", **both)
        with pytest.raises(ValueError, match="not both"):
            NewMessage("a", b"x", **both)
        queue.send("a", b"x")
        [msg] = queue.dequeue(LOCK)
        with pytest.raises(ValueError, match="not both"):
            msg.defer(**both)
        assert msg.complete() is SettleStatus.COMPLETED  # the refused defer changed nothing


@pytest.mark.parametrize("delay", [timedelta(days=400_000), -timedelta(days=400_000),
                                   timedelta(days=3651)])
def test_a_delay_past_the_longest_duration_is_refused_naming_it(
        dsn: str, delay: timedelta) -> None:
    """Past PostgreSQL's timestamps the database answered 22008 "timestamp out of
    range", naming no argument; the bound is fairq's longest duration, as the CLI's."""
    with Queue(dsn) as queue:
        with pytest.raises(ValueError, match="delay must be at most 3650 days"):
            queue.send("a", b"x", delay=delay)
        with pytest.raises(ValueError, match="delay must be at most 3650 days"):
            NewMessage("a", b"x", delay=delay)
        queue.send("a", b"x", delay=timedelta(days=3650))
        queue.send("a", b"x")
        [msg] = queue.dequeue(LOCK)
        with pytest.raises(ValueError, match="delay must be at most"):
            msg.defer(delay=delay)
        assert msg.complete() is SettleStatus.COMPLETED
        assert queue.stats().scheduled == 1  # only the ten-year one


def test_a_queues_own_pool_works_where_the_default_isolation_is_another(dsn: str) -> None:
    """fairq's calls refuse REPEATABLE READ (sql/validate.sql): a database that defaults
    to it made every call of a queue with its own pool fail."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        dbname = conn.info.dbname
        conn.execute(f'ALTER DATABASE "{dbname}" SET default_transaction_isolation'
                     " = 'repeatable read'")
    with Queue(dsn) as queue:
        assert queue.send("a", b"x").status is CreateStatus.CREATED
        [msg] = queue.dequeue(LOCK)
        assert msg.complete() is SettleStatus.COMPLETED

    async def scenario() -> None:
        async with AsyncQueue(dsn) as aqueue:
            assert (await aqueue.send("a", b"y")).status is CreateStatus.CREATED
            [amsg] = await aqueue.dequeue(LOCK)
            assert await amsg.complete() is SettleStatus.COMPLETED
    asyncio.run(scenario())
    with psycopg.connect(dsn, autocommit=True) as conn, \
            pytest.raises(psycopg.errors.FeatureNotSupported, match="READ COMMITTED"):
        Queue(conn).send("a", b"z")  # a connection of the caller's keeps its own setting


def test_fairqs_own_connections_time_out_unless_told_otherwise() -> None:
    """The LISTEN and doorbell connections, and a queue's own pool, had no connect
    timeout: an unreachable host held the worker's loop, and stop(), for minutes."""
    from psycopg.conninfo import conninfo_to_dict

    from fairq._source import with_connection_defaults

    plain = conninfo_to_dict(with_connection_defaults("host=db.example dbname=app"))
    assert (plain["connect_timeout"], plain["keepalives"], plain["tcp_user_timeout"],
            plain["dbname"]) == ("10", "1", "60000", "app")
    own = conninfo_to_dict(with_connection_defaults("postgresql://u@db.example/app?connect_timeout=3"))
    assert (own["connect_timeout"], own["user"]) == ("3", "u")


def test_fairqs_own_connections_are_named_fairq_unless_named_otherwise(dsn: str) -> None:
    """pg_stat_activity showed a queue's own connections without a name, so an operator
    could not tell fairq's sessions (workers, heartbeats, doorbells) from others."""
    with Queue(dsn) as queue, queue.connection() as conn:
        assert conn.execute("SHOW application_name").fetchone() == ("fairq",)
    named = psycopg.conninfo.make_conninfo(dsn, application_name="billing-worker")
    with Queue(named) as queue, queue.connection() as conn:
        assert conn.execute("SHOW application_name").fetchone() == ("billing-worker",)


def test_a_queues_own_pool_connects_with_a_timeout_and_keepalives(dsn: str) -> None:
    """Its connections had neither, unlike the worker's own: after a failover to a host
    that stopped answering, each connect of the pool waited for the system's TCP
    timeout. The queue's conninfo stays the one it was given (a connect_timeout of
    the caller's own is kept)."""
    own = psycopg.conninfo.make_conninfo(dsn, connect_timeout="7")
    with Queue(dsn) as queue, queue.connection() as conn:
        assert queue.conninfo == dsn
        given = conn.info.get_parameters()
        assert (given.get("connect_timeout"), given.get("keepalives"),
                given.get("tcp_user_timeout")) == ("10", "1", "60000")
    with Queue(own) as queue, queue.connection() as conn:
        assert conn.info.get_parameters().get("connect_timeout") == "7"

    async def scenario() -> None:
        async with AsyncQueue(dsn) as aqueue, aqueue.connection() as aconn:
            assert aqueue.conninfo == dsn
            given = aconn.info.get_parameters()
            assert (given.get("connect_timeout"), given.get("keepalives")) == ("10", "1")
    asyncio.run(scenario())


def test_a_count_past_the_sqls_integer_is_out_of_range(dsn: str) -> None:
    with Queue(dsn) as queue, pytest.raises(psycopg.errors.NumericValueOutOfRange):
        queue.dequeue(LOCK, 2**31)  # was "function fairq.message_dequeue(...) does not exist"


# Every call that takes a message's id or token, given one past the SQL's bigint.
PAST_BIGINT = 2**63
CALLS_WITH_AN_ID: dict[str, Callable[[Queue[bytes], Message[bytes]], object]] = {
    "cancel": lambda q, m: q.cancel(PAST_BIGINT),
    "dead_letter_retry": lambda q, m: q.dead_letter_retry(PAST_BIGINT),
    "dead_letter_delete": lambda q, m: q.dead_letter_delete(PAST_BIGINT),
    "complete": lambda q, m: q.complete(replace(m, id=PAST_BIGINT)),
    "complete_batch": lambda q, m: q.complete_batch([replace(m, id=PAST_BIGINT)]),
    "defer": lambda q, m: q.defer(replace(m, id=PAST_BIGINT)),
    "heartbeat": lambda q, m: q.heartbeat(replace(m, id=PAST_BIGINT), LOCK),
    "fail": lambda q, m: q.fail(replace(m, id=PAST_BIGINT)),
    "complete, token": lambda q, m: q.complete(replace(m, num_attempts=PAST_BIGINT)),
    "defer, token": lambda q, m: q.defer(replace(m, num_attempts=PAST_BIGINT)),
    "heartbeat, token": lambda q, m: q.heartbeat(replace(m, num_attempts=PAST_BIGINT), LOCK),
    "fail, token": lambda q, m: q.fail(replace(m, num_attempts=PAST_BIGINT)),
}


@pytest.mark.parametrize("call", CALLS_WITH_AN_ID)
def test_an_id_past_the_sqls_bigint_is_out_of_range(dsn: str, call: str) -> None:
    """As a count past the integer is: sent uncast, such an int went as a numeric, and
    the call failed with "function fairq.message_cancel(p_id => numeric) does not
    exist" (42883). The message held stays held."""
    with Queue(dsn) as queue:
        queue.send("a", b"x")
        [held] = queue.dequeue(LOCK)
        with pytest.raises(psycopg.errors.NumericValueOutOfRange):
            CALLS_WITH_AN_ID[call](queue, held)
        assert queue.complete(held) is SettleStatus.COMPLETED


def test_a_lock_wait_past_what_lock_timeout_holds_is_refused_naming_it(dsn: str) -> None:
    """lock_timeout holds at most 2^31 - 1 ms (about 24.8 days): a longer lock_wait
    failed in set_config with 22023 naming lock_timeout, a setting the caller never
    named."""
    with Queue(dsn) as queue:
        queue.send("a", b"x")
        [held] = queue.dequeue(LOCK)
        with pytest.raises(ValueError, match="lock_wait"):
            queue.heartbeat(held, LOCK, lock_wait=timedelta(days=25))
        longest = timedelta(milliseconds=2**31 - 1)
        assert queue.heartbeat(held, LOCK, lock_wait=longest) is SettleStatus.HEARTBEATED


def test_a_negative_duration_below_a_millisecond_is_refused(dsn: str) -> None:
    with Queue(dsn) as queue:
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="p_release_interval_ms"):
            queue.channel_set("a", release_interval=timedelta(microseconds=-1))
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="p_lock_ms"):
            queue.dequeue(timedelta(microseconds=-1))
        assert queue.channels() == []


def test_raw_content_must_be_bytes_like(dsn: str) -> None:
    """bytes(5) is five zero bytes: an int sent as content was stored as that."""
    with Queue(dsn) as queue:
        for wrong in (5, [104, 105], "text"):
            with pytest.raises(TypeError, match="content must be bytes"):
                queue.send("a", wrong)  # type: ignore[arg-type]
        for right in (b"x", bytearray(b"x"), memoryview(b"x")):
            assert queue.send("a", right).status is CreateStatus.CREATED  # type: ignore[arg-type]
        assert {m.raw for m in queue.dequeue(LOCK, 10)} == {b"x"}
        assert queue.stats().size == 3


def test_a_naive_datetime_is_refused_before_anything_is_sent(dsn: str) -> None:
    """PostgreSQL reads a naive datetime in the session's time zone, not the caller's:
    datetime.now() in Tokyo scheduled a message nine hours late."""
    naive = datetime.now() + timedelta(hours=1)
    with Queue(dsn) as queue:
        calls = {
            "dequeue_at": [lambda: queue.send("a", b"x", dequeue_at=naive),
                           lambda: NewMessage("a", b"x", dequeue_at=naive)],
            "until": [lambda: queue.pause(naive), lambda: queue.channel_pause("a", naive)],
            "before": [lambda: queue.dead_letter_purge(naive), lambda: queue.history_prune(naive)],
            "since": [lambda: queue.history(since=naive)],
            "start_at": [lambda: queue.schedule_periodic("p", timedelta(minutes=1), "a", b"x",
                                                         start_at=naive)],
        }
        for name, refused in calls.items():
            for call in refused:
                with pytest.raises(ValueError, match=f"{name} must be timezone-aware"):
                    call()
        queue.send("a", b"x")
        [msg] = queue.dequeue(LOCK)
        with pytest.raises(ValueError, match="dequeue_at must be timezone-aware"):
            msg.defer(dequeue_at=naive)
        assert msg.complete() is SettleStatus.COMPLETED
        assert queue.stats().size == 0 and queue.stats().paused_until is None


def test_undecodable_content_reaches_the_receiver(dsn: str) -> None:
    with Queue(dsn) as raw_queue, Queue(dsn, codec=JsonCodec()) as queue:
        raw_queue.send("a", b"\xff not json")
        raw_queue.send("b", b"[1]")
        first, second = sorted(queue.dequeue(LOCK, 2), key=lambda m: m.channel)
        assert second.content == [1]
        with pytest.raises(ValueError):
            _ = first.content
        assert first.fail("undecodable") is SettleStatus.DEAD


def test_the_workers_longest_lock_is_the_sqls(dsn: str) -> None:
    """_work.MAX_LOCK mirrors fairq.max_duration_ms(): a worker refuses a lock that
    every dequeue would refuse."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT fairq.max_duration_ms()").fetchone()
    assert row is not None and timedelta(milliseconds=row[0]) == _work.MAX_LOCK


def test_a_heartbeat_with_a_lock_wait_in_a_callers_transaction_leaves_its_lock_timeout(
        dsn: str) -> None:
    """The wait is the heartbeat's alone: it set lock_timeout for the rest of the
    caller's transaction, and every later statement there gave up on a lock after
    100 ms. It still bounds the heartbeat's own wait for a row held elsewhere."""
    with Queue(dsn) as queue:
        queue.send("tenant-a", b"x")
        (message,) = queue.dequeue(LOCK)
        with queue.transaction() as tx:
            assert tx.execute("SHOW lock_timeout").fetchone() == ("0",)
            assert queue.heartbeat(message, LOCK, conn=tx,
                                   lock_wait=timedelta(milliseconds=100)) is SettleStatus.HEARTBEATED
            assert tx.execute("SHOW lock_timeout").fetchone() == ("0",)
        with psycopg.connect(dsn) as holder:
            holder.execute("SELECT 1 FROM fairq.message FOR UPDATE")
            started = time.monotonic()
            with pytest.raises(psycopg.errors.LockNotAvailable):
                queue.heartbeat(message, LOCK, lock_wait=timedelta(milliseconds=100))
            assert time.monotonic() - started < 10  # (a failure net: it waits 100 ms)


def test_a_source_of_the_wrong_kind_is_refused_by_the_constructor(dsn: str) -> None:
    """None (``os.environ.get`` of an unset variable), or the other binding's connection
    or pool, failed only at the first call, with an AttributeError about something
    else ("'NoneType' object has no attribute 'info'", "'ConnectionPool' object has
    no attribute 'autocommit'")."""
    sync_pool: ConnectionPool[Any] = ConnectionPool(dsn, open=False)

    async def wrong_for_the_sync_queue() -> list[TypeError]:
        async with await psycopg.AsyncConnection.connect(dsn) as aconn:
            apool: AsyncConnectionPool[Any] = AsyncConnectionPool(dsn, open=False)
            refused = []
            for source in (aconn, apool):
                with pytest.raises(TypeError, match="source must be") as raised:
                    Queue(source)  # type: ignore[call-overload]
                refused.append(raised.value)
            return refused

    assert "AsyncConnection" in str(asyncio.run(wrong_for_the_sync_queue())[0])
    with psycopg.connect(dsn) as sync_conn:
        for source in (None, 42, sync_conn, sync_pool):
            with pytest.raises(TypeError, match="source must be"):
                AsyncQueue(source)  # type: ignore[call-overload]
        with pytest.raises(TypeError, match=r"source must be .* got NoneType"):
            Queue(None)  # type: ignore[call-overload]


def test_json_content_is_standard_json(dsn: str) -> None:
    """NaN and the infinities went out as ``NaN``/``Infinity``, which no JSON parser but
    Python's reads: PostgreSQL's ``::jsonb`` refused every row of a query over such
    content. What goes out still reads there, compact and UTF-8."""
    codec = JsonCodec()
    for number in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="not JSON"):
            codec.encode({"score": number})
    with Queue(dsn, codec=codec) as queue, psycopg.connect(dsn) as conn:
        content = {"big": 10**30, "t": "é", "f": 0.5, "n": None}
        assert queue.send("a", content).status is CreateStatus.CREATED
        assert conn.execute("SELECT convert_from(content, 'UTF8')::jsonb = %s::jsonb"
                            " FROM fairq.message", [json.dumps(content)]).fetchone() == (True,)
        [message] = queue.dequeue(LOCK)
        assert message.content == content
        assert message.raw == b'{"big":1000000000000000000000000000000,"t":"\xc3\xa9","f":0.5,"n":null}'


def test_a_text_codec_refuses_an_encoding_it_cannot_use_when_made() -> None:
    """A misspelt encoding failed only at the first encode or decode: a worker given it
    failed every message it took (each retried until max_attempts dead-lettered it)."""
    for wrong in ("utf-9", "no-such-encoding", "base64", "rot13"):
        with pytest.raises(LookupError):
            TextCodec(wrong)
    assert TextCodec("latin-1").decode(b"\xe9") == "é"


def test_a_connection_whose_cursors_are_raw_works(dsn: str) -> None:
    """A connection made with ``cursor_factory=RawCursor`` (``$1`` placeholders) made
    every call fail with "raw queries require a sequence of parameters": the queues
    ran their named-parameter statements on whatever cursor the connection makes."""
    with psycopg.connect(dsn, autocommit=True, cursor_factory=psycopg.RawCursor) as conn:
        queue = Queue(conn, name="raw")
        assert queue.send("a", b"x").status is CreateStatus.CREATED
        [message] = queue.dequeue(LOCK, conn=conn)
        assert message.complete() is SettleStatus.COMPLETED
        # The caller's own cursors stay raw.
        assert type(conn.cursor()) is psycopg.RawCursor

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(
                dsn, autocommit=True, cursor_factory=psycopg.AsyncRawCursor) as aconn:
            aqueue = AsyncQueue(aconn, name="raw")
            assert (await aqueue.send("a", b"y")).status is CreateStatus.CREATED
            [amessage] = await aqueue.dequeue(LOCK)
            assert amessage.raw == b"y"
            assert await amessage.complete(conn=aconn) is SettleStatus.COMPLETED
            assert type(aconn.cursor()) is psycopg.AsyncRawCursor
    asyncio.run(scenario())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11's")
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_call_the_installed_extension_lacks_says_it_may_be_behind(dsn: str, kind: str) -> None:
    """A package newer than its database's extension failed with "function
    fairq.message_create(p_channel => unknown, ...) does not exist", which does not say
    why: the error now carries a note naming the versions to compare and the upgrade."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP EXTENSION fairq CASCADE")
        conn.execute("CREATE EXTENSION fairq VERSION '0.5.0'")
    with pytest.raises(psycopg.errors.UndefinedFunction) as excinfo:
        if kind == "sync":
            with Queue(dsn) as queue:
                queue.send("a", b"x")
        else:
            async def scenario() -> None:
                async with AsyncQueue(dsn) as queue:
                    await queue.send("a", b"x")
            asyncio.run(scenario())
    notes = getattr(excinfo.value, "__notes__", [])
    assert any("ALTER EXTENSION fairq UPDATE" in note and __version__ in note
               for note in notes), notes


@pytest.mark.parametrize("call", [
    lambda q: q.dead_letters(limit=-1),
    lambda q: q.dead_letters(limit=2**63),
    lambda q: q.history(limit=-1),
    lambda q: q.history(limit=True),
], ids=["dead_letters -1", "dead_letters past bigint", "history -1", "history True"])
def test_a_limit_sql_cannot_take_is_refused_naming_it(
        dsn: str, call: Callable[[Queue[bytes]], object]) -> None:
    """PostgreSQL's LIMIT refused these with its own words (2201W, 22003), not naming
    the argument."""
    with Queue(dsn) as queue, pytest.raises(ValueError, match=r"^limit must be an integer from 0"):
        call(queue)


@pytest.mark.parametrize("call", [
    lambda q: q.send("a", b"x", dequeue_at=date(2030, 1, 1)),
    lambda q: q.pause(date(2030, 1, 1)),
    lambda q: q.history_prune(date(2030, 1, 1)),
], ids=["send dequeue_at", "pause until", "history_prune before"])
def test_a_date_where_a_point_in_time_is_wanted_is_refused_naming_it(
        dsn: str, call: Callable[[Queue[bytes]], object]) -> None:
    """A date failed with AttributeError: 'datetime.date' object has no attribute
    'utcoffset'."""
    with Queue(dsn) as queue, pytest.raises(TypeError,
                                            match=r"must be a timezone-aware datetime, got date"):
        call(queue)
