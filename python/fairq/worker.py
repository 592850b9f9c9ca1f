"""``Worker``: runs a handler over the queue's messages with a pool of threads.

- Each message is locked for ``lock`` and heartbeated every ``lock / 3`` while its
  handler runs, so a short lock (fast recovery after a crash) is safe for long jobs.
- A handler that returns completes the message; one that raises defers it with
  exponential back-off and jitter (the attempt count is kept, it is the fencing
  token), and after ``max_attempts`` deliveries fails it into the dead letters.
- Settlements are fenced: if the lock was lost (expired and handed to another
  worker), the SQL answers STALE, nothing changes and the worker logs it.
- The worker sleeps until ``NOTIFY fairq`` says work arrived (or a slot freed up
  elsewhere), polling every ``poll_interval`` in case a notification is missed.
- ``stop()`` (or SIGTERM/SIGINT while ``run()`` is in the main thread) stops taking
  work; handlers get ``grace_period`` to finish, then what is still running is
  deferred so another worker picks it up at once instead of after its lock expires.
- Drivers of periodic schedules (channel ``fairq.periodic``) are handled here, not by
  the handler: see :mod:`fairq.periodic`.
"""

from __future__ import annotations

import json
import logging
import queue as stdqueue
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from types import FrameType
from typing import Generic, TypeVar

import psycopg

from fairq import periodic
from fairq.queue import Queue
from fairq.types import CreateStatus, Message, SettleStatus

__all__ = ["Backoff", "Worker"]

T = TypeVar("T")
log = logging.getLogger("fairq.worker")


@dataclass(frozen=True)
class Backoff:
    """Delay before delivery ``attempt + 1`` after ``attempt`` failed: doubling from
    ``base`` up to ``cap``, with "equal jitter" (between half and all of it) so that
    messages failing together do not come back together."""

    base: timedelta = timedelta(seconds=1)
    cap: timedelta = timedelta(minutes=10)

    def delay(self, attempt: int) -> timedelta:
        doublings = min(max(0, attempt - 1), 32)  # beyond that the cap rules anyway
        ceiling = min(self.cap, self.base * (1 << doublings))
        return ceiling / 2 + ceiling / 2 * random.random()


class _LostDriver(Exception):
    """A periodic driver's reschedule was refused: roll its tick back."""


class Worker(Generic[T]):
    def __init__(self, queue: Queue[T], handler: Callable[[Message[T]], None], *,
                 concurrency: int = 1, lock: timedelta = timedelta(seconds=30),
                 max_attempts: int | None = 5, backoff: Backoff = Backoff(),
                 poll_interval: timedelta = timedelta(seconds=5),
                 grace_period: timedelta = timedelta(seconds=30),
                 listen: bool = True) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.queue = queue
        self.handler = handler
        self.concurrency = concurrency
        self.lock = lock
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.poll_interval = poll_interval
        self.grace_period = grace_period
        self.listen = listen
        self._stopping = threading.Event()
        self._finished = threading.Event()  # run() is over: background threads quit
        self._wake = threading.Event()
        self._in_flight: dict[int, Message[T]] = {}
        self._in_flight_changed = threading.Condition()
        self._todo: stdqueue.SimpleQueue[Message[T]] = stdqueue.SimpleQueue()
        self._next_due: datetime | None = None  # earliest future dequeue_at heard of

    # -- control --------------------------------------------------------------------

    def stop(self) -> None:
        """Stops taking work; ``run()`` returns once in-flight work is settled."""
        self._stopping.set()
        self._wake.set()

    def run(self) -> None:
        """Works until ``stop()`` (or SIGTERM/SIGINT when called from the main thread)."""
        restore = self._install_signal_handlers()
        threads = [threading.Thread(target=self._handler_loop, daemon=True,
                                    name=f"fairq-handler-{i}") for i in range(self.concurrency)]
        threads.append(threading.Thread(target=self._heartbeat_loop, daemon=True,
                                        name="fairq-heartbeat"))
        if self.listen and self.queue.conninfo is None:
            log.warning("the queue's pool computes its conninfo: no LISTEN, polling only")
        elif self.listen:
            threads.append(threading.Thread(target=self._listen_loop, daemon=True,
                                            name="fairq-listen"))
        for thread in threads:
            thread.start()
        try:
            self._dequeue_loop()
            self._drain()
        finally:
            self._finished.set()
            restore()
            # The LISTEN connection closes within one notifies() timeout: when run()
            # returns, the worker holds no connection of its own any more.
            for thread in threads:
                if thread.name == "fairq-listen":
                    thread.join()

    def _install_signal_handlers(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_signal(signum: int, frame: FrameType | None) -> None:
            log.info("received %s: stopping", signal.Signals(signum).name)
            self.stop()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return restore

    # -- taking work ----------------------------------------------------------------

    def _dequeue_loop(self) -> None:
        while not self._stopping.is_set():
            with self._in_flight_changed:
                free = self.concurrency - len(self._in_flight)
            if free == 0:
                self._wait(self.poll_interval)
                continue
            # Cleared before the dequeue: an event that arrives during it wakes the
            # wait below instead of being lost.
            self._wake.clear()
            try:
                messages = self.queue.dequeue(self.lock, free)
            except psycopg.Error:
                log.exception("dequeue failed; retrying in %s", self.poll_interval)
                self._wait(self.poll_interval)
                continue
            with self._in_flight_changed:
                for message in messages:
                    self._in_flight[message.id] = message
            for message in messages:
                self._todo.put(message)
            if len(messages) < free:
                self._wait(self._idle_timeout())

    def _wait(self, timeout: timedelta) -> None:
        self._wake.wait(max(0.0, timeout.total_seconds()))
        self._wake.clear()

    def _idle_timeout(self) -> timedelta:
        """Until the next poll, or until a message we heard of becomes due."""
        if self._next_due is None:
            return self.poll_interval
        until_due = self._next_due - datetime.now(timezone.utc)
        if until_due <= timedelta(0):
            self._next_due = None
            return timedelta(0)
        return min(self.poll_interval, until_due)

    def _listen_loop(self) -> None:
        assert self.queue.conninfo is not None  # run() checked it
        while not self._finished.is_set():
            try:
                with psycopg.connect(self.queue.conninfo, autocommit=True) as conn:
                    conn.execute("LISTEN fairq")
                    self._wake.set()  # anything sent before LISTEN took effect
                    while not self._finished.is_set():
                        for notify in conn.notifies(timeout=0.5):
                            self._on_event(notify.payload)
            except psycopg.Error:
                log.warning("LISTEN connection lost; polling until it is back", exc_info=True)
                self._finished.wait(self.poll_interval.total_seconds())

    def _on_event(self, payload: str) -> None:
        try:
            due = json.loads(payload).get("dequeue_at")
            due_at = datetime.fromisoformat(due) if due else None
        except (ValueError, AttributeError):
            due_at = None
        if (due_at is not None and due_at > datetime.now(timezone.utc)
                and (self._next_due is None or due_at < self._next_due)):
            self._next_due = due_at
        self._wake.set()

    # -- doing work -----------------------------------------------------------------

    def _handler_loop(self) -> None:
        while True:
            message = self._todo.get()
            try:
                self._process(message)
            except Exception:
                # The settlement itself failed (database gone?): the lock expires and
                # the message comes back; nothing else to do here.
                log.exception("message %s: could not be settled", message.id)
            finally:
                with self._in_flight_changed:
                    self._in_flight.pop(message.id, None)
                    self._in_flight_changed.notify_all()
                self._wake.set()

    def _process(self, message: Message[T]) -> None:
        if message.channel == periodic.PERIODIC_CHANNEL:
            self._tick(message)
            return
        try:
            self.handler(message)
        except Exception as exc:
            self._retry_or_fail(message, exc)
            return
        self._report(message, message.complete(), SettleStatus.COMPLETED)

    def _retry_or_fail(self, message: Message[T], exc: Exception) -> None:
        error = f"{type(exc).__name__}: {exc}"
        if self.max_attempts is not None and message.num_attempts >= self.max_attempts:
            log.error("message %s failed on attempt %s of %s, giving up: %s", message.id,
                      message.num_attempts, self.max_attempts, error, exc_info=exc)
            self._report(message, message.fail(error), SettleStatus.DEAD)
            return
        delay = self.backoff.delay(message.num_attempts)
        log.warning("message %s failed on attempt %s, retrying in %.1fs: %s", message.id,
                    message.num_attempts, delay.total_seconds(), error)
        self._report(message, message.defer(delay=delay), SettleStatus.DEFERRED)

    def _report(self, message: Message[T], status: SettleStatus, expected: SettleStatus) -> None:
        if status is not expected:
            log.warning("message %s (attempt %s): lock lost before it could be %s (%s); "
                        "its new holder decides its fate", message.id, message.num_attempts,
                        expected.value, status.value)

    def _tick(self, driver: Message[T]) -> None:
        tick = periodic.tick(driver, datetime.now(timezone.utc), self.queue.name)
        try:
            with self.queue.transaction() as conn:
                work = self.queue._run(tick.work, conn)
                status = self.queue._run(tick.reschedule, conn)
                if status is not SettleStatus.DEFERRED:
                    raise _LostDriver(status.value)
        except _LostDriver as lost:
            log.warning("periodic %r: driver lock lost (%s), tick rolled back",
                        tick.schedule.name, lost)
            return
        if work.status is CreateStatus.DROPPED:
            log.warning("periodic %r: channel %s is full, the tick due at %s was dropped",
                        tick.schedule.name, tick.schedule.channel, tick.due_at)

    def _heartbeat_loop(self) -> None:
        interval = self.lock.total_seconds() / 3
        while not self._finished.wait(interval):
            with self._in_flight_changed:
                running = list(self._in_flight.values())
            for message in running:
                try:
                    status = message.heartbeat(self.lock)
                except psycopg.Error:
                    log.warning("message %s: heartbeat failed", message.id, exc_info=True)
                    continue
                if status is not SettleStatus.HEARTBEATED:
                    log.warning("message %s (attempt %s): lock lost while its handler runs (%s)",
                                message.id, message.num_attempts, status.value)

    # -- stopping -------------------------------------------------------------------

    def _drain(self) -> None:
        """Waits up to the grace period for handlers, then defers what still runs."""
        deadline = time.monotonic() + self.grace_period.total_seconds()
        with self._in_flight_changed:
            while self._in_flight and time.monotonic() < deadline:
                self._in_flight_changed.wait(deadline - time.monotonic())
            left = list(self._in_flight.values())
        for message in left:
            try:
                status = message.defer()
            except psycopg.Error:
                log.exception("message %s: could not be handed back; its lock will expire",
                              message.id)
                continue
            log.warning("message %s still running after the grace period: handed back (%s)",
                        message.id, status.value)
