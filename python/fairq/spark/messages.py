"""DataFrame rows as fairq messages: the projection that every writer reads, and the
call that creates a chunk of those rows' messages (on an executor)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from fairq.types import CreateStatus

if TYPE_CHECKING:
    import psycopg
    from pyspark.sql import Column, DataFrame

DEFAULT_QUEUE = "default"

#: The columns of :func:`project`'s rows, in order.
MESSAGE_COLUMNS = ("channel", "content", "dequeue_at_us", "priority", "dedup_key")

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def column(value: str | Column) -> Column:
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
    named = [column(c).alias(c if isinstance(c, str) else f"c{i}")
             for i, c in enumerate(columns)]
    digest = F.sha2(F.to_json(F.struct(*named)), 256)
    return F.concat(F.lit(prefix), digest) if prefix else digest


def _content_bytes(df: DataFrame, content: str | Column) -> Column:
    """``content`` as a binary column: bytes as they are, strings in UTF-8, structs,
    maps and arrays as JSON (Spark's ``to_json``: compact, NULL fields left out)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    value = column(content)
    kind = df.select(value).schema.fields[0].dataType
    if isinstance(kind, T.BinaryType):
        return value
    if isinstance(kind, T.StringType):
        return F.encode(value, "UTF-8")
    if isinstance(kind, (T.StructType, T.MapType, T.ArrayType)):
        return F.encode(F.to_json(value), "UTF-8")
    raise TypeError(f"content must be binary, string, struct, map or array, not {kind}"
                    " (serialise it first, e.g. with to_json or cast('string'))")


def _micros(value: Column) -> Column:
    """A point in time as microseconds since the epoch (timestamps carry their own
    instant; other types are cast to timestamp in the session's time zone)."""
    from pyspark.sql import functions as F

    return F.unix_micros(value.cast("timestamp"))


def project(df: DataFrame, channel: str | Column, content: str | Column,
            dequeue_at: str | Column | None, priority: str | Column | None,
            dedup_key: str | Column | None) -> DataFrame:
    """The rows :func:`create_messages` sends, in :data:`MESSAGE_COLUMNS`: channel,
    content bytes, dequeue_at in epoch microseconds, priority and dedup_key."""
    from pyspark.sql import functions as F

    none = F.lit(None)
    return df.select(
        column(channel).cast("string").alias("channel"),
        _content_bytes(df, content).alias("content"),
        (none.cast("long") if dequeue_at is None else _micros(column(dequeue_at)))
        .alias("dequeue_at_us"),
        (none if priority is None else column(priority)).cast("int").alias("priority"),
        (none if dedup_key is None else column(dedup_key)).cast("string").alias("dedup_key"),
    )


def chunks(rows: Iterable[Any], size: int) -> Iterator[list[Any]]:
    it = iter(rows)
    while batch := list(itertools.islice(it, size)):
        yield batch


def _create_batch_query(queue: str) -> str:
    # fairq 0.6.0's message_create_batch has no p_queue: naming it only for another
    # queue keeps the default queue's call valid there and on versions with queues.
    in_queue = "" if queue == DEFAULT_QUEUE else ", p_queue => %(queue)s::text"
    return ("SELECT status, count(*) FROM fairq.message_create_batch("
            "p_channels => %(channels)b::text[], p_contents => %(contents)b::bytea[],"
            " p_dequeue_ats => %(dequeue_ats)b::timestamptz[],"
            " p_priorities => %(priorities)b::int[], p_dedup_keys => %(dedup_keys)b::text[]"
            f"{in_queue}) GROUP BY status")


def create_messages(conn: psycopg.Connection[Any], rows: Sequence[Sequence[Any]],
                    queue: str) -> Counter[CreateStatus]:
    """Creates the messages of ``rows`` (:func:`project`'s, or longer: the columns after
    :data:`MESSAGE_COLUMNS` are ignored) in ``queue`` with one call of
    ``fairq.message_create_batch`` on ``conn``, and counts them by status. NULL
    dequeue_at and priority elements mean the SQL's defaults (now, 0)."""
    params = {
        "channels": [row[0] for row in rows],
        "contents": [bytes(row[1]) for row in rows],
        "dequeue_ats": [None if row[2] is None else _EPOCH + timedelta(microseconds=row[2])
                        for row in rows],
        "priorities": [row[3] for row in rows],
        "dedup_keys": [row[4] for row in rows],
        "queue": queue,
    }
    with conn.cursor() as cur:
        found = cur.execute(_create_batch_query(queue), params).fetchall()
    return Counter({CreateStatus(status): count for status, count in found})


def has_named_queues(conn: psycopg.Connection[Any]) -> bool:
    """Whether the database's fairq creates messages in named queues (0.7.0 and later:
    ``fairq.message_create_batch`` takes ``p_queue``)."""
    row = conn.execute(
        "SELECT EXISTS (SELECT FROM pg_proc WHERE pronamespace = 'fairq'::regnamespace"
        " AND proname = 'message_create_batch' AND 'p_queue' = ANY (proargnames))").fetchone()
    return bool(row and row[0])


def require_queue(conn: psycopg.Connection[Any], queue: str) -> None:
    """Raises before anything is written if ``queue`` is not the default queue and the
    database's fairq has no named queues (rather than failing every task)."""
    if queue != DEFAULT_QUEUE and not has_named_queues(conn):
        raise RuntimeError(f"queue={queue!r}: the installed fairq has no named queues"
                           " (fairq.message_create_batch takes no p_queue); upgrade it,"
                           " or use the default queue")
