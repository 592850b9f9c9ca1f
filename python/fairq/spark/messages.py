"""DataFrame rows as fairq messages: the projection that every writer reads, and the
call that creates a chunk of those rows' messages (on an executor), through
:meth:`fairq.Queue.send_many`."""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from fairq import _pools
from fairq._source import with_connection_defaults
from fairq._sql import name_problem
from fairq.queue import Queue
from fairq.types import CreateStatus, NewMessage

if TYPE_CHECKING:
    import psycopg
    from pyspark.sql import Column, DataFrame

DEFAULT_QUEUE = "default"

log = logging.getLogger("fairq.spark")


class InvalidRows(enum.Enum):
    """What a writer does with a row whose fields fairq's limits refuse
    (:func:`row_problem`)."""

    FAIL = "fail"  # fairq refuses the chunk: the task fails, and with it the job
    SKIP = "skip"  # the row is left out, counted as invalid and logged


#: fairq's limit on dedup keys, in bytes of UTF-8 (sql/validate.sql; tests/test_spark.py
#: checks it against the SQL at the edges). Names: fairq._sql.MAX_NAME_BYTES.
MAX_DEDUP_KEY_BYTES = 1024


def row_problem(row: Sequence[Any]) -> str | None:
    """Why fairq would refuse the message of ``row`` (:func:`project`'s), or None.

    These are fairq's documented limits, checked before anything is sent: rows that
    break them are what ``invalid_rows="skip"`` leaves out. A chunk is still sent in
    one call, with no savepoint (in a stream's part, savepoints that commit would
    each hold a subtransaction until the part commits, and past 64 of them every
    snapshot on the server gets slower); whatever else the server refuses fails it.
    The row's own ``problem`` (:func:`project`'s checks) comes first."""
    channel, content, _, _, dedup_key, problem = row[:6]
    if problem is not None:
        return str(problem)
    problem = name_problem(channel)
    if problem is not None:
        return f"channel {problem}"
    if content is None:
        return "content is NULL"
    if dedup_key is not None:
        size = len(dedup_key.encode())
        if size > MAX_DEDUP_KEY_BYTES:
            return f"dedup_key must be at most {MAX_DEDUP_KEY_BYTES} bytes, got {size}"
        if "\x00" in dedup_key:
            return "dedup_key holds a NUL character (PostgreSQL text cannot)"
    return None


@dataclass(frozen=True)
class Tally:
    """Rows by outcome: fairq's three create statuses, and rows left out as invalid."""

    created: int = 0
    duplicate: int = 0
    dropped: int = 0
    invalid: int = 0

    def __add__(self, other: Tally) -> Tally:
        return Tally(self.created + other.created, self.duplicate + other.duplicate,
                     self.dropped + other.dropped, self.invalid + other.invalid)


#: The columns of :func:`project`'s rows, in order.
MESSAGE_COLUMNS = ("channel", "content", "dequeue_at_us", "priority", "dedup_key", "problem")

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MICROSECOND = timedelta(microseconds=1)
#: The instants a writer can send, in epoch microseconds: Python's datetime holds years
#: 1 to 9999 only, and Spark and PostgreSQL hold more (a task building a datetime of
#: year 20000 died with an OverflowError that named no row).
MIN_DEQUEUE_AT_US = (datetime.min.replace(tzinfo=timezone.utc) - _EPOCH) // _MICROSECOND
MAX_DEQUEUE_AT_US = (datetime.max.replace(tzinfo=timezone.utc) - _EPOCH) // _MICROSECOND
#: fairq's priorities are int4.
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1

#: How :func:`dedup_key_from` and JSON content write times: to the microsecond, in UTC,
#: whatever the session's time zone (Spark's defaults stop at the millisecond and use
#: the session's zone, so rows a microsecond apart got one key, and one row two keys
#: in two zones).
#: ``ignoreNullFields`` is pinned to Spark's default for the same reason: otherwise
#: spark.sql.jsonGenerator.ignoreNullFields decides, and a session that set it gave
#: a row with a NULL field another key and another content.
JSON_OPTIONS = {"timestampFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX",
                "timestampNTZFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSS",
                "timeZone": "UTC", "ignoreNullFields": "true"}


def column(value: str | Column) -> Column:
    from pyspark.sql import functions as F

    return F.col(value) if isinstance(value, str) else value


def dedup_key_from(*columns: str | Column, prefix: str = "") -> Column:
    """A deterministic dedup key computed from ``columns``: ``prefix`` followed by the
    SHA-256 (hex) of the JSON object of their values. Equal values give equal keys on
    every run and every retry; NULLs are told apart from empty strings. Keys are
    ``len(prefix) + 64`` characters (fairq accepts up to 1024 bytes). A column given by
    name is keyed under its name, a ``Column`` under its position: keep the call the
    same between runs (changing how it is written changes every key)."""
    from pyspark.sql import functions as F

    if not columns:
        raise ValueError("dedup_key_from needs at least one column")
    named = [column(c).alias(c if isinstance(c, str) else f"c{i}")
             for i, c in enumerate(columns)]
    digest = F.sha2(F.to_json(F.struct(*named), JSON_OPTIONS), 256)
    return F.concat(F.lit(prefix), digest) if prefix else digest


def _content_bytes(df: DataFrame, content: str | Column) -> Column:
    """``content`` as a binary column: bytes as they are, strings in UTF-8, structs,
    maps and arrays as JSON (Spark's ``to_json``: compact, NULL fields left out; times
    as :data:`JSON_OPTIONS` writes them)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    value = column(content)
    kind = _kind(df, value)
    if isinstance(kind, T.BinaryType):
        return value
    if isinstance(kind, T.StringType):
        return F.encode(value, "UTF-8")
    if isinstance(kind, (T.StructType, T.MapType, T.ArrayType)):
        return F.encode(F.to_json(value, JSON_OPTIONS), "UTF-8")
    raise TypeError(f"content must be binary, string, struct, map or array, not {kind}"
                    " (serialise it first, e.g. with to_json or cast('string'))")


def _kind(df: DataFrame, value: Column) -> Any:
    return df.select(value).schema.fields[0].dataType


def _channel(df: DataFrame, channel: str | Column) -> Column:
    """``channel`` as a string column: text types only (a binary name that is not UTF-8
    was decoded with U+FFFD, so two tenants' names became one channel; a struct
    became its display string)."""
    from pyspark.sql import types as T

    value = column(channel)
    kind = _kind(df, value)
    if not isinstance(kind, (T.StringType, T.CharType, T.VarcharType, T.NullType)):
        raise TypeError(f"channel must be a string column, not {kind}"
                        " (decode or format it first)")
    return value.cast("string")


def _priority(df: DataFrame, priority: str | Column) -> tuple[Column, Column]:
    """``priority`` as an int column, and the problem of a value outside int's range:
    integral types only (a double's 1.9 was cast to 1 without a word). The range is
    checked here, not by the cast: with spark.sql.ansi.enabled=false the cast wraps
    (2**32 + 5 became 5)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    value = column(priority)
    kind = _kind(df, value)
    if not isinstance(kind, (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.NullType)):
        raise TypeError(f"priority must be an integer column, not {kind}"
                        " (round or cast it first)")
    fits = value.between(MIN_PRIORITY, MAX_PRIORITY)
    problem = F.when(~fits, F.concat(F.lit("priority "), value.cast("string"),
                                     F.lit(" is outside int's range")))
    return F.when(fits, value.cast("int")), problem


def _timestamp(df: DataFrame, value: Column) -> Column:
    """A point in time as a timestamp column, NULL where a string is not one, whatever
    spark.sql.ansi.enabled says (the ANSI cast failed the task, the other gave NULL,
    which is "now"). Naive times (strings, timestamp_ntz, dates) are in the session's
    time zone."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    kind = _kind(df, value)
    if isinstance(kind, T.TimestampType):
        return value
    if isinstance(kind, (T.TimestampNTZType, T.DateType, T.NullType)):
        return value.cast(T.TimestampType())
    if isinstance(kind, (T.StringType, T.CharType, T.VarcharType)):
        # (Without a format, try_to_timestamp is the cast that gives NULL rather than
        # failing; its type follows spark.sql.timestampType.)
        return F.try_to_timestamp(value).cast(T.TimestampType())
    raise TypeError(f"dequeue_at must be a timestamp, date or string column, not {kind}"
                    " (for epoch numbers use timestamp_seconds or timestamp_millis)")


def _dequeue_at(df: DataFrame, dequeue_at: str | Column) -> tuple[Column, Column]:
    """``dequeue_at`` in epoch microseconds, and the problem of a value that is no time
    or that a writer cannot send (:data:`MIN_DEQUEUE_AT_US`)."""
    from pyspark.sql import functions as F

    value = column(dequeue_at)
    micros = F.unix_micros(_timestamp(df, value))
    problem = (F.when(value.isNotNull() & micros.isNull(),
                      F.concat(F.lit("dequeue_at is not a time: "), value.cast("string")))
               .when(~micros.between(MIN_DEQUEUE_AT_US, MAX_DEQUEUE_AT_US),
                     F.concat(F.lit("dequeue_at "), value.cast("string"),
                              F.lit(" is outside years 1 to 9999, which the writers"
                                    " (Python's datetime) cannot send"))))
    return micros, problem


def project(df: DataFrame, channel: str | Column, content: str | Column,
            dequeue_at: str | Column | None, priority: str | Column | None,
            dedup_key: str | Column | None) -> DataFrame:
    """The rows :func:`create_messages` sends, in :data:`MESSAGE_COLUMNS`: channel,
    content bytes, dequeue_at in epoch microseconds, priority, dedup_key, and why the
    row is invalid when a field's value is not what it must be (else NULL)."""
    from pyspark.sql import functions as F

    none = F.lit(None)
    dequeue_at_us, late = ((none.cast("long"), none) if dequeue_at is None
                           else _dequeue_at(df, dequeue_at))
    priority_int, out_of_range = ((none.cast("int"), none) if priority is None
                                  else _priority(df, priority))
    return df.select(
        _channel(df, channel).alias("channel"),
        _content_bytes(df, content).alias("content"),
        dequeue_at_us.alias("dequeue_at_us"),
        priority_int.alias("priority"),
        (none if dedup_key is None else column(dedup_key)).cast("string").alias("dedup_key"),
        F.coalesce(late, out_of_range).cast("string").alias("problem"),
    )


#: The content bytes one ``message_create_batch`` call carries, at most (a single larger
#: row goes alone): PostgreSQL refuses a protocol message over 1 GB by closing the
#: connection, so a chunk of ``batch_size`` large rows failed its task at every retry.
CHUNK_BYTES = 64 * 1024 * 1024


def chunks(rows: Iterable[Any], size: int, max_bytes: int = CHUNK_BYTES) -> Iterator[list[Any]]:
    """``rows`` (:func:`project`'s) in lists of at most ``size`` rows and, unless one
    row is larger alone, ``max_bytes`` of content."""
    batch: list[Any] = []
    content_bytes = 0
    for row in rows:
        row_bytes = 0 if row[1] is None else len(row[1])
        if batch and (len(batch) == size or content_bytes + row_bytes > max_bytes):
            yield batch
            batch, content_bytes = [], 0
        batch.append(row)
        content_bytes += row_bytes
    if batch:
        yield batch


#: Set on each writer's session besides :data:`fairq._pools.SESSION_SETUP`. A stream's
#: task writes its part in one transaction that holds the part's claim, and every other
#: attempt at that part waits for the claim (fairq.spark.stream). An executor lost with
#: its host or its network leaves that transaction open until the server finds the
#: connection dead: by default after the system's keepalive time, two hours on Linux,
#: all that time holding up the replay. These have the server probe a silent connection
#: after a minute and drop it after another minute of unanswered probes, which rolls
#: the transaction back and frees the claim. (Over a Unix socket they do nothing: no
#: peer there can vanish.)
WRITER_KEEPALIVES = ("SET tcp_keepalives_idle = 60; SET tcp_keepalives_interval = 10;"
                     " SET tcp_keepalives_count = 6")


def connect(dsn: str) -> psycopg.Connection[Any]:
    """An autocommit connection for the writers, in READ COMMITTED whatever the
    database's default (fairq's calls refuse any other isolation), with a connect
    timeout and keepalives on both ends (:data:`WRITER_KEEPALIVES`)."""
    import psycopg

    conn = psycopg.connect(with_connection_defaults(dsn), autocommit=True)
    conn.execute(_pools.SESSION_SETUP)
    conn.execute(WRITER_KEEPALIVES)
    return conn


def create_messages(conn: psycopg.Connection[Any], rows: Sequence[Sequence[Any]],
                    queue: str, invalid_rows: InvalidRows = InvalidRows.FAIL) -> Tally:
    """Creates the messages of ``rows`` (:func:`project`'s, or longer: the columns after
    :data:`MESSAGE_COLUMNS` are ignored) in ``queue`` with one call of
    ``fairq.message_create_batch`` on ``conn`` (joining any transaction open there), and
    counts them by outcome. A NULL dequeue_at means now, a NULL priority 0; a NULL
    content fails with SQLSTATE 22004, as the SQL would (the codec cannot carry it).

    With :attr:`InvalidRows.SKIP`, rows that :func:`row_problem` refuses are left out,
    counted as ``invalid`` and logged, and the others sent. Otherwise a row with a
    ``problem`` raises ValueError (the server cannot see it: the value it would get is
    not the row's), and the server judges the rest."""
    if invalid_rows is InvalidRows.SKIP:
        valid = []
        for row in rows:
            problem = row_problem(row)
            if problem is None:
                valid.append(row)
            else:
                log.warning("left out a row of channel %r: %s", row[0], problem)
        return (_create(conn, valid, queue) if valid else Tally()) + Tally(
            invalid=len(rows) - len(valid))
    for row in rows:
        if row[5] is not None:
            raise ValueError(f"a row of channel {row[0]!r}: {row[5]}")
    return _create(conn, rows, queue)


def _create(conn: psycopg.Connection[Any], rows: Sequence[Sequence[Any]], queue: str) -> Tally:
    from psycopg import errors

    for row in rows:
        if row[1] is None:
            raise errors.NullValueNotAllowed(
                f"content must not be NULL (a row of channel {row[0]!r})")
    messages = [
        NewMessage(row[0], bytes(row[1]),
                   dequeue_at=None if row[2] is None
                   else _EPOCH + timedelta(microseconds=row[2]),
                   priority=0 if row[3] is None else row[3], dedup_key=row[4])
        for row in rows]
    statuses = [result.status for result in Queue(conn, name=queue).send_many(messages, conn=conn)]
    return Tally(statuses.count(CreateStatus.CREATED), statuses.count(CreateStatus.DUPLICATE),
                 statuses.count(CreateStatus.DROPPED))


def require_queue_name(queue: str) -> None:
    """Raises ValueError before any row is sent if fairq would refuse ``queue``'s name
    (a fault of no row: never left out as invalid)."""
    problem = name_problem(queue)
    if problem is not None:
        raise ValueError(f"queue {problem}")


def has_named_queues(conn: psycopg.Connection[Any]) -> bool:
    """Whether the database's fairq has named queues (0.7.0 and later:
    ``fairq.message_create_batch`` takes ``p_queue``)."""
    row = conn.execute(
        "SELECT EXISTS (SELECT FROM pg_proc WHERE pronamespace = 'fairq'::regnamespace"
        " AND proname = 'message_create_batch' AND 'p_queue' = ANY (proargnames))").fetchone()
    return bool(row and row[0])


def require_named_queues(conn: psycopg.Connection[Any]) -> None:
    """Raises before anything is written if the database's fairq has no named queues,
    which every call of this package names (rather than failing every task)."""
    if not has_named_queues(conn):
        raise RuntimeError("the installed fairq has no named queues"
                           " (fairq.message_create_batch takes no p_queue): this fairq"
                           " package needs its SQL at 0.7.0 or later; upgrade it"
                           " (ALTER EXTENSION fairq UPDATE, or fairq upgrade)")
