"""Enqueueing a DataFrame: one fairq message per row, written partition by partition."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from fairq.spark.messages import (
    DEFAULT_QUEUE,
    InvalidRows,
    Tally,
    chunks,
    connect,
    create_messages,
    project,
    require_named_queues,
    require_queue_name,
)

if TYPE_CHECKING:
    from pyspark.accumulators import Accumulator
    from pyspark.sql import Column, DataFrame


@dataclass(frozen=True)
class EnqueueResult:
    """What an :func:`enqueue` did, row by row: ``created`` + ``duplicate`` +
    ``dropped`` + ``invalid`` is the number of rows of the DataFrame.

    ``duplicate`` counts rows whose (channel, dedup key) message already existed,
    including rows that a failed attempt of a retried task had already enqueued;
    ``dropped`` counts rows refused because their channel was at ``max_size``;
    ``invalid`` rows left out because fairq refuses their fields (with
    ``invalid_rows="skip"``; otherwise such a row fails the job).
    """

    created: int
    duplicate: int
    dropped: int
    invalid: int = 0

    @property
    def rows(self) -> int:
        return self.created + self.duplicate + self.dropped + self.invalid


def _write_partition(rows: Iterable[Any], *, dsn: str, queue: str, batch_size: int,
                     invalid_rows: InvalidRows,
                     counters: tuple[Accumulator[int], Accumulator[int], Accumulator[int],
                                     Accumulator[int]],
                     ) -> None:
    """Runs on an executor: sends the partition's rows in batches on one connection.

    Each batch is its own transaction, so a failure later in the partition keeps the
    batches before it; the task's rerun finds them again as duplicates (with dedup
    keys). Spark applies the accumulator updates of one successful attempt only.
    """

    batches = chunks(rows, batch_size)
    first = next(batches, None)
    if first is None:  # an empty partition opens no connection
        return
    tally = Tally()
    with connect(dsn) as conn:
        for batch in itertools.chain([first], batches):
            tally += create_messages(conn, batch, queue, invalid_rows)
    created, duplicate, dropped, invalid = counters
    created.add(tally.created)
    duplicate.add(tally.duplicate)
    dropped.add(tally.dropped)
    invalid.add(tally.invalid)


def enqueue(df: DataFrame, dsn: str, *, channel: str | Column, content: str | Column,
            dequeue_at: str | Column | None = None, priority: str | Column | None = None,
            dedup_key: str | Column | None = None, queue: str = DEFAULT_QUEUE,
            batch_size: int = 1000,
            invalid_rows: InvalidRows | str = InvalidRows.FAIL) -> EnqueueResult:
    """Creates one fairq message per row of ``df`` in ``queue`` and reports what happened.

    Each field is a column name or a Column expression: ``channel`` (string),
    ``content`` (binary; strings are sent as UTF-8, structs/maps/arrays as JSON),
    ``dequeue_at`` (timestamp; NULL or omitted: now), ``priority`` (int; NULL or
    omitted: 0) and ``dedup_key`` (string; see :func:`dedup_key_from`). A row whose
    fields fairq refuses (a NULL channel or content, an empty or over-long channel
    name, ...: SQLSTATE class 22) fails the job, or with ``invalid_rows="skip"`` is left
    out, counted in ``invalid`` and logged on its executor (logger ``fairq.spark``).
    An invalid ``queue`` name raises before any row is sent.

    The database's fairq must have named queues (0.7.0 and later); on an older one
    this raises RuntimeError before any row is sent.

    ``dsn`` is a libpq conninfo or URL that the executors can reach. Each partition
    opens one connection and calls ``fairq.message_create_batch`` per ``batch_size``
    rows (one transaction each). Without ``dedup_key``, a task that Spark retries
    may enqueue its partition's rows again (see the package's documentation).
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    invalid_rows = InvalidRows(invalid_rows)
    require_queue_name(queue)

    with connect(dsn) as conn:
        require_named_queues(conn)
    sc = df.sparkSession.sparkContext
    counters = (sc.accumulator(0), sc.accumulator(0), sc.accumulator(0), sc.accumulator(0))
    project(df, channel, content, dequeue_at, priority, dedup_key).foreachPartition(
        partial(_write_partition, dsn=dsn, queue=queue, batch_size=batch_size,
                invalid_rows=invalid_rows, counters=counters))
    return EnqueueResult(*(counter.value for counter in counters))
