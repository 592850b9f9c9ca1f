"""``AsyncWorker``: runs an ``async def`` handler over an :class:`~fairq.AsyncQueue`.

The same worker as :class:`fairq.Worker`, with the same options and every decision
shared with it (:mod:`fairq._work`): locks heartbeated every ``lock / 3``, back-off
with jitter on exceptions, dead letters after ``max_attempts``, fenced settlements,
``NOTIFY fairq`` wake-ups of its own queue with a polling fallback (and the queue's
doorbell held while it waits for work, on a connection of its own), periodic drivers,
and a graceful stop. Only the running differs: each message's handler is a task of
the caller's event loop (at most ``concurrency`` at once), and the dequeue loop,
heartbeats and LISTEN connection are tasks beside them.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any, Generic, TypeVar

import psycopg
from psycopg_pool import PoolTimeout

from fairq import _sql, _timestamps, _work, periodic
from fairq._source import with_connection_defaults
from fairq._work import Backoff, Settlement
from fairq.aio import AsyncQueue, finish
from fairq.types import AsyncMessage, SettleStatus

__all__ = ["AsyncWorker"]

T = TypeVar("T")
R = TypeVar("R")
log = _work.log


async def settle(message: AsyncMessage[T], settlement: Settlement,
                 conn: psycopg.AsyncConnection[Any] | None = None) -> SettleStatus:
    """Applies a settlement through the message's queue (on ``conn`` if given)."""
    # (Through the queue: the message's own methods record what its handler did.)
    if settlement.outcome is SettleStatus.COMPLETED:
        return await message.queue.complete(message, conn=conn)
    if settlement.outcome is SettleStatus.DEAD:
        return await message.queue.fail(message, settlement.error, conn=conn)
    return await message.queue.defer(message, delay=settlement.delay, conn=conn)


class AsyncWorker(Generic[T]):
    """``await worker.run()`` works until ``stop()``, or SIGTERM/SIGINT when the loop
    runs in the main thread; the options are those of :class:`fairq.Worker`."""

    def __init__(self, queue: AsyncQueue[T],
                 handler: Callable[[AsyncMessage[T]], Awaitable[None]], *,
                 concurrency: int = 1, lock: timedelta = timedelta(seconds=30),
                 max_attempts: int | None = 5, backoff: Backoff = Backoff(),
                 poll_interval: timedelta = timedelta(seconds=5),
                 grace_period: timedelta = timedelta(seconds=30),
                 listen: bool = True) -> None:
        self.queue = queue
        self.handler = handler
        self.options = _work.Options(
            concurrency=concurrency, lock=lock, max_attempts=max_attempts, backoff=backoff,
            poll_interval=poll_interval, grace_period=grace_period, listen=listen)
        self._wakeups = _work.Wakeups(_work.queue_name(queue), poll_interval)
        self._doorbell: _work.Doorbell | None = (
            _work.Doorbell(_work.queue_name(queue), poll_interval)
            if listen and queue.conninfo is not None else None)
        self._doorbell_conn: psycopg.AsyncConnection[Any] | None = None
        self._stopping = False
        self._stopping_now = False  # the grace period is over
        self._loop: asyncio.AbstractEventLoop | None = None  # while run() runs
        self._wake = asyncio.Event()
        self._grace_over = asyncio.Event()  # set with _stopping_now
        # by _work.delivery
        self._running: dict[tuple[int, int], tuple[AsyncMessage[T], asyncio.Task[None]]] = {}
        # Deliveries whose handler has returned and whose settlement is being sent: a
        # drain neither hands them back nor cancels them (the settlement, cut short or
        # beaten by the hand-back, made the finished work come back).
        self._settling: set[tuple[int, int]] = set()
        # The deliveries handed back by the worker (by _drain, whose tasks it cancels,
        # or by _process, whose task was cancelled from outside): a CancelledError from
        # any other handler is the handler's own failure.
        self._handed_back: set[tuple[int, int]] = set()
        # One per dequeue or hand-back under way: the queue's close() waits for them.
        self._under_way: set[asyncio.Future[None]] = set()
        self._reported_not_async = False  # _work.report_not_async: once per worker

    # -- control --------------------------------------------------------------------

    def stop(self, *, now: bool = False) -> None:
        """Stops taking work; ``run()`` returns once in-flight work is settled, or handed
        back when ``grace_period`` is over. With ``now``, the grace period is over at
        once: what still runs is handed back (as a second SIGTERM/SIGINT does). It may
        be called from any thread."""
        loop = self._loop
        if loop is None or _running_loop() is loop:
            self._request_stop(now)
        else:
            loop.call_soon_threadsafe(self._request_stop, now)

    def _request_stop(self, now: bool) -> None:
        self._stopping = True
        self._wake.set()
        if now:
            self._stopping_now = True
            self._grace_over.set()

    async def run(self) -> None:
        """Works until ``stop()`` (or SIGTERM/SIGINT when the loop runs in the main thread).
        A worker may be run again once it has returned; a ``stop()`` before ``run()``
        makes it return at once. A second run() while one runs raises RuntimeError (the
        two took each other's messages, past ``concurrency``)."""
        loop = asyncio.get_running_loop()
        if self._loop is not None:
            raise RuntimeError("this worker is already running")
        self._loop = loop
        # Bound to this loop on first use; a worker may be run again in another one.
        self._wake = asyncio.Event()
        self._grace_over = asyncio.Event()
        if self._stopping:
            self._wake.set()
        if self._stopping_now:
            self._grace_over.set()
        leave = _signals.join(loop, self)
        self.queue._before_close.add(self._before_queue_closes)
        background = [asyncio.create_task(self._heartbeat_loop(), name="fairq-heartbeat")]
        if self.options.listen and self.queue.conninfo is None:
            log.warning("the queue's pool computes its conninfo: no LISTEN, polling only")
        elif self.options.listen:
            background.append(asyncio.create_task(self._listen_loop(), name="fairq-listen"))
        try:
            await self._dequeue_loop()
            await self._drain(self.options.grace_period)
        except asyncio.CancelledError:
            # run() itself was cancelled (a TaskGroup, wait_for, an application's
            # shutdown): no grace, the caller wants it gone; what runs is handed back
            # at once rather than left to lapse, and its tasks are cancelled. A second
            # cancellation (a shutdown, then its timeout) does not cut that short: it
            # would leave messages locked and handlers running after run() is gone.
            # The hand-back costs a statement per message.
            await finish(asyncio.ensure_future(self._drain(timedelta(0))))
            raise
        finally:
            # When run() returns, the worker holds no connection of its own any more.
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            leave()
            self.queue._before_close.discard(self._before_queue_closes)
            self._loop = None
            if self._doorbell_conn is not None:
                await self._doorbell_conn.close()  # lets go of the doorbell
                self._doorbell_conn = None
            if self._doorbell is not None:
                self._doorbell.lost()
            self._stopping = False  # (0.7.26 kept it: a second run() returned at once)
            self._stopping_now = False

    def _on_signal(self, sig: signal.Signals) -> None:
        # The first asks for a graceful stop; a second one (an operator's second
        # Ctrl-C) is impatience: what still runs goes back to the queue now.
        again = self._stopping
        log.info("received %s%s", sig.name,
                 " again: handing back what still runs" if again else ": stopping")
        self.stop(now=again)

    # -- taking work ----------------------------------------------------------------

    async def _dequeue_loop(self) -> None:
        while not self._stopping:
            free = self.options.concurrency - len(self._running)
            if free == 0:
                await self._wait(self.options.poll_interval)
                continue
            # Cleared before the dequeue: an event that arrives during it wakes the
            # wait below instead of being lost.
            self._wake.clear()
            try:
                messages = await self._dequeue(free)
            except psycopg.Error:
                log.exception("dequeue failed; retrying in %s", self.options.poll_interval)
                await self._wait(self.options.poll_interval)
                continue
            if not messages and self._stopping:
                break  # (not a word to the doorbell: the database may be out of reach)
            for message in messages:
                task = asyncio.create_task(self._process(message),
                                           name=f"fairq-message-{message.id}")
                self._running[_work.delivery(message)] = (message, task)
            if len(messages) == free:
                if self._doorbell is not None:
                    await self._ask_doorbell(self._doorbell.busy())
                continue
            if messages and self._doorbell is not None:
                self._doorbell.took_work()
            if await self._may_sleep():
                await self._wait(self._wakeups.idle_timeout(datetime.now(timezone.utc)))

    async def _dequeue(self, free: int) -> list[AsyncMessage[T]]:
        """A dequeue whose wait for a pooled connection looks every
        ``ConnectionWait.SLICE`` whether the worker is stopping: then it takes nothing.
        A cancellation of run() ends that wait at once (0.7.36 shielded it, and waited
        up to ``ConnectionWait.LIMIT``); one that arrives once the statement is sent
        is answered by ``AsyncQueue.dequeue``: it waits for the answer and hands its
        messages back, however often run() is cancelled meanwhile (0.7.36 let a second
        cancellation cut that short, and the messages stayed locked)."""
        wait = _work.ConnectionWait(time.monotonic())
        with self._tracked():
            while True:
                try:
                    async with self.queue.connection(
                            timeout=wait.SLICE.total_seconds()) as conn:
                        return await self.queue.dequeue(self.options.lock, free, conn=conn)
                except PoolTimeout:
                    if self._stopping:
                        return []
                    if wait.over(time.monotonic()):
                        raise

    async def _may_sleep(self) -> bool:
        """With the doorbell: hold it and hear "quiet" before sleeping (False: look
        for work first, after the pause the doorbell asks for)."""
        if self._doorbell is None:
            return True
        answer = await self._ask_doorbell(self._doorbell.before_sleep(time.monotonic()))
        if answer is None:
            return True
        self._wakeups.expect(answer.next_turn_at, datetime.now(timezone.utc))
        pause = self._doorbell.answered(answer, time.monotonic())
        if pause is not None:
            await self._wait(pause)
        return False

    async def _ask_doorbell(self, call: _sql.Call[R] | None) -> R | None:
        if call is None or self._doorbell is None:
            return None
        try:
            if self._doorbell_conn is None or self._doorbell_conn.closed:
                assert self.queue.conninfo is not None  # as the doorbell's creation checked
                self._doorbell_conn = await psycopg.AsyncConnection.connect(
                    with_connection_defaults(self.queue.conninfo), autocommit=True)
                # Its answer's next_turn_at is 'infinity' (or the year 10000) while a
                # channel is paused until resumed.
                _timestamps.register(self._doorbell_conn)
            cursor = await self._doorbell_conn.execute(call.query, call.params)
            return call.decode(await cursor.fetchall())
        except psycopg.Error as exc:
            if self._doorbell_conn is not None:
                await self._doorbell_conn.close()
            if self._doorbell.failed(exc):
                self._doorbell = None
            return None

    async def _wait(self, timeout: timedelta) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), max(0.0, timeout.total_seconds()))
        self._wake.clear()

    async def _listen_loop(self) -> None:
        assert self.queue.conninfo is not None  # run() checked it
        conninfo = with_connection_defaults(self.queue.conninfo)
        outage = _work.ListenOutage()
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(conninfo,
                                                                 autocommit=True) as conn:
                    await conn.execute("LISTEN fairq")
                    outage.connected(time.monotonic())
                    self._wake.set()  # anything sent before LISTEN took effect
                    async for notify in conn.notifies():
                        if self._wakeups.heard(notify.payload, datetime.now(timezone.utc)):
                            self._wake.set()
            except psycopg.Error as exc:
                outage.failed(exc, time.monotonic())
                await asyncio.sleep(self.options.poll_interval.total_seconds())

    # -- doing work -----------------------------------------------------------------

    async def _process(self, message: AsyncMessage[T]) -> None:
        try:
            stopping = False
            if message.channel == periodic.PERIODIC_CHANNEL:
                try:
                    _work.report_tick(await self.queue.periodic_tick(message))
                    return
                except Exception as exc:  # unreadable, or the tick failed: not left to its lock
                    settlement = _work.driver_not_ticked(message, exc, self.options)
            else:
                try:
                    result: object = self.handler(message)
                    if inspect.isawaitable(result):
                        await result
                    elif not self._reported_not_async:
                        self._reported_not_async = True
                        _work.report_not_async(self.handler)
                except asyncio.CancelledError as exc:
                    if _work.delivery(message) in self._handed_back:
                        raise  # ours: _drain handed the message back
                    if _task_cancelled():
                        # From outside (asyncio.run's shutdown cancels every task left,
                        # a task group its tasks): not the handler's failure, and not
                        # ours any more: back now rather than when its lock lapses.
                        self._handed_back.add(_work.delivery(message))
                        _work.report_task_cancelled(message)
                        await finish(asyncio.ensure_future(self._hand_back([message])))
                        raise
                    # The handler's own (it awaited something cancelled elsewhere).
                    settlement = _work.after_failure(message, exc, self.options)
                except BaseException as exc:  # as Worker: whatever a handler raises
                    settlement = _work.after_failure(message, exc, self.options)
                    stopping = _work.stops_worker(exc)
                else:
                    settlement = _work.SUCCESS
            self._settling.add(_work.delivery(message))
            _work.report_settlement(message, settlement, await settle(message, settlement))
            if stopping:
                self.stop()
        except Exception:
            # The settlement itself failed (database gone?): the lock expires and the
            # message comes back; nothing else to do here.
            log.exception("message %s: could not be settled", message.id)
        finally:
            self._running.pop(_work.delivery(message), None)
            self._handed_back.discard(_work.delivery(message))
            self._settling.discard(_work.delivery(message))
            self._wake.set()

    async def _heartbeat_loop(self) -> None:
        """Heartbeats, on a connection of their own, as Worker's (worker.py says why)."""
        interval = self.options.heartbeat_interval.total_seconds()
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            while True:
                await asyncio.sleep(interval)
                for message, _ in list(self._running.values()):
                    try:
                        if conn is None and self.queue.conninfo is not None:
                            conn = await psycopg.AsyncConnection.connect(
                                with_connection_defaults(self.queue.conninfo), autocommit=True)
                        status = await self.queue.heartbeat(message, self.options.lock,
                                                            lock_wait=_work.HEARTBEAT_LOCK_WAIT,
                                                            conn=conn)
                    except psycopg.errors.LockNotAvailable:
                        _work.report_heartbeat_held(message)
                        continue
                    except psycopg.Error:
                        log.warning("message %s: heartbeat failed", message.id, exc_info=True)
                        if conn is not None and conn.broken:
                            await conn.close()
                            conn = None  # connected again for the next
                        continue
                    delivery = _work.delivery(message)
                    if delivery in self._running and delivery not in self._settling:
                        _work.report_heartbeat(message, status)  # (which says why not else)
        finally:
            if conn is not None:
                await conn.close()

    # -- stopping -------------------------------------------------------------------

    async def _drain(self, grace: timedelta, *, wait: bool = True) -> None:
        """Waits up to ``grace`` for handlers (less, if ``stop(now=True)`` ends it), then
        hands back what still runs and cancels its task (its outcome no longer counts:
        the message is not ours), and waits for those tasks unless ``wait`` is False."""
        tasks = [task for _, task in self._running.values()]
        if tasks and grace > timedelta(0) and not self._grace_over.is_set():
            # (Neither wait cancels what it waits for: the handlers run on, and are
            # cancelled below only once their messages are back.)
            finished = asyncio.ensure_future(asyncio.wait(tasks))
            grace_over = asyncio.ensure_future(self._grace_over.wait())
            try:
                await asyncio.wait((finished, grace_over), timeout=grace.total_seconds(),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                finished.cancel()
                grace_over.cancel()
        settling = [task for message, task in self._running.values()
                    if _work.delivery(message) in self._settling]
        left = [(message, task) for message, task in self._running.values()
                if _work.delivery(message) not in self._settling]
        # (Not those _process hands back itself: its task was cancelled from outside.)
        back = [message for message, _ in left
                if _work.delivery(message) not in self._handed_back]
        self._handed_back.update(_work.delivery(message) for message in back)
        await self._hand_back(back)
        tasks = [task for _, task in left]
        for task in tasks:
            task.cancel()
        if wait:
            await asyncio.gather(*tasks, *settling, return_exceptions=True)

    async def _before_queue_closes(self) -> None:
        """Called by ``AsyncQueue.close()`` while run() runs, before the queue's own pool
        closes: every call of the worker's would fail after it, hand-backs included,
        and what it held waited for its locks. So what runs is handed back now and its
        tasks cancelled, run() stops as with ``stop(now=True)``, and the hand-backs
        already under way (run()'s own, or a handler's task cancelled from outside)
        end first. The handlers' tasks are not waited for (run() does): one may be the
        closer, or wait for it (``await asyncio.wait_for(queue.close(), t)`` in a
        handler, a task of its own before 3.12), and close() waited for it for ever."""
        self._request_stop(True)
        while True:
            await self._drain(timedelta(0), wait=False)
            if not self._under_way:
                return
            # Then again: a dequeue's messages are running by the time it is seen over.
            await asyncio.wait(set(self._under_way))

    @contextlib.contextmanager
    def _tracked(self) -> Iterator[None]:
        """Marks a dequeue or hand-back under way, for the queue's close() to wait for."""
        under_way: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._under_way.add(under_way)
        try:
            yield
        finally:
            self._under_way.discard(under_way)
            under_way.set_result(None)

    async def _hand_back(self, messages: list[AsyncMessage[T]]) -> None:
        with self._tracked():
            await self._give_back(messages)

    async def _give_back(self, messages: list[AsyncMessage[T]]) -> None:
        """Each hand-back waits ``HAND_BACK_CONNECTION_WAIT`` at most for a connection,
        and the first that gets none leaves the rest to their locks' expiry."""
        wait = _work.HAND_BACK_CONNECTION_WAIT.total_seconds()
        for i, message in enumerate(messages):
            try:
                async with message.queue.connection(timeout=wait) as conn:
                    status = await settle(message, _work.HAND_BACK, conn)
            except psycopg.Error as exc:
                if _work.without_connection(exc):
                    _work.report_hand_backs_given_up(messages[i:], exc)
                    return
                log.exception("message %s: could not be handed back; its lock will expire",
                              message.id)
                continue
            _work.report_hand_back(message, status)


class _SignalDispatch:
    """SIGTERM and SIGINT for the AsyncWorkers that run in an event loop of the main
    thread. A loop keeps one handler per signal: when each run() installed its own, a
    signal stopped only the worker started last, and the first to return put back
    what it had found (asyncio's no-op handler, installed by the other), so later
    signals were ignored. One handler per loop and signal stops every worker running
    there; the last to leave removes it and puts back what was there before (the
    loop's removal leaves the default disposition, not asyncio.run's own SIGINT
    handler, say). Used from the main thread only, like signals themselves."""

    def __init__(self) -> None:
        # Per loop and signal: the handler found before the first worker joined (None:
        # one set outside Python, which cannot be put back), and the workers running.
        self._joined: dict[tuple[asyncio.AbstractEventLoop, signal.Signals],
                           tuple[Any, list[AsyncWorker[Any]]]] = {}

    def join(self, loop: asyncio.AbstractEventLoop,
             worker: AsyncWorker[Any]) -> Callable[[], None]:
        """Has SIGTERM/SIGINT stop ``worker`` while it runs; returns what to call when
        it returns."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        joined: list[tuple[asyncio.AbstractEventLoop, signal.Signals]] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            key = (loop, sig)
            if key not in self._joined:
                previous = signal.getsignal(sig)
                try:
                    loop.add_signal_handler(sig, self._received, key)
                except (NotImplementedError, RuntimeError):  # a loop without signal support
                    continue
                self._joined[key] = (previous, [])
            self._joined[key][1].append(worker)
            joined.append(key)

        def leave() -> None:
            for key in joined:
                previous, workers = self._joined[key]
                workers.remove(worker)
                if not workers:
                    del self._joined[key]
                    loop.remove_signal_handler(key[1])
                    if previous is not None:
                        signal.signal(key[1], previous)
        return leave

    def _received(self, key: tuple[asyncio.AbstractEventLoop, signal.Signals]) -> None:
        # (A signal the loop had already queued when the last worker left finds none.)
        _, workers = self._joined.get(key, (None, []))
        for worker in list(workers):
            worker._on_signal(key[1])


_signals = _SignalDispatch()


def _task_cancelled() -> bool:
    """Whether the current task is being cancelled, as opposed to a CancelledError that
    its code raised of itself (it awaited something cancelled elsewhere). Python 3.10
    cannot tell (``Task.cancelling()`` is 3.11's): there every CancelledError the
    worker did not cause counts as the handler's failure, as in 0.7.36."""
    if sys.version_info >= (3, 11):
        task = asyncio.current_task()
        return task is not None and task.cancelling() > 0
    return False


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
