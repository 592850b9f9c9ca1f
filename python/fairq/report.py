"""``fairq report``: a Spark job that turns ``fairq.message_history`` into a report.

    fairq report --dsn URL --out DIR [--since T] [--window SECONDS]
    python -m fairq.report --dsn URL --out DIR

It reads the history through Spark's JDBC source (the JDBC URL is derived from the
libpq DSN) and writes, under DIR:

* ``parquet/<table>/`` and ``csv/<table>.csv`` for each table below;
* ``charts/*.png`` (matplotlib, Agg backend);
* ``index.html``, which shows the summary and links everything.

Definitions (all times in milliseconds, hours and windows in UTC):

* a history row is *settled* at ``settled_at``; ``hours`` buckets rows by the hour
  of ``settled_at``; throughput is settled rows per bucket;
* *wait time* = ``first_dequeued_at - created_at``, over rows that were dequeued;
* *processing time* = ``settled_at - first_dequeued_at``, over completed and dead rows;
* percentiles are exact and interpolate like SQL's ``percentile_cont``;
* *dead-letter rate* = dead / (completed + dead) (cancelled rows were never judged);
* *Jain's fairness index* of a window = (Σx)² / (n·Σx²), where the n channels are
  those with a message waiting during the window (created before its end, and first
  dequeued — or, never dequeued, settled — at or after its start) and x is the
  number of each channel's messages first dequeued in the window. 1 means every
  waiting channel was served equally; 1/n means one channel got everything.
  Messages still queued when the report runs are not in the history, so a channel
  starved up to now does not count yet.

History rows exist only while the setting ``fairq.history`` is on (off by default).
"""

from __future__ import annotations

import argparse
import csv
import html
import os
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

__all__ = ["TABLES", "compute", "main", "parse_since", "write_report"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
HOUR_US = 3_600_000_000
PERCENTILES = (0.5, 0.95, 0.99)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

#: The report's tables, in the order index.html lists them.
TABLES = ("summary", "channels", "hours", "channel_hours", "attempts", "fairness")
#: How each table's files are sorted.
ORDER = {"summary": (), "channels": ("channel",), "hours": ("hour",),
         "channel_hours": ("hour", "channel"), "attempts": ("channel", "num_attempts"),
         "fairness": ("window_start",)}

_DESCRIPTIONS = {
    "summary": "the whole period in one row",
    "channels": "per channel: throughput, outcomes, wait and processing percentiles",
    "hours": "per hour (of settled_at): the same figures over all channels",
    "channel_hours": "per channel and hour: throughput by outcome",
    "attempts": "per channel: how many messages settled after n attempts",
    "fairness": "per window: waiting channels, first deliveries, Jain's fairness index",
}


# -- the computation ------------------------------------------------------------------


def _prepared(history: DataFrame) -> DataFrame:
    """History rows with instants as epoch microseconds and the two durations."""
    from pyspark.sql import functions as F

    c, f, s = (F.unix_micros(F.col(n)) for n in ("created_at", "first_dequeued_at", "settled_at"))
    judged = F.col("outcome").isin("completed", "dead")
    return history.select(
        "id", "channel", "num_attempts", "outcome",
        c.alias("c_us"), f.alias("f_us"), s.alias("s_us"),
        ((f - c) / 1000.0).alias("wait_ms"),
        F.when(judged, (s - f) / 1000.0).alias("proc_ms"),
        (s - F.pmod(s, F.lit(HOUR_US))).alias("hour_us"),
    )


def _window(micros: str, window_us: int) -> Column:
    """The index of the window holding an instant (integer arithmetic: exact)."""
    from pyspark.sql import functions as F

    return F.expr(f"({micros} - pmod({micros}, {window_us})) div {window_us}")


def _figures() -> list[Column]:
    """The aggregate columns shared by summary, channels and hours."""
    from pyspark.sql import functions as F

    def count(outcome: str) -> Column:
        return F.sum(F.when(F.col("outcome") == outcome, 1).otherwise(0)).cast("long")

    pct = ", ".join(str(p) for p in PERCENTILES)
    return [
        F.count(F.lit(1)).alias("settled"),
        count("completed").alias("completed"),
        count("dead").alias("dead"),
        count("cancelled").alias("cancelled"),
        F.expr(f"percentile(wait_ms, array({pct}))").alias("_wait"),
        F.expr(f"percentile(proc_ms, array({pct}))").alias("_proc"),
        F.avg("num_attempts").alias("mean_attempts"),
    ]


def _finish(df: DataFrame) -> DataFrame:
    """Turns the percentile arrays into columns and adds the dead-letter rate."""
    from pyspark.sql import functions as F

    judged = F.col("completed") + F.col("dead")
    extra = [F.when(judged > 0, F.col("dead") / judged).alias("dead_letter_rate")]
    for name in ("wait", "proc"):
        for i, p in enumerate(PERCENTILES):
            extra.append(F.col(f"_{name}")[i].alias(f"{name}_p{round(p * 100)}_ms"))
    keep = [c for c in df.columns if not c.startswith("_")]
    return df.select(*keep, *extra)


def _fairness(rows: DataFrame, window_us: int) -> DataFrame:
    from pyspark.sql import functions as F

    waiting = rows.select(
        "channel",
        F.explode(F.sequence(_window("c_us", window_us),
                             _window("coalesce(f_us, s_us)", window_us))).alias("k"),
    ).distinct()
    delivered = (rows.where(F.col("f_us").isNotNull())
                 .groupBy("channel", _window("f_us", window_us).alias("k"))
                 .agg(F.count(F.lit(1)).alias("x")))
    per_window = (waiting.join(delivered, ["channel", "k"], "left")
                  .select("k", F.coalesce("x", F.lit(0)).cast("long").alias("x"))
                  .groupBy("k")
                  .agg(F.count(F.lit(1)).alias("channels"), F.sum("x").alias("deliveries"),
                       F.sum(F.col("x") * F.col("x")).alias("_sumsq")))
    return per_window.select(
        F.timestamp_micros(F.col("k") * window_us).alias("window_start"),
        F.timestamp_micros((F.col("k") + 1) * window_us).alias("window_end"),
        "channels", "deliveries",
        F.when(F.col("_sumsq") > 0,
               F.col("deliveries") * F.col("deliveries") / (F.col("channels") * F.col("_sumsq")))
        .alias("jain_index"),
    )


def compute(history: DataFrame, *,
            window: timedelta = timedelta(minutes=1)) -> dict[str, DataFrame]:
    """The report's tables (see :data:`TABLES`; unsorted, see :data:`ORDER`) from a
    DataFrame with the columns of ``fairq.message_history``. Each table reads
    ``history`` again: cache it first when it comes from the database (``main`` does)."""
    from pyspark.sql import functions as F

    window_us = window // timedelta(microseconds=1)
    if window_us <= 0:
        raise ValueError("window must be positive")
    rows = _prepared(history)
    fairness = _fairness(rows, window_us).cache()  # the summary aggregates it too
    jain = fairness.agg(F.avg("jain_index").alias("jain_mean"),
                        F.min("jain_index").alias("jain_min"),
                        F.count(F.lit(1)).alias("windows"))
    summary = _finish(rows.agg(
        F.timestamp_micros(F.min("s_us")).alias("first_settled_at"),
        F.timestamp_micros(F.max("s_us")).alias("last_settled_at"),
        F.countDistinct("channel").alias("channels"),
        *_figures()))
    channels = _finish(rows.groupBy("channel").agg(*_figures()))
    hours = _finish(rows.groupBy("hour_us").agg(F.countDistinct("channel").alias("channels"),
                                                *_figures()))
    hours = hours.select(F.timestamp_micros("hour_us").alias("hour"),
                         *[c for c in hours.columns if c != "hour_us"])

    def count(outcome: str) -> Column:
        return F.sum(F.when(F.col("outcome") == outcome, 1).otherwise(0)).cast("long")

    channel_hours = (rows.groupBy("hour_us", "channel")
                     .agg(F.count(F.lit(1)).alias("settled"), count("completed").alias("completed"),
                          count("dead").alias("dead"), count("cancelled").alias("cancelled"))
                     .select(F.timestamp_micros("hour_us").alias("hour"), "channel", "settled",
                             "completed", "dead", "cancelled"))
    attempts = rows.groupBy("channel", "num_attempts").agg(F.count(F.lit(1)).alias("messages"))
    return {"summary": summary.crossJoin(jain), "channels": channels, "hours": hours,
            "channel_hours": channel_hours, "attempts": attempts, "fairness": fairness}


# -- writing --------------------------------------------------------------------------


def _csv_rows(df: DataFrame) -> Iterator[list[Any]]:
    """Rows of ``df`` for CSV: timestamps as ISO 8601 UTC (taken as epoch microseconds,
    so neither the session's nor Python's local time zone matters)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    stamps = [f.name for f in df.schema.fields if isinstance(f.dataType, T.TimestampType)]
    plain = df.select(*[F.unix_micros(F.col(c)).alias(c) if c in stamps else F.col(c)
                        for c in df.columns])
    for row in plain.toLocalIterator():
        yield [_iso(v) if c in stamps else v for c, v in zip(df.columns, row, strict=True)]


def _iso(micros: int | None) -> str | None:
    if micros is None:
        return None
    return (_EPOCH + timedelta(microseconds=micros)).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class _Collected:
    columns: list[str]
    rows: list[list[Any]]

    def column(self, name: str) -> list[Any]:
        i = self.columns.index(name)
        return [r[i] for r in self.rows]


def _collect(df: DataFrame, limit: int | None = None) -> _Collected:
    return _Collected(df.columns, list(_csv_rows(df if limit is None else df.limit(limit))))


def _charts(out: Path, tables: dict[str, DataFrame], top: int) -> list[tuple[str, str]]:
    """Draws the PNG charts; returns (file name, caption) pairs."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from pyspark.sql import functions as F

    charts: list[tuple[str, str]] = []
    hours = _collect(tables["hours"])
    busiest = _collect(tables["channels"].orderBy(F.desc("settled"), "channel"), top)
    attempts = _collect(tables["attempts"].groupBy("num_attempts")
                        .agg(F.sum("messages").alias("messages")).orderBy("num_attempts"))
    fairness = _collect(tables["fairness"])

    def times(data: _Collected, name: str) -> list[Any]:  # matplotlib takes datetimes
        return [datetime.fromisoformat(v.replace("Z", "+00:00")) for v in data.column(name)]

    def save(fig: Any, name: str, caption: str) -> None:
        fig.tight_layout()
        fig.savefig(out / "charts" / name, dpi=100)
        plt.close(fig)
        charts.append((f"charts/{name}", caption))

    def empty(ax: Any) -> None:
        ax.text(0.5, 0.5, "no history", ha="center", va="center", transform=ax.transAxes)

    fig, ax = plt.subplots(figsize=(9, 4))
    if hours.rows:
        at = times(hours, "hour")
        bottom = [0] * len(at)
        for outcome in ("completed", "dead", "cancelled"):
            values = hours.column(outcome)
            ax.bar(at, values, width=1 / 24 * 0.9, bottom=bottom, label=outcome, align="edge")
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.legend()
        fig.autofmt_xdate()
    else:
        empty(ax)
    ax.set(title="Throughput per hour (settled messages)", ylabel="messages")
    save(fig, "throughput.png", "Throughput per hour, by outcome")

    for key, title in (("wait", "Wait time (created → first dequeued)"),
                       ("proc", "Processing time (first dequeued → settled)")):
        fig, ax = plt.subplots(figsize=(9, 4))
        if hours.rows:
            at = times(hours, "hour")
            for p in PERCENTILES:
                name = f"{key}_p{round(p * 100)}_ms"
                ax.plot(at, hours.column(name), marker="o", label=name)
            ax.legend()
            fig.autofmt_xdate()
        else:
            empty(ax)
        ax.set(title=f"{title} per hour", ylabel="ms")
        save(fig, f"{key}_time.png", f"{title}: p50, p95, p99 per hour")

    fig, ax = plt.subplots(figsize=(9, 4))
    if attempts.rows:
        ax.bar([str(n) for n in attempts.column("num_attempts")], attempts.column("messages"))
    else:
        empty(ax)
    ax.set(title="Attempts distribution", xlabel="num_attempts at settlement", ylabel="messages")
    save(fig, "attempts.png", "How many attempts messages took")

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, max(3.0, 0.25 * len(busiest.rows) + 1)))
    if busiest.rows:
        names = busiest.column("channel")[::-1]
        left.barh(names, busiest.column("settled")[::-1])
        right.barh(names, [r or 0 for r in busiest.column("dead_letter_rate")[::-1]])
        right.set_xlim(0, 1)
    else:
        empty(left)
        empty(right)
    left.set(title=f"Throughput of the busiest channels (top {top})",
             xlabel="settled messages")
    right.set(title="Dead-letter rate", xlabel="dead / (completed + dead)")
    save(fig, "channels.png", f"The {top} busiest channels: throughput and dead-letter rate")

    fig, ax = plt.subplots(figsize=(9, 4))
    if fairness.rows:
        ax.plot(times(fairness, "window_start"), fairness.column("jain_index"), marker=".")
        ax.set_ylim(0, 1.05)
        fig.autofmt_xdate()
    else:
        empty(ax)
    ax.set(title="Jain's fairness index per window", ylabel="index (1 = fair)")
    save(fig, "fairness.png", "Jain's fairness index over the waiting channels of each window")
    return charts


def _html_table(data: _Collected) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in data.columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>"
        for row in data.rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_report(tables: dict[str, DataFrame], out: Path, *, title: str = "fairq report",
                 top: int = 20, note: str = "") -> Path:
    """Writes Parquet, CSV, charts and index.html under ``out``; returns index.html.

    Each table is computed once, into one sorted Parquet file; the CSV files and the
    charts are made from those files."""
    (out / "csv").mkdir(parents=True, exist_ok=True)
    (out / "charts").mkdir(parents=True, exist_ok=True)
    written: dict[str, DataFrame] = {}
    for name in TABLES:
        df, path = tables[name], str(out / "parquet" / name)
        one = df.coalesce(1)
        if ORDER[name]:
            one = one.sortWithinPartitions(*ORDER[name])
        one.write.mode("overwrite").parquet(path)
        written[name] = df.sparkSession.read.parquet(path)
        with open(out / "csv" / f"{name}.csv", "w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(df.columns)
            writer.writerows(_csv_rows(written[name]))
    tables = written
    charts = _charts(out, tables, top)
    summary = _collect(tables["summary"])
    transposed = _Collected(["figure", "value"],
                            [[c, v] for c, v in zip(summary.columns, summary.rows[0], strict=True)]
                            if summary.rows else [])
    links = "".join(
        f'<li><b>{name}</b> — {html.escape(_DESCRIPTIONS[name])}: '
        f'<a href="csv/{name}.csv">CSV</a>, <a href="parquet/{name}/">Parquet</a></li>'
        for name in TABLES)
    figures = "".join(
        f'<figure><img src="{src}" alt="{html.escape(caption)}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        for src, caption in charts)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1000px}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}
figure{{margin:1em 0}}img{{max-width:100%}}</style></head>
<body><h1>{html.escape(title)}</h1>
<p>{html.escape(note)}</p>
<p>Times in milliseconds; hours and windows in UTC. Wait time: created → first dequeued.
Processing time: first dequeued → settled (completed and dead messages). Dead-letter rate:
dead / (completed + dead). Jain's index: (Σx)² / (n·Σx²) over the channels waiting in a
window, x = their first deliveries in it.</p>
<h2>Summary</h2>{_html_table(transposed)}
<h2>Tables</h2><ul>{links}</ul>
<h2>Charts</h2>{figures}
</body></html>
"""
    index = out / "index.html"
    index.write_text(page, encoding="utf-8")
    return index


# -- the command ----------------------------------------------------------------------

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """An ISO 8601 instant (naive = UTC) or a duration back from now: ``90m``, ``24h``,
    ``7d``, ``2w``."""
    match = _RELATIVE.match(text.strip())
    if match:
        now = now or datetime.now(timezone.utc)
        return now - timedelta(**{_UNITS[match[2]]: float(match[1])})
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 time or a duration like 24h: {text!r}") from None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def _positive_seconds(text: str) -> timedelta:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return timedelta(seconds=value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fairq report",
        description="Spark report of fairq.message_history: throughput, wait and processing "
                    "times, attempts, dead-letter rate and fairness, as Parquet, CSV, PNG "
                    "charts and index.html.")
    parser.add_argument("--dsn", default=os.environ.get("DATABASE_URL"),
                        help="PostgreSQL conninfo or URL, reachable over TCP "
                             "(default: $DATABASE_URL)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--since", type=parse_since,
                        help="only history settled at or after this ISO 8601 time, "
                             "or this long ago (24h, 7d)")
    parser.add_argument("--window", type=_positive_seconds, default=timedelta(minutes=1),
                        metavar="SECONDS", help="fairness window (default: 60)")
    parser.add_argument("--top", type=int, default=20,
                        help="channels shown in the per-channel chart (default: 20)")
    parser.add_argument("--partitions", type=int, default=None,
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
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if not args.dsn:
        parser.print_usage(sys.stderr)
        print("fairq report: error: --dsn (or $DATABASE_URL) is required", file=sys.stderr)
        return EXIT_USAGE
    if args.top < 1:
        print("fairq report: error: --top must be at least 1", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
