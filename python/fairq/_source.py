"""Where a queue gets its connections: a conninfo string, a connection or a pool.

Shared by the sync and async queues: the conninfo a worker needs for its own LISTEN
connection, derived from whatever the queue was built on.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import pq
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool, ConnectionPool

Source = (str | psycopg.Connection[Any] | ConnectionPool[Any]
          | psycopg.AsyncConnection[Any] | AsyncConnectionPool[Any])


def conninfo_of(source: Source) -> str | None:
    """A conninfo that opens a new connection to the same database as ``source``, or
    None for a pool whose conninfo is computed by a function.

    A live connection's ``info.dsn`` omits the password, so it is put back.
    """
    if isinstance(source, str):
        return source
    if isinstance(source, (ConnectionPool, AsyncConnectionPool)):
        if not isinstance(source.conninfo, str) or callable(source.kwargs):
            return None
        # A pool's kwargs mix libpq parameters (password, ...) with psycopg options
        # (autocommit, row_factory, ...): only the former belong in a conninfo.
        libpq_keywords = {d.keyword.decode() for d in pq.Conninfo.get_defaults()}
        extra = {k: v for k, v in (source.kwargs or {}).items() if k in libpq_keywords}
        return make_conninfo(source.conninfo, **extra)
    password = source.info.password
    return make_conninfo(source.info.dsn, **({"password": password} if password else {}))
