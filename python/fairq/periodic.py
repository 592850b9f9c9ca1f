"""Periodic messages, the LonnyMQ way: a driver message that never completes.

``schedule`` creates the driver on the reserved channel ``fairq.periodic`` with the
schedule's name as dedup key, so there is one driver per name however often (and from
however many processes) it is scheduled. Its content is the schedule: target channel,
interval, priority and the work's content. Each time a worker receives the driver it
enqueues the work and defers the driver to its next tick, both in one transaction and
fenced by the driver's attempt count: a crash before the commit leaves the driver
locked until its lock expires, then it is delivered again and the tick happens once.

The driver keeps its row forever, so its ``num_attempts`` grows by one per tick: give
``fairq.periodic`` no ``max_attempts``.

Schedules belong to a queue: the driver is a message of the queue it was scheduled
in, and its ticks' work goes to the queue whose worker received it, the same one.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from fairq import _sql
from fairq.types import CreateResult, ReceivedMessage, SettleStatus

__all__ = ["PERIODIC_CHANNEL", "Schedule", "Tick", "schedule", "tick"]

PERIODIC_CHANNEL = "fairq.periodic"


@dataclass(frozen=True)
class Schedule:
    """What a driver message carries (as JSON, the content base64-encoded)."""

    name: str
    interval: timedelta
    channel: str
    content: bytes
    priority: int = 0

    def encode(self) -> bytes:
        return json.dumps({
            "name": self.name, "interval_ms": _sql.milliseconds(self.interval),
            "channel": self.channel, "priority": self.priority,
            "content": base64.b64encode(self.content).decode("ascii"),
        }).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Schedule:
        doc = json.loads(raw)
        return cls(name=doc["name"], interval=timedelta(milliseconds=doc["interval_ms"]),
                   channel=doc["channel"], content=base64.b64decode(doc["content"]),
                   priority=doc["priority"])


def schedule(name: str, interval: timedelta, channel: str, content: bytes, *, queue: str,
             start_at: datetime | None, priority: int) -> _sql.Call[CreateResult]:
    """The call that creates the driver of schedule ``name`` in ``queue`` (first tick at
    ``start_at``)."""
    if interval <= timedelta(0):
        raise ValueError(f"interval must be positive, got {interval}")
    driver = Schedule(name, interval, channel, content, priority)
    return _sql.create(PERIODIC_CHANNEL, driver.encode(), queue=queue, dequeue_at=start_at,
                       delay=None, priority=0, dedup_key=name)


@dataclass(frozen=True)
class Tick:
    """One tick of a driver: run ``work`` then ``reschedule`` in one transaction, and
    commit only if ``reschedule`` answers DEFERRED (otherwise the driver was not ours)."""

    schedule: Schedule
    due_at: datetime
    next_at: datetime
    work: _sql.Call[CreateResult]
    reschedule: _sql.Call[SettleStatus]


def tick(driver: ReceivedMessage[Any], now: datetime, queue: str) -> Tick:
    """The tick a driver received from ``queue`` stands for. Ticks missed while no
    worker ran are not replayed: the next one is the first tick of the schedule's grid
    after ``now``."""
    sched = Schedule.decode(driver.raw)
    due_at = driver.dequeue_at
    missed = max(0, (now - due_at) // sched.interval)
    next_at = due_at + sched.interval * (missed + 1)
    # Keyed by tick, so the same tick never has two work messages pending at once. The
    # driver's id, not the name, keeps the key short whatever the name's length.
    work_key = f"{PERIODIC_CHANNEL}:{driver.id}@{due_at.isoformat()}"
    work = _sql.create(sched.channel, sched.content, queue=queue, dequeue_at=None, delay=None,
                       priority=sched.priority, dedup_key=work_key)
    reschedule = _sql.defer(driver.id, driver.num_attempts, dequeue_at=next_at, delay=None,
                            state=None)
    return Tick(sched, due_at, next_at, work, reschedule)
