"""``fairq bench`` and ``python -m fairq.bench``: arguments, the throwaway cluster, and
what the run writes and prints."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg

from fairq._source import dsn_argument, shown_conninfo
from fairq.bench.database import DatabaseInUse
from fairq.bench.output import clean, table, write_json
from fairq.bench.plots import write_plots
from fairq.bench.progress import Progress
from fairq.bench.sizes import FULL, QUICK, TINY
from fairq.bench.suite import SCENARIOS, run, spark_scenario

__all__ = ["main"]


# Rows a DataFrame enqueues in the --spark scenario, by size preset.
SPARK_ROWS = {"full": 1_000_000, "quick": 100_000, "tiny": 2_000}

# Durable, as in production; autovacuum visits tables every 10 s, as docs/operations.md
# recommends for fairq (its channel table takes thousands of non-HOT updates a second).
DURABLE_SETTINGS = {
    "fsync": "on", "synchronous_commit": "on", "full_page_writes": "on",
    "max_connections": "200", "shared_buffers": "1GB", "autovacuum_naptime": "10s",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fairq bench", description="fairq against the physical floor, side by side.",
        allow_abbrev=False)
    parser.add_argument("--dsn", type=dsn_argument,
                        help="a database dedicated to the bench (default: start a"
                             " throwaway cluster on 127.0.0.1 and remove it afterwards)")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes: the whole run takes a few minutes")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results here")
    parser.add_argument("--plots", type=Path, metavar="DIR", help="write PNG plots here")
    parser.add_argument("--spark", action="store_true",
                        help="also measure enqueueing a DataFrame through fairq.spark"
                             " (needs the spark extra and the JDBC driver)")
    parser.add_argument("--sizes", choices=("full", "quick", "tiny"), help=argparse.SUPPRESS)
    parser.add_argument("--only", help=argparse.SUPPRESS)  # comma-separated scenarios
    # Own cluster only: preload pg_stat_statements and report top statements per
    # throughput scenario (adds overhead: not for the reported numbers).
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    return parser


#: Ctrl-C and SIGTERM (a CI timeout, `kill`) end a run alike: the throwaway cluster is
#: removed on the way out instead of being left running.
_STOPS = (signal.SIGINT, signal.SIGTERM)


def _interrupt(signum: int, frame: Any) -> None:
    # The first ends the run; those after it are ignored until the cluster is gone
    # (one arriving while it is being removed would leave it running).
    for stop in _STOPS:
        signal.signal(stop, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sizes = {"full": FULL, "quick": QUICK, "tiny": TINY}[args.sizes or
                                                         ("quick" if args.quick else "full")]
    scenarios = tuple(args.only.split(",")) if args.only else SCENARIOS
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        print(f"fairq bench: unknown scenarios {sorted(unknown)}", file=sys.stderr)
        return 2
    # Where the results go is checked before the run (which takes an hour at full size):
    # a path it could not write ended the run in a traceback, its results lost.
    for flag, directory in (("--json", args.json and args.json.parent), ("--plots", args.plots)):
        problem = _unwritable(directory) if directory is not None else None
        if problem:
            print(f"fairq bench: {flag}: cannot write into {directory}: {problem}",
                  file=sys.stderr)
            return 2
    if args.json is not None and args.json.is_dir():
        print(f"fairq bench: --json: {args.json} is a directory", file=sys.stderr)
        return 2
    log = Progress()
    cluster = None
    previous = {stop: signal.signal(stop, _interrupt) for stop in _STOPS}
    try:
        if args.dsn:
            dsn, where = args.dsn, "external (--dsn)"
        else:
            from fairq.cluster import Cluster
            settings = dict(DURABLE_SETTINGS)
            if args.profile:
                settings.update({"shared_preload_libraries": "pg_stat_statements",
                                 "pg_stat_statements.track": "all"})
            cluster = Cluster(settings=settings)
            log(f"starting a throwaway cluster of {cluster.version} (durable settings)")
            cluster.start()
            dsn, where = cluster.dsn(), f"throwaway, {DURABLE_SETTINGS}"
        # (--dsn may hold a password: it is not shown.)
        log(f"fairq bench ({sizes.name}) against {shown_conninfo(dsn)}")
        results = run(dsn, sizes, log, scenarios, where, profile=args.profile)
        if args.spark:
            spark_scenario(dsn, SPARK_ROWS[sizes.name], results, log)
    except KeyboardInterrupt:
        print("fairq bench: interrupted", file=sys.stderr)
        return 130
    except DatabaseInUse as exc:
        print(f"fairq bench: {exc}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as exc:  # initdb / pg_ctl of the throwaway cluster
        print(f"fairq bench: {exc}\n{(exc.stderr or '').strip()}", file=sys.stderr)
        return 1
    except (psycopg.Error, OSError, RuntimeError) as exc:
        # A --dsn it cannot reach, no pgbench, a pgbench that failed: what went wrong,
        # in one message (a traceback buried it; psycopg's does not repeat a password).
        print(f"fairq bench: failed: {exc}", file=sys.stderr)
        return 1
    finally:
        try:
            if cluster is not None:
                for stop in _STOPS:
                    signal.signal(stop, signal.SIG_IGN)
                log("removing the throwaway cluster")
                cluster.remove()
        finally:
            for stop, handler in previous.items():
                signal.signal(stop, handler)
    results = clean(results)
    # The table first: it is not lost if a file cannot be written after all.
    print(table(results), flush=True)
    try:
        if args.json:
            write_json(results, args.json)
            log(f"wrote {args.json}")
        if args.plots:
            for path in write_plots(results, args.plots):
                log(f"wrote {path}")
    except OSError as exc:
        print(f"fairq bench: failed to write the results: {exc}", file=sys.stderr)
        return 1
    return 0


def _unwritable(directory: Path) -> str | None:
    """Why files cannot be written into ``directory`` (made if missing), or None."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return exc.strerror or str(exc)
    if not os.access(directory, os.W_OK | os.X_OK):
        return "permission denied"
    return None
