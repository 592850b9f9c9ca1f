"""The pools a queue opens for itself (given a conninfo, not a connection or a pool).

A connection that sat in the pool is checked with one round trip before it is handed
out, so one the server dropped meanwhile (a restart, ``idle_session_timeout``, a
proxy's idle limit) is replaced instead of failing the caller's call: without the
check, every pooled connection failed once after a restart, each failure a send or a
heartbeat that did not happen. Connections used again within :data:`CHECK_AFTER_S`
of their return are not checked: a busy worker pays no round trip per call.

Their connections get :data:`fairq._source.CONNECTION_DEFAULTS` (a connect timeout,
keepalives) where the conninfo sets none of its own, as a worker's own connections
do: without them, after a failover to a host that stopped answering, each call's
connect waited for the system's TCP timeout.

After a connect fails, psycopg_pool tries again after 1, 2, 4, 8, 16, 32 s ... for
``reconnect_timeout`` (5 minutes by default), and a caller waiting for a connection
does not make it try sooner: back from a 40 s outage, workers waited 18-25 s more for
the next attempt. So a series of attempts here gives up after
:data:`RECONNECT_SERIES_S`, and a fresh one (from 1 s again) starts at once if a caller
is waiting, or with the next call: two attempts are at most about 3 s apart.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

from psycopg_pool import AsyncConnectionPool, ConnectionPool

from fairq._source import with_connection_defaults

__all__ = ["CHECK_AFTER_S", "RECONNECT_SERIES_S", "SESSION_SETUP", "owned_async_pool",
           "owned_pool"]

#: How long a connection may sit in the pool and still be handed out unchecked.
CHECK_AFTER_S = 1.0

#: How long one series of connect attempts goes on (the pool's ``reconnect_timeout``):
#: attempts at 0, 1, 3 and 6 s, each failed one logged by psycopg_pool, then the
#: series' end. Longer series mean longer gaps (the next backoff is 8 s), shorter ones
#: more warnings in the log while the database is down.
RECONNECT_SERIES_S = 6.0


class _IdleSince:
    """Since when each pooled connection has sat in the pool (monotonic seconds): from
    when it was made, then from each return."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()

    def now(self, conn: Any) -> None:
        with self._lock:
            self._since[conn] = time.monotonic()

    def idle_long(self, conn: Any) -> bool:
        """Whether ``conn`` has sat in the pool for CHECK_AFTER_S or more."""
        with self._lock:
            since = self._since.get(conn)
        return since is None or time.monotonic() - since >= CHECK_AFTER_S


#: Set on each new connection of a queue's own pool: fairq's calls refuse any other
#: isolation (sql/validate.sql), and a database whose default is another made every
#: call of the queue fail.
SESSION_SETUP = "SET default_transaction_isolation = 'read committed'"


def owned_pool(conninfo: str, size: int) -> ConnectionPool[Any]:
    idle = _IdleSince()

    def configure(conn: Any) -> None:
        conn.execute(SESSION_SETUP)
        idle.now(conn)

    def check(conn: Any) -> None:
        if idle.idle_long(conn):
            ConnectionPool.check_connection(conn)

    def series_failed(pool: ConnectionPool[Any]) -> None:
        # A caller already waiting does not start a series of its own (only a new
        # wait does): without this, one waiting through the series' end got nothing
        # until its timeout, even with the server back meanwhile.
        if pool.get_stats()["requests_waiting"]:
            pool.check()

    return ConnectionPool(with_connection_defaults(conninfo), min_size=1, max_size=size,
                          kwargs={"autocommit": True}, open=True, name="fairq",
                          configure=configure, check=check, reset=idle.now,
                          reconnect_timeout=RECONNECT_SERIES_S, reconnect_failed=series_failed)


def owned_async_pool(conninfo: str, size: int) -> AsyncConnectionPool[Any]:
    """Not opened: an async pool cannot open in a constructor."""
    idle = _IdleSince()

    async def check(conn: Any) -> None:
        if idle.idle_long(conn):
            await AsyncConnectionPool.check_connection(conn)

    async def configure(conn: Any) -> None:
        await conn.execute(SESSION_SETUP)
        idle.now(conn)

    async def now(conn: Any) -> None:
        idle.now(conn)

    async def series_failed(pool: AsyncConnectionPool[Any]) -> None:
        # As in owned_pool.
        if pool.get_stats()["requests_waiting"]:
            await pool.check()

    return AsyncConnectionPool(with_connection_defaults(conninfo), min_size=1, max_size=size,
                               kwargs={"autocommit": True}, open=False, name="fairq",
                               configure=configure, check=check, reset=now,
                               reconnect_timeout=RECONNECT_SERIES_S,
                               reconnect_failed=series_failed)
