"""A Structured Streaming sink: every micro-batch into the queue exactly once, also when
Spark replays a batch after a failure.

Spark's ``foreachBatch`` hands the sink ``(batch_df, batch_id)``; after a failure the query
restarts from its checkpoint and hands it the last, uncommitted batch again, with the
same id and the same rows (from a replayable source), possibly in another order and
another partitioning. The sink must then write what the failed attempt did not, and
nothing twice — even if workers have completed the messages written the first time, so
dedup keys (which hold only while their message exists) cannot be what decides.

What decides is a progress table written in the same transactions as the messages:

* Each batch is split into ``parts`` by a hash of each row's message fields, so a row's
  part depends on the row alone: a replay rebuilds exactly the same parts. The batch's
  first attempt fixes ``parts`` in a batch row (part -1) before any part is written.
* Each part is written in one transaction that first claims the part (a row keyed by
  query id, sink name, batch id and part) and ends by recording its counts. So a part's
  messages exist if and only if its claim was committed, and a concurrent attempt at the
  same part (a retried, speculative or leftover task) waits for the claim and skips.
* A replay skips the committed parts and writes the others; when all are committed it
  runs no Spark job at all. A row's fields, and so its part, may depend on session
  settings (the time zone of a naive dequeue_at): the batch row records them, and a
  replay that has parts to write under other settings is refused.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from psycopg import errors, sql
from psycopg.types.json import Jsonb

from fairq.spark.messages import (
    DEFAULT_QUEUE,
    MESSAGE_COLUMNS,
    InvalidRows,
    Tally,
    chunks,
    connect,
    create_messages,
    project,
    require_named_queues,
    require_queue_name,
)
from fairq.spark.settings import session_settings, settings_changed

if TYPE_CHECKING:
    import psycopg
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.streaming.query import StreamingQuery

log = logging.getLogger("fairq.spark")

#: The sink's bookkeeping table, created in the schema the sink is given.
PROGRESS_TABLE = "fairq_spark_sink_progress"

# The local property by which Spark tells a foreachBatch function its query's id; the id
# is kept in the checkpoint, so it is the same for every run from that checkpoint.
_QUERY_ID_PROPERTY = "sql.streaming.queryId"

# The part number of a batch's own row, which fixes how many parts the batch has.
_BATCH_ROW = -1

# Rows of the batches before the one running that the table keeps: a killed or
# speculative attempt of a task of an earlier batch may still be finishing when the next
# batch starts, and must still find its part claimed. They also show recent batches.
_KEPT_BATCHES = 10

_CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS {table} (
    query_id   text        NOT NULL,
    sink       text        NOT NULL,
    batch_id   bigint      NOT NULL,
    part       int         NOT NULL,
    parts      int         NOT NULL,
    created    bigint      NOT NULL DEFAULT 0,
    duplicate  bigint      NOT NULL DEFAULT 0,
    dropped    bigint      NOT NULL DEFAULT 0,
    invalid    bigint      NOT NULL DEFAULT 0,
    settings   jsonb,
    written_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (query_id, sink, batch_id, part)
)"""

# The columns newer than the table, which a table made before lacks: the rows a part
# left out as invalid, and the session settings of a batch's first attempt.
_ADDED_COLUMNS = {"invalid": "bigint NOT NULL DEFAULT 0", "settings": "jsonb"}
_ADD_COLUMN = "ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} "

_TABLE_COMMENT = (
    "fairq.spark.QueueSink: the parts of each micro-batch written into the queue, each row"
    " committed in the same transaction as its part's messages (part -1: the batch's"
    " own row, which fixes how many parts it has)")


@dataclass(frozen=True)
class SinkBatchResult:
    """What a :class:`QueueSink` did with one micro-batch.

    ``created``, ``duplicate`` and ``dropped`` count the batch's rows by outcome (as
    :class:`~fairq.spark.EnqueueResult` does), over every attempt at the batch: a
    replay reports what the earlier attempts committed too. ``parts`` is how many parts
    the batch was split into, ``skipped`` how many of them an earlier attempt had
    already committed (``skipped == parts``: a replay that wrote nothing and ran no job).
    ``invalid`` counts rows left out with ``invalid_rows="skip"``.
    """

    batch_id: int
    created: int
    duplicate: int
    dropped: int
    parts: int
    skipped: int
    invalid: int = 0

    @property
    def rows(self) -> int:
        return self.created + self.duplicate + self.dropped + self.invalid


def _table(schema: str) -> sql.Identifier:
    return sql.Identifier(schema, PROGRESS_TABLE)


def _add_column(table: sql.Identifier, name: str) -> sql.Composed:
    return sql.SQL(_ADD_COLUMN + _ADDED_COLUMNS[name]).format(table=table,
                                                              column=sql.Identifier(name))


def ensure_progress_table(conn: psycopg.Connection[Any], schema: str, *,
                          need_invalid: bool = False) -> frozenset[str]:
    """Creates ``schema.fairq_spark_sink_progress`` unless it exists (a role without
    CREATE on the schema can use one made ahead of time with the same columns), and
    returns which of the columns newer than the table it has. A table made before gets
    them where this role may add them; where not, a sink that leaves invalid rows out
    (``need_invalid``) raises, and any other works as before (without ``settings`` it
    cannot tell a replay under other session settings, and logs that)."""
    table = _table(schema)
    name = table.as_string(conn)
    found = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL, coalesce(array_agg(attname::text)"
        " FILTER (WHERE attname = ANY (%s)), '{}') FROM pg_attribute"
        " WHERE attrelid = to_regclass(%s) AND NOT attisdropped",
        [name, list(_ADDED_COLUMNS), name]).fetchone()
    assert found is not None
    exists, present = bool(found[0]), frozenset(found[1])
    missing = [column for column in _ADDED_COLUMNS if column not in present]
    if exists and not missing:
        return present
    try:
        with conn.transaction():
            # CREATE TABLE IF NOT EXISTS still fails when another session creates the
            # same table at the same moment: the lock makes sinks starting together
            # take turns.
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [name])
            if not exists:
                conn.execute(sql.SQL(_CREATE_TABLE).format(table=table))
                conn.execute(sql.SQL("COMMENT ON TABLE {table} IS {comment}").format(
                    table=table, comment=sql.Literal(_TABLE_COMMENT)))
            else:
                for column in missing:
                    conn.execute(_add_column(table, column))
        return frozenset(_ADDED_COLUMNS)
    except errors.InsufficientPrivilege as error:
        if not exists:
            raise RuntimeError(
                f"the sink's progress table {name} does not exist, and this role may not"
                " create it (it needs CREATE on the schema): have a role that may run "
                + sql.SQL(_CREATE_TABLE).format(table=table).as_string(conn)
                + " and grant SELECT, INSERT, UPDATE, DELETE on it to this one") from error
        if need_invalid and "invalid" in missing:
            raise RuntimeError(
                f"{name} has no invalid column, which a sink with invalid_rows=\"skip\""
                " counts in, and this role may not add it: have the table's owner run "
                + _add_column(table, "invalid").as_string(conn)) from error
        if "settings" in missing:
            log.warning("%s has no settings column and this role may not add it: a replay"
                        " under other session settings cannot be refused (have the"
                        " table's owner run %s)", name,
                        _add_column(table, "settings").as_string(conn))
        return present


def _write_part(rows: Iterable[Any], *, dsn: str, schema: str, query_id: str, sink: str,
                batch_id: int, parts: int, queue: str, batch_size: int,
                invalid_rows: InvalidRows, record_invalid: bool) -> None:
    """Runs on an executor: writes one part of a batch (this task's partition) in one
    transaction, unless another attempt has committed it. Rows left out as invalid
    are the same on every attempt (the limits look at the row alone)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is None:
        raise RuntimeError("_write_part runs in a Spark task")
    part = context.partitionId()
    key = {"query_id": query_id, "sink": sink, "batch_id": batch_id, "part": part}
    table = _table(schema)
    with connect(dsn) as conn, conn.transaction():
        # The claim comes first: an attempt at the same part that is writing now holds
        # its key until it commits (then this one skips) or rolls back (then this one
        # writes).
        claimed = conn.execute(sql.SQL(
            "INSERT INTO {table} (query_id, sink, batch_id, part, parts) VALUES"
            " (%(query_id)s, %(sink)s, %(batch_id)s, %(part)s, %(parts)s)"
            " ON CONFLICT DO NOTHING RETURNING part").format(table=table),
            {**key, "parts": parts}).fetchone()
        if claimed is None:
            # Read the rows anyway: a Python worker that leaves input unread is not reused.
            collections.deque(rows, maxlen=0)
            return
        tally = Tally()
        for chunk in chunks(rows, batch_size):
            stray = next((row[-1] for row in chunk if row[-1] != part), None)
            if stray is not None:
                # Spark's hash partitioning no longer matches pmod(hash(...)): parts
                # would then depend on more than the rows, and replays could duplicate.
                raise RuntimeError(f"a row of part {stray} is in partition {part}")
            tally += create_messages(conn, chunk, queue, invalid_rows)
        # (A table made before the sink counted invalid rows, which this role may not
        # alter, has no invalid column; then no row was left out.)
        invalid = ", invalid = %(invalid)s" if record_invalid else ""
        conn.execute(sql.SQL(
            "UPDATE {table} SET created = %(created)s, duplicate = %(duplicate)s,"
            f" dropped = %(dropped)s{invalid} WHERE (query_id, sink, batch_id, part)"
            " = (%(query_id)s, %(sink)s, %(batch_id)s, %(part)s)").format(table=table),
            {**key, "created": tally.created, "duplicate": tally.duplicate,
             "dropped": tally.dropped, "invalid": tally.invalid})


class QueueSink:
    """A ``foreachBatch`` function that feeds a streaming query into the queue, each
    micro-batch exactly once: ``df.writeStream.foreachBatch(QueueSink(dsn, ...))``.

    The fields are those of :func:`~fairq.spark.enqueue`: ``channel``, ``content``,
    ``dequeue_at``, ``priority`` and ``dedup_key`` (column names or Column expressions;
    no dedup key is needed for exactly-once), and ``queue``.

    ``name`` tells this sink's progress apart from other sinks of the same query
    (default: the queue's name). ``progress_schema`` holds the progress table
    (:data:`PROGRESS_TABLE`, created on first use). ``partitions``: parts per batch, each
    one transaction on one connection (default: Spark's default parallelism);
    ``batch_size``: rows per ``fairq.message_create_batch`` call. ``invalid_rows``: as
    for :func:`~fairq.spark.enqueue`; with ``"skip"`` a row fairq refuses is left out
    on every attempt alike instead of failing the batch (and every replay of it).

    :meth:`write_batch` returns a :class:`SinkBatchResult`, which the sink also keeps
    as ``last_result``. The sink must run as a streaming query's foreachBatch function
    (or be called from one), with a checkpoint location: see docs/spark.md for the
    guarantee and its limits.
    """

    def __init__(self, dsn: str, *, channel: str | Column, content: str | Column,
                 dequeue_at: str | Column | None = None, priority: str | Column | None = None,
                 dedup_key: str | Column | None = None, queue: str = DEFAULT_QUEUE,
                 name: str | None = None, progress_schema: str = "public",
                 partitions: int | None = None, batch_size: int = 1000,
                 invalid_rows: InvalidRows | str = InvalidRows.FAIL) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if partitions is not None and partitions < 1:
            raise ValueError("partitions must be at least 1")
        if name == "":
            raise ValueError("name must not be empty")
        require_queue_name(queue)
        self.dsn = dsn
        self.channel, self.content = channel, content
        self.dequeue_at, self.priority, self.dedup_key = dequeue_at, priority, dedup_key
        self.queue = queue
        self.name = queue if name is None else name
        self.progress_schema = progress_schema
        self.partitions = partitions
        self.batch_size = batch_size
        self.invalid_rows = InvalidRows(invalid_rows)
        self.last_result: SinkBatchResult | None = None
        self._checked = False
        self._columns: frozenset[str] = frozenset()  # the progress table's added columns

    def __call__(self, batch_df: DataFrame, batch_id: int) -> None:
        """The foreachBatch function: :meth:`write_batch`."""
        self.write_batch(batch_df, batch_id)

    def write_batch(self, batch_df: DataFrame, batch_id: int) -> SinkBatchResult:
        """Writes micro-batch ``batch_id`` (what an earlier attempt at it has not
        committed) and reports on the whole batch."""

        query_id = batch_df.sparkSession.sparkContext.getLocalProperty(_QUERY_ID_PROPERTY)
        if query_id is None:
            raise RuntimeError("a QueueSink writes the micro-batches of a streaming query"
                               " (writeStream.foreachBatch(sink)), and Spark names no running"
                               f" query on this thread (local property {_QUERY_ID_PROPERTY})")
        with connect(self.dsn) as conn:
            if not self._checked:
                require_named_queues(conn)
                self._columns = ensure_progress_table(
                    conn, self.progress_schema,
                    need_invalid=self.invalid_rows is InvalidRows.SKIP)
                self._checked = True
            settings = session_settings(batch_df.sparkSession)
            parts, committed, first = self._begin(
                conn, query_id, batch_id,
                self.partitions or batch_df.sparkSession.sparkContext.defaultParallelism,
                settings)
            if committed < parts:
                changed = None if first is None else settings_changed(first, settings)
                if changed is not None:
                    raise RuntimeError(
                        f"batch {batch_id} of sink {self.name!r} (query {query_id}) was"
                        f" first attempted under other session settings ({changed}):"
                        " its rows' fields, and so the parts they fall into, could differ,"
                        " and this replay would write some rows twice and others never."
                        " Restart the query with the first attempt's settings")
                self._write(batch_df, query_id, batch_id, parts)
            result = self._result(conn, query_id, batch_id, parts, committed)
        self.last_result = result
        return result

    def _key(self, query_id: str, batch_id: int) -> dict[str, Any]:
        return {"query_id": query_id, "sink": self.name, "batch_id": batch_id}

    def _begin(self, conn: psycopg.Connection[Any], query_id: str, batch_id: int,
               parts: int, settings: dict[str, str | None],
               ) -> tuple[int, int, dict[str, str | None] | None]:
        """Records the batch (unless an earlier attempt did) and returns its number of
        parts and session settings (the first attempt's; None where not recorded) and
        how many of its parts are committed."""
        table = _table(self.progress_schema)
        key = {**self._key(query_id, batch_id), "parts": parts, "kept": _KEPT_BATCHES,
               "settings": Jsonb(settings)}
        # (Only the batch row holds settings.)
        settings_column, settings_value, settings_read = (
            (", settings", ", %(settings)s", "max(settings::text)")
            if "settings" in self._columns else ("", "", "NULL"))
        match = "query_id = %(query_id)s AND sink = %(sink)s"
        with conn.transaction():
            newest = conn.execute(sql.SQL(f"SELECT max(batch_id) FROM {{table}} WHERE {match}")
                                  .format(table=table), key).fetchone()
            if newest and newest[0] is not None and newest[0] > batch_id:
                raise RuntimeError(
                    f"sink {self.name!r} of query {query_id} has written batch {newest[0]},"
                    f" and Spark asks for batch {batch_id}: the checkpoint was rewound. To"
                    f" write those batches again, delete the sink's rows from"
                    f" {table.as_string(conn)}")
            conn.execute(sql.SQL(f"DELETE FROM {{table}} WHERE {match}"
                                 " AND batch_id < %(batch_id)s - %(kept)s").format(table=table),
                         key)
            conn.execute(sql.SQL(
                f"INSERT INTO {{table}} (query_id, sink, batch_id, part, parts{settings_column})"
                f" VALUES (%(query_id)s, %(sink)s, %(batch_id)s, {_BATCH_ROW}, %(parts)s"
                f"{settings_value}) ON CONFLICT DO NOTHING").format(table=table), key)
            row = conn.execute(sql.SQL(
                f"SELECT max(parts) FILTER (WHERE part = {_BATCH_ROW}),"
                f" count(*) FILTER (WHERE part <> {_BATCH_ROW}),"
                f" {settings_read}"
                f" FROM {{table}} WHERE {match} AND batch_id = %(batch_id)s").format(table=table),
                key).fetchone()
        assert row is not None
        return int(row[0]), int(row[1]), None if row[2] is None else json.loads(row[2])

    def _write(self, batch_df: DataFrame, query_id: str, batch_id: int, parts: int) -> None:
        """Runs the Spark job that writes the batch's parts, one task each."""
        from pyspark.sql import functions as F

        rows = project(batch_df, self.channel, self.content, self.dequeue_at, self.priority,
                       self.dedup_key)
        hashed = [F.col(name) for name in MESSAGE_COLUMNS]
        # repartition(n, cols) puts a row in partition pmod(hash(cols), n): each partition
        # is then one part, a function of the rows alone. The part column lets each task
        # check that.
        (rows.repartition(parts, *hashed)
         .withColumn("part", F.pmod(F.hash(*hashed), F.lit(parts)))
         .foreachPartition(partial(
             _write_part, dsn=self.dsn, schema=self.progress_schema, query_id=query_id,
             sink=self.name, batch_id=batch_id, parts=parts, queue=self.queue,
             batch_size=self.batch_size, invalid_rows=self.invalid_rows,
             record_invalid="invalid" in self._columns)))

    def _result(self, conn: psycopg.Connection[Any], query_id: str, batch_id: int,
                parts: int, skipped: int) -> SinkBatchResult:
        invalid_sum = "coalesce(sum(invalid), 0)" if "invalid" in self._columns else "0"
        row = conn.execute(sql.SQL(
            "SELECT count(*), coalesce(sum(created), 0), coalesce(sum(duplicate), 0),"
            f" coalesce(sum(dropped), 0), {invalid_sum}"
            " FROM {table} WHERE query_id = %(query_id)s"
            f" AND sink = %(sink)s AND batch_id = %(batch_id)s AND part <> {_BATCH_ROW}")
            .format(table=_table(self.progress_schema)), self._key(query_id, batch_id)).fetchone()
        assert row is not None
        written, created, duplicate, dropped, invalid = (int(v) for v in row)
        if written != parts:
            raise RuntimeError(f"batch {batch_id}: {written} of its {parts} parts are written")
        return SinkBatchResult(batch_id, created, duplicate, dropped, parts, skipped, invalid)


def stream_to_queue(df: DataFrame, dsn: str, *, checkpoint_location: str,
                    channel: str | Column, content: str | Column,
                    dequeue_at: str | Column | None = None, priority: str | Column | None = None,
                    dedup_key: str | Column | None = None, queue: str = DEFAULT_QUEUE,
                    name: str | None = None, progress_schema: str = "public",
                    partitions: int | None = None, batch_size: int = 1000,
                    invalid_rows: InvalidRows | str = InvalidRows.FAIL,
                    trigger: Mapping[str, Any] | None = None,
                    query_name: str | None = None) -> StreamingQuery:
    """Starts a streaming query that feeds the streaming DataFrame ``df`` into the queue
    through a :class:`QueueSink` (the same arguments), checkpointed at
    ``checkpoint_location``, and returns it. ``trigger``: the keyword arguments of
    ``DataStreamWriter.trigger``, e.g. ``{"processingTime": "10 seconds"}`` or
    ``{"availableNow": True}`` (default: Spark's, a batch as soon as the last ends)."""
    sink = QueueSink(dsn, channel=channel, content=content, dequeue_at=dequeue_at,
                     priority=priority, dedup_key=dedup_key, queue=queue, name=name,
                     progress_schema=progress_schema, partitions=partitions,
                     batch_size=batch_size, invalid_rows=invalid_rows)
    writer = df.writeStream.foreachBatch(sink).option("checkpointLocation", checkpoint_location)
    if query_name is not None:
        writer = writer.queryName(query_name)
    if trigger is not None:
        writer = writer.trigger(**trigger)
    return writer.start()
