"""The report's tables, computed by Spark from a DataFrame of ``fairq.message_history``
(definitions: see :mod:`fairq.report`)."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from fairq.types import HistoryOutcome

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

__all__ = ["CHANNEL", "ORDER", "OUTCOMES", "PERCENTILES", "TABLES", "compute"]


HOUR_US = 3_600_000_000
PERCENTILES = (0.5, 0.95, 0.99)
#: The outcomes the tables count, one column each: completed, dead, cancelled.
OUTCOMES = tuple(outcome.value for outcome in HistoryOutcome)


#: The report's tables, in the order index.html lists them.
TABLES = ("summary", "channels", "hours", "channel_hours", "attempts", "fairness")
#: How each table's files are sorted.
ORDER = {"summary": (), "channels": ("queue", "channel"), "hours": ("hour",),
         "channel_hours": ("hour", "queue", "channel"),
         "attempts": ("queue", "channel", "num_attempts"), "fairness": ("window_start", "queue")}
#: A channel is a name within a queue: two queues' channels of one name are two channels.
CHANNEL = ("queue", "channel")


def _prepared(history: DataFrame) -> DataFrame:
    """History rows with instants as epoch microseconds and the two durations."""
    from pyspark.sql import functions as F

    c, f, s = (F.unix_micros(F.col(n)) for n in ("created_at", "first_dequeued_at", "settled_at"))
    judged = F.col("outcome").isin(HistoryOutcome.COMPLETED.value, HistoryOutcome.DEAD.value)
    return history.select(
        "id", *CHANNEL, "num_attempts", "outcome",
        c.alias("c_us"), f.alias("f_us"), s.alias("s_us"),
        ((f - c) / 1000.0).alias("wait_ms"),
        F.when(judged, (s - f) / 1000.0).alias("proc_ms"),
        (s - F.pmod(s, F.lit(HOUR_US))).alias("hour_us"),
    )


def _window(micros: str, window_us: int) -> Column:
    """The index of the window holding an instant (integer arithmetic: exact)."""
    from pyspark.sql import functions as F

    return F.expr(f"({micros} - pmod({micros}, {window_us})) div {window_us}")


def _outcome_counts() -> list[Column]:
    """How many rows had each outcome: one column per outcome, named after it."""
    from pyspark.sql import functions as F

    return [F.coalesce(F.sum(F.when(F.col("outcome") == outcome, 1).otherwise(0)), F.lit(0))
            .cast("long").alias(outcome)  # (0, not NULL, over no rows)
            for outcome in OUTCOMES]


def _figures() -> list[Column]:
    """The aggregate columns shared by summary, channels and hours."""
    from pyspark.sql import functions as F

    pct = ", ".join(str(p) for p in PERCENTILES)
    return [
        F.count(F.lit(1)).alias("settled"),
        *_outcome_counts(),
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


def _waiting(rows: DataFrame, window_us: int) -> DataFrame:
    """(queue, channel, k): the windows in which the channel had a message waiting, from
    the window of the first delivery in the history on (before it nothing was served:
    a message scheduled years ahead made years of windows). A message waits from its
    creation to its first dequeue (or its settling without one); each channel's
    overlapping waits are merged before they are spread over windows, so the rows made
    are the table's, not one per message and window."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    start = rows.agg(F.min(F.coalesce("f_us", "s_us")).alias("start_us"))
    waits = rows.crossJoin(start).select(
        *CHANNEL,
        F.greatest(_window("c_us", window_us), _window("start_us", window_us)).alias("a"),
        _window("coalesce(f_us, s_us)", window_us).alias("b")).where("a <= b")
    earlier = (Window.partitionBy(*CHANNEL).orderBy("a", "b")
               .rowsBetween(Window.unboundedPreceding, -1))
    # A wait that starts after every earlier one of its channel ended starts an island
    # of merged waits; the islands are numbered by a running count of such starts.
    fresh = F.coalesce(F.col("a") > F.max("b").over(earlier), F.lit(True))
    numbered = (waits.withColumn("fresh", fresh.cast("int"))
                .withColumn("island", F.sum("fresh").over(earlier.rowsBetween(
                    Window.unboundedPreceding, Window.currentRow))))
    islands = numbered.groupBy(*CHANNEL, "island").agg(F.min("a").alias("a"),
                                                        F.max("b").alias("b"))
    return islands.select(*CHANNEL, F.explode(F.sequence("a", "b")).alias("k"))


def _fairness(rows: DataFrame, window_us: int) -> DataFrame:
    from pyspark.sql import functions as F

    waiting = _waiting(rows, window_us)
    delivered = (rows.where(F.col("f_us").isNotNull())
                 .groupBy(*CHANNEL, _window("f_us", window_us).alias("k"))
                 .agg(F.count(F.lit(1)).alias("x")))
    # Per queue: each queue is a round-robin of its own.
    per_window = (waiting.join(delivered, [*CHANNEL, "k"], "left")
                  .select("queue", "k", F.coalesce("x", F.lit(0)).cast("long").alias("x"))
                  .groupBy("queue", "k")
                  .agg(F.count(F.lit(1)).alias("channels"), F.sum("x").alias("deliveries"),
                       F.sum(F.col("x") * F.col("x")).alias("_sumsq")))
    return per_window.select(
        F.timestamp_micros(F.col("k") * window_us).alias("window_start"),
        F.timestamp_micros((F.col("k") + 1) * window_us).alias("window_end"),
        "queue", "channels", "deliveries",
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
        F.countDistinct(*CHANNEL).alias("channels"),
        *_figures()))
    channels = _finish(rows.groupBy(*CHANNEL).agg(*_figures()))
    hours = _finish(rows.groupBy("hour_us").agg(F.countDistinct(*CHANNEL).alias("channels"),
                                                *_figures()))
    hours = hours.select(F.timestamp_micros("hour_us").alias("hour"),
                         *[c for c in hours.columns if c != "hour_us"])
    channel_hours = (rows.groupBy("hour_us", *CHANNEL)
                     .agg(F.count(F.lit(1)).alias("settled"), *_outcome_counts())
                     .select(F.timestamp_micros("hour_us").alias("hour"), *CHANNEL, "settled",
                             *OUTCOMES))
    attempts = rows.groupBy(*CHANNEL, "num_attempts").agg(F.count(F.lit(1)).alias("messages"))
    return {"summary": summary.crossJoin(jain), "channels": channels, "hours": hours,
            "channel_hours": channel_hours, "attempts": attempts, "fairness": fairness}
