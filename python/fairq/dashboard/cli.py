"""``fairq dashboard``: arguments, the start-up checks, and serving until Ctrl-C."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import psycopg

from fairq import _arguments
from fairq._source import dsn_argument

if TYPE_CHECKING:
    from fairq.dashboard.app import Settings

__all__ = ["LOOPBACK_HOSTS", "WILDCARD_HOSTS", "answered_hosts", "check_database",
           "dashboard_settings", "main", "missing_extra"]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # every address: no Host name to accept from it
EXTRA = ("starlette", "uvicorn", "jinja2", "prometheus_client")


def missing_extra(program: str, modules: Sequence[str] = EXTRA) -> bool:
    """Says how to install the extra when one of its modules is missing (the CLI imports
    the web libraries only once they are known to be there)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        print(f"{program} needs the dashboard extra ({', '.join(missing)} missing): "
              "pip install 'fairq[dashboard]'", file=sys.stderr)
    return bool(missing)


def check_database(dsn: str) -> str:
    """Connects once, so that a wrong DSN or a database without fairq fails at start with
    its reason; returns the role's name."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT current_user::text, to_regclass('fairq.queues') IS NOT NULL"
                           ).fetchone()
    assert row is not None
    if not row[1]:
        raise psycopg.errors.UndefinedTable(
            "fairq is not installed in this database, or this role cannot see its schema "
            "(CREATE EXTENSION fairq; fairq.grant_observer(role) for a read-only role)")
    return str(row[0])


def answered_hosts(host: str, allowed_hosts: Sequence[str]) -> tuple[str, ...]:
    """The Host names a server listening on ``host`` answers to (the dashboard and
    ``fairq metrics``): the loopback names, that address (unless it is every
    address) and ``allowed_hosts``."""
    listened = () if host in (*LOOPBACK_HOSTS, *WILDCARD_HOSTS) else (host,)
    return (*LOOPBACK_HOSTS, *listened, *allowed_hosts)


def dashboard_settings(dsn: str, *, host: str, allowed_hosts: Sequence[str],
                       origins: Sequence[str], **options: Any) -> Settings:
    """The Settings of a dashboard listening on ``host`` (see :func:`answered_hosts`)."""
    from fairq.dashboard.app import Settings

    return Settings(dsn, allowed_hosts=answered_hosts(host, allowed_hosts),
                    origins=tuple(o.rstrip("/") for o in origins), **options)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fairq dashboard",
        description="A live web view of fairq's queues, channels, locks and dead letters, "
                    "with Prometheus metrics at /metrics.",
        allow_abbrev=False)
    parser.add_argument("--dsn", type=dsn_argument,
                        help="PostgreSQL conninfo or URL (default: $DATABASE_URL); the "
                             "dashboard has exactly this role's rights")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=_arguments.port, default=8080,
                        help="port to listen on (default 8080; 0: any free one)")
    parser.add_argument("--read-only", action="store_true",
                        help="no buttons: retry, delete, pause and resume are refused")
    parser.add_argument("--interval", type=_arguments.positive_seconds,
                        default=timedelta(seconds=5),
                        help="seconds between samples of the queues and page refreshes "
                             "(default 5)")
    parser.add_argument("--top-channels", type=int, default=20, metavar="N",
                        help="/metrics has per-channel gauges for the N channels with the "
                             "largest ready backlog (default 20; 0: none)")
    parser.add_argument("--page-size", type=int, default=50, help="rows per page (default 50)")
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="a Host name to answer to besides this machine's loopback names "
                             "and the --host address (the name your proxy forwards); "
                             "repeatable")
    parser.add_argument("--origin", action="append", default=[], metavar="URL",
                        help="an origin whose actions are accepted besides the address a "
                             "request came to, e.g. https://dash.example.com behind a proxy "
                             "that ends TLS; repeatable")
    args = parser.parse_args(argv)
    args.dsn = _arguments.dsn_or_environment(parser, args.dsn)
    if not args.dsn:
        parser.error("no database: pass --dsn or set DATABASE_URL")
    if missing_extra("fairq dashboard"):
        return 2
    from fairq.dashboard.app import Dashboard
    from fairq.dashboard.server import bind, serve, url_of
    if args.top_channels < 0 or args.page_size < 1:
        parser.error("--top-channels must be >= 0 and --page-size >= 1")
    loopback = args.host in LOOPBACK_HOSTS
    settings = dashboard_settings(args.dsn, host=args.host, allowed_hosts=args.allowed_host,
                                  origins=args.origin, read_only=args.read_only,
                                  interval=args.interval, top_channels=args.top_channels,
                                  page_size=args.page_size)
    try:
        role = check_database(args.dsn)
        sock = bind(args.host, args.port)
    except (psycopg.Error, OSError) as exc:
        print(f"fairq dashboard: {exc}", file=sys.stderr)
        return 1
    mode = "read-only" if args.read_only else "actions on"
    print(f"fairq dashboard on {url_of(sock)} (role {role}, {mode}; Ctrl-C stops it)",
          flush=True)
    if not loopback:
        print("note: listening beyond this machine: anyone who reaches the port sees the "
              "queues (and may act, unless --read-only); put it behind your own "
              "authentication. It answers only to the Host names "
              f"{', '.join(settings.allowed_hosts)} (--allowed-host adds one)",
              file=sys.stderr)
    serve(Dashboard(settings), sock)
    return 0
