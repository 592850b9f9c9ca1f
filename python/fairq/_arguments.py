"""argparse types shared by the command lines (fairq, dashboard, metrics, report, demo).

Each refuses what it cannot turn into a value as a usage error naming its option: argparse
catches ValueError and ArgumentTypeError, but not the OverflowError that ``timedelta``
and ``socket.bind`` raise for a number too large (``--interval 1e300``, ``--port
99999`` ended in a traceback).
"""

from __future__ import annotations

import argparse
import math
import os
from datetime import timedelta

from fairq._source import checked_conninfo
from fairq._sql import INTEGER, name_problem
from fairq.types import MAX_DURATION

__all__ = ["dsn_or_environment", "port", "positive_integer", "positive_seconds", "queue_name",
           "seconds", "whole_number"]

#: Ports a server may listen on; 0 lets the system choose a free one (printed at start).
PORTS = range(0, 65536)


def port(text: str) -> int:
    """A TCP port, 0 to 65535 (0: any free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if value not in PORTS:
        raise argparse.ArgumentTypeError(
            f"expected a port from {PORTS.start} to {PORTS.stop - 1}, got {value}")
    return value


def whole_number(text: str, allowed: range) -> int:
    """A whole number in ``allowed``: checked here, a usage error naming its option (a
    number too large for the SQL's type failed in the database, naming none, or before
    it with a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value not in allowed:
        raise argparse.ArgumentTypeError(
            f"expected {allowed.start} to {allowed.stop - 1}, got {value}")
    return value


def positive_integer(text: str) -> int:
    """A count of at least 1 (rows shown, partitions read) that an SQL integer holds."""
    return whole_number(text, range(1, INTEGER.stop))


def queue_name(text: str) -> str:
    """A queue's name, as fairq takes it (:func:`fairq._sql.name_problem`): a queue
    refuses any other when it is made, before a worker's pool is, or a listing's
    filter answers nothing for it."""
    problem = name_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def _seconds(text: str, *, positive: bool) -> timedelta:
    # Bounded by the longest duration fairq's SQL takes (ten years): every duration the
    # commands take is one the SQL, a thread's wait or a page's refresh can hold.
    try:
        value = float(text)
    except ValueError:
        value = math.nan  # refused below, as NaN is
    longest = MAX_DURATION.total_seconds()
    low_enough = value > 0 if positive else value >= 0  # (NaN is neither)
    if not (low_enough and value <= longest):
        lowest = "more than 0" if positive else "at least 0"
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds, {lowest} and at most {longest:.0f}, got {text!r}")
    return timedelta(seconds=value)


def seconds(text: str) -> timedelta:
    """A duration in seconds, 0 to :data:`fairq.types.MAX_DURATION`."""
    return _seconds(text, positive=False)


def positive_seconds(text: str) -> timedelta:
    """A duration in seconds, more than 0 and at most :data:`fairq.types.MAX_DURATION`."""
    return _seconds(text, positive=True)


def dsn_or_environment(parser: argparse.ArgumentParser, dsn: str | None) -> str | None:
    """``dsn`` (``--dsn``), or else $DATABASE_URL, checked as ``--dsn`` is: a malformed one
    is a usage error naming DATABASE_URL (as argparse's ``default``, it was reported as
    a malformed "argument --dsn" that was never given)."""
    if dsn is not None:
        return dsn
    url = os.environ.get("DATABASE_URL")
    if url is None:
        return None
    try:
        return checked_conninfo(url)
    except ValueError as exc:
        parser.error(f"DATABASE_URL: {exc}")
