"""Periodic messages, the LonnyMQ way: a driver message that never completes.

``schedule`` creates the driver on the reserved channel ``fairq.periodic`` with the
schedule's name as dedup key, so there is one driver per name however often (and from
however many processes) it is scheduled. Its content is the schedule: target channel,
interval or cron expression, priority and the work's content. Each time a worker
receives the driver it enqueues the work and defers the driver to its next tick, both
in one transaction and fenced by the driver's attempt count: a crash before the commit
leaves the driver locked until its lock expires, then it is delivered again and the
tick happens once.

Ticks missed while no worker ran are not replayed: the next tick is the first one of
the schedule after now (a worker that was down for an hour on a five-minute schedule
sends one message when it comes back, not twelve). Now is the database's clock, read
in the tick's transaction, since the database's clock hands the driver out: a worker
host's clock a day ahead silenced the schedule for a day, one behind replayed the
missed ticks. Cron expressions are evaluated in UTC unless the schedule names a time
zone (with that zone's DST, as Debian's cron does: see cronsim).

The driver keeps its row forever, so its ``num_attempts`` grows by one per tick: give
``fairq.periodic`` no ``max_attempts``.

Schedules belong to a queue: the driver is a message of the queue it was scheduled
in, and its ticks' work goes to the queue whose worker received it, the same one.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from fairq import _sql
from fairq.types import MAX_DURATION, CreateResult, ReceivedMessage, SettleStatus, require_aware

__all__ = ["PERIODIC_CHANNEL", "Refused", "Schedule", "Tick", "TickResult", "Unreadable",
           "schedule", "tick"]

PERIODIC_CHANNEL = "fairq.periodic"
UTC = timezone.utc


@dataclass(frozen=True)
class Schedule:
    """What a driver message carries (as JSON, the content base64-encoded): every
    ``interval``, or at the times of the ``cron`` expression in ``timezone`` (an IANA
    name; None is UTC). Exactly one of ``interval`` and ``cron``."""

    name: str
    interval: timedelta | None
    channel: str
    content: bytes
    priority: int = 0
    cron: str | None = None
    timezone: str | None = None

    def __post_init__(self) -> None:
        # Checked here, when the schedule is made (and whenever a driver is read), for
        # what would make every tick fail: the database would refuse each tick's work,
        # and the driver would come back, never sending anything and never dying.
        if (self.interval is None) == (self.cron is None):
            raise ValueError("give exactly one of interval and cron")
        if self.interval is not None and not timedelta(0) < self.interval <= MAX_DURATION:
            # (Ten years, the longest duration the SQL takes: one of 8000 years took
            # the next tick past what a timestamp holds.)
            raise ValueError(f"interval must be positive and at most {MAX_DURATION.days}"
                             f" days (fairq.max_duration_ms()), got {self.interval}")
        _sql.require_channel(self.channel, "channel")
        if self.channel == PERIODIC_CHANNEL:
            # Its work would be a message on the drivers' channel: a schedule there is
            # one more driver per tick, anything else a message no worker can tick.
            raise ValueError(f"channel must not be {PERIODIC_CHANNEL!r}, the channel of"
                             " the schedules' drivers")
        # (The type first: `in` tests a float or a str against each integer in turn.)
        if not isinstance(self.priority, int) or self.priority not in _sql.INTEGER:
            raise ValueError(f"priority must be an integer from {_sql.INTEGER.start} to"
                             f" {_sql.INTEGER.stop - 1} (the SQL's integer), got"
                             f" {self.priority!r}")
        if self.timezone is not None and self.cron is None:
            raise ValueError("timezone is for cron schedules only")
        if self.cron is not None:
            try:
                self._zone()
                CronSim(self.cron, datetime.now(UTC))
            except ZoneInfoNotFoundError as exc:
                raise ValueError(f"unknown time zone {self.timezone!r}") from exc
            except CronSimError as exc:
                raise ValueError(f"invalid cron expression {self.cron!r}: {exc}") from exc

    def _zone(self) -> tzinfo:
        return ZoneInfo(self.timezone) if self.timezone is not None else UTC

    def _cron_after(self, moment: datetime) -> datetime:
        """The first time of the cron expression strictly after ``moment``, in UTC."""
        assert self.cron is not None
        if moment.tzinfo is None:
            raise ValueError(f"a cron schedule needs aware datetimes, got {moment}")
        # cronsim counts in local wall time: from a moment in the hour the autumn DST
        # change repeats, it may answer that hour's first pass, before the moment (from
        # 01:10 EST, 01:30 EDT). The driver was then deferred to its own due time and
        # ran again at once, for as long as the hour lasted. Such answers are skipped.
        for candidate in CronSim(self.cron, moment.astimezone(self._zone())):
            if candidate.astimezone(UTC) > moment:
                return candidate.astimezone(UTC)
        raise ValueError(f"cron expression {self.cron!r} has no time after {moment}")

    def first_at(self, start_at: datetime | None, now: datetime | None) -> datetime | None:
        """The first tick, at or after ``start_at`` (default: ``now``, the database's
        clock, needed only then: :func:`needs_clock`). None for an interval schedule
        without ``start_at``: the database's now."""
        if self.cron is None:
            return start_at
        start = start_at if start_at is not None else now
        assert start is not None, "a cron schedule without start_at needs the clock"
        # cronsim answers times strictly after its start (counted in whole seconds).
        return self._cron_after(start - timedelta(microseconds=1))

    def next_after(self, due_at: datetime, now: datetime) -> datetime:
        """The tick after the one due at ``due_at``, skipping those already past at
        ``now``: the first tick of the schedule after both."""
        if self.interval is None:
            return self._cron_after(max(due_at, now))
        missed = max(0, (now - due_at) // self.interval)
        return due_at + self.interval * (missed + 1)

    def encode(self) -> bytes:
        doc: dict[str, Any] = {"name": self.name, "channel": self.channel,
                               "priority": self.priority,
                               "content": base64.b64encode(self.content).decode("ascii")}
        if self.interval is not None:
            doc["interval_ms"] = _sql.milliseconds(self.interval)
        else:
            doc["cron"] = self.cron
            doc["timezone"] = self.timezone
        return json.dumps(doc).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Schedule:
        doc = json.loads(raw)
        interval_ms = doc.get("interval_ms")
        return cls(name=doc["name"],
                   interval=timedelta(milliseconds=interval_ms) if interval_ms is not None
                   else None,
                   channel=doc["channel"], content=base64.b64decode(doc["content"]),
                   priority=doc["priority"], cron=doc.get("cron"), timezone=doc.get("timezone"))


def needs_clock(cron: str | None, start_at: datetime | None) -> bool:
    """Whether :func:`schedule` needs the database's clock: for a cron schedule's first
    time when no ``start_at`` is given. (The host's clock put it a tick early or late
    by the hosts' skew.)"""
    return cron is not None and start_at is None


def schedule(name: str, channel: str, content: bytes, *, queue: str,
             interval: timedelta | None = None, cron: str | None = None,
             timezone: str | None = None, start_at: datetime | None,
             priority: int, now: datetime | None) -> _sql.Call[CreateResult]:
    """The call that creates the driver of schedule ``name`` in ``queue``: every
    ``interval`` from ``start_at`` (default: now), or at the times of ``cron`` from
    ``start_at`` (default: ``now``, the database's clock where :func:`needs_clock`)
    on."""
    require_aware(start_at, "start_at")
    driver = Schedule(name, interval, channel, content, priority, cron, timezone)
    first = driver.first_at(start_at, now)
    return _sql.create(PERIODIC_CHANNEL, driver.encode(), queue=queue, dequeue_at=first,
                       delay=None, priority=0, dedup_key=name)


@dataclass(frozen=True)
class TickResult:
    """What a tick did: ``work`` is the work message's creation, or None when the
    driver's reschedule answered ``status`` (not DEFERRED: it was not ours any more)
    and the tick was rolled back."""

    schedule: Schedule
    due_at: datetime
    next_at: datetime
    status: SettleStatus
    work: CreateResult | None


class Unreadable(ValueError):
    """The message handed to a tick is not a schedule this version can run: another
    application's message on the periodic channel, or a driver from a newer version."""


class Refused(Exception):
    """Raised inside a tick's transaction to roll it back: the driver was not ours.
    ``result`` is the tick's result."""

    def __init__(self, result: TickResult) -> None:
        super().__init__(result.status.value)
        self.result = result


@dataclass(frozen=True)
class Tick:
    """One tick of a driver: run ``work`` then ``reschedule`` in one transaction, pass
    the latter's answer to ``check`` (which raises :class:`Refused` unless it is
    DEFERRED, so the transaction rolls back), and commit."""

    schedule: Schedule
    due_at: datetime
    next_at: datetime
    work: _sql.Call[CreateResult]
    reschedule: _sql.Call[SettleStatus]

    def check(self, status: SettleStatus) -> None:
        if status is not SettleStatus.DEFERRED:
            raise Refused(TickResult(self.schedule, self.due_at, self.next_at, status, None))

    def done(self, work: CreateResult) -> TickResult:
        return TickResult(self.schedule, self.due_at, self.next_at, SettleStatus.DEFERRED, work)


def tick(driver: ReceivedMessage[Any], now: datetime, queue: str) -> Tick:
    """The tick a driver received from ``queue`` stands for. Ticks missed while no
    worker ran are not replayed: the next one is the schedule's first tick after
    ``now`` (the queues pass the database's clock)."""
    due_at = driver.dequeue_at
    try:
        sched = Schedule.decode(driver.raw)
        next_at = sched.next_after(due_at, now)
    # What bad JSON raises, or a schedule this version refuses; OverflowError: a time
    # or an interval past what datetime and timedelta hold.
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
        raise Unreadable(f"message {driver.id} is not a schedule: {type(exc).__name__}: {exc}") \
            from exc
    # Keyed by tick, so the same tick never has two work messages pending at once. The
    # driver's id, not the name, keeps the key short whatever the name's length. In UTC:
    # the due time comes in the session's time zone, and two workers in two zones that
    # both received the tick (a lock lapsed) made two keys, and two work messages.
    work_key = f"{PERIODIC_CHANNEL}:{driver.id}@{due_at.astimezone(UTC).isoformat()}"
    work = _sql.create(sched.channel, sched.content, queue=queue, dequeue_at=None, delay=None,
                       priority=sched.priority, dedup_key=work_key)
    reschedule = _sql.defer(driver.id, driver.num_attempts, dequeue_at=next_at, delay=None,
                            state=None)
    return Tick(sched, due_at, next_at, work, reschedule)
