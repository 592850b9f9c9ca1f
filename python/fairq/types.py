"""Results of queue calls: statuses as enums, rows as frozen dataclasses.

The SQL answers with plain text statuses; these enums are their exact values, so a
status the SQL adds later fails loudly in ``Enum(value)`` rather than slipping by.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from fairq.codecs import Codec

if TYPE_CHECKING:
    import psycopg

    from fairq.aio import AsyncQueue
    from fairq.queue import Queue

__all__ = [
    "AsyncMessage",
    "CancelStatus",
    "ChannelStats",
    "CreateResult",
    "CreateStatus",
    "DeadLetter",
    "DeleteStatus",
    "HistoryOutcome",
    "HistoryRecord",
    "Message",
    "NewMessage",
    "QueueStats",
    "ReceivedMessage",
    "RetryStatus",
    "SettleResult",
    "SettleStatus",
    "require_aware",
    "require_one_due_time",
]

T = TypeVar("T")


class CreateStatus(enum.Enum):
    CREATED = "created"
    DUPLICATE = "duplicate"  # the id is that of the message already holding the dedup key
    DROPPED = "dropped"  # the channel is at max_size: nothing stored, id is None


class SettleStatus(enum.Enum):
    COMPLETED = "completed"
    DEFERRED = "deferred"
    HEARTBEATED = "heartbeated"
    DEAD = "dead"
    NOT_FOUND = "not_found"
    # The message exists but the caller's lock is gone (expired and handed to someone
    # else, or already settled): the call changed nothing.
    STALE = "stale"


class CancelStatus(enum.Enum):
    CANCELLED = "cancelled"
    NOT_FOUND = "not_found"
    LOCKED = "locked"  # in flight: only its worker may settle it


class RetryStatus(enum.Enum):
    REQUEUED = "requeued"
    NOT_FOUND = "not_found"


class DeleteStatus(enum.Enum):
    DELETED = "deleted"
    NOT_FOUND = "not_found"


class HistoryOutcome(enum.Enum):
    """How a message left the queue, as ``fairq.message_history`` records it."""

    COMPLETED = "completed"
    DEAD = "dead"  # moved to the dead letters (max_attempts reached, or failed)
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class CreateResult:
    id: int | None
    status: CreateStatus


@dataclass(frozen=True)
class SettleResult:
    id: int
    status: SettleStatus


def require_aware(moment: datetime | None, name: str) -> None:
    """A point in time must carry its time zone: PostgreSQL reads a naive one in the
    database session's zone, not the caller's (a message scheduled "in an hour" from
    Tokyo came due nine hours late). A ``date`` is no point in time: it failed with an
    AttributeError about ``utcoffset``."""
    if moment is not None and not isinstance(moment, datetime):
        raise TypeError(f"{name} must be a timezone-aware datetime, got {type(moment).__name__}"
                        f" {moment!r}")
    if moment is not None and moment.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware, got the naive {moment!r}"
                         " (for example datetime.now(timezone.utc))")


#: The longest duration fairq takes (``fairq.max_duration_ms()``: ten years of 365 days).
MAX_DURATION = timedelta(milliseconds=315_360_000_000)


def require_one_due_time(dequeue_at: datetime | None, delay: timedelta | None) -> None:
    """A message's due time is ``dequeue_at`` (timezone-aware) or ``delay``: given both,
    one would be dropped without a word. A delay is at most :data:`MAX_DURATION` either
    way, as every duration fairq takes (past PostgreSQL's timestamps, the database
    answered "timestamp out of range", naming nothing)."""
    require_aware(dequeue_at, "dequeue_at")
    if dequeue_at is not None and delay is not None:
        raise ValueError(f"give dequeue_at or delay, not both (got {dequeue_at!r} and {delay!r})")
    if delay is not None and abs(delay) > MAX_DURATION:
        raise ValueError(f"delay must be at most {MAX_DURATION.days} days either way, got {delay}"
                         " (give dequeue_at for a later time)")


@dataclass(frozen=True)
class NewMessage(Generic[T]):
    """One element of ``send_many``. ``delay`` counts from the database's clock."""

    channel: str
    content: T
    dequeue_at: datetime | None = None
    delay: timedelta | None = None
    priority: int = 0
    dedup_key: str | None = None

    def __post_init__(self) -> None:
        require_one_due_time(self.dequeue_at, self.delay)


@dataclass(frozen=True)
class QueueStats:
    """A row of the ``fairq.queues`` view: the queue's channels (as ``fairq.channels``
    counts them), its messages, its dead letters, and the end of its pause (None: not
    paused; ``datetime.max`` in UTC: until resumed)."""

    queue: str
    channels: int
    size: int
    ready: int
    scheduled: int
    in_flight: int
    dead: int
    paused_until: datetime | None


@dataclass(frozen=True)
class ChannelStats:
    """A row of the ``fairq.channels`` view. Limits are None when unlimited;
    ``release_interval`` is zero when messages are released without pause.
    ``paused_until`` is None when the channel is not paused, ``datetime.max`` in UTC
    when it is paused until resumed (and then so is ``next_dequeue_at``)."""

    queue: str
    channel: str
    max_concurrency: int | None
    release_interval: timedelta
    max_size: int | None
    max_attempts: int | None
    weight: int
    paused_until: datetime | None
    size: int
    ready: int
    scheduled: int
    in_flight: int
    next_dequeue_at: datetime | None


@dataclass(frozen=True)
class DeadLetter:
    """A row of ``fairq.dead_letters``. ``content`` stays raw bytes: a message often dies
    precisely because its content cannot be decoded."""

    id: int
    queue: str
    channel: str
    content: bytes
    state: bytes | None
    num_attempts: int
    error: str | None
    created_at: datetime
    died_at: datetime


@dataclass(frozen=True)
class HistoryRecord:
    id: int
    queue: str
    channel: str
    priority: int
    created_at: datetime
    first_dequeued_at: datetime | None
    settled_at: datetime
    num_attempts: int
    outcome: HistoryOutcome


@dataclass(frozen=True)
class ReceivedMessage(Generic[T]):
    """A message handed out by a dequeue, locked for its receiver.

    ``raw`` is the content as stored; ``content`` decodes it on first access, so a
    message whose content the codec rejects still reaches the worker, which can then
    defer or dead-letter it like any failure instead of losing the whole batch.
    ``num_attempts`` is the fencing token every settlement passes back.
    """

    id: int
    channel: str
    raw: bytes
    state: bytes | None
    num_attempts: int
    priority: int
    dequeue_at: datetime
    recovered: bool
    codec: Codec[T] = field(repr=False, compare=False, kw_only=True)
    # What the message's own methods settled it as (complete, defer, fail), so a worker
    # whose handler settled it knows its own STALE answers for no lost lock.
    settled_by_holder: list[SettleStatus] = field(default_factory=list, init=False,
                                                  repr=False, compare=False)

    @cached_property
    def content(self) -> T:
        return self.codec.decode(self.raw)

    def _settled(self, status: SettleStatus, success: SettleStatus) -> SettleStatus:
        if status is success:
            self.settled_by_holder.append(status)
        return status


@dataclass(frozen=True)
class Message(ReceivedMessage[T]):
    """A message from a :class:`~fairq.Queue`; its methods settle it through that queue."""

    queue: Queue[T] = field(repr=False, compare=False, kw_only=True)

    def complete(self, *, conn: psycopg.Connection[Any] | None = None) -> SettleStatus:
        return self._settled(self.queue.complete(self, conn=conn), SettleStatus.COMPLETED)

    def defer(self, dequeue_at: datetime | None = None, *, delay: timedelta | None = None,
              state: bytes | None = None,
              conn: psycopg.Connection[Any] | None = None) -> SettleStatus:
        return self._settled(self.queue.defer(self, dequeue_at, delay=delay, state=state,
                                              conn=conn), SettleStatus.DEFERRED)

    def heartbeat(self, lock: timedelta, *, lock_wait: timedelta | None = None,
                  conn: psycopg.Connection[Any] | None = None) -> SettleStatus:
        return self.queue.heartbeat(self, lock, lock_wait=lock_wait, conn=conn)

    def fail(self, error: str | None = None, *,
             conn: psycopg.Connection[Any] | None = None) -> SettleStatus:
        return self._settled(self.queue.fail(self, error, conn=conn), SettleStatus.DEAD)


@dataclass(frozen=True)
class AsyncMessage(ReceivedMessage[T]):
    """A message from an :class:`~fairq.AsyncQueue`; its methods are coroutines."""

    queue: AsyncQueue[T] = field(repr=False, compare=False, kw_only=True)

    async def complete(self, *,
                       conn: psycopg.AsyncConnection[Any] | None = None) -> SettleStatus:
        return self._settled(await self.queue.complete(self, conn=conn), SettleStatus.COMPLETED)

    async def defer(self, dequeue_at: datetime | None = None, *,
                    delay: timedelta | None = None, state: bytes | None = None,
                    conn: psycopg.AsyncConnection[Any] | None = None) -> SettleStatus:
        return self._settled(await self.queue.defer(self, dequeue_at, delay=delay, state=state,
                                                    conn=conn), SettleStatus.DEFERRED)

    async def heartbeat(self, lock: timedelta, *, lock_wait: timedelta | None = None,
                        conn: psycopg.AsyncConnection[Any] | None = None) -> SettleStatus:
        return await self.queue.heartbeat(self, lock, lock_wait=lock_wait, conn=conn)

    async def fail(self, error: str | None = None, *,
                   conn: psycopg.AsyncConnection[Any] | None = None) -> SettleStatus:
        return self._settled(await self.queue.fail(self, error, conn=conn), SettleStatus.DEAD)
