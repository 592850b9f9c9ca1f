"""Where a queue gets its connections: a conninfo string, a connection or a pool.

Shared by the sync and async queues: the conninfo a worker needs for its own LISTEN
connection, derived from whatever the queue was built on, and the connection settings
fairq adds to the connections it opens itself.
"""

from __future__ import annotations

import argparse
from typing import Any

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool, ConnectionPool

Source = (str | psycopg.Connection[Any] | ConnectionPool[Any]
          | psycopg.AsyncConnection[Any] | AsyncConnectionPool[Any])


def checked_conninfo(conninfo: str) -> str:
    """``conninfo``, once libpq can read it. libpq's complaint about one it cannot
    quotes the text it choked on, which may be the password: the ValueError raised
    instead does not repeat it (neither do logs, tracebacks or a pool's retries). So
    for a URL whose password holds an unescaped "@": libpq reads the rest of the
    password as part of the host name, and every failure to resolve it printed that."""
    try:
        parsed = conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        raise ValueError("the connection string is malformed (not shown: it may hold a"
                         " password)") from None
    for key in ("host", "hostaddr"):
        # (A socket directory is a path, and an abstract socket's name starts with @.)
        if any("@" in host and not host.startswith(("/", "@"))
               for host in str(parsed.get(key) or "").split(",")):
            raise ValueError(f"the connection string is malformed: its {key} holds an '@'"
                             " (not shown: it may be the end of a password; write '@' in a"
                             " URL's password as %40)")
    return conninfo


def dsn_argument(text: str) -> str:
    """An argparse ``type`` for ``--dsn``: :func:`checked_conninfo`, as a usage error
    (which argparse prints without the value)."""
    try:
        return checked_conninfo(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def shown_conninfo(conninfo: str) -> str:
    """``conninfo`` as it may be shown (in a log, a progress line): without its password,
    whether a URL's or a keyword's."""
    params = conninfo_to_dict(conninfo)
    params.pop("password", None)
    return make_conninfo("", **params)


#: What every connection fairq opens itself (a queue's own pool, a worker's LISTEN and
#: doorbell connections) adds to the conninfo it was given unless that says otherwise:
#: a host that stopped answering (a failover's old primary) held a connect for the
#: system's TCP timeout (minutes), and with it a pool's calls or the worker's loop and
#: stop(); keepalives find an idle connection whose peer is gone, which otherwise
#: waits for an answer (or a LISTEN's events) that never comes; and tcp_user_timeout
#: ends one whose sent call the peer never acknowledged, which keepalives do not probe
#: (the kernel retransmits for some 15 minutes). A server busy with a long statement
#: has acknowledged it: that wait is not cut short.
#: fallback_application_name names them in pg_stat_activity (an operator looking for
#: the workers of a queue saw nameless sessions), unless the conninfo or PGAPPNAME
#: names them otherwise.
CONNECTION_DEFAULTS = {"connect_timeout": "10", "keepalives": "1", "keepalives_idle": "30",
                       "keepalives_interval": "10", "keepalives_count": "3",
                       "tcp_user_timeout": "60000", "fallback_application_name": "fairq"}


def with_connection_defaults(conninfo: str) -> str:
    """``conninfo`` with :data:`CONNECTION_DEFAULTS` where it sets none of its own, and
    only those this libpq knows (tcp_user_timeout came with libpq 12; an unknown
    keyword would fail every connect)."""
    given = conninfo_to_dict(conninfo)
    known = {d.keyword.decode() for d in pq.Conninfo.get_defaults()}
    return make_conninfo(conninfo, **{k: v for k, v in CONNECTION_DEFAULTS.items()
                                      if k not in given and k in known})


def require_source(source: object, kinds: tuple[type, ...], expected: str) -> None:
    """Raises TypeError unless ``source`` is one of ``kinds`` (``expected`` names them):
    checked by a queue's constructor, since None (``os.environ.get`` of an unset
    variable) or the other binding's connection or pool otherwise failed only at the
    first call, with an AttributeError about something else."""
    if not isinstance(source, kinds):
        raise TypeError(f"source must be {expected}, got {type(source).__name__}")


def conninfo_of(source: Source) -> str | None:
    """A conninfo that opens a new connection to the same database as ``source``, or
    None for a pool whose conninfo is computed by a function.

    A live connection's ``info.dsn`` omits the password, so it is put back. A string is
    checked (:func:`checked_conninfo`).
    """
    if isinstance(source, str):
        return checked_conninfo(source)
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
