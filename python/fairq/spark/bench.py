"""The throughput of enqueueing a DataFrame (``fairq bench --spark``)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from fairq.spark.dataframe import enqueue
from fairq.spark.messages import project

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


def bench_enqueue(spark: SparkSession, dsn: str, rows: int, *, channels: int = 1000,
                  batch_size: int = 1000, partitions: int | None = None) -> float:
    """Enqueues ``rows`` generated rows (JSON content, ``channels`` tenants, a dedup key
    each) into the database at ``dsn`` and returns rows per second.

    The rows land as real messages (channels ``bench-spark-<n>``): use a throwaway
    database. ``spark``: e.g. ``local_session("local[2]")``. The figure covers
    generating, shipping and creating the messages, not Spark's warm-up: the Python
    workers are started beforehand, and up to 20,000 rows go through the same
    generation and projection into the Python workers first (untimed, nothing sent to
    the database), so the JVM has compiled that code, as in a long-running job.
    """
    from pyspark.sql import functions as F

    sc = spark.sparkContext
    parts = partitions or sc.defaultParallelism

    def frame(count: int) -> DataFrame:
        run = f"{time.time_ns():x}"
        return spark.range(0, count, numPartitions=parts).select(
            F.concat(F.lit("bench-spark-"), (F.col("id") % channels).cast("string"))
            .alias("tenant"),
            F.struct(F.col("id").alias("job"), F.lit("x" * 32).alias("payload")).alias("body"),
            F.concat(F.lit(f"bench-{run}-"), F.col("id").cast("string")).alias("key"))

    fields = {"channel": "tenant", "content": "body", "dedup_key": "key"}
    # Start (and keep, spark.python.worker.reuse) one Python worker per core first.
    sc.parallelize(range(parts), parts).foreachPartition(_warm_up)
    project(frame(min(rows, 20_000)), dequeue_at=None, priority=None,
             **fields).foreachPartition(_warm_up)
    timed = frame(rows)
    started = time.perf_counter()
    result = enqueue(timed, dsn, batch_size=batch_size, **fields)
    elapsed = time.perf_counter() - started
    if result.created != rows:
        raise RuntimeError(f"created {result.created} of {rows} rows")
    return rows / elapsed


def _warm_up(rows: Iterable[Any]) -> None:
    """Runs on an executor: loads what _write_partition imports and reads every row."""
    import psycopg  # noqa: F401

    import fairq.spark.messages  # noqa: F401

    for _ in rows:
        pass
