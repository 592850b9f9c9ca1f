"""``fairq metrics``: the dashboard's Prometheus metrics without the dashboard.

``--once`` prints one exposition and exits (for cron and node_exporter's textfile
collector: its counters are the totals that fairq.message_history holds); otherwise it
serves ``/metrics`` alone until Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from datetime import timedelta

import psycopg

from fairq._source import dsn_argument
from fairq.dashboard.cli import check_database, missing_extra, seconds

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fairq metrics",
                                     description="fairq's Prometheus metrics (text format).")
    parser.add_argument("--dsn", type=dsn_argument, default=os.environ.get("DATABASE_URL"),
                        help="PostgreSQL conninfo or URL (default: $DATABASE_URL)")
    parser.add_argument("--once", action="store_true",
                        help="print the metrics once and exit, instead of serving /metrics")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9464)
    parser.add_argument("--interval", type=seconds, default=timedelta(seconds=5),
                        help="seconds between samples when serving (default 5)")
    parser.add_argument("--top-channels", type=int, default=20, metavar="N",
                        help="per-channel gauges for the N largest ready backlogs (default 20)")
    args = parser.parse_args(argv)
    if not args.dsn:
        parser.error("no database: pass --dsn or set DATABASE_URL")
    if missing_extra("fairq metrics", ["prometheus_client"]):
        return 2
    from prometheus_client import generate_latest, start_http_server

    from fairq.dashboard.metrics import collect_once, live, registry
    from fairq.dashboard.sampler import Sampler
    try:
        check_database(args.dsn)
        if args.once:
            with psycopg.connect(args.dsn, autocommit=True, options="-c jit=off") as conn:
                data = collect_once(conn, args.top_channels)
            sys.stdout.write(generate_latest(registry(lambda: data)).decode())
            return 0
    except psycopg.Error as exc:
        print(f"fairq metrics: {exc}", file=sys.stderr)
        return 1

    def connect() -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(args.dsn, autocommit=True, options="-c jit=off")

    sampler = Sampler(connect, args.interval)
    sampler.start()
    server, thread = start_http_server(args.port, args.host,
                                       registry(live(sampler, connect, args.top_channels)))
    print(f"fairq metrics on http://{args.host}:{server.server_port}/metrics (Ctrl-C stops it)",
          flush=True)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.set())
    with contextlib.suppress(KeyboardInterrupt):
        stopping.wait()
    server.shutdown()
    thread.join()
    sampler.stop()
    return 0
