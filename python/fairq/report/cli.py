"""``fairq report`` and ``python -m fairq.report``: arguments, the Spark session, the
JDBC read of the history, exit codes."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from fairq import _arguments
from fairq._source import dsn_argument
from fairq.report.queries import compute
from fairq.report.render import write_report

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["main", "parse_since"]


EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """An ISO 8601 instant (naive = UTC) or a duration back from now: ``90m``, ``24h``,
    ``7d``, ``2w``."""
    match = _RELATIVE.match(text.strip())
    if match:
        now = now or datetime.now(timezone.utc)
        try:
            return now - timedelta(**{_UNITS[match[2]]: float(match[1])})
        except OverflowError:  # (argparse reports only ValueError and its own as usage)
            raise argparse.ArgumentTypeError(
                f"{text!r} goes back before the year 1") from None
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 time or a duration like 24h: {text!r}") from None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fairq report",
        description="Spark report of fairq.message_history: throughput, wait and processing "
                    "times, attempts, dead-letter rate and fairness, as Parquet, CSV, PNG "
                    "charts and index.html.",
        allow_abbrev=False)
    parser.add_argument("--dsn", type=dsn_argument,
                        help="PostgreSQL conninfo or URL, reachable over TCP "
                             "(default: $DATABASE_URL)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--since", type=parse_since,
                        help="only history settled at or after this ISO 8601 time, "
                             "or this long ago (24h, 7d)")
    parser.add_argument("--window", type=_arguments.positive_seconds, default=timedelta(minutes=1),
                        metavar="SECONDS", help="fairness window (default: 60)")
    parser.add_argument("--top", type=_arguments.positive_integer, default=20,
                        help="channels shown in the per-channel chart (default: 20)")
    parser.add_argument("--partitions", type=_arguments.positive_integer, default=None,
                        help="JDBC read partitions (default: Spark's default parallelism)")
    parser.add_argument("--master", default=None,
                        help="Spark master (default: local[*], or what spark-submit set)")
    parser.add_argument("--jdbc-jar", default=os.environ.get("FAIRQ_JDBC_JAR"),
                        help="PostgreSQL JDBC driver jar (default: $FAIRQ_JDBC_JAR or "
                             "/usr/share/java/postgresql.jar from libpostgresql-jdbc-java)")
    return parser


def _session(master: str | None, jar: str) -> tuple[SparkSession, bool]:
    """The active SparkSession (kept), or a new one (stopped by the caller): local
    unless spark-submit launched us or ``master`` names a cluster."""
    from pyspark.sql import SparkSession

    from fairq.spark import local_session

    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:  # not spark-submit
        master = "local[*]"
    if master is not None and master.startswith("local"):
        return local_session(master, app_name="fairq-report", jdbc_jar=jar,
                             fast_start=False), True
    builder = SparkSession.builder.appName("fairq-report").config("spark.jars", jar)
    if master is not None:
        builder = builder.master(master)
    return builder.getOrCreate(), True


def main(argv: Sequence[str] | None = None) -> int:
    """``fairq report``: returns 0 on success, 1 when the job fails, 2 on usage errors."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        args.dsn = _arguments.dsn_or_environment(parser, args.dsn)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if not args.dsn:
        parser.print_usage(sys.stderr)
        print("fairq report: error: --dsn (or $DATABASE_URL) is required", file=sys.stderr)
        return EXIT_USAGE
    try:
        from fairq import spark as fspark

        url = fspark.jdbc_url(args.dsn)
        properties = fspark.jdbc_properties(args.dsn)
    except ValueError as exc:
        print(f"fairq report: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    jar = args.jdbc_jar or fspark.DEFAULT_JDBC_JAR
    if not Path(jar).is_file():
        print(f"fairq report: error: no JDBC driver at {jar} (apt-get install "
              "libpostgresql-jdbc-java, or pass --jdbc-jar)", file=sys.stderr)
        return EXIT_USAGE
    try:
        spark, owned = _session(args.master, jar)
    except Exception as exc:
        print(f"fairq report: cannot start Spark: {exc}", file=sys.stderr)
        return EXIT_FAILED
    history = None
    tables: dict[str, DataFrame] = {}
    try:
        history = fspark.read(spark, url, "message_history", properties=properties,
                              since=args.since, num_partitions=args.partitions).cache()
        tables = compute(history, window=args.window)
        since = f" since {args.since.isoformat()}" if args.since else ""
        index = write_report(tables, args.out, top=args.top,
                             note=f"fairq.message_history of {url}{since}.")
    except Exception as exc:
        first_lines = "\n".join(str(exc).splitlines()[:3])
        print(f"fairq report: failed: {type(exc).__name__}: {first_lines}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if not owned:  # leave the caller's session as it was
            for df in (history, tables.get("fairness")):
                if df is not None:
                    df.unpersist()
        if owned:
            spark.stop()
    print(index)
    return EXIT_OK
