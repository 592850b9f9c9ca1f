"""``fairq demo`` and ``python -m fairq.demo``: arguments, signals, exit codes."""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TextIO

import psycopg

from fairq import _arguments
from fairq._source import dsn_argument
from fairq.demo.dashboard import offer_dashboard
from fairq.demo.database import DemoError, throwaway_database
from fairq.demo.runner import scenario_run
from fairq.demo.scenario import Scenario

__all__ = ["add_arguments", "main", "run"]

#: The longest run ``--seconds`` asks for: a day.
MAX_SECONDS = 86_400.0


@contextmanager
def quiet_workers() -> Iterator[None]:
    """The demo reports failures itself. Kept until the server is gone: a Worker's
    LISTEN thread outlives ``run()`` by up to half a second."""
    log = logging.getLogger("fairq.worker")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        time.sleep(0.6)
        log.setLevel(level)


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", type=dsn_argument,
                        help="run in this existing database (channels demo-*, "
                             "cleaned up afterwards) instead of a throwaway cluster; "
                             "no other channel may hold messages there")
    parser.add_argument("--quick", action="store_true", help="a 5-second run instead of 20")
    parser.add_argument("--seconds", type=float, help="seconds of sending (default 20, or 5)")
    parser.add_argument("--chart", type=Path, default=Path("fairq-demo.png"),
                        help="where to write the PNG chart (default ./fairq-demo.png)")
    parser.add_argument("--no-chart", dest="chart", action="store_const", const=None,
                        help="write no chart")
    parser.add_argument("--seed", type=int, default=1, help="random seed of the workload")
    parser.add_argument("--dashboard-port", type=_arguments.port, default=8080,
                        help="watch the run in `fairq dashboard` on 127.0.0.1 at this port "
                             "(default 8080, or a free one if taken; needs the dashboard extra)")
    parser.add_argument("--no-dashboard", dest="dashboard_port", action="store_const",
                        const=None, help="offer no dashboard")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Runs the demo as ``args`` (from :func:`add_arguments`) say; returns the exit code:
    0 when every check held, 1 when one failed, 2 when the demo could not run, 130 when
    interrupted."""
    out = out or sys.stdout
    seconds = args.seconds if args.seconds is not None else (5.0 if args.quick else 20.0)
    # (NaN compares false both ways, infinity would never end, and the bursts of a huge
    # value would not fit in memory.)
    if not 0 < seconds <= MAX_SECONDS:
        print(f"fairq demo: --seconds must be more than 0 and at most {MAX_SECONDS:g}",
              file=sys.stderr)
        return 2
    scenario = Scenario.build(seconds)
    try:
        with sigterm_as_interrupt(), quiet_workers():
            if args.dsn:
                with offer_dashboard(args.dsn, args.dashboard_port, out):
                    return scenario_run(args.dsn, scenario, args.chart, out, args.seed, True)
            with throwaway_database(out) as dsn, offer_dashboard(dsn, args.dashboard_port, out):
                return scenario_run(dsn, scenario, args.chart, out, args.seed, False)
    except KeyboardInterrupt:
        print("\nfairq demo: interrupted, cleaned up", file=sys.stderr)
        return 130
    except (DemoError, psycopg.Error, OSError) as exc:
        print(f"fairq demo: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:  # initdb / pg_ctl of the throwaway cluster
        print(f"fairq demo: {exc}\n{exc.stderr or ''}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fairq demo",
        description="Watch fairq share workers fairly between tenants, with limits, "
                    "failures and a crash, then read what happened.",
        allow_abbrev=False)
    add_arguments(parser)
    return run(parser.parse_args(argv))
