"""What a worker decides, whichever way it runs.

:class:`~fairq.Worker` (threads) and :class:`~fairq.AsyncWorker` (asyncio) differ only
in how they wait and run. Every decision is made here, once, without I/O: the options
and their checks, back-off, what a handler's outcome becomes (complete, defer or
dead-letter), which ``NOTIFY fairq`` events concern the worker's queue and how long
to sleep for lack of them, and what is logged (to ``fairq.worker``) when the database
answers something else than expected.
"""

from __future__ import annotations

import inspect
import json
import logging
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg

from fairq import _sql, periodic
from fairq.types import MAX_DURATION, CreateStatus, ReceivedMessage, SettleStatus

__all__ = [
    "DEFAULT_QUEUE",
    "HAND_BACK",
    "HAND_BACK_CONNECTION_WAIT",
    "HEARTBEAT_LOCK_WAIT",
    "MAX_LOCK",
    "STOPPING",
    "SUCCESS",
    "Backoff",
    "ConnectionWait",
    "Doorbell",
    "Event",
    "Options",
    "Settlement",
    "Wakeups",
    "after_failure",
    "delivery",
    "describe",
    "driver_not_ticked",
    "parse_event",
    "queue_name",
    "refuse_awaitable",
    "report_hand_back",
    "report_hand_backs_given_up",
    "report_heartbeat",
    "report_heartbeat_held",
    "report_not_async",
    "report_settlement",
    "report_task_cancelled",
    "report_tick",
    "stops_worker",
    "wakes",
    "without_connection",
]

log = logging.getLogger("fairq.worker")

# The queue of a call that names none, and of an event whose payload names none
# (extension versions before named queues send no "queue" key).
DEFAULT_QUEUE = "default"


@dataclass(frozen=True)
class Backoff:
    """Delay before delivery ``attempt + 1`` after ``attempt`` failed: doubling from
    ``base`` up to ``cap``, with "equal jitter" (between half and all of it) so that
    messages failing together do not come back together."""

    base: timedelta = timedelta(seconds=1)
    cap: timedelta = timedelta(minutes=10)

    def delay(self, attempt: int) -> timedelta:
        doublings = min(max(0, attempt - 1), 64)  # beyond that the cap rules anyway
        # (In seconds: base * 2**doublings overflows timedelta long before the cap.)
        ceiling = timedelta(seconds=min(self.cap.total_seconds(),
                                        self.base.total_seconds() * 2.0 ** doublings))
        return ceiling / 2 + ceiling / 2 * random.random()


# A lock is a duration the SQL takes.
MAX_LOCK = MAX_DURATION


@dataclass(frozen=True)
class Options:
    """A worker's settings (see the ``Worker`` documentation), checked once."""

    concurrency: int = 1
    lock: timedelta = timedelta(seconds=30)
    max_attempts: int | None = 5
    backoff: Backoff = field(default_factory=Backoff)
    poll_interval: timedelta = timedelta(seconds=5)
    grace_period: timedelta = timedelta(seconds=30)
    listen: bool = True

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if not timedelta(0) < self.lock <= MAX_LOCK:
            # (Past the SQL's limit, every dequeue would fail, and the worker only log it.)
            raise ValueError(f"lock must be positive and at most {MAX_LOCK.days} days"
                             f" (fairq.max_duration_ms()), got {self.lock}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1 or None, got {self.max_attempts}")
        if self.poll_interval <= timedelta(0):
            raise ValueError(f"poll_interval must be positive, got {self.poll_interval}")
        if self.grace_period < timedelta(0):
            raise ValueError(f"grace_period must not be negative, got {self.grace_period}")

    @property
    def heartbeat_interval(self) -> timedelta:
        """Three heartbeats per lock: two may fail (a slow database) before it lapses."""
        return self.lock / 3


# How long one heartbeat waits for its message's row. Only a transaction settling the
# message holds it, normally for milliseconds; one held longer is a handler's own
# transaction that settled the message and has not committed (the heartbeat can wait
# for the next round). Heartbeats run one after another, so waiting for such a row
# held every other message's heartbeat up until their locks lapsed.
HEARTBEAT_LOCK_WAIT = timedelta(milliseconds=100)


def queue_name(queue: object) -> str:
    """The name of the queue a worker serves: ``queue.name`` where the binding has one."""
    name = getattr(queue, "name", DEFAULT_QUEUE)
    return name if isinstance(name, str) else DEFAULT_QUEUE


# -- events ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Event:
    """A ``NOTIFY fairq`` payload: ``{"event", "queue", "channel", "id", "dequeue_at"}``."""

    event: str | None
    queue: str
    channel: str | None
    id: int | None
    dequeue_at: datetime | None


# PostgreSQL writes as many fraction digits as it needs; Python 3.10's fromisoformat
# takes only 3 or 6.
_FRACTION = re.compile(r"\.(\d{1,6})")


def _timestamp(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    text = _FRACTION.sub(lambda m: "." + m.group(1).ljust(6, "0"), value.replace("Z", "+00:00"),
                         count=1)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return None
    return when if when.tzinfo is not None else None


def parse_event(payload: str) -> Event | None:
    """The event a payload stands for, or None when it is not one we can read. A payload
    without ``queue`` (or with null) is an event of the queue ``"default"``."""
    try:
        doc = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    queue = doc.get("queue")
    id_ = doc.get("id")
    event = doc.get("event")
    channel = doc.get("channel")
    return Event(event=event if isinstance(event, str) else None,
                 queue=queue if isinstance(queue, str) else DEFAULT_QUEUE,
                 channel=channel if isinstance(channel, str) else None,
                 id=id_ if isinstance(id_, int) and not isinstance(id_, bool) else None,
                 dequeue_at=_timestamp(doc.get("dequeue_at")))


def wakes(event: Event | None, queue: str) -> bool:
    """Whether an event should wake a worker of ``queue``. Another queue's events never
    do: its messages are not ours to dequeue. A payload we cannot read does, as a
    needless dequeue costs less than a message left waiting for the next poll."""
    return event is None or event.queue == queue


class Wakeups:
    """When the dequeue loop should look again: at the next poll, at once when one of
    its queue's events arrives, or when a message an event announced for later (or a
    channel the doorbell said waits) is due."""

    # Due times kept: the earliest ones. One forgotten costs a poll interval, never a
    # message.
    KEPT = 64

    def __init__(self, queue: str, poll_interval: timedelta) -> None:
        self.queue = queue
        self.poll_interval = poll_interval
        # Due times heard of and not yet looked at, earliest first. Written by the
        # listener, read by the dequeue loop (a list replaced whole, never changed in
        # place; a time lost between the two costs a poll interval).
        self._due: list[datetime] = []

    def heard(self, payload: str, now: datetime) -> bool:
        """Takes in a notification; True if it should wake the dequeue loop."""
        event = parse_event(payload)
        if event is None:
            log.debug("NOTIFY %r: unreadable, wake", payload)
            return True
        if not wakes(event, self.queue):
            log.debug("NOTIFY %s #%s of queue %r: not queue %r, ignored",
                      event.event, event.id, event.queue, self.queue)
            return False
        if event.dequeue_at is not None and event.dequeue_at > now:
            self._keep(event.dequeue_at)
        log.debug("NOTIFY %s #%s of queue %r: wake", event.event, event.id, event.queue)
        return True

    def expect(self, due: datetime | None, now: datetime) -> None:
        """A time some work may become due without an event (fairq.doorbell_hold's
        next_turn_at): the dequeue loop looks again then at the latest."""
        if due is not None:
            self._keep(max(due, now))

    def _keep(self, due: datetime) -> None:
        self._due = sorted({*self._due, due})[:self.KEPT]

    def idle_timeout(self, now: datetime) -> timedelta:
        """How long to sleep with nothing to do: until the next poll, or until a message
        heard of becomes due, whichever comes first. A due time that has come is
        looked at once (no sleep) and then forgotten; a later one still counts (0.7.27:
        before, a past time hid every later one, and a rate-limited channel's next
        turn waited for the poll)."""
        due = self._due
        if due and due[0] <= now:
            self._due = [d for d in due if d > now]
            return timedelta(0)
        if not due:
            return self.poll_interval
        return min(self.poll_interval, due[0] - now)


class ListenOutage:
    """What the LISTEN loop logs while its connection is down: the loss once, with its
    traceback; then, while every try to connect again fails, one line a
    ``repeat_after`` (a try every poll interval, each with a traceback, was a dozen
    tracebacks a minute per worker for as long as the database was away); and the
    return."""

    def __init__(self, repeat_after: timedelta = timedelta(minutes=1)) -> None:
        self.repeat_after = repeat_after
        self._lost_at: float | None = None  # monotonic seconds
        self._told_at = 0.0
        self._tries = 0

    def failed(self, exc: BaseException, now: float) -> None:
        if self._lost_at is None:
            self._lost_at = self._told_at = now
            self._tries = 1
            log.warning("LISTEN connection lost; polling until it is back", exc_info=exc)
            return
        self._tries += 1
        if now - self._told_at >= self.repeat_after.total_seconds():
            self._told_at = now
            log.warning("LISTEN connection still lost after %.0f s (%s tries to connect);"
                        " polling meanwhile: %s", now - self._lost_at, self._tries, exc)

    def connected(self, now: float) -> None:
        if self._lost_at is not None:
            log.info("LISTEN connection back after %.0f s", now - self._lost_at)
            self._lost_at = None


class Doorbell:
    """The worker's side of its queue's doorbell (sql/events.sql). Calls that make
    work available send their events only while a worker holds the doorbell, so a
    worker holds it while it waits for work and lets go once a dequeue fills every
    free slot (then it has nothing to wake up for).

    Before sleeping, a worker holds the doorbell, hears "quiet" (no call is between
    making work available and committing) and then looks for work once more. Until
    it hears quiet it looks again after a short pause that doubles up to the poll
    interval: a producer transaction left open (an enqueue inside a long application
    transaction) costs a few extra looks, never a message left unannounced."""

    FIRST_PAUSE = timedelta(milliseconds=10)

    def __init__(self, queue: str, poll_interval: timedelta) -> None:
        self.queue = queue
        self.poll_interval = poll_interval
        self.held = False
        self._quiet_heard_at: float | None = None  # monotonic seconds; None: not heard
        self._pause = self.FIRST_PAUSE

    def before_sleep(self, now: float) -> _sql.Call[_sql.DoorbellAnswer] | None:
        """What to ask the database before sleeping; None when the worker may sleep.
        ``now``: monotonic seconds. "Quiet" counts for one poll interval: then the
        worker asks again, which tells it when waiting channels come due and finds a
        doorbell session the server has lost (restart, idle timeout, a proxy)."""
        if (self.held and self._quiet_heard_at is not None
                and now - self._quiet_heard_at < self.poll_interval.total_seconds()):
            return None
        self._quiet_heard_at = None
        return _sql.doorbell_quiet(self.queue) if self.held else _sql.doorbell_hold(self.queue)

    def answered(self, answer: _sql.DoorbellAnswer, now: float) -> timedelta | None:
        """How long to pause before looking for work again; None: look at once (and
        sleep if that finds nothing)."""
        self.held = self.held or answer.held
        if answer.quiet:
            self._quiet_heard_at = now
            self._pause = self.FIRST_PAUSE
            return None
        pause = self._pause
        self._pause = min(self._pause * 2, self.poll_interval)
        return pause

    def took_work(self) -> None:
        """A dequeue handed out messages but left slots free: before sleeping, ask
        again (its answer says when the channels just served may be served again: a
        rate limit's next release, say)."""
        self._quiet_heard_at = None

    def busy(self) -> _sql.Call[None] | None:
        """Every free slot taken: what lets go of the doorbell (None if not held)."""
        if not self.held:
            return None
        self.lost()
        return _sql.doorbell_release(self.queue)

    def lost(self) -> None:
        """The session that held the doorbell is gone (and with it the lock)."""
        self.held = False
        self._quiet_heard_at = None
        self._pause = self.FIRST_PAUSE

    def failed(self, exc: Exception) -> bool:
        """A call failed; the caller closes its connection (letting go of the lock).
        True when the database cannot give this worker a doorbell at all (an
        extension before 0.7.4, or a role without fairq.grant_worker's newer grants):
        the worker then sleeps as before."""
        self.lost()
        # undefined_function, insufficient_privilege
        if getattr(exc, "sqlstate", None) in ("42883", "42501"):
            log.warning("no doorbell (%s): this worker hears producers' events only if"
                        " the database sends them to everyone (fairq.events = wake), and"
                        " else polls every poll_interval", exc)
            return True
        log.warning("doorbell connection failed; polling until it is back", exc_info=exc)
        return False


# -- outcomes -------------------------------------------------------------------------

def delivery(message: ReceivedMessage[Any]) -> tuple[int, int]:
    """What a worker tracks a running handler by: the message's id and attempt. A
    handler may settle its own message (a ``defer`` to go on later) and run on while
    the same id comes back to this worker: two deliveries, two handlers (0.7.27:
    keyed by id alone, the first one's end took the second out of the heartbeats)."""
    return (message.id, message.num_attempts)


# A handler that raises one of these fails its message like any other exception, and
# then stops its worker (as it would stop the process), which finishes or hands back
# the rest.
STOPPING = (SystemExit, KeyboardInterrupt)


def stops_worker(exc: BaseException) -> bool:
    return isinstance(exc, STOPPING)


def refuse_awaitable(result: object) -> None:
    """A plain Worker's handler that returned an awaitable did not run its body: an
    ``async def`` handler (maybe behind a decorator) given to ``Worker`` instead of
    ``AsyncWorker``. Raised as the handler's failure, so that its message fails
    rather than completing unrun."""
    if not inspect.isawaitable(result):
        return
    if inspect.iscoroutine(result):
        result.close()  # never awaited: no RuntimeWarning at garbage collection
    raise TypeError("the handler returned an awaitable: an async handler needs AsyncWorker")


def report_not_async(handler: object) -> None:
    """The reverse mistake: an AsyncWorker's handler that returned something not
    awaitable is a plain function, and its body has run and returned. Its message is
    completed, as Worker would (0.7.36 awaited the result: a TypeError after the work
    was done, retried and dead-lettered, its side effects repeated each time). Logged
    once per worker: such a handler holds up the event loop, every other handler and
    the heartbeats, while it runs."""
    log.error("the handler %r is not async: its messages complete, but it blocks the event"
              " loop (other handlers, heartbeats) while it runs; make it `async def` (with"
              " `asyncio.to_thread` for blocking work) or give it to Worker", handler)


def report_task_cancelled(message: ReceivedMessage[Any]) -> None:
    log.warning("message %s: its handler's task was cancelled from outside the worker;"
                " handing it back", message.id)


@dataclass(frozen=True)
class Settlement:
    """What to do with a message its handler is done with: the status that answers
    success (COMPLETED, DEFERRED or DEAD), with the defer's delay or the error."""

    outcome: SettleStatus
    delay: timedelta | None = None  # DEFERRED: None is now
    error: str | None = None  # DEAD


SUCCESS = Settlement(SettleStatus.COMPLETED)
# Handed back at the end of the grace period: due again now, its attempt counted, so
# another worker takes it at once instead of after its lock expires.
HAND_BACK = Settlement(SettleStatus.DEFERRED)


def describe(exc: BaseException) -> str:
    """``Type: message`` for a dead letter's error and the log. An exception whose
    ``str()`` itself raises is described by its type: formatting it raised inside the
    worker, the message was never settled, and it came back at every lock expiry, past
    ``max_attempts``, for ever."""
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:
        return f"{type(exc).__name__} (its message could not be read)"


def after_failure(message: ReceivedMessage[Any], exc: BaseException,
                  options: Options) -> Settlement:
    """A handler raised: dead-letter on the last allowed attempt, else defer with
    back-off (``num_attempts`` is kept: it is the fencing token)."""
    error = describe(exc)
    if options.max_attempts is not None and message.num_attempts >= options.max_attempts:
        log.error("message %s failed on attempt %s of %s, giving up: %s", message.id,
                  message.num_attempts, options.max_attempts, error, exc_info=exc)
        return Settlement(SettleStatus.DEAD, error=error)
    delay = options.backoff.delay(message.num_attempts)
    log.warning("message %s failed on attempt %s, retrying in %.1fs: %s", message.id,
                message.num_attempts, delay.total_seconds(), error)
    return Settlement(SettleStatus.DEFERRED, delay=delay)


def report_settlement(message: ReceivedMessage[Any], settlement: Settlement,
                      status: SettleStatus) -> None:
    """Settlements are fenced: STALE (or NOT_FOUND) means the lock was lost and nothing
    changed; the message's new holder decides its fate. Unless its handler settled it
    itself (a documented pattern): then nothing was lost."""
    if status is settlement.outcome:
        return
    if message.settled_by_holder:
        log.debug("message %s (attempt %s): its handler settled it (%s); the worker's %s"
                  " answered %s", message.id, message.num_attempts,
                  message.settled_by_holder[-1].value, settlement.outcome.value, status.value)
    else:
        log.warning("message %s (attempt %s): lock lost before it could be %s (%s); "
                    "its new holder decides its fate", message.id, message.num_attempts,
                    settlement.outcome.value, status.value)


def report_heartbeat_held(message: ReceivedMessage[Any]) -> None:
    log.debug("message %s (attempt %s): its row is held by a transaction settling it;"
              " heartbeat skipped this round", message.id, message.num_attempts)


def report_heartbeat(message: ReceivedMessage[Any], status: SettleStatus) -> None:
    """For a delivery whose handler still runs. Not for one settled or being settled: a
    heartbeat that waited for the row of its completion, or went out once that had
    committed, answers not_found (0.7.39 logged it as a lost lock: after a restart,
    once per heartbeat until the completion, sent again, got through), and the
    settlement's own answer says whether the lock was lost."""
    if status is not SettleStatus.HEARTBEATED and not message.settled_by_holder:
        log.warning("message %s (attempt %s): lock lost while its handler runs (%s)",
                    message.id, message.num_attempts, status.value)


def report_hand_back(message: ReceivedMessage[Any], status: SettleStatus) -> None:
    log.warning("message %s handed back as the worker stops (%s)", message.id, status.value)


# -- waiting for a connection ---------------------------------------------------------

class ConnectionWait:
    """How the dequeue loop waits for a connection of its queue's pool: :data:`SLICE`
    at a time, looking between two waits whether the worker is stopping, and for
    :data:`LIMIT` in all before the dequeue counts as failed (logged, and tried again
    after ``poll_interval``). In one wait of the pool's own timeout (30 s by default),
    a database that could not be reached held stop() until that wait was over."""

    SLICE = timedelta(milliseconds=250)
    # psycopg_pool's default timeout: how long the dequeue waited before.
    LIMIT = timedelta(seconds=30)

    def __init__(self, now: float) -> None:
        self._since = now  # monotonic seconds

    def over(self, now: float) -> bool:
        """A wait of SLICE found no connection: whether to give up (True) or wait again."""
        return now - self._since >= self.LIMIT.total_seconds()


# How long a message's hand-back (as the worker stops) waits for a connection of the
# pool. Stopping is on a clock (Kubernetes kills the process grace seconds after
# SIGTERM), and a message not handed back only comes back later, when its lock expires.
HAND_BACK_CONNECTION_WAIT = timedelta(seconds=2)


def without_connection(exc: Exception) -> bool:
    """Whether a call failed for lack of a working connection (the pool's PoolTimeout
    is an OperationalError too), rather than for what the database answered."""
    return isinstance(exc, psycopg.OperationalError)


def report_hand_backs_given_up(messages: Sequence[ReceivedMessage[Any]],
                               exc: Exception) -> None:
    """The hand-backs stop at the first that found no connection: with ten handlers
    left, each waiting for the pool, a worker took minutes to stop after SIGTERM."""
    log.error("could not hand back %s message(s) as the worker stops, %s; their locks"
              " will expire (ids: %s)", len(messages), exc,
              ", ".join(str(message.id) for message in messages))


def driver_not_ticked(message: ReceivedMessage[Any], exc: Exception,
                      options: Options) -> Settlement:
    """A message on the periodic channel whose tick did not happen: not a schedule this
    worker can read (:class:`fairq.periodic.Unreadable`: another application's message
    on that channel, or a driver written by a newer version), or a tick that failed
    (the database refused its work, the connection broke). Deferred with back-off,
    never dead-lettered — a driver's attempt count grows by one per tick, so the
    worker's max_attempts says nothing about it, and a newer worker may read it. Left
    locked, it came back after every lock, forever. (A tick that did commit before its
    answer was lost has unlocked the driver: this deferral answers stale, changing
    nothing.)"""
    delay = options.backoff.delay(message.num_attempts)
    if isinstance(exc, periodic.Unreadable):
        log.error("%s (channel %s); deferred by %.1fs", exc, message.channel,
                  delay.total_seconds())
    else:
        log.error("message %s: periodic tick failed, %s: %s; deferred by %.1fs", message.id,
                  type(exc).__name__, exc, delay.total_seconds())
    return Settlement(SettleStatus.DEFERRED, delay=delay)


def report_tick(result: periodic.TickResult) -> None:
    if result.work is None:
        log.warning("periodic %r: driver lock lost (%s), tick rolled back",
                    result.schedule.name, result.status.value)
    elif result.work.status is CreateStatus.DROPPED:
        log.warning("periodic %r: channel %s is full, the tick due at %s was dropped",
                    result.schedule.name, result.schedule.channel, result.due_at)
