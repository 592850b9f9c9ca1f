"""fairq.spark's streaming sink, on a real cluster and the local Spark session of
test_spark.py: every input row becomes exactly one message, also when the query dies in
the middle of a micro-batch and restarts from its checkpoint, and when workers completed
what the failed attempt had written before the batch is replayed.

The stream reads a directory of JSON files, one micro-batch per file
(``maxFilesPerTrigger=1``), and runs with ``availableNow`` until the files written so
far are done: which rows form which batch never depends on timing. Failures are
injected by progress (a trigger that fails a batch's inserts once some of its parts are
committed), and a whole-batch replay by removing the batch's entry from the checkpoint's
commit log, which is what Spark finds after a crash between writing and committing.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

import test_spark
from test_spark import has_named_queues

# test_spark.py's session-scoped SparkSession fixture; its getOrCreate() hands this
# module the session that module started, when both run.
spark = test_spark.spark

ROWS = 120  # per input file, so per micro-batch
TENANTS = 6
PROGRESS = "public.fairq_spark_sink_progress"
QUERY_ID = "sql.streaming.queryId"  # how Spark tells a foreachBatch function its query


def add_input(source: Path, batch: int) -> None:
    """Input file ``batch``: jobs batch * ROWS .. (batch + 1) * ROWS - 1, written aside
    and renamed in, so that the stream never lists a half-written file."""
    source.mkdir(exist_ok=True)
    lines = [json.dumps({"n": n, "tenant": f"tenant-{n % TENANTS}"})
             for n in range(batch * ROWS, (batch + 1) * ROWS)]
    aside = source.parent / f"batch-{batch:03d}.json"
    aside.write_text("\n".join(lines) + "\n")
    aside.rename(source / aside.name)


def input_stream(spark: Any, source: Path) -> Any:
    return (spark.readStream.schema("n long, tenant string")
            .option("maxFilesPerTrigger", 1).json(str(source)))


def make_sink(dsn: str, partitions: int = 4, **options: Any) -> Any:
    from pyspark.sql import functions as F

    from fairq.spark import QueueSink

    return QueueSink(dsn, channel="tenant", content=F.struct("n", "tenant"),
                     partitions=partitions, batch_size=25, **options)


def run_query(spark: Any, source: Path, checkpoint: Path, sink: Any,
              results: list[Any]) -> None:
    """Runs the stream through ``sink`` until every file in ``source`` is processed,
    appending each micro-batch's SinkBatchResult to ``results``; raises the query's
    exception if it fails."""
    def each_batch(df: Any, batch_id: int) -> None:
        results.append(sink.write_batch(df, batch_id))

    query = (input_stream(spark, source).writeStream.foreachBatch(each_batch)
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    try:
        query.awaitTermination()
    finally:
        query.stop()


def complete_everything(conn: psycopg.Connection[Any]) -> list[bytes]:
    """A worker's job: dequeues and completes every message; returns their contents."""
    done: list[bytes] = []
    while rows := conn.execute("SELECT id, num_attempts, content"
                               " FROM fairq.message_dequeue(60000, 100)").fetchall():
        conn.execute("SELECT fairq.message_complete_batch(%s, %s)",
                     ([r[0] for r in rows], [r[1] for r in rows]))
        done += [bytes(r[2]) for r in rows]
    return done


def lost_and_duplicated(conn: psycopg.Connection[Any], completed: list[bytes],
                        batches: int) -> tuple[int, int]:
    """Of the jobs of the first ``batches`` input files, how many have no message
    (queued now or completed earlier) and how many messages too many there are."""
    queued = [bytes(c) for (c,) in conn.execute("SELECT content FROM fairq.message")]
    counts = Counter(json.loads(c)["n"] for c in queued + completed)
    jobs = range(batches * ROWS)
    assert set(counts) <= set(jobs), "a message of no input row"
    lost = sum(1 for n in jobs if counts[n] == 0)
    duplicated = sum(c - 1 for c in counts.values() if c > 1)
    return lost, duplicated


def crash_when_parts_committed(conn: psycopg.Connection[Any], batch_id: int,
                               committed: int) -> None:
    """Every insert of a message of micro-batch ``batch_id`` fails once ``committed`` of
    the batch's parts are committed: a part's transaction sees its own claim and the
    other parts' once they commit. Every attempt at such a part fails, so the job and
    with it the query fail, the batch partly written."""
    conn.execute(f"""
        CREATE FUNCTION public.crash_batch() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF (SELECT count(*) FROM {PROGRESS}
                 WHERE batch_id = {batch_id} AND part >= 0) > {committed} THEN
                RAISE EXCEPTION 'injected crash in batch {batch_id}';
            END IF;
            RETURN NEW;
        END $$""")
    conn.execute("CREATE TRIGGER crash_batch BEFORE INSERT ON fairq.message"
                 " FOR EACH ROW EXECUTE FUNCTION public.crash_batch()")


def no_part_still_writing(conn: psycopg.Connection[Any]) -> None:
    """Waits until no other session of the test's database is in a transaction: when a
    task fails the job, a part of it may still be writing (its Python worker goes on
    until it commits), and counting the committed parts before it ends counts one
    too few. (60 s is a failure net: it ends within a second.)"""
    for _ in range(600):
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname ="
                           " current_database() AND pid <> pg_backend_pid()"
                           " AND backend_type = 'client backend'"
                           " AND xact_start IS NOT NULL").fetchone()
        if row == (0,):
            return
        time.sleep(0.1)
    raise AssertionError("a part's transaction is still open after 60 s")


def parts_committed(conn: psycopg.Connection[Any], batch_id: int) -> list[tuple[int, int]]:
    """(part, messages created) of the committed parts of ``batch_id``."""
    return conn.execute(f"SELECT part, created FROM {PROGRESS} WHERE batch_id = %s"
                        " AND part >= 0 ORDER BY part", [batch_id]).fetchall()


# -- replays after a failure ----------------------------------------------------------


@pytest.mark.parametrize("completed_before_restart", [False, True],
                         ids=["messages-queued", "messages-completed"])
def test_a_query_killed_mid_batch_restarts_without_loss_or_duplicates(
        spark: Any, conn: psycopg.Connection[Any], tmp_path: Path,
        completed_before_restart: bool) -> None:
    from pyspark.errors import StreamingQueryException

    source, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    for batch in range(2):
        add_input(source, batch)
    crash_when_parts_committed(conn, batch_id=1, committed=2)
    before: list[Any] = []
    with pytest.raises(StreamingQueryException, match="injected crash in batch 1"):
        run_query(spark, source, checkpoint, make_sink(conn.info.dsn, partitions=4), before)
    assert [r.batch_id for r in before] == [0]
    no_part_still_writing(conn)
    written = parts_committed(conn, 1)
    # Two slots run the four parts: the last to start finds two committed and fails.
    assert 2 <= len(written) < 4, written
    assert conn.execute("SELECT count(*) FROM fairq.message").fetchone() == (
        ROWS + sum(created for _, created in written),)

    conn.execute("DROP TRIGGER crash_batch ON fairq.message")
    completed = complete_everything(conn) if completed_before_restart else []
    add_input(source, 2)
    # The replay reads its file in smaller input partitions, and the sink is now set to
    # three parts: neither may change which rows batch 1's committed parts hold.
    spark.conf.set("spark.sql.files.maxPartitionBytes", "1000")
    try:
        after: list[Any] = []
        run_query(spark, source, checkpoint, make_sink(conn.info.dsn, partitions=3), after)
    finally:
        spark.conf.unset("spark.sql.files.maxPartitionBytes")

    assert lost_and_duplicated(conn, completed, batches=3) == (0, 0)
    replay, batch2 = after
    assert (replay.batch_id, replay.parts, replay.skipped) == (1, 4, len(written))
    assert (replay.created, replay.duplicate, replay.dropped) == (ROWS, 0, 0)
    assert (batch2.batch_id, batch2.parts, batch2.created) == (2, 3, ROWS)


def test_a_replayed_batch_that_was_written_whole_is_a_no_op(
        spark: Any, conn: psycopg.Connection[Any], tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    from fairq.spark import stream_to_queue

    source, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    for batch in range(2):
        add_input(source, batch)
    query = stream_to_queue(input_stream(spark, source), conn.info.dsn,
                            checkpoint_location=str(checkpoint), channel="tenant",
                            content=F.struct("n", "tenant"), trigger={"availableNow": True})
    query.awaitTermination()
    assert [p["batchId"] for p in query.recentProgress] == [0, 1]
    completed = complete_everything(conn)
    assert len(completed) == 2 * ROWS

    # A crash after the sink wrote batch 1 but before Spark committed it: the restart
    # replays batch 1, whose messages workers have completed meanwhile.
    (checkpoint / "commits" / "1").unlink()
    (checkpoint / "commits" / ".1.crc").unlink(missing_ok=True)
    add_input(source, 2)
    results: list[Any] = []
    run_query(spark, source, checkpoint, make_sink(conn.info.dsn, partitions=4), results)
    assert lost_and_duplicated(conn, completed, batches=3) == (0, 0)
    replay, batch2 = results
    assert (replay.batch_id, replay.skipped, replay.parts) == (1, 2, 2)  # default: 2 cores
    assert (replay.created, batch2.batch_id, batch2.created) == (ROWS, 2, ROWS)


# -- the sink called directly, as a foreachBatch function is --------------------------


@pytest.fixture
def in_query(spark: Any) -> Any:
    """The local property by which Spark names the running query, set as Spark sets it
    for a foreachBatch function (on this thread), and removed afterwards."""
    sc = spark.sparkContext
    sc.setLocalProperty(QUERY_ID, "test-query")
    yield sc
    sc.setLocalProperty(QUERY_ID, None)


def test_equal_rows_are_separate_messages_and_a_batch_is_written_once(
        spark: Any, conn: psycopg.Connection[Any], in_query: Any) -> None:
    from fairq.spark import SinkBatchResult

    rows = [(n % 10, "tenant-a") for n in range(40)]  # each row four times
    df = spark.createDataFrame(rows, "n long, tenant string").repartition(3)
    sink = make_sink(conn.info.dsn, partitions=5)
    first = sink.write_batch(df, 7)
    assert (first.created, first.duplicate, first.parts, first.skipped) == (40, 0, 5, 0)
    again = sink.write_batch(df.orderBy("n"), 7)
    assert conn.execute("SELECT count(*) FROM fairq.message").fetchone() == (40,)
    assert again == SinkBatchResult(7, 40, 0, 0, 5, 5) and sink.last_result == again

    # Another sink of the same query keeps its own progress.
    other = make_sink(conn.info.dsn, partitions=2, name="copy").write_batch(df, 7)
    assert (other.created, other.skipped) == (40, 0)


def test_a_rewound_checkpoint_is_refused_and_old_batches_are_forgotten(
        spark: Any, conn: psycopg.Connection[Any], in_query: Any) -> None:
    df = spark.createDataFrame([(1, "tenant-a")], "n long, tenant string")
    sink = make_sink(conn.info.dsn, partitions=2)
    sink.write_batch(df, 3)
    sink.write_batch(df, 14)
    with pytest.raises(RuntimeError, match="has written batch 14, and Spark asks for batch 13"):
        sink.write_batch(df, 13)
    # Batch 3 is more than ten batches behind batch 14: its rows are gone.
    assert conn.execute(f"SELECT DISTINCT batch_id FROM {PROGRESS}").fetchall() == [(14,)]


def test_the_sink_outside_a_streaming_query_refuses(
        spark: Any, conn: psycopg.Connection[Any]) -> None:
    df = spark.createDataFrame([(1, "tenant-a")], "n long, tenant string")
    with pytest.raises(RuntimeError, match="names no running query"):
        make_sink(conn.info.dsn).write_batch(df, 0)


def test_the_sink_into_a_named_queue(spark: Any, conn: psycopg.Connection[Any],
                                     in_query: Any) -> None:
    if not has_named_queues(conn):
        pytest.skip("the installed fairq has no named queues (no p_queue)")
    df = spark.createDataFrame([(n, f"tenant-{n % 3}") for n in range(30)],
                               "n long, tenant string")
    result = make_sink(conn.info.dsn, queue="emails").write_batch(df, 0)
    assert (result.created, result.parts) == (30, 4)
    assert conn.execute("SELECT queue, sum(size)::int FROM fairq.channels GROUP BY queue"
                        ).fetchall() == [("emails", 30)]
    assert conn.execute(f"SELECT DISTINCT sink FROM {PROGRESS}").fetchall() == [("emails",)]


def test_rows_fairq_refuses_are_left_out_and_recorded_when_asked(
        spark: Any, conn: psycopg.Connection[Any], in_query: Any) -> None:
    """By default a row fairq refuses fails its batch (and would fail every replay);
    with invalid_rows="skip" the batch is written without it, each part recording how
    many it left out, and a replay reports the same. A progress table made by a sink
    before it counted invalid rows gets its invalid column."""
    from fairq.spark import SinkBatchResult
    from fairq.spark.stream import _CREATE_TABLE

    conn.execute(_CREATE_TABLE.replace("    invalid    bigint      NOT NULL DEFAULT 0,\n", "")
                 .format(table=PROGRESS))
    rows = [(n, "" if n % 9 == 0 else f"tenant-{n % 3}") for n in range(60)]
    df = spark.createDataFrame(rows, "n long, tenant string").repartition(3)
    with pytest.raises(Exception, match="must be non-empty"):
        make_sink(conn.info.dsn, queue="strict").write_batch(df, 0)
    sink = make_sink(conn.info.dsn, invalid_rows="skip")
    first = sink.write_batch(df, 1)
    assert (first.created, first.invalid, first.rows, first.skipped) == (53, 7, 60, 0)
    assert sorted(json.loads(bytes(c))["n"] for (c,) in conn.execute(
        "SELECT m.content FROM fairq.message m JOIN fairq.queue q ON q.id = m.queue_id"
        " WHERE q.name = 'default'")) == [n for n in range(60) if n % 9]
    assert sink.write_batch(df.orderBy("n"), 1) == SinkBatchResult(1, 53, 0, 0, 4, 4, 7)


def test_an_older_progress_table_its_role_may_not_alter(
        spark: Any, conn: psycopg.Connection[Any], in_query: Any, server: Any) -> None:
    """A progress table made ahead of time by its owner before the sink counted invalid
    rows: a sink of another role keeps working without the column, and one that would
    leave rows out says what the owner must run."""
    from fairq.spark.stream import _CREATE_TABLE

    role = f"fairq_sink_{uuid.uuid4().hex[:12]}"
    server.admin(f'CREATE ROLE "{role}" LOGIN')
    try:
        conn.execute(_CREATE_TABLE.replace("    invalid    bigint      NOT NULL DEFAULT 0,\n", "")
                     .format(table=PROGRESS))
        conn.execute(f'GRANT SELECT, INSERT, UPDATE, DELETE ON {PROGRESS} TO "{role}"')
        conn.execute("SELECT fairq.grant_producer(%s::regrole)", [role])
        dsn = psycopg.conninfo.make_conninfo(conn.info.dsn, user=role)
        df = spark.createDataFrame([(n, "tenant-a") for n in range(10)], "n long, tenant string")
        result = make_sink(dsn, partitions=2).write_batch(df, 0)
        assert (result.created, result.invalid) == (10, 0)
        with pytest.raises(RuntimeError, match="have the table's owner run ALTER TABLE"):
            make_sink(dsn, partitions=2, invalid_rows="skip").write_batch(df, 1)
        assert conn.execute("SELECT count(*) FROM pg_attribute WHERE attrelid = %s::regclass"
                            " AND attname = 'invalid'", [PROGRESS]).fetchone() == (0,)
    finally:
        conn.execute(f'DROP OWNED BY "{role}"')
        server.admin(f'DROP ROLE "{role}"')


@pytest.mark.parametrize("queue", ["emails", "default"])
def test_the_sink_without_named_queues_refuses(
        spark: Any, conn: psycopg.Connection[Any], in_query: Any, queue: str) -> None:
    if has_named_queues(conn):
        pytest.skip("the installed fairq has named queues")
    df = spark.createDataFrame([(1, "tenant-a")], "n long, tenant string")
    with pytest.raises(RuntimeError, match="no named queues"):
        make_sink(conn.info.dsn, queue=queue).write_batch(df, 0)
    assert conn.execute("SELECT count(*) FROM fairq.message").fetchone() == (0,)


# -- docs/spark.md --------------------------------------------------------------------

STREAMING_DOCS = Path(__file__).resolve().parent.parent / "docs" / "spark.md"


def streaming_section() -> str:
    text = STREAMING_DOCS.read_text()
    start = text.index("## Streaming: ")
    return text[start:text.index("\n## ", start + 1)]


def test_the_docs_streaming_examples_run(spark: Any, conn: psycopg.Connection[Any],
                                         tmp_path: Path) -> None:
    """Each python block of the section, with its paths in tmp_path, starts a query
    that puts one file's jobs into the queue."""
    blocks = re.findall(r"^```python\n(.*?)^```", streaming_section(), flags=re.M | re.S)
    assert len(blocks) == 2
    scope: dict[str, Any] = {"spark": spark, "dsn": conn.info.dsn}
    for i, code in enumerate(blocks):
        source, checkpoint = tmp_path / f"in-{i}", tmp_path / f"checkpoint-{i}"
        source.mkdir()
        (source / "jobs.json").write_text("".join(
            json.dumps({"tenant": f"tenant-{n % 3}", "job_id": n, "payload": "x"}) + "\n"
            for n in range(10)))
        exec(code.replace("/data/in/", str(source))
             .replace("/data/checkpoints/jobs", str(checkpoint)), scope)
        try:
            scope["query"].processAllAvailable()
        finally:
            scope["query"].stop()
        assert conn.execute("SELECT count(*) FROM fairq.message").fetchone() == (10 * (i + 1),)


def test_the_progress_table_in_the_docs_is_the_sinks() -> None:
    from fairq.spark import stream

    ddl = re.search(r"^```sql\n(CREATE TABLE .*?)^```", streaming_section(), flags=re.M | re.S)
    assert ddl is not None
    table = f"public.{stream.PROGRESS_TABLE}"
    assert ddl.group(1).split() == stream._CREATE_TABLE.format(table=table).split()


# -- what a part's transaction meets ---------------------------------------------------


def test_a_replay_under_other_session_settings_is_refused(
        spark: Any, conn: psycopg.Connection[Any], in_query: Any) -> None:
    """A naive dequeue_at is read in the session's time zone, and a row's part is a hash
    of its fields: a replay under another zone put rows in other parts (22 lost, 21
    duplicated of 120). The batch records the settings of its first attempt; a replay
    with parts to write under others is refused, and one under the same writes the
    rest."""
    rows = [(n, f"tenant-{n % TENANTS}", f"2030-01-01 00:{n // 60:02d}:{n % 60:02d}")
            for n in range(ROWS)]
    df = spark.createDataFrame(rows, "n long, tenant string, run_at string").repartition(2)
    sink = make_sink(conn.info.dsn, dequeue_at="run_at")
    crash_when_parts_committed(conn, batch_id=0, committed=1)
    with pytest.raises(Exception, match="injected crash in batch 0"):
        sink.write_batch(df, 0)
    no_part_still_writing(conn)
    written = parts_committed(conn, 0)
    assert 1 <= len(written) < 4, written
    conn.execute("DROP TRIGGER crash_batch ON fairq.message")
    zone = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone",
                   "America/New_York" if zone != "America/New_York" else "UTC")
    try:
        with pytest.raises(RuntimeError, match=r"spark\.sql\.session\.timeZone: '.*' -> '"):
            sink.write_batch(df, 0)
    finally:
        spark.conf.set("spark.sql.session.timeZone", zone)
    assert parts_committed(conn, 0) == written
    replay = sink.write_batch(df, 0)
    assert (replay.created, replay.skipped) == (ROWS, len(written))
    assert lost_and_duplicated(conn, [], batches=1) == (0, 0)


def test_a_missing_progress_table_its_role_may_not_create(
        spark: Any, conn: psycopg.Connection[Any], in_query: Any, server: Any) -> None:
    """A role without CREATE on the schema and no progress table: the error says so and
    gives the statement that makes it (not a missing invalid column)."""
    from fairq.spark.stream import _CREATE_TABLE

    role = f"fairq_sink_{uuid.uuid4().hex[:12]}"
    server.admin(f'CREATE ROLE "{role}" LOGIN')
    try:
        conn.execute("SELECT fairq.grant_producer(%s::regrole)", [role])
        dsn = psycopg.conninfo.make_conninfo(conn.info.dsn, user=role)
        df = spark.createDataFrame([(1, "tenant-a")], "n long, tenant string")
        for mode in ("fail", "skip"):
            with pytest.raises(RuntimeError, match="does not exist, and this role may not"
                               " create it") as excinfo:
                make_sink(dsn, invalid_rows=mode).write_batch(df, 0)
            assert " ".join(_CREATE_TABLE.format(table='"public"."fairq_spark_sink_progress"')
                            .split()) in " ".join(str(excinfo.value).split())
    finally:
        conn.execute(f'DROP OWNED BY "{role}"')
        server.admin(f'DROP ROLE "{role}"')
