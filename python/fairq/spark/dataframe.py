"""Enqueueing a DataFrame: one fairq message per row, written partition by partition."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.accumulators import Accumulator
    from pyspark.sql import Column, DataFrame

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class EnqueueResult:
    """What an :func:`enqueue` did, row by row: ``created`` + ``duplicate`` +
    ``dropped`` is the number of rows of the DataFrame.

    ``duplicate`` counts rows whose (channel, dedup key) message already existed,
    including rows that a failed attempt of a retried task had already enqueued;
    ``dropped`` counts rows refused because their channel was at ``max_size``.
    """

    created: int
    duplicate: int
    dropped: int

    @property
    def rows(self) -> int:
        return self.created + self.duplicate + self.dropped


def _column(value: str | Column) -> Column:
    from pyspark.sql import functions as F

    return F.col(value) if isinstance(value, str) else value


def dedup_key_from(*columns: str | Column, prefix: str = "") -> Column:
    """A deterministic dedup key computed from ``columns``: ``prefix`` followed by the
    SHA-256 (hex) of the JSON object of their values. Equal values give equal keys on
    every run and every retry; NULLs are told apart from empty strings. Keys are
    ``len(prefix) + 64`` characters (fairq accepts up to 1024 bytes)."""
    from pyspark.sql import functions as F

    if not columns:
        raise ValueError("dedup_key_from needs at least one column")
    named = [_column(c).alias(c if isinstance(c, str) else f"c{i}")
             for i, c in enumerate(columns)]
    digest = F.sha2(F.to_json(F.struct(*named)), 256)
    return F.concat(F.lit(prefix), digest) if prefix else digest


def _content_bytes(df: DataFrame, content: str | Column) -> Column:
    """``content`` as a binary column: bytes as they are, strings in UTF-8, structs,
    maps and arrays as JSON (Spark's ``to_json``: compact, NULL fields left out)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    column = _column(content)
    kind = df.select(column).schema.fields[0].dataType
    if isinstance(kind, T.BinaryType):
        return column
    if isinstance(kind, T.StringType):
        return F.encode(column, "UTF-8")
    if isinstance(kind, (T.StructType, T.MapType, T.ArrayType)):
        return F.encode(F.to_json(column), "UTF-8")
    raise TypeError(f"content must be binary, string, struct, map or array, not {kind}"
                    " (serialise it first, e.g. with to_json or cast('string'))")


def _micros(column: Column) -> Column:
    """A point in time as microseconds since the epoch (timestamps carry their own
    instant; other types are cast to timestamp in the session's time zone)."""
    from pyspark.sql import functions as F

    return F.unix_micros(column.cast("timestamp"))


def _chunks(rows: Iterable[Any], size: int) -> Iterator[list[Any]]:
    it = iter(rows)
    while batch := list(itertools.islice(it, size)):
        yield batch


def _write_partition(rows: Iterable[Any], *, dsn: str, batch_size: int,
                     counters: tuple[Accumulator[int], Accumulator[int], Accumulator[int]],
                     ) -> None:
    """Runs on an executor: sends the partition's rows in batches on one connection.

    Each batch is its own transaction, so a failure later in the partition keeps the
    batches before it; the task's rerun finds them again as duplicates (with dedup
    keys). Spark applies the accumulator updates of one successful attempt only.
    """
    import psycopg

    from fairq import _sql
    from fairq.codecs import BytesCodec
    from fairq.types import CreateStatus, NewMessage

    batches = _chunks(rows, batch_size)
    first = next(batches, None)
    if first is None:  # an empty partition opens no connection
        return
    codec = BytesCodec()
    tally = dict.fromkeys(CreateStatus, 0)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for batch in itertools.chain([first], batches):
            messages = [
                NewMessage(channel, bytes(content),
                           dequeue_at=None if at is None else _EPOCH + timedelta(microseconds=at),
                           priority=0 if priority is None else priority, dedup_key=key)
                for channel, content, at, priority, key in batch]
            call = _sql.create_batch(messages, codec)
            with conn.cursor() as cur:
                results = call.decode(cur.execute(call.query, call.params).fetchall())
            for result in results:
                tally[result.status] += 1
    created, duplicate, dropped = counters
    created.add(tally[CreateStatus.CREATED])
    duplicate.add(tally[CreateStatus.DUPLICATE])
    dropped.add(tally[CreateStatus.DROPPED])


def enqueue(df: DataFrame, dsn: str, *, channel: str | Column, content: str | Column,
            dequeue_at: str | Column | None = None, priority: str | Column | None = None,
            dedup_key: str | Column | None = None, batch_size: int = 1000) -> EnqueueResult:
    """Creates one fairq message per row of ``df`` and reports what happened.

    Each field is a column name or a Column expression: ``channel`` (string),
    ``content`` (binary; strings are sent as UTF-8, structs/maps/arrays as JSON),
    ``dequeue_at`` (timestamp; NULL or omitted: now), ``priority`` (int; NULL or
    omitted: 0) and ``dedup_key`` (string; see :func:`dedup_key_from`). A NULL channel
    or content fails the job with fairq's SQLSTATE 22004 error.

    ``dsn`` is a libpq conninfo or URL that the executors can reach. Each partition
    opens one connection and calls ``fairq.message_create_batch`` per ``batch_size``
    rows (one transaction each). Without ``dedup_key``, a task that Spark retries
    may enqueue its partition's rows again (see the module's documentation).
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    sc = df.sparkSession.sparkContext
    counters = (sc.accumulator(0), sc.accumulator(0), sc.accumulator(0))
    _project(df, channel, content, dequeue_at, priority, dedup_key).foreachPartition(
        partial(_write_partition, dsn=dsn, batch_size=batch_size, counters=counters))
    return EnqueueResult(counters[0].value, counters[1].value, counters[2].value)


def _project(df: DataFrame, channel: str | Column, content: str | Column,
             dequeue_at: str | Column | None, priority: str | Column | None,
             dedup_key: str | Column | None) -> DataFrame:
    """The rows :func:`_write_partition` reads: (channel, content bytes, dequeue_at in
    epoch microseconds, priority, dedup_key)."""
    from pyspark.sql import functions as F

    none = F.lit(None)
    return df.select(
        _column(channel).cast("string").alias("channel"),
        _content_bytes(df, content).alias("content"),
        (none.cast("long") if dequeue_at is None else _micros(_column(dequeue_at)))
        .alias("dequeue_at_us"),
        (none if priority is None else _column(priority)).cast("int").alias("priority"),
        (none if dedup_key is None else _column(dedup_key)).cast("string").alias("dedup_key"),
    )
