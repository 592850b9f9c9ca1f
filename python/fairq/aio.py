"""``AsyncQueue``: the asyncio binding, the same calls as :class:`fairq.Queue`.

It sends exactly the statements of ``fairq._sql``; only the execution differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar, overload

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool

from fairq import _sql, _timestamps, periodic
from fairq._pools import owned_async_pool
from fairq._source import conninfo_of, require_source
from fairq.codecs import BytesCodec, Codec
from fairq.types import (
    AsyncMessage,
    CancelStatus,
    ChannelStats,
    CreateResult,
    DeadLetter,
    DeleteStatus,
    HistoryRecord,
    NewMessage,
    QueueStats,
    ReceivedMessage,
    RetryStatus,
    SettleResult,
    SettleStatus,
)

__all__ = ["AsyncQueue"]

T = TypeVar("T")
R = TypeVar("R")
AsyncConnection = psycopg.AsyncConnection[Any]


def _cursor(conn: AsyncConnection) -> psycopg.AsyncCursor[tuple[Any, ...]]:
    """As :func:`fairq.queue._cursor`: the connection's own kind of cursor, unless it
    takes ``$1`` placeholders only (``cursor_factory=AsyncRawCursor``)."""
    if issubclass(conn.cursor_factory, psycopg.AsyncRawCursor):
        return psycopg.AsyncCursor(conn, row_factory=tuple_row)
    return conn.cursor(row_factory=tuple_row)


@dataclass
class _Hold:
    """One use of a shared connection: a call, or a :meth:`AsyncQueue.transaction`
    block. Calls from the tasks started inside it (they see it in their context) join
    it, one at a time: ``joined`` is their lock."""

    parent: _Hold | None  # the use it joined, if any
    joined: asyncio.Lock = field(default_factory=asyncio.Lock)
    active: bool = True

    async def end(self) -> None:
        """Waits for the calls that joined this use, those under way and those waiting
        their turn, and then takes no more: a later one waits for the connection."""
        async with self.joined:
            self.active = False


@dataclass
class _Shared:
    """A connection shared by the queue's tasks: one call at a time on it. Reentrant for
    the task that holds it and for the tasks it starts meanwhile: a call made without
    ``conn=`` inside :meth:`AsyncQueue.transaction` joins that transaction, even from a
    task of its own (``asyncio.wait_for`` makes one before Python 3.12, ``gather`` one
    per call). Reentrant by task alone, such a call waited for the block that waited
    for it: until the timeout, or for ever. A task started before the block (or one
    whose call comes once the block's body is over) waits for the connection as any
    other."""

    conn: AsyncConnection
    lock: asyncio.Lock
    # (A variable per connection: a task inside uses of two connections joins each.)
    hold: ContextVar[_Hold | None]

    @classmethod
    def of(cls, conn: AsyncConnection) -> _Shared:
        """The connection's one lock and hold, whichever queues use it: two queues (two
        names) on one connection took turns by two locks, and one's calls ran inside the
        other's transaction() block, committed or rolled back with it."""
        with _CONNECTION_TURNS_LOCK:
            lock, hold = _CONNECTION_TURNS.setdefault(
                conn, (asyncio.Lock(), ContextVar("fairq_shared_hold", default=None)))
        return cls(conn, lock, hold)

    @asynccontextmanager
    async def held(self, block: bool) -> AsyncIterator[AsyncConnection]:
        """The connection, for a call (in a transaction of its own unless autocommit) or
        a ``transaction()`` ``block`` (in one more). The calls that joined this use end
        inside its transaction, before it commits or rolls back: they belong to it.
        Waited for once it had ended, one still waiting its turn ran after the commit
        (and outside a rollback), and without autocommit one under way made the
        block's exit fail with OutOfOrderTransactionNesting."""
        lock, joined = await self._acquire()
        hold = _Hold(joined)
        token = self.hold.set(hold)
        try:
            async with contextlib.AsyncExitStack() as stack:
                for _ in range((0 if self.conn.autocommit else 1) + int(block)):
                    await stack.enter_async_context(self.conn.transaction())
                try:
                    yield self.conn
                finally:
                    # Not cut short by a cancellation: a joined call still running
                    # when the transaction ends fails its exit, and the connection
                    # with it. The cancellation rolls the block back once they end.
                    if await finish(asyncio.ensure_future(hold.end())):
                        raise asyncio.CancelledError
        finally:
            self.hold.reset(token)
            hold.active = False
            lock.release()

    async def _acquire(self) -> tuple[asyncio.Lock, _Hold | None]:
        """The lock to hold: that of the innermost use this task's context is inside
        and that still runs, else the connection's own."""
        outer = self.hold.get()
        while outer is not None:
            if outer.active:
                await outer.joined.acquire()
                if outer.active:
                    return outer.joined, outer
                outer.joined.release()  # it ended while this task waited
            outer = outer.parent
        await self.lock.acquire()
        return self.lock, None


# (Weak keys: a connection's lock and hold live as long as it.)
_CONNECTION_TURNS: weakref.WeakKeyDictionary[
    AsyncConnection, tuple[asyncio.Lock, ContextVar[_Hold | None]]] = weakref.WeakKeyDictionary()
_CONNECTION_TURNS_LOCK = threading.Lock()


class AsyncQueue(Generic[T]):
    """fairq over psycopg 3, with asyncio: the queue ``name`` (default ``"default"``).
    ``source`` is a conninfo string (the queue then owns a pool: ``await queue.open()``
    or ``async with``, then ``close()``), an ``AsyncConnection`` or an
    ``AsyncConnectionPool`` (both stay the caller's)."""

    @overload
    def __init__(self: AsyncQueue[bytes],
                 source: str | AsyncConnection | AsyncConnectionPool[Any], *,
                 name: str = "default", codec: None = None, pool_size: int = 10) -> None: ...

    @overload
    def __init__(self, source: str | AsyncConnection | AsyncConnectionPool[Any], *,
                 name: str = "default", codec: Codec[T], pool_size: int = 10) -> None: ...

    def __init__(self, source: str | AsyncConnection | AsyncConnectionPool[Any], *,
                 name: str = "default", codec: Codec[Any] | None = None,
                 pool_size: int = 10) -> None:
        # (As Queue's: the listings only filter by the name.)
        _sql.require_channel(name, "name")
        require_source(source, (str, psycopg.AsyncConnection, AsyncConnectionPool),
                       "a conninfo string, a psycopg.AsyncConnection or a"
                       " psycopg_pool.AsyncConnectionPool (Queue takes the sync ones)")
        self.name = name
        self.codec: Codec[T] = codec if codec is not None else BytesCodec()  # type: ignore[assignment]
        self.conninfo = conninfo_of(source)
        self._owned_pool: AsyncConnectionPool[Any] | None = None
        self._backend: AsyncConnectionPool[Any] | _Shared
        if isinstance(source, str):
            # An async pool cannot open in a constructor: open() or the first call does.
            self._owned_pool = owned_async_pool(source, pool_size)
            self._backend = self._owned_pool
        elif isinstance(source, AsyncConnectionPool):
            self._backend = source
        else:
            self._backend = _Shared.of(source)
        # What the AsyncWorkers running on the queue do before its own pool closes.
        self._before_close: set[Callable[[], Awaitable[None]]] = set()

    async def open(self) -> None:
        if self._owned_pool is not None and self._owned_pool.closed:
            await self._owned_pool.open()

    async def close(self) -> None:
        """Closes the pool the queue opened itself (a caller's connection or pool stays open).

        The AsyncWorkers still running on that pool first hand back what they hold
        (each message deferred to now) and stop, as with ``stop(now=True)``: once
        the pool is closed, their hand-backs could only fail,
        and the messages waited for their locks (``async with AsyncQueue(dsn)`` left
        with a worker's run() in a task of its own, then cancelled by asyncio.run's
        shutdown). A cancellation of close() meanwhile does not cut that short; it is
        re-raised once the pool is closed."""
        if self._owned_pool is None:
            return
        cancelled = False
        try:
            for hand_back in list(self._before_close):
                cancelled |= await finish(asyncio.ensure_future(hand_back()))
        finally:
            await self._owned_pool.close()
        if cancelled:
            raise asyncio.CancelledError

    async def __aenter__(self) -> AsyncQueue[T]:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @asynccontextmanager
    async def connection(self, *, timeout: float | None = None
                         ) -> AsyncIterator[AsyncConnection]:
        """A connection for one unit of work, committed (unless autocommit) at the end.
        ``timeout``: seconds to wait for one of a pool's connections before
        ``psycopg_pool.PoolTimeout`` (None: the pool's own timeout); a queue on a single
        connection waits for it as long as another call holds it."""
        if isinstance(self._backend, _Shared):
            async with self._backend.held(block=False) as shared:
                yield shared
        else:
            await self.open()
            async with self._backend.connection(timeout=timeout) as conn:
                yield conn

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncConnection]:
        """A connection in a transaction that commits when the block ends without error:
        pass it as ``conn=`` to make several calls atomic."""
        if isinstance(self._backend, _Shared):
            # (The calls that joined it end inside its transaction: _Shared.held.)
            async with self._backend.held(block=True) as shared:
                yield shared
            return
        async with self.connection() as conn, conn.transaction():
            yield conn

    async def _run(self, call: _sql.Call[R], conn: AsyncConnection | None = None) -> R:
        if conn is None:
            async with self.connection() as own:
                try:
                    return await self._run(call, own)
                except psycopg.OperationalError:
                    if not (_sql.sent_again(call, own)
                            and isinstance(self._backend, AsyncConnectionPool)):
                        raise
            # (The pool threw the dead connection away; the others may be dead too.)
            await self._backend.check()
            async with self.connection() as own:
                return await self._run(call, own)
        async with _cursor(conn) as cur:
            _timestamps.register(cur)
            try:
                await cur.execute(call.query, call.params)
            except psycopg.errors.UndefinedFunction as exc:
                _sql.explain_missing_function(exc)
                raise
            return call.decode(await cur.fetchall())

    # -- the queue ------------------------------------------------------------------

    async def pause(self, until: datetime | None = None, *,
                    conn: AsyncConnection | None = None) -> None:
        await self._run(_sql.queue_pause(self.name, until), conn)

    async def resume(self, *, conn: AsyncConnection | None = None) -> bool:
        return await self._run(_sql.queue_resume(self.name), conn)

    async def stats(self, *, conn: AsyncConnection | None = None) -> QueueStats:
        return await self._run(_sql.queue_stats(self.name), conn)

    async def queues(self, *, conn: AsyncConnection | None = None) -> list[QueueStats]:
        return await self._run(_sql.queues(), conn)

    # -- channels -------------------------------------------------------------------

    async def channel_set(self, channel: str, *, max_concurrency: int | None = None,
                          release_interval: timedelta = timedelta(0),
                          max_size: int | None = None, max_attempts: int | None = None,
                          weight: int = 1, conn: AsyncConnection | None = None) -> None:
        await self._run(_sql.channel_set(channel, queue=self.name,
                                         max_concurrency=max_concurrency,
                                         release_interval=release_interval, max_size=max_size,
                                         max_attempts=max_attempts, weight=weight), conn)

    async def channel_clear(self, channel: str, *, conn: AsyncConnection | None = None) -> bool:
        return await self._run(_sql.channel_clear(channel, queue=self.name), conn)

    async def channel_pause(self, channel: str, until: datetime | None = None, *,
                            conn: AsyncConnection | None = None) -> None:
        await self._run(_sql.channel_pause(channel, queue=self.name, until=until), conn)

    async def channel_resume(self, channel: str, *,
                             conn: AsyncConnection | None = None) -> bool:
        return await self._run(_sql.channel_resume(channel, queue=self.name), conn)

    async def channels(self, channel: str | None = None, *,
                       conn: AsyncConnection | None = None) -> list[ChannelStats]:
        return await self._run(_sql.channels(channel, queue=self.name), conn)

    # -- producing ------------------------------------------------------------------

    async def send(self, channel: str, content: T, *, dequeue_at: datetime | None = None,
                   delay: timedelta | None = None, priority: int = 0,
                   dedup_key: str | None = None,
                   conn: AsyncConnection | None = None) -> CreateResult:
        return await self._run(_sql.create(channel, self.codec.encode(content),
                                           queue=self.name, dequeue_at=dequeue_at, delay=delay,
                                           priority=priority, dedup_key=dedup_key), conn)

    async def send_many(self, messages: Sequence[NewMessage[T]], *,
                        conn: AsyncConnection | None = None) -> list[CreateResult]:
        return await self._run(_sql.create_batch(messages, self.codec, queue=self.name),
                               conn)

    async def cancel(self, message_id: int, *,
                     conn: AsyncConnection | None = None) -> CancelStatus:
        return await self._run(_sql.cancel(message_id), conn)

    async def schedule_periodic(self, name: str, interval: timedelta | None, channel: str,
                                content: T, *, cron: str | None = None,
                                timezone: str | None = None, start_at: datetime | None = None,
                                priority: int = 0,
                                conn: AsyncConnection | None = None) -> CreateResult:
        def create(now: datetime | None) -> _sql.Call[CreateResult]:
            return periodic.schedule(name, channel, self.codec.encode(content), queue=self.name,
                                     interval=interval, cron=cron, timezone=timezone,
                                     start_at=start_at, priority=priority, now=now)
        if not periodic.needs_clock(cron, start_at):
            return await self._run(create(None), conn)
        async with self._atomic(conn) as tx:
            now = await self._run(_sql.clock(), tx)
            return await self._run(create(now), tx)

    # -- consuming ------------------------------------------------------------------

    async def dequeue(self, lock: timedelta, max_messages: int = 1, *,
                      conn: AsyncConnection | None = None) -> list[AsyncMessage[T]]:
        """Up to ``max_messages`` messages, each locked for ``lock``; [] when none is due.

        A cancellation (``asyncio.timeout``, ``wait_for``, a cancelled task) that arrives
        once the statement is sent waits for its answer, hands back what it brought
        (each message deferred to now, on the same connection) and is then re-raised:
        psycopg reads a committed answer before it raises, and those messages stayed
        locked for ``lock`` with nobody to handle them. Further cancellations meanwhile
        do not cut that short. Waiting for a pool's connection is cancelled at once."""
        call = _sql.dequeue(lock, max_messages, queue=self.name)
        if conn is not None:
            return await self._dequeue_on(call, conn)
        async with self.connection() as own:
            return await self._dequeue_on(call, own)

    async def _dequeue_on(self, call: _sql.Call[list[_sql.Row]],
                          conn: AsyncConnection) -> list[AsyncMessage[T]]:
        answer = asyncio.ensure_future(self._run(call, conn))
        try:
            rows = await asyncio.shield(answer)
        except asyncio.CancelledError:
            await finish(asyncio.ensure_future(self._hand_back(answer, conn)))
            raise
        return [AsyncMessage(*row, codec=self.codec, queue=self) for row in rows]

    async def _hand_back(self, answer: asyncio.Future[list[_sql.Row]],
                         conn: AsyncConnection) -> None:
        """What a cancelled dequeue's answer brought, deferred to now with each message's
        token (its attempt counted, as a worker's hand-back). A statement that fails
        leaves the rest to their locks: the connection is likely gone."""
        with contextlib.suppress(psycopg.Error):
            for row in await answer:
                await self.defer(AsyncMessage(*row, codec=self.codec, queue=self), conn=conn)

    async def complete(self, message: ReceivedMessage[T], *,
                       conn: AsyncConnection | None = None) -> SettleStatus:
        return await self._run(_sql.complete(message.id, message.num_attempts), conn)

    async def complete_batch(self, messages: Sequence[ReceivedMessage[T]], *,
                             conn: AsyncConnection | None = None) -> list[SettleResult]:
        return await self._run(
            _sql.complete_batch([(m.id, m.num_attempts) for m in messages]), conn)

    async def defer(self, message: ReceivedMessage[T], dequeue_at: datetime | None = None, *,
                    delay: timedelta | None = None, state: bytes | None = None,
                    conn: AsyncConnection | None = None) -> SettleStatus:
        return await self._run(_sql.defer(message.id, message.num_attempts,
                                          dequeue_at=dequeue_at, delay=delay, state=state), conn)

    async def heartbeat(self, message: ReceivedMessage[T], lock: timedelta, *,
                        lock_wait: timedelta | None = None,
                        conn: AsyncConnection | None = None) -> SettleStatus:
        return await self._run(_sql.heartbeat(message.id, message.num_attempts, lock, lock_wait),
                               conn)

    async def fail(self, message: ReceivedMessage[T], error: str | None = None, *,
                   conn: AsyncConnection | None = None) -> SettleStatus:
        return await self._run(_sql.fail(message.id, message.num_attempts, error), conn)

    async def periodic_tick(self, driver: ReceivedMessage[T], *, now: datetime | None = None,
                            conn: AsyncConnection | None = None) -> periodic.TickResult:
        """:meth:`fairq.Queue.periodic_tick`, with asyncio."""
        try:
            async with self._atomic(conn) as tx:
                if now is None:
                    now = await self._run(_sql.clock(), tx)
                tick = periodic.tick(driver, now, self.name)
                work = await self._run(tick.work, tx)
                tick.check(await self._run(tick.reschedule, tx))
                return tick.done(work)
        except periodic.Refused as refused:
            return refused.result

    @asynccontextmanager
    async def _atomic(self, conn: AsyncConnection | None) -> AsyncIterator[AsyncConnection]:
        """A savepoint in the caller's transaction on ``conn``, or a transaction of our
        own."""
        if conn is None:
            async with self.transaction() as own:
                yield own
        else:
            if _sql.joins_implicit_transaction(conn.autocommit, conn.info.transaction_status):
                await conn.execute(_sql.BEGIN_IMPLICIT)
            async with conn.transaction():
                yield conn

    # -- operating ------------------------------------------------------------------

    async def dead_letters(self, channel: str | None = None, *, limit: int = 100,
                           conn: AsyncConnection | None = None) -> list[DeadLetter]:
        return await self._run(_sql.dead_letters(channel, limit, queue=self.name), conn)

    async def dead_letter_retry(self, message_id: int, *,
                                conn: AsyncConnection | None = None) -> RetryStatus:
        return await self._run(_sql.dead_letter_retry(message_id), conn)

    async def dead_letter_delete(self, message_id: int, *,
                                 conn: AsyncConnection | None = None) -> DeleteStatus:
        return await self._run(_sql.dead_letter_delete(message_id), conn)

    async def dead_letter_purge(self, before: datetime, *, all_queues: bool = False,
                                conn: AsyncConnection | None = None) -> int:
        return await self._run(
            _sql.dead_letter_purge(before, queue=None if all_queues else self.name), conn)

    async def history(self, channel: str | None = None, *, since: datetime | None = None,
                      limit: int = 1000,
                      conn: AsyncConnection | None = None) -> list[HistoryRecord]:
        return await self._run(_sql.history(channel, since, limit, queue=self.name), conn)

    async def history_prune(self, before: datetime, *,
                            conn: AsyncConnection | None = None) -> int:
        return await self._run(_sql.history_prune(before), conn)


async def finish(task: asyncio.Future[Any]) -> bool:
    """Awaits ``task`` to its end, whatever cancellations of the caller arrive meanwhile
    (its exception, if any, is raised); True if one did. For the work a cancellation
    itself starts (a hand-back): a second one (a shutdown, then its timeout) cut it
    short, leaving messages locked until their lock lapsed. The caller re-raises its
    first cancellation afterwards."""
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = cancelled or not task.done()
    task.result()
    return cancelled
