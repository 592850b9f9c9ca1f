"""``Queue``: the synchronous binding of fairq's SQL functions.

Every method takes an optional ``conn``: given one, the call runs on it and joins
whatever transaction is open there (transactional enqueue: the message exists iff
the caller's business writes commit). Without one, the call runs in a transaction of
its own on the queue's connection or pool.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar, overload

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool

from fairq import _sql, _timestamps, periodic
from fairq._pools import owned_pool
from fairq._source import conninfo_of, require_source
from fairq.codecs import BytesCodec, Codec
from fairq.types import (
    CancelStatus,
    ChannelStats,
    CreateResult,
    DeadLetter,
    DeleteStatus,
    HistoryRecord,
    Message,
    NewMessage,
    QueueStats,
    ReceivedMessage,
    RetryStatus,
    SettleResult,
    SettleStatus,
)

__all__ = ["Queue"]

T = TypeVar("T")
R = TypeVar("R")
Connection = psycopg.Connection[Any]


def _cursor(conn: Connection) -> psycopg.Cursor[tuple[Any, ...]]:
    """A cursor for the queue's statements, which name their parameters (``%(x)s``):
    one of the connection's own kind (a ClientCursor, say, chosen for a pooler), unless
    that kind takes ``$1`` placeholders only (``cursor_factory=RawCursor``), on which
    every call failed with "raw queries require a sequence of parameters"."""
    if issubclass(conn.cursor_factory, psycopg.RawCursor):
        return psycopg.Cursor(conn, row_factory=tuple_row)
    return conn.cursor(row_factory=tuple_row)


@dataclass(frozen=True)
class _Shared:
    """A connection shared by the queue's users: one call at a time on it. Reentrant: a
    call made without ``conn=`` inside :meth:`Queue.transaction` joins that transaction
    (with a plain lock it waited for its own thread for ever)."""

    conn: Connection
    lock: threading.RLock

    @classmethod
    def of(cls, conn: Connection) -> _Shared:
        """The connection's one lock, whichever queues use it: two queues (two names) on
        one connection took turns by two locks, and one's calls ran inside the other's
        transaction() block, committed or rolled back with it."""
        with _CONNECTION_LOCKS_LOCK:
            lock = _CONNECTION_LOCKS.setdefault(conn, threading.RLock())
        return cls(conn, lock)


# (Weak keys: a lock lives as long as its connection.)
_CONNECTION_LOCKS: weakref.WeakKeyDictionary[Connection, threading.RLock] = (
    weakref.WeakKeyDictionary())
_CONNECTION_LOCKS_LOCK = threading.Lock()


class Queue(Generic[T]):
    """fairq over psycopg 3, synchronously: the queue ``name`` (default ``"default"``).

    ``source`` is a conninfo string (the queue then owns a pool of up to
    ``pool_size`` autocommit connections; close it with ``close()`` or ``with``), a
    ``psycopg.Connection`` or a ``psycopg_pool.ConnectionPool`` (both stay the
    caller's). ``codec`` turns contents into bytes and back (default: raw bytes).
    Queues on the same database are independent: each has its own channels,
    round-robin, dead letters and history, and a dequeue serves only its own.
    """

    @overload
    def __init__(self: Queue[bytes], source: str | Connection | ConnectionPool[Any], *,
                 name: str = "default", codec: None = None, pool_size: int = 10) -> None: ...

    @overload
    def __init__(self, source: str | Connection | ConnectionPool[Any], *,
                 name: str = "default", codec: Codec[T], pool_size: int = 10) -> None: ...

    def __init__(self, source: str | Connection | ConnectionPool[Any], *,
                 name: str = "default", codec: Codec[Any] | None = None,
                 pool_size: int = 10) -> None:
        # Checked here, before a pool is opened: the listings (stats(), channels(), ...)
        # only filter by the name, so a name every write refuses answered them "empty".
        _sql.require_channel(name, "name")
        require_source(source, (str, psycopg.Connection, ConnectionPool),
                       "a conninfo string, a psycopg.Connection or a"
                       " psycopg_pool.ConnectionPool (AsyncQueue takes the async ones)")
        self.name = name
        self.codec: Codec[T] = codec if codec is not None else BytesCodec()  # type: ignore[assignment]
        self.conninfo = conninfo_of(source)
        self._owned_pool: ConnectionPool[Any] | None = None
        self._backend: ConnectionPool[Any] | _Shared
        if isinstance(source, str):
            self._owned_pool = owned_pool(source, pool_size)
            self._backend = self._owned_pool
        elif isinstance(source, ConnectionPool):
            self._backend = source
        else:
            self._backend = _Shared.of(source)
        # What the Workers running on the queue do before its own pool closes (each
        # registers in its run()'s thread, close() calls them in its own).
        self._before_close: set[Callable[[], None]] = set()
        self._before_close_lock = threading.Lock()

    def open(self) -> None:
        """Opens the pool the queue owns, if it is not open. The constructor already opens
        it: this is :meth:`AsyncQueue.open`'s twin, so that code can treat both bindings
        alike. A closed queue cannot be opened again."""
        if self._owned_pool is not None and self._owned_pool.closed:
            self._owned_pool.open()

    def close(self) -> None:
        """Closes the pool the queue opened itself (a caller's connection or pool stays open).

        The Workers still running on that pool (in other threads) first hand back what
        they hold (each message deferred to now) and stop, as with ``stop(now=True)``:
        once the pool is closed their hand-backs could only fail, and the messages
        waited for their locks. As :meth:`AsyncQueue.close`."""
        if self._owned_pool is None:
            return
        try:
            with self._before_close_lock:
                hand_backs = list(self._before_close)
            for hand_back in hand_backs:
                hand_back()
        finally:
            self._owned_pool.close()

    def __enter__(self) -> Queue[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def connection(self, *, timeout: float | None = None) -> Iterator[Connection]:
        """A connection for one unit of work, committed (unless autocommit) at the end.
        ``timeout``: seconds to wait for one of a pool's connections before
        ``psycopg_pool.PoolTimeout`` (None: the pool's own timeout); a queue on a single
        connection waits for it as long as another call holds it."""
        if isinstance(self._backend, _Shared):
            shared = self._backend.conn
            with self._backend.lock:
                if shared.autocommit:
                    yield shared
                else:
                    with shared.transaction():
                        yield shared
        else:
            with self._backend.connection(timeout=timeout) as conn:
                yield conn

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A connection in a transaction that commits when the block ends without error:
        pass it as ``conn=`` to make several calls atomic."""
        with self.connection() as conn, conn.transaction():
            yield conn

    def _run(self, call: _sql.Call[R], conn: Connection | None = None) -> R:
        if conn is None:
            with self.connection() as own:
                try:
                    return self._run(call, own)
                except psycopg.OperationalError:
                    if not (_sql.sent_again(call, own)
                            and isinstance(self._backend, ConnectionPool)):
                        raise
            # (The pool threw the dead connection away; the others may be dead too.)
            self._backend.check()
            with self.connection() as own:
                return self._run(call, own)
        with _cursor(conn) as cur:
            _timestamps.register(cur)
            try:
                rows = cur.execute(call.query, call.params).fetchall()
            except psycopg.errors.UndefinedFunction as exc:
                _sql.explain_missing_function(exc)
                raise
            return call.decode(rows)

    # -- the queue ------------------------------------------------------------------

    def pause(self, until: datetime | None = None, *, conn: Connection | None = None) -> None:
        """Hands out none of the queue's messages before ``until`` (None: until
        :meth:`resume`); creates, settlements and heartbeats go on."""
        self._run(_sql.queue_pause(self.name, until), conn)

    def resume(self, *, conn: Connection | None = None) -> bool:
        """Ends the queue's pause; True if it was paused."""
        return self._run(_sql.queue_resume(self.name), conn)

    def stats(self, *, conn: Connection | None = None) -> QueueStats:
        """The queue's counts and pause (zeros for a queue never used)."""
        return self._run(_sql.queue_stats(self.name), conn)

    def queues(self, *, conn: Connection | None = None) -> list[QueueStats]:
        """Every queue of the database (not only this one), by name."""
        return self._run(_sql.queues(), conn)

    # -- channels -------------------------------------------------------------------

    def channel_set(self, channel: str, *, max_concurrency: int | None = None,
                    release_interval: timedelta = timedelta(0), max_size: int | None = None,
                    max_attempts: int | None = None, weight: int = 1,
                    conn: Connection | None = None) -> None:
        """Sets the channel's policy (None = unlimited); ``weight`` (1-1000) is its share
        of turns."""
        self._run(_sql.channel_set(channel, queue=self.name, max_concurrency=max_concurrency,
                                   release_interval=release_interval, max_size=max_size,
                                   max_attempts=max_attempts, weight=weight), conn)

    def channel_clear(self, channel: str, *, conn: Connection | None = None) -> bool:
        """Forgets the channel's policy and any pause; True if it had one."""
        return self._run(_sql.channel_clear(channel, queue=self.name), conn)

    def channel_pause(self, channel: str, until: datetime | None = None, *,
                      conn: Connection | None = None) -> None:
        """Hands out none of the channel's messages before ``until`` (None: until
        :meth:`channel_resume`); it keeps its messages, policy and locks."""
        self._run(_sql.channel_pause(channel, queue=self.name, until=until), conn)

    def channel_resume(self, channel: str, *, conn: Connection | None = None) -> bool:
        """Ends the channel's pause; True if it was paused."""
        return self._run(_sql.channel_resume(channel, queue=self.name), conn)

    def channels(self, channel: str | None = None, *,
                 conn: Connection | None = None) -> list[ChannelStats]:
        """Every live channel's policy and counts (or just ``channel``'s), by name."""
        return self._run(_sql.channels(channel, queue=self.name), conn)

    # -- producing ------------------------------------------------------------------

    def send(self, channel: str, content: T, *, dequeue_at: datetime | None = None,
             delay: timedelta | None = None, priority: int = 0, dedup_key: str | None = None,
             conn: Connection | None = None) -> CreateResult:
        """Creates a message, due at ``dequeue_at`` or after ``delay`` (default: now)."""
        return self._run(_sql.create(channel, self.codec.encode(content), queue=self.name,
                                     dequeue_at=dequeue_at, delay=delay, priority=priority,
                                     dedup_key=dedup_key), conn)

    def send_many(self, messages: Sequence[NewMessage[T]], *,
                  conn: Connection | None = None) -> list[CreateResult]:
        """Creates many messages in one call; results are in input order."""
        return self._run(_sql.create_batch(messages, self.codec, queue=self.name), conn)

    def cancel(self, message_id: int, *, conn: Connection | None = None) -> CancelStatus:
        return self._run(_sql.cancel(message_id), conn)

    def schedule_periodic(self, name: str, interval: timedelta | None, channel: str,
                          content: T, *, cron: str | None = None, timezone: str | None = None,
                          start_at: datetime | None = None, priority: int = 0,
                          conn: Connection | None = None) -> CreateResult:
        """Sends ``content`` to ``channel`` of this queue every ``interval`` from
        ``start_at`` (default: now), or (``interval=None``) at the times of the ``cron``
        expression, evaluated in ``timezone`` (an IANA name; default UTC), from
        ``start_at`` on; for as long as a worker serves the queue. One schedule per
        ``name`` and queue: a second call answers DUPLICATE and changes nothing."""
        def create(now: datetime | None) -> _sql.Call[CreateResult]:
            return periodic.schedule(name, channel, self.codec.encode(content), queue=self.name,
                                     interval=interval, cron=cron, timezone=timezone,
                                     start_at=start_at, priority=priority, now=now)
        if not periodic.needs_clock(cron, start_at):
            return self._run(create(None), conn)
        with self._atomic(conn) as tx:
            now = self._run(_sql.clock(), tx)
            return self._run(create(now), tx)

    # -- consuming ------------------------------------------------------------------

    def dequeue(self, lock: timedelta, max_messages: int = 1, *,
                conn: Connection | None = None) -> list[Message[T]]:
        """Up to ``max_messages`` messages, each locked for ``lock``; [] when none is due."""
        rows = self._run(_sql.dequeue(lock, max_messages, queue=self.name), conn)
        return [Message(*row, codec=self.codec, queue=self) for row in rows]

    def complete(self, message: ReceivedMessage[T], *,
                 conn: Connection | None = None) -> SettleStatus:
        return self._run(_sql.complete(message.id, message.num_attempts), conn)

    def complete_batch(self, messages: Sequence[ReceivedMessage[T]], *,
                       conn: Connection | None = None) -> list[SettleResult]:
        return self._run(_sql.complete_batch([(m.id, m.num_attempts) for m in messages]), conn)

    def defer(self, message: ReceivedMessage[T], dequeue_at: datetime | None = None, *,
              delay: timedelta | None = None, state: bytes | None = None,
              conn: Connection | None = None) -> SettleStatus:
        """Unlocks and reschedules the message (default: now), keeping its attempt count;
        ``state`` (if given) replaces the saved state."""
        return self._run(_sql.defer(message.id, message.num_attempts, dequeue_at=dequeue_at,
                                    delay=delay, state=state), conn)

    def heartbeat(self, message: ReceivedMessage[T], lock: timedelta, *,
                  lock_wait: timedelta | None = None,
                  conn: Connection | None = None) -> SettleStatus:
        """Extends the message's lock to now + ``lock`` (never shortens it). With
        ``lock_wait``, waits at most that long while another transaction holds the
        message's row (one settling it) and then raises
        ``psycopg.errors.LockNotAvailable``, changing nothing."""
        return self._run(_sql.heartbeat(message.id, message.num_attempts, lock, lock_wait), conn)

    def fail(self, message: ReceivedMessage[T], error: str | None = None, *,
             conn: Connection | None = None) -> SettleStatus:
        """Moves the message to the dead letters now."""
        return self._run(_sql.fail(message.id, message.num_attempts, error), conn)

    def periodic_tick(self, driver: ReceivedMessage[T], *, now: datetime | None = None,
                      conn: Connection | None = None) -> periodic.TickResult:
        """Runs one tick of a periodic driver (a message of channel ``fairq.periodic`` of
        this queue, which workers hand here): creates the tick's work in this queue and
        defers the driver to its next tick after ``now`` (default: the database's clock,
        read in the tick's transaction), atomically. If the driver was not ours any more
        (its lock lapsed), nothing changes: the result's ``work`` is None and its
        ``status`` says why."""
        try:
            with self._atomic(conn) as tx:
                if now is None:
                    now = self._run(_sql.clock(), tx)
                tick = periodic.tick(driver, now, self.name)
                work = self._run(tick.work, tx)
                tick.check(self._run(tick.reschedule, tx))
                return tick.done(work)
        except periodic.Refused as refused:
            return refused.result

    @contextmanager
    def _atomic(self, conn: Connection | None) -> Iterator[Connection]:
        """A savepoint in the caller's transaction on ``conn``, or a transaction of our
        own."""
        if conn is None:
            with self.transaction() as own:
                yield own
        else:
            if _sql.joins_implicit_transaction(conn.autocommit, conn.info.transaction_status):
                conn.execute(_sql.BEGIN_IMPLICIT)
            with conn.transaction():
                yield conn

    # -- operating ------------------------------------------------------------------

    def dead_letters(self, channel: str | None = None, *, limit: int = 100,
                     conn: Connection | None = None) -> list[DeadLetter]:
        """The queue's dead letters, oldest death first."""
        return self._run(_sql.dead_letters(channel, limit, queue=self.name), conn)

    def dead_letter_retry(self, message_id: int, *,
                          conn: Connection | None = None) -> RetryStatus:
        """Puts a dead letter back on its channel with a fresh budget of attempts.
        Message ids are unique across queues: this acts on the id, whatever its queue."""
        return self._run(_sql.dead_letter_retry(message_id), conn)

    def dead_letter_delete(self, message_id: int, *,
                           conn: Connection | None = None) -> DeleteStatus:
        """Deletes a dead letter for good (by id, whatever its queue)."""
        return self._run(_sql.dead_letter_delete(message_id), conn)

    def dead_letter_purge(self, before: datetime, *, all_queues: bool = False,
                          conn: Connection | None = None) -> int:
        """Deletes the queue's dead letters that died before ``before`` (every queue's
        with ``all_queues``); returns how many went."""
        return self._run(_sql.dead_letter_purge(before, queue=None if all_queues else self.name),
                         conn)

    def history(self, channel: str | None = None, *, since: datetime | None = None,
                limit: int = 1000, conn: Connection | None = None) -> list[HistoryRecord]:
        """The queue's settled messages (recorded while ``fairq.history`` is on), oldest
        first."""
        return self._run(_sql.history(channel, since, limit, queue=self.name), conn)

    def history_prune(self, before: datetime, *, conn: Connection | None = None) -> int:
        """Deletes history settled before ``before``, of every queue (the SQL prunes by
        time only); returns how many rows went."""
        return self._run(_sql.history_prune(before), conn)
