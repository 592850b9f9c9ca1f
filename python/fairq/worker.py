"""``Worker``: runs a handler over the queue's messages with a pool of threads.

- Each message is locked for ``lock`` and heartbeated every ``lock / 3`` while its
  handler runs, so a short lock (fast recovery after a crash) is safe for long jobs.
  Heartbeats go on a connection of their own (opened from the queue's conninfo, kept
  for the run; the queue's pool where the conninfo is not known): handlers that each
  hold a pooled connection for their work (a transaction that settles the message
  with it) left them waiting for the pool while the locks lapsed, and another worker
  ran the messages again.
- A handler that returns completes the message; one that raises defers it with
  exponential back-off and jitter (the attempt count is kept, it is the fencing
  token), and after ``max_attempts`` deliveries fails it into the dead letters.
- Settlements are fenced: if the lock was lost (expired and handed to another
  worker), the SQL answers STALE, nothing changes and the worker logs it.
- The worker sleeps until ``NOTIFY fairq`` says work arrived in its queue (or a slot
  freed up elsewhere), polling every ``poll_interval`` in case a notification is missed.
  While it waits for work it holds its queue's doorbell on a connection of its own,
  so that producers send those notifications (see :class:`fairq._work.Doorbell`).
- ``stop()`` (or SIGTERM/SIGINT while ``run()`` is in the main thread) stops taking
  work; handlers get ``grace_period`` to finish, then what is still running is
  deferred so another worker picks it up at once instead of after its lock expires.
  ``stop(now=True)`` (or a second signal) ends the grace period at once.
- Drivers of periodic schedules (channel ``fairq.periodic``) are handled here, not by
  the handler: see :mod:`fairq.periodic`.

Every decision is shared with :class:`fairq.AsyncWorker` (:mod:`fairq._work`); this
module only waits and runs, with threads.
"""

from __future__ import annotations

import queue as stdqueue
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from types import FrameType
from typing import Any, Generic, TypeVar

import psycopg
from psycopg_pool import PoolTimeout

from fairq import _sql, _timestamps, _work, periodic
from fairq._source import with_connection_defaults
from fairq._work import Backoff, Settlement
from fairq.queue import Queue
from fairq.types import Message, SettleStatus

__all__ = ["Backoff", "Worker"]

T = TypeVar("T")
R = TypeVar("R")
log = _work.log


def settle(message: Message[T], settlement: Settlement,
           conn: psycopg.Connection[Any] | None = None) -> SettleStatus:
    """Applies a settlement through the message's queue (on ``conn`` if given)."""
    # (Through the queue: the message's own methods record what its handler did.)
    if settlement.outcome is SettleStatus.COMPLETED:
        return message.queue.complete(message, conn=conn)
    if settlement.outcome is SettleStatus.DEAD:
        return message.queue.fail(message, settlement.error, conn=conn)
    return message.queue.defer(message, delay=settlement.delay, conn=conn)


class Worker(Generic[T]):
    def __init__(self, queue: Queue[T], handler: Callable[[Message[T]], None], *,
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
        self._doorbell_conn: psycopg.Connection[Any] | None = None
        self._stopping = threading.Event()
        self._stopping_now = threading.Event()  # the grace period is over
        self._running = threading.Lock()  # held by run(): one at a time
        self._wake = threading.Event()
        self._in_flight: dict[tuple[int, int], Message[T]] = {}  # by _work.delivery
        # Deliveries whose handler has returned and whose settlement is being sent: the
        # grace period's end leaves them to it (a hand-back then made the finished work
        # come back, if it landed first).
        self._settling: set[tuple[int, int]] = set()
        self._in_flight_changed = threading.Condition()
        # Messages for this run's handler threads; None tells one of them to end. A
        # queue per run: a handler still running from a run that returned takes its
        # None later, and a None left for it must not end a thread of the next run.
        self._todo: stdqueue.SimpleQueue[Message[T] | None] = stdqueue.SimpleQueue()

    # -- control --------------------------------------------------------------------

    def stop(self, *, now: bool = False) -> None:
        """Stops taking work; ``run()`` returns once in-flight work is settled, or handed
        back when ``grace_period`` is over. With ``now``, the grace period is over at
        once: what still runs is handed back (as a second SIGTERM/SIGINT does)."""
        self._stopping.set()
        if now:
            self._stopping_now.set()
            with self._in_flight_changed:  # (an RLock: a signal handler may take it)
                self._in_flight_changed.notify_all()
        self._wake.set()

    def run(self) -> None:
        """Works until ``stop()`` (or SIGTERM/SIGINT when called from the main thread).
        A worker may be run again once it has returned; a ``stop()`` before ``run()``
        makes it return at once. A second run() while one runs raises RuntimeError (the
        two took each other's messages, past ``concurrency``)."""
        if not self._running.acquire(blocking=False):
            raise RuntimeError("this worker is already running")
        try:
            self._run()
        finally:
            self._running.release()

    def _run(self) -> None:
        # Set when this run is over: its background threads quit. One per run: a
        # heartbeat thread in the middle of a round when run() returned missed a flag
        # shared by every run (the next run() cleared it), and went on beside that
        # run's own.
        finished = threading.Event()
        restore = self._install_signal_handlers()
        todo = self._todo = stdqueue.SimpleQueue()
        threads = [threading.Thread(target=self._handler_loop, args=(todo,), daemon=True,
                                    name=f"fairq-handler-{i}")
                   for i in range(self.options.concurrency)]
        threads.append(threading.Thread(target=self._heartbeat_loop, args=(finished,),
                                        daemon=True, name="fairq-heartbeat"))
        if self.options.listen and self.queue.conninfo is None:
            log.warning("the queue's pool computes its conninfo: no LISTEN, polling only")
        elif self.options.listen:
            threads.append(threading.Thread(target=self._listen_loop, args=(finished,),
                                            daemon=True, name="fairq-listen"))
        # Set once this run has handed back what it held: the queue's close() waits for
        # it before closing its pool, after which every hand-back failed.
        drained = threading.Event()
        runner = threading.current_thread()

        def before_queue_closes() -> None:
            self.stop(now=True)
            if threading.current_thread() is not runner:  # (else it waited for itself)
                drained.wait()

        with self.queue._before_close_lock:
            self.queue._before_close.add(before_queue_closes)
        for thread in threads:
            thread.start()
        try:
            self._dequeue_loop()
            self._drain()
        finally:
            with self.queue._before_close_lock:
                self.queue._before_close.discard(before_queue_closes)
            drained.set()
            finished.set()
            for thread in threads:
                if thread.name.startswith("fairq-handler"):
                    todo.put(None)
            restore()
            if self._doorbell_conn is not None:
                self._doorbell_conn.close()  # lets go of the doorbell
            if self._doorbell is not None:
                self._doorbell.lost()
            # The LISTEN connection closes within one notifies() timeout: when run()
            # returns, the worker holds no connection of its own any more.
            for thread in threads:
                if thread.name == "fairq-listen":
                    thread.join()
            self._stopping.clear()  # (0.7.26 kept it: a second run() returned at once)
            self._stopping_now.clear()

    def _install_signal_handlers(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_signal(signum: int, frame: FrameType | None) -> None:
            # The first asks for a graceful stop; a second one (an operator's second
            # Ctrl-C) is impatience: what still runs goes back to the queue now.
            again = self._stopping.is_set()
            log.info("received %s%s", signal.Signals(signum).name,
                     " again: handing back what still runs" if again else ": stopping")
            self.stop(now=again)

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for sig, handler in previous.items():
                if handler is not None:  # (one set outside Python cannot be put back)
                    signal.signal(sig, handler)
        return restore

    # -- taking work ----------------------------------------------------------------

    def _dequeue_loop(self) -> None:
        while not self._stopping.is_set():
            with self._in_flight_changed:
                free = self.options.concurrency - len(self._in_flight)
            if free == 0:
                self._wait(self.options.poll_interval)
                continue
            # Cleared before the dequeue: an event that arrives during it wakes the
            # wait below instead of being lost.
            self._wake.clear()
            try:
                messages = self._dequeue(free)
            except psycopg.Error:
                log.exception("dequeue failed; retrying in %s", self.options.poll_interval)
                self._wait(self.options.poll_interval)
                continue
            if not messages and self._stopping.is_set():
                break  # (not a word to the doorbell: the database may be out of reach)
            with self._in_flight_changed:
                for message in messages:
                    self._in_flight[_work.delivery(message)] = message
            for message in messages:
                self._todo.put(message)
            if len(messages) == free:
                if self._doorbell is not None:
                    self._ask_doorbell(self._doorbell.busy())
                continue
            if messages and self._doorbell is not None:
                self._doorbell.took_work()
            if self._may_sleep():
                self._wait(self._wakeups.idle_timeout(datetime.now(timezone.utc)))

    def _dequeue(self, free: int) -> list[Message[T]]:
        """A dequeue whose wait for a pooled connection looks every
        ``ConnectionWait.SLICE`` whether the worker is stopping: then it takes nothing."""
        wait = _work.ConnectionWait(time.monotonic())
        while True:
            try:
                with self.queue.connection(
                        timeout=wait.SLICE.total_seconds()) as conn:
                    return self.queue.dequeue(self.options.lock, free, conn=conn)
            except PoolTimeout:
                if self._stopping.is_set():
                    return []
                if wait.over(time.monotonic()):
                    raise

    def _may_sleep(self) -> bool:
        """With the doorbell: hold it and hear "quiet" before sleeping (False: look
        for work first, after the pause the doorbell asks for)."""
        if self._doorbell is None:
            return True
        answer = self._ask_doorbell(self._doorbell.before_sleep(time.monotonic()))
        if answer is None:
            return True
        self._wakeups.expect(answer.next_turn_at, datetime.now(timezone.utc))
        pause = self._doorbell.answered(answer, time.monotonic())
        if pause is not None:
            self._wait(pause)
        return False

    def _ask_doorbell(self, call: _sql.Call[R] | None) -> R | None:
        if call is None or self._doorbell is None:
            return None
        try:
            if self._doorbell_conn is None or self._doorbell_conn.closed:
                assert self.queue.conninfo is not None  # as the doorbell's creation checked
                self._doorbell_conn = psycopg.connect(with_connection_defaults(self.queue.conninfo),
                                                      autocommit=True)
                # Its answer's next_turn_at is 'infinity' (or the year 10000) while a
                # channel is paused until resumed.
                _timestamps.register(self._doorbell_conn)
            return call.decode(self._doorbell_conn.execute(call.query, call.params).fetchall())
        except psycopg.Error as exc:
            if self._doorbell_conn is not None:
                self._doorbell_conn.close()
            if self._doorbell.failed(exc):
                self._doorbell = None
            return None

    def _wait(self, timeout: timedelta) -> None:
        self._wake.wait(max(0.0, timeout.total_seconds()))
        self._wake.clear()

    def _listen_loop(self, finished: threading.Event) -> None:
        assert self.queue.conninfo is not None  # run() checked it
        conninfo = with_connection_defaults(self.queue.conninfo)
        outage = _work.ListenOutage()
        while not finished.is_set():
            try:
                with psycopg.connect(conninfo, autocommit=True) as conn:
                    conn.execute("LISTEN fairq")
                    outage.connected(time.monotonic())
                    self._wake.set()  # anything sent before LISTEN took effect
                    while not finished.is_set():
                        for notify in conn.notifies(timeout=0.5):
                            if self._wakeups.heard(notify.payload, datetime.now(timezone.utc)):
                                self._wake.set()
            except psycopg.Error as exc:
                outage.failed(exc, time.monotonic())
                finished.wait(self.options.poll_interval.total_seconds())

    # -- doing work -----------------------------------------------------------------

    def _handler_loop(self, todo: stdqueue.SimpleQueue[Message[T] | None]) -> None:
        while (message := todo.get()) is not None:
            with self._in_flight_changed:
                handed_back = _work.delivery(message) not in self._in_flight
            if handed_back:  # by _drain, before a thread took it: not ours any more
                continue
            try:
                self._process(message)
            except Exception:
                # The settlement itself failed (database gone?): the lock expires and
                # the message comes back; nothing else to do here.
                log.exception("message %s: could not be settled", message.id)
            finally:
                with self._in_flight_changed:
                    self._in_flight.pop(_work.delivery(message), None)
                    self._settling.discard(_work.delivery(message))
                    self._in_flight_changed.notify_all()
                self._wake.set()

    def _process(self, message: Message[T]) -> None:
        stopping = False
        if message.channel == periodic.PERIODIC_CHANNEL:
            try:
                _work.report_tick(self.queue.periodic_tick(message))
                return
            except Exception as exc:  # unreadable, or the tick failed: not left to its lock
                settlement = _work.driver_not_ticked(message, exc, self.options)
        else:
            try:
                _work.refuse_awaitable(self.handler(message))
            except BaseException as exc:  # a handler thread must outlive whatever it raises
                settlement = _work.after_failure(message, exc, self.options)
                stopping = _work.stops_worker(exc)
            else:
                settlement = _work.SUCCESS
        with self._in_flight_changed:
            handed_back = _work.delivery(message) not in self._in_flight
            if not handed_back:
                self._settling.add(_work.delivery(message))
        if handed_back:
            # At the grace period's end, before the handler returned: the hand-back
            # stands. (Settling answered stale, or failed once the queue had closed
            # its pool, logged as an error: a queue closed under a running worker.)
            return
        _work.report_settlement(message, settlement, settle(message, settlement))
        if stopping:
            self.stop()

    def _heartbeat_loop(self, finished: threading.Event) -> None:
        """Heartbeats, on a connection of their own (this module's docstring says why)."""
        interval = self.options.heartbeat_interval.total_seconds()
        conn: psycopg.Connection[Any] | None = None
        try:
            while not finished.wait(interval):
                with self._in_flight_changed:
                    running = list(self._in_flight.values())
                for message in running:
                    try:
                        if conn is None and self.queue.conninfo is not None:
                            conn = psycopg.connect(with_connection_defaults(self.queue.conninfo),
                                                   autocommit=True)
                        status = self.queue.heartbeat(message, self.options.lock,
                                                      lock_wait=_work.HEARTBEAT_LOCK_WAIT,
                                                      conn=conn)
                    except psycopg.errors.LockNotAvailable:
                        _work.report_heartbeat_held(message)
                        continue
                    except psycopg.Error:
                        log.warning("message %s: heartbeat failed", message.id, exc_info=True)
                        if conn is not None and conn.broken:
                            conn.close()
                            conn = None  # connected again for the next
                        continue
                    with self._in_flight_changed:
                        delivery = _work.delivery(message)
                        running_still = (delivery in self._in_flight
                                         and delivery not in self._settling)
                    if running_still:  # (else _work.report_heartbeat says why not)
                        _work.report_heartbeat(message, status)
        finally:
            if conn is not None:
                conn.close()

    # -- stopping -------------------------------------------------------------------

    def _drain(self) -> None:
        """Waits up to the grace period for handlers, then defers what still runs: each
        hand-back waits ``HAND_BACK_CONNECTION_WAIT`` at most for a connection, and the
        first that gets none leaves the rest to their locks' expiry."""
        deadline = time.monotonic() + self.options.grace_period.total_seconds()
        with self._in_flight_changed:
            while (self._in_flight and not self._stopping_now.is_set()
                   and time.monotonic() < deadline):
                self._in_flight_changed.wait(deadline - time.monotonic())
            left = [message for delivery, message in self._in_flight.items()
                    if delivery not in self._settling]
            # No longer this worker's: not heartbeated, not started if still waiting
            # for a thread, and no slot taken when run() is called again.
            self._in_flight.clear()
        wait = _work.HAND_BACK_CONNECTION_WAIT.total_seconds()
        for i, message in enumerate(left):
            try:
                with message.queue.connection(timeout=wait) as conn:
                    status = settle(message, _work.HAND_BACK, conn)
            except psycopg.Error as exc:
                if _work.without_connection(exc):
                    _work.report_hand_backs_given_up(left[i:], exc)
                    return
                log.exception("message %s: could not be handed back; its lock will expire",
                              message.id)
                continue
            _work.report_hand_back(message, status)
