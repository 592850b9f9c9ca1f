"""fairq from Apache Spark: enqueue a DataFrame, read the queue's tables into Spark.

``enqueue`` writes each partition of a DataFrame through ``fairq.message_create_batch``
(one psycopg connection per partition, one transaction per batch). ``read`` loads
``fairq.channels``, ``fairq.dead_letters`` or ``fairq.message_history`` through Spark's
JDBC source. Both need a classic (non-Connect) SparkSession; ``read`` needs the
PostgreSQL JDBC driver on Spark's classpath (``spark.jars``; on Debian the
``libpostgresql-jdbc-java`` package installs ``/usr/share/java/postgresql.jar``).

**Retries and exactly-once.** Spark re-runs a failed task from the start of its
partition, and a task may fail after some of its batches were committed. With a dedup
key per row, the rerun finds those rows still queued and reports them as
``duplicate``: every row is enqueued once. Without a dedup key, a retried task
enqueues the rows its failed attempt had already committed a second time. Derive a
deterministic key from the columns that identify a row with :func:`dedup_key_from`.
(A dedup key only guards while its message exists: a row whose message was already
completed by a worker when the retry runs is enqueued again.)
"""

from __future__ import annotations

import getpass
import itertools
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from psycopg.conninfo import conninfo_to_dict

if TYPE_CHECKING:
    from pyspark.accumulators import Accumulator
    from pyspark.sql import Column, DataFrame, SparkSession

__all__ = [
    "DEFAULT_JDBC_JAR",
    "EnqueueResult",
    "bench_enqueue",
    "dedup_key_from",
    "enqueue",
    "jdbc_properties",
    "jdbc_url",
    "local_session",
    "read",
]

#: Where Debian's libpostgresql-jdbc-java puts the PostgreSQL JDBC driver.
DEFAULT_JDBC_JAR = "/usr/share/java/postgresql.jar"
JDBC_DRIVER = "org.postgresql.Driver"

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


# -- enqueue --------------------------------------------------------------------------


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


# -- JDBC -----------------------------------------------------------------------------

# libpq parameters that the PostgreSQL JDBC driver understands, and their names there.
_JDBC_PARAMETERS = {
    "sslmode": "sslmode", "sslrootcert": "sslrootcert", "sslcert": "sslcert",
    "sslkey": "sslkey", "application_name": "ApplicationName",
    "connect_timeout": "connectTimeout", "options": "options",
}


def _libpq(dsn: str) -> dict[str, str]:
    """The DSN's parameters, completed from the PG* environment like libpq does."""
    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    for key, env in (("host", "PGHOST"), ("port", "PGPORT"), ("user", "PGUSER"),
                     ("password", "PGPASSWORD"), ("dbname", "PGDATABASE"),
                     ("sslmode", "PGSSLMODE")):
        if key not in params and os.environ.get(env):
            params[key] = os.environ[env]
    return params


def jdbc_url(dsn: str) -> str:
    """The ``jdbc:postgresql://`` URL of the database that a libpq conninfo or URL names,
    without user and password (pass :func:`jdbc_properties` to Spark separately, so the
    password never appears in plans or logs).

    Defaults follow libpq: the PG* environment, then localhost:5432, and the user's
    name as database. Unix-socket hosts are refused: the JDBC driver speaks TCP only.
    ``passfile``/``service`` files are not read.
    """
    params = _libpq(dsn)
    hosts = (params.get("host") or params.get("hostaddr") or "localhost").split(",")
    ports = (params.get("port") or "5432").split(",")
    if len(ports) == 1:
        ports = ports * len(hosts)
    if len(ports) != len(hosts):
        raise ValueError("the DSN names a different number of hosts and ports")
    if any(h.startswith("/") or h.startswith("@") for h in hosts):
        raise ValueError("the JDBC driver cannot use a Unix-domain socket: give a TCP host")
    netloc = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}"
                      for h, p in zip(hosts, ports, strict=True))
    dbname = params.get("dbname") or params.get("user") or getpass.getuser()
    query = "&".join(f"{jdbc}={quote(params[libpq], safe='')}"
                     for libpq, jdbc in _JDBC_PARAMETERS.items() if params.get(libpq))
    return f"jdbc:postgresql://{netloc}/{quote(dbname, safe='')}" + (f"?{query}" if query else "")


def jdbc_properties(dsn: str) -> dict[str, str]:
    """JDBC connection properties for ``dsn``: driver, user and (if any) password."""
    params = _libpq(dsn)
    props = {"driver": JDBC_DRIVER, "user": params.get("user") or getpass.getuser()}
    if params.get("password"):
        props["password"] = params["password"]
    return props


# name -> (columns, relation, id column or None, time column used by ``since``)
_SOURCES: dict[str, tuple[str, str, str | None, str | None]] = {
    "channels": ("channel, max_concurrency, release_interval_ms, max_size, max_attempts,"
                 " size, ready, scheduled, in_flight, next_dequeue_at",
                 "fairq.channels", None, None),
    "dead_letters": ("id, channel, content, state, num_attempts, error, created_at, died_at",
                     "fairq.dead_letters", "id", "died_at"),
    "message_history": ("id, channel, priority, created_at, first_dequeued_at, settled_at,"
                        " num_attempts, outcome", "fairq.message_history", "id", "settled_at"),
}


def _jdbc_reader(spark: SparkSession, url: str, properties: dict[str, str] | None,
                 fetch_size: int) -> Any:
    reader = (spark.read.format("jdbc").option("url", url).option("driver", JDBC_DRIVER)
              .option("fetchsize", str(fetch_size)))
    for key, value in (properties or {}).items():
        reader = reader.option(key, value)
    return reader


def read(spark: SparkSession, jdbc_url: str, what: str = "message_history", *,
         properties: dict[str, str] | None = None, since: datetime | None = None,
         num_partitions: int | None = None, bounds: tuple[int, int] | None = None,
         fetch_size: int = 10_000) -> DataFrame:
    """One of fairq's observer relations as a DataFrame, through Spark's JDBC source.

    ``what``: ``channels`` (the view of live channels; it has no id, so it is read in
    one partition — it is small), ``dead_letters`` or ``message_history`` (read in
    ``num_partitions`` ranges of ``id``, default: the session's default parallelism;
    ``bounds`` = (lowest, highest) id skips the query that finds them). ``since``
    keeps rows settled (history) or died (dead letters) at or after that instant
    (naive datetimes are UTC). ``properties``: JDBC options such as ``user`` and
    ``password`` (see :func:`jdbc_properties`). Column names and types follow the SQL:
    ``timestamptz`` becomes TimestampType, ``bytea`` BinaryType.
    Reading needs SELECT on the relation (``fairq.grant_observer``).
    """
    if what not in _SOURCES:
        raise ValueError(f"what must be one of {', '.join(_SOURCES)}, not {what!r}")
    columns, relation, id_column, time_column = _SOURCES[what]
    where = ""
    if since is not None:
        if time_column is None:
            raise ValueError(f"since does not apply to {what}")
        if since.tzinfo is None:
            since = since.replace(tzinfo=timezone.utc)
        where = f" WHERE {time_column} >= TIMESTAMPTZ '{since.isoformat()}'"
    table = f"(SELECT {columns} FROM {relation}{where}) AS fairq_{what}"
    reader = _jdbc_reader(spark, jdbc_url, properties, fetch_size)
    if id_column is None:
        return reader.option("dbtable", table).load()  # type: ignore[no-any-return]
    partitions = num_partitions or spark.sparkContext.defaultParallelism
    if bounds is None and partitions > 1:
        row = (_jdbc_reader(spark, jdbc_url, properties, fetch_size)
               .option("query", f"SELECT min({id_column}) AS lo, max({id_column}) AS hi"
                                f" FROM {relation}{where}")
               .load().first())
        if row is not None and row["lo"] is not None:
            bounds = (int(row["lo"]), int(row["hi"]))
    if bounds is None or partitions <= 1:
        return reader.option("dbtable", table).load()  # type: ignore[no-any-return]
    # Spark's JDBC stride is (upper - lower) / partitions: every id lands in exactly one
    # partition whatever the bounds; the bounds only shape the ranges.
    return (reader.option("dbtable", table)  # type: ignore[no-any-return]
            .option("partitionColumn", id_column).option("lowerBound", str(bounds[0]))
            .option("upperBound", str(bounds[1] + 1)).option("numPartitions", str(partitions))
            .load())


# -- sessions -------------------------------------------------------------------------


def local_session(master: str = "local[2]", *, app_name: str = "fairq",
                  jdbc_jar: str | None = DEFAULT_JDBC_JAR, fast_start: bool = True,
                  shuffle_partitions: int | None = None) -> SparkSession:
    """A local SparkSession set up the way fairq's tests and benchmarks run Spark:
    bound to 127.0.0.1, no web UI or progress bar, Python workers running this
    interpreter (``PYSPARK_PYTHON``, unless already set) and the JDBC driver on the
    classpath. ``fast_start`` runs the driver JVM with C1 only and the serial GC, which
    halves start-up (fine for short jobs). Returns the active session if there is one.
    """
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (SparkSession.builder.master(master).appName(app_name)
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions",
                       str(shuffle_partitions or 2 * (os.cpu_count() or 1))))
    if jdbc_jar:
        builder = builder.config("spark.jars", jdbc_jar)
    if fast_start:
        builder = builder.config("spark.driver.extraJavaOptions",
                                 "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
    return builder.getOrCreate()


# -- benchmark ------------------------------------------------------------------------


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
    _project(frame(min(rows, 20_000)), dequeue_at=None, priority=None,
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

    from fairq import _sql  # noqa: F401

    for _ in rows:
        pass
