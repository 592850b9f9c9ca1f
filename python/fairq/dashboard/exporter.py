"""``fairq metrics``: the dashboard's Prometheus metrics without the dashboard.

``--once`` prints one exposition and exits (for cron and node_exporter's textfile
collector: its counters are the totals that fairq.message_history holds); otherwise it
serves ``/metrics`` alone until Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from datetime import timedelta
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import psycopg

from fairq import _arguments
from fairq._source import dsn_argument
from fairq.dashboard.cli import answered_hosts, check_database, missing_extra

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["EXPORTER_CONNECTIONS", "main", "serve_metrics"]

#: The database connections ``fairq metrics`` holds at most, however many scrapes come.
EXPORTER_CONNECTIONS = 2


def _host_name(header: str) -> str:
    """A Host header without its port: "[::1]:9464" is "[::1]", "example:9464" is
    "example"; a bare IPv6 address ("::1") has none."""
    if header.startswith("["):
        return header[:header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def serve_metrics(host: str, port: int, metrics: CollectorRegistry,
                  allowed_hosts: tuple[str, ...]) -> tuple[WSGIServer, threading.Thread]:
    """Serves ``metrics`` on a thread, to requests whose Host is one of ``allowed_hosts``
    (as the dashboard: a page whose DNS name resolves to this address read every queue
    and channel name)."""
    from prometheus_client import make_wsgi_app

    app = make_wsgi_app(metrics)

    def checked(environ: dict[str, Any], start_response: Any) -> Any:
        if _host_name(environ.get("HTTP_HOST", "")) not in allowed_hosts:
            start_response("400 Bad Request", [("Content-Type", "text/plain")])
            return [b"Invalid host header\n"]
        return app(environ, start_response)

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = make_server(host, port, checked, Server, handler_class=QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="fairq-metrics", daemon=True)
    thread.start()
    return server, thread


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fairq metrics",
                                     description="fairq's Prometheus metrics (text format).",
                                     allow_abbrev=False)
    parser.add_argument("--dsn", type=dsn_argument,
                        help="PostgreSQL conninfo or URL (default: $DATABASE_URL)")
    parser.add_argument("--once", action="store_true",
                        help="print the metrics once and exit, instead of serving /metrics")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="a Host name to answer to besides the loopback names and the "
                             "--host address (the name Prometheus scrapes); repeatable")
    parser.add_argument("--port", type=_arguments.port, default=9464,
                        help="port to listen on (default 9464; 0: any free one)")
    parser.add_argument("--interval", type=_arguments.positive_seconds,
                        default=timedelta(seconds=5),
                        help="seconds between samples when serving (default 5)")
    parser.add_argument("--top-channels", type=int, default=20, metavar="N",
                        help="per-channel gauges for the N largest ready backlogs (default 20)")
    args = parser.parse_args(argv)
    args.dsn = _arguments.dsn_or_environment(parser, args.dsn)
    if not args.dsn:
        parser.error("no database: pass --dsn or set DATABASE_URL")
    if missing_extra("fairq metrics", ["prometheus_client"]):
        return 2
    from prometheus_client import generate_latest

    from fairq.dashboard.metrics import collect_once, live, registry
    from fairq.dashboard.queries import connect, connection_pool
    from fairq.dashboard.sampler import Sampler
    try:
        check_database(args.dsn)
        if args.once:
            with connect(args.dsn) as conn:
                data = collect_once(conn, args.top_channels)
            sys.stdout.write(generate_latest(registry(lambda: data)).decode())
            return 0
    except psycopg.Error as exc:
        print(f"fairq metrics: {exc}", file=sys.stderr)
        return 1

    # The sampler's connection and one for scrapes: scrapes that come together queue
    # for it (a connection each let parallel scrapes take every connection slot).
    pool = connection_pool(args.dsn, EXPORTER_CONNECTIONS)
    pool.open()
    sampler = Sampler(pool.connection, args.interval)
    sampler.start()
    server, thread = serve_metrics(args.host, args.port,
                                   registry(live(sampler, pool.connection, args.top_channels)),
                                   answered_hosts(args.host, args.allowed_host))
    print(f"fairq metrics on http://{args.host}:{server.server_port}/metrics (Ctrl-C stops it)",
          flush=True)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.set())
    with contextlib.suppress(KeyboardInterrupt):
        stopping.wait()
    server.shutdown()
    thread.join()
    sampler.stop()
    pool.close()
    return 0
