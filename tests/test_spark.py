"""fairq.spark and fairq.report against a real cluster and one local Spark session.

The session is ``local[2,2]``: two cores, and a task may fail twice (the second number
of a local master is spark.task.maxFailures), so a failed task is retried once.
Without pyspark or the JDBC driver these tests skip, except in CI (CI=true), where
they fail: CI installs both.
"""

from __future__ import annotations

import csv
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fairq import CancelStatus, Queue
from fairq.spark import DEFAULT_JDBC_JAR, jdbc_properties, jdbc_url

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _require(ok: bool, why: str) -> None:
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"{why} (CI must install it)")
        pytest.skip(why)


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        _require(False, "pyspark is not installed (pip install '.[spark]')")
    _require(Path(DEFAULT_JDBC_JAR).is_file(),
             f"no JDBC driver at {DEFAULT_JDBC_JAR} (apt-get install libpostgresql-jdbc-java)")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    session = (SparkSession.builder.master("local[2,2]").appName("fairq-tests")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.ui.enabled", "false")
               .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
               .config("spark.jars", DEFAULT_JDBC_JAR)
               .config("spark.sql.shuffle.partitions", "4")
               .config("spark.default.parallelism", "2")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()


def jobs(spark: Any, rows: int = 10_000, tenants: int = 50, partitions: int = 4) -> Any:
    """``rows`` jobs over ``tenants`` channels; row n sits in partition n // (rows / partitions)."""
    from pyspark.sql import functions as F

    return spark.range(0, rows, numPartitions=partitions).select(
        F.col("id").alias("n"),
        F.concat(F.lit("tenant-"), (F.col("id") % tenants).cast("string")).alias("tenant"),
        F.struct(F.col("id").alias("n"), F.lit("resize").alias("job")).alias("body"))


def fail_once_at(conn: psycopg.Connection[Any], n: int) -> None:
    """The first insert of job ``n`` into fairq.message fails (a sequence, unlike a
    table, remembers across the rollback), failing its batch and so its Spark task."""
    conn.execute("CREATE SEQUENCE public.fail_once")
    conn.execute(f"""
        CREATE FUNCTION public.fail_once() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF convert_from(NEW.content, 'UTF8') LIKE '{{"n":{n},%'
               AND nextval('public.fail_once') = 1 THEN
                RAISE EXCEPTION 'injected failure at job {n}';
            END IF;
            RETURN NEW;
        END $$""")
    conn.execute("CREATE TRIGGER fail_once BEFORE INSERT ON fairq.message"
                 " FOR EACH ROW EXECUTE FUNCTION public.fail_once()")


def landed(conn: psycopg.Connection[Any]) -> tuple[int, int, int, int]:
    """(messages, distinct jobs, distinct dedup keys, channels)."""
    row = conn.execute(
        "SELECT count(*), count(DISTINCT convert_from(content, 'UTF8')::jsonb->'n'),"
        " count(DISTINCT dedup_key), count(DISTINCT channel_id) FROM fairq.message").fetchone()
    assert row is not None
    return row  # type: ignore[return-value]


# -- enqueue --------------------------------------------------------------------------


def test_dataframe_lands_exactly_once(spark: Any, conn: psycopg.Connection[Any]) -> None:
    from fairq.spark import dedup_key_from, enqueue

    df = jobs(spark)
    result = enqueue(df, conn.info.dsn, channel="tenant", content="body",
                     dedup_key=dedup_key_from("n", prefix="job-"), batch_size=700)
    assert (result.created, result.duplicate, result.dropped) == (10_000, 0, 0)
    assert landed(conn) == (10_000, 10_000, 10_000, 50)
    per_channel = conn.execute("SELECT DISTINCT size FROM fairq.channels").fetchall()
    assert per_channel == [(200,)]
    name, content, key = conn.execute(
        "SELECT c.name, convert_from(content, 'UTF8'), dedup_key FROM fairq.message m"
        " JOIN fairq.channel c ON c.id = m.channel_id"
        " WHERE convert_from(content, 'UTF8')::jsonb->>'n' = '7'").fetchone()  # type: ignore[misc]
    assert (name, content) == ("tenant-7", '{"n":7,"job":"resize"}')
    assert key.startswith("job-") and len(key) == 4 + 64

    again = enqueue(df, conn.info.dsn, channel="tenant", content="body",
                    dedup_key=dedup_key_from("n", prefix="job-"))
    assert (again.created, again.duplicate, again.dropped) == (0, 10_000, 0)
    assert landed(conn)[0] == 10_000


def test_a_retried_task_does_not_enqueue_twice(spark: Any, conn: psycopg.Connection[Any]) -> None:
    from fairq.spark import dedup_key_from, enqueue

    # Job 7321 is the 2322nd row of partition 2 (5000..7499): with batches of 500, the
    # failed attempt commits 2000 rows before its fifth batch fails.
    fail_once_at(conn, 7321)
    result = enqueue(jobs(spark), conn.info.dsn, channel="tenant", content="body",
                     dedup_key=dedup_key_from("tenant", "n"), batch_size=500)
    assert conn.execute("SELECT last_value FROM public.fail_once").fetchone() == (2,)
    assert (result.created, result.duplicate, result.dropped) == (8_000, 2_000, 0)
    assert landed(conn) == (10_000, 10_000, 10_000, 50)


def test_without_dedup_keys_a_retried_task_enqueues_again(
        spark: Any, conn: psycopg.Connection[Any]) -> None:
    from fairq.spark import enqueue

    fail_once_at(conn, 7321)
    result = enqueue(jobs(spark), conn.info.dsn, channel="tenant", content="body",
                     batch_size=500)
    assert (result.created, result.duplicate, result.dropped) == (10_000, 0, 0)
    messages, distinct_jobs, _, _ = landed(conn)
    assert (messages, distinct_jobs) == (12_000, 10_000)  # the documented hazard


def test_content_kinds_schedule_priority_and_drops(
        spark: Any, conn: psycopg.Connection[Any]) -> None:
    from pyspark.sql import functions as F

    from fairq.spark import enqueue

    later = datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=timezone.utc)
    rows = [("bin", bytearray(b"\x00\xff"), "é", 1, later, 5, "k1"),
            ("bin", bytearray(b"\x01"), "b", 2, None, None, None),
            ("full", bytearray(b"x"), "c", 3, None, -2, "k3"),
            ("full", bytearray(b"y"), "d", 4, None, 0, "k4")]
    df = spark.createDataFrame(
        rows, "ch string, raw binary, txt string, n int, at timestamp, prio int, key string")
    Queue(conn).channel_set("full", max_size=1)

    result = enqueue(df, conn.info.dsn, channel="ch", content="raw", dequeue_at="at",
                     priority="prio", dedup_key="key")
    assert (result.created, result.duplicate, result.dropped) == (3, 0, 1)
    stored = conn.execute(
        "SELECT c.name, m.content, m.dequeue_at = %s, m.priority, m.dedup_key, m.status::text"
        " FROM fairq.message m JOIN fairq.channel c ON c.id = m.channel_id ORDER BY m.content",
        [later]).fetchall()
    assert stored == [("bin", b"\x00\xff", True, 5, "k1", "scheduled"),
                      ("bin", b"\x01", False, 0, None, "ready"),
                      ("full", b"x", False, -2, "k3", "ready")]

    text = enqueue(df.where("ch = 'bin'"), conn.info.dsn, channel=F.lit("text"), content="txt")
    as_json = enqueue(df.where("ch = 'bin'"), conn.info.dsn, channel=F.lit("json"),
                      content=F.struct("n", "txt"), batch_size=1)
    assert text.created == as_json.created == 2
    contents = conn.execute(
        "SELECT c.name, m.content FROM fairq.message m JOIN fairq.channel c"
        " ON c.id = m.channel_id WHERE c.name IN ('text', 'json') ORDER BY c.name, m.content"
    ).fetchall()
    assert contents == [("json", b'{"n":1,"txt":"\xc3\xa9"}'), ("json", b'{"n":2,"txt":"b"}'),
                        ("text", b"b"), ("text", "é".encode())]
    with pytest.raises(TypeError, match="content must be"):
        enqueue(df, conn.info.dsn, channel="ch", content="n")


def test_dedup_keys_see_microseconds_and_no_session_time_zone(
        spark: Any, conn: psycopg.Connection[Any]) -> None:
    """to_json wrote times to the millisecond in the session's zone: two rows a few
    microseconds apart got one key (one job lost as a duplicate), and one row two keys
    in two zones (a rerun elsewhere enqueued it again). Struct content the same."""
    from pyspark.sql import functions as F

    from fairq.spark import dedup_key_from, enqueue

    at = datetime(2030, 1, 1, 12, tzinfo=timezone.utc)
    rows = [("t", at + timedelta(microseconds=100), "a"), ("t", at + timedelta(microseconds=200), "b")]
    df = spark.createDataFrame(rows, "tenant string, event_at timestamp, job string")
    result = enqueue(df, conn.info.dsn, channel="tenant", content=F.struct("event_at"),
                     dedup_key=dedup_key_from("tenant", "event_at"))
    assert (result.created, result.duplicate) == (2, 0)
    assert [r[0] for r in conn.execute("SELECT content FROM fairq.message ORDER BY content")] == [
        b'{"event_at":"2030-01-01T12:00:00.000100Z"}',
        b'{"event_at":"2030-01-01T12:00:00.000200Z"}']
    zone = spark.conf.get("spark.sql.session.timeZone")
    keys = []
    try:
        for name in ("UTC", "Asia/Tokyo"):
            spark.conf.set("spark.sql.session.timeZone", name)
            keys.append(df.select(dedup_key_from("tenant", "event_at")).first()[0])
    finally:
        spark.conf.set("spark.sql.session.timeZone", zone)
    assert keys[0] == keys[1]


def test_bad_rows_fail_clearly(spark: Any, conn: psycopg.Connection[Any]) -> None:
    from fairq.spark import enqueue

    # A binary channel was decoded with U+FFFD: b"\xff\x01" and b"\xfe\x01" were one.
    binary = spark.createDataFrame([(bytearray(b"\xff\x01"), "x")], "c binary, b string")
    with pytest.raises(TypeError, match="channel must be a string column"):
        enqueue(binary, conn.info.dsn, channel="c", content="b")

    nulls = spark.createDataFrame([("c", None)], "c string, b string")
    with pytest.raises(Exception, match="content must not be NULL") as excinfo:
        enqueue(nulls, conn.info.dsn, channel="c", content="b")
    assert "NullValueNotAllowed" in str(excinfo.value)  # SQLSTATE 22004, as the SQL's
    doubles = spark.createDataFrame([("c", "x", 1.9)], "c string, b string, p double")
    with pytest.raises(TypeError, match="priority must be an integer"):
        enqueue(doubles, conn.info.dsn, channel="c", content="b", priority="p")
    assert landed(conn)[0] == 0


def test_rows_fairq_refuses_are_left_out_and_counted_when_asked(
        spark: Any, conn: psycopg.Connection[Any]) -> None:
    """invalid_rows="skip": each row beyond fairq's limits is left out and counted,
    every other row lands once; without it the job fails. A bad queue name and what
    the server refuses for other reasons (here a bad setting) fail either way."""
    from fairq.spark import enqueue

    bad = {7: (None, "x", None), 40: ("", "x", None), 41: ("c" * 256, "x", None),
           42: ("nul\x00", "x", None), 99: ("t", None, None), 150: ("t", "x", "k" * 1025)}
    rows = [bad.get(i, (f"t{i % 5}", f"job-{i}", f"key-{i}")) for i in range(200)]
    df = spark.createDataFrame(rows, "tenant string, body string, key string").repartition(3)
    result = enqueue(df, conn.info.dsn, channel="tenant", content="body", dedup_key="key",
                     batch_size=50, invalid_rows="skip")
    assert (result.created, result.duplicate, result.dropped, result.invalid) == (194, 0, 0, 6)
    assert result.rows == 200
    bodies = sorted(bytes(b).decode() for (b,) in conn.execute("SELECT content FROM fairq.message"))
    assert bodies == sorted(f"job-{i}" for i in range(200) if i not in bad)
    again = enqueue(df, conn.info.dsn, channel="tenant", content="body", dedup_key="key",
                    batch_size=50, invalid_rows="skip")
    assert (again.created, again.duplicate, again.invalid) == (0, 194, 6)
    with pytest.raises(ValueError, match="queue must be non-empty text"):
        enqueue(df, conn.info.dsn, channel="tenant", content="body", queue="",
                invalid_rows="skip")
    with pytest.raises(Exception, match=r"must be non-empty|must not be NULL|0x00"):
        enqueue(df, conn.info.dsn, channel="tenant", content="body", dedup_key="key",
                batch_size=50)
    conn.execute(f'ALTER DATABASE "{conn.info.dbname}" SET fairq.events = \'nonsense\'')
    fine = spark.createDataFrame([("t", "new")], "tenant string, body string")
    with pytest.raises(Exception, match=r"fairq\.events must be"):
        enqueue(fine, conn.info.dsn, channel="tenant", content="body", invalid_rows="skip")


@pytest.mark.parametrize("ansi", ["false", "true"])
def test_values_a_cast_would_change_are_invalid_rows(
        spark: Any, conn: psycopg.Connection[Any], ansi: str) -> None:
    """Without ANSI casts a priority outside int's range wrapped (2**32 + 5 became 5)
    and a dequeue_at that is no time became NULL (due now); with them the job failed,
    whatever invalid_rows said. A time beyond Python's datetime (year 20000) crashed
    the task with an OverflowError naming nothing. Each is now an invalid row."""
    from pyspark.sql import functions as F

    from fairq.spark import enqueue
    from fairq.spark.messages import MAX_DEQUEUE_AT_US, MIN_DEQUEUE_AT_US

    old = spark.conf.get("spark.sql.ansi.enabled")
    spark.conf.set("spark.sql.ansi.enabled", ansi)
    try:
        rows = [("ok", 2**31 - 1, "2030-01-01 00:00:00"), ("low", -(2**31), None),
                ("wrap", 2**32 + 5, None), ("under", -(2**31) - 1, None),
                ("tuesday", None, "next tuesday")]
        df = spark.createDataFrame(rows, "body string, pri long, run_at string")
        result = enqueue(df, conn.info.dsn, channel=F.lit("t"), content="body", priority="pri",
                         dequeue_at="run_at", invalid_rows="skip")
        assert (result.created, result.invalid) == (2, 3)
        assert sorted(conn.execute(
            "SELECT convert_from(content, 'UTF8'), priority, dequeue_at > '2029-12-31'"
            " FROM fairq.message")) == [("low", -(2**31), False), ("ok", 2**31 - 1, True)]
        for i, reason in ((2, "priority 4294967301 is outside int's range"),
                          (4, "dequeue_at is not a time: next tuesday")):
            with pytest.raises(Exception, match=reason):
                enqueue(df.where(F.col("body") == rows[i][0]), conn.info.dsn,
                        channel=F.lit("t"), content="body", priority="pri", dequeue_at="run_at")
        edges = spark.createDataFrame(
            [(us,) for us in (MIN_DEQUEUE_AT_US - 1, MIN_DEQUEUE_AT_US, MAX_DEQUEUE_AT_US,
                              MAX_DEQUEUE_AT_US + 1)], "us long")
        times = edges.select(F.col("us").cast("string").alias("body"),
                             F.timestamp_micros("us").alias("run_at"))
        conn.execute("DELETE FROM fairq.message")
        result = enqueue(times, conn.info.dsn, channel=F.lit("t"), content="body",
                         dequeue_at="run_at", invalid_rows="skip")
        assert (result.created, result.invalid) == (2, 2)
        assert sorted(int(bytes(c)) for (c,) in conn.execute("SELECT content FROM fairq.message")
                      ) == [MIN_DEQUEUE_AT_US, MAX_DEQUEUE_AT_US]
        with pytest.raises(Exception, match="outside years 1 to 9999"):
            enqueue(times, conn.info.dsn, channel=F.lit("t"), content="body", dequeue_at="run_at")
    finally:
        spark.conf.set("spark.sql.ansi.enabled", old)


def test_json_does_not_follow_the_sessions_ignore_null_fields(spark: Any) -> None:
    """spark.sql.jsonGenerator.ignoreNullFields gave a row with a NULL field another
    dedup key and another JSON content."""
    from pyspark.sql import functions as F

    from fairq.spark import dedup_key_from
    from fairq.spark.messages import JSON_OPTIONS

    df = spark.createDataFrame([("acme", 7, None)], "tenant string, job long, note string")
    seen = set()
    try:
        for flag in ("true", "false"):
            spark.conf.set("spark.sql.jsonGenerator.ignoreNullFields", flag)
            seen.add(tuple(df.select(dedup_key_from("tenant", "job", "note"),
                                     F.to_json(F.struct("tenant", "note"), JSON_OPTIONS)).first()))
    finally:
        spark.conf.unset("spark.sql.jsonGenerator.ignoreNullFields")
    assert len(seen) == 1, seen


def test_the_limits_rows_are_checked_against_are_fairqs(conn: psycopg.Connection[Any]) -> None:
    """fairq.spark leaves out, before sending, exactly the rows the SQL refuses: at
    the edges of each limit, row_problem and message_create_batch agree."""
    from fairq._sql import MAX_NAME_BYTES, name_problem
    from fairq.spark.messages import MAX_DEDUP_KEY_BYTES, row_problem

    edges = [("é" * (MAX_NAME_BYTES // 2), b"x", None), ("c" * MAX_NAME_BYTES, b"x", None),
             ("c" * (MAX_NAME_BYTES + 1), b"x", None), ("", b"x", None), (None, b"x", None),
             ("c", None, None), ("c", b"x", "k" * MAX_DEDUP_KEY_BYTES),
             ("c", b"x", "é" * (MAX_DEDUP_KEY_BYTES // 2 + 1)), ("c", b"x", "")]
    for channel, content, key in edges:
        try:
            conn.execute("SELECT fairq.message_create_batch(%s, %s, p_dedup_keys => %s)",
                         ([channel], [content], [key]))
            refused = False
        except psycopg.DataError:
            refused = True
        assert (row_problem((channel, content, None, None, key, None)) is not None) == refused, (
            channel, content, key)
    queues = ("q" * MAX_NAME_BYTES, "q" * (MAX_NAME_BYTES + 1), "")
    for queue in queues if has_named_queues(conn) else ():  # (p_queue came with 0.7.0)
        try:
            conn.execute("SELECT fairq.message_create_batch(%s, %s, p_queue => %s)",
                         (["c"], [b"x"], queue))
            refused = False
        except psycopg.DataError:
            refused = True
        assert (name_problem(queue) is not None) == refused, queue


def test_writers_work_where_the_default_isolation_is_another(
        spark: Any, conn: psycopg.Connection[Any]) -> None:
    """fairq's calls refuse REPEATABLE READ (0.7.28): the writers' own connections set
    READ COMMITTED, as the package's pools do."""
    from fairq.spark import enqueue

    conn.execute(f'ALTER DATABASE "{conn.info.dbname}" SET default_transaction_isolation'
                 " = 'repeatable read'")
    df = spark.createDataFrame([("c", "x"), ("d", "y")], "ch string, body string")
    assert enqueue(df, conn.info.dsn, channel="ch", content="body").created == 2


def test_writers_have_the_server_drop_a_lost_executors_session(conn: psycopg.Connection[Any]) -> None:
    """A stream's part is claimed by its writer's open transaction, and a replay of the
    part waits for that claim: the writers' sessions have the server probe a silent
    connection after a minute (not the system's two hours), so a lost executor's
    transaction ends and frees its claim within about two minutes."""
    from fairq.spark.messages import connect

    with connect(conn.info.dsn) as writer:
        assert writer.info.host == "127.0.0.1"  # (over a Unix socket they read 0)
        assert writer.execute(
            "SELECT current_setting('tcp_keepalives_idle'), current_setting('tcp_keepalives_interval'),"
            " current_setting('tcp_keepalives_count'), current_setting('transaction_isolation')"
        ).fetchone() == ("60", "10", "6", "read committed")


def test_chunks_cut_by_rows_and_by_content_bytes() -> None:
    from fairq.spark.messages import chunks

    rows = [("c", b"x" * size) for size in (10, 10, 10, 40, 1, 1)]
    assert [[len(r[1]) for r in chunk] for chunk in chunks(rows, 100, max_bytes=25)] == [
        [10, 10], [10], [40], [1, 1]]  # a row larger than the budget goes alone
    assert [len(chunk) for chunk in chunks(rows, 4)] == [4, 2]


def test_bench_enqueue_reports_a_rate(spark: Any, conn: psycopg.Connection[Any]) -> None:
    from fairq.spark import bench_enqueue

    assert bench_enqueue(spark, conn.info.dsn, 2_000, channels=20, batch_size=300) > 0
    assert landed(conn)[0::2] == (2_000, 2_000)


def has_named_queues(conn: psycopg.Connection[Any]) -> bool:
    """Whether the installed fairq has named queues: message_create_batch takes p_queue."""
    row = conn.execute(
        "SELECT EXISTS (SELECT FROM pg_proc WHERE pronamespace = 'fairq'::regnamespace"
        " AND proname = 'message_create_batch' AND 'p_queue' = ANY (proargnames))").fetchone()
    return bool(row and row[0])


def test_enqueue_into_a_named_queue(spark: Any, conn: psycopg.Connection[Any]) -> None:
    from fairq.spark import enqueue

    if not has_named_queues(conn):
        pytest.skip("the installed fairq has no named queues (no p_queue)")
    result = enqueue(jobs(spark, 300, 5), conn.info.dsn, channel="tenant", content="body",
                     queue="emails", batch_size=100)
    assert (result.created, result.duplicate, result.dropped) == (300, 0, 0)
    assert conn.execute("SELECT queue, sum(size)::int FROM fairq.channels GROUP BY queue"
                        ).fetchall() == [("emails", 300)]


@pytest.mark.parametrize("queue", ["emails", "default"])
def test_without_named_queues_enqueue_fails_before_sending(
        spark: Any, conn: psycopg.Connection[Any], queue: str) -> None:
    """The package names the queue in every call, the default one too: on a fairq before
    0.7.0 (FAIRQ_TEST_EXTENSION_VERSION=0.6.0) enqueue says so before any task runs."""
    from fairq.spark import enqueue

    if has_named_queues(conn):
        pytest.skip("the installed fairq has named queues")
    with pytest.raises(RuntimeError, match="no named queues"):
        enqueue(jobs(spark, 300, 5), conn.info.dsn, channel="tenant", content="body",
                queue=queue)
    assert landed(conn)[0] == 0


# -- reading --------------------------------------------------------------------------


def _micros(value: datetime) -> int:
    return (value - EPOCH) // timedelta(microseconds=1)


def spark_rows(df: Any) -> list[tuple[Any, ...]]:
    """Rows with timestamps as epoch microseconds and binaries as bytes, sorted."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    cols = [F.unix_micros(f.name).alias(f.name) if isinstance(f.dataType, T.TimestampType)
            else F.col(f.name) for f in df.schema.fields]
    out = [tuple(bytes(v) if isinstance(v, bytearray) else v for v in row)
           for row in df.select(*cols).collect()]
    return sorted(out, key=repr)


def sql_rows(conn: psycopg.Connection[Any], query: str) -> list[tuple[Any, ...]]:
    out = [tuple(_micros(v) if isinstance(v, datetime) else v for v in row)
           for row in conn.execute(query)]  # type: ignore[arg-type]
    return sorted(out, key=repr)


def lifecycle(conn: psycopg.Connection[Any]) -> int:
    """Messages on three channels, some completed, dead, cancelled, in flight or still
    queued, with history on; returns how many settled."""
    conn.execute("SET fairq.history = on")
    queue = Queue(conn)
    queue.channel_set("c", max_attempts=2, max_concurrency=3)
    for i in range(60):
        queue.send("abc"[i % 3], f"job {i}".encode(), priority=i % 4)
    for i, message in enumerate(queue.dequeue(timedelta(minutes=5), 40)):
        if i % 5 == 0:
            message.fail(f"error {i}")
        elif i % 5 != 1:
            message.complete()
    cancelled = [queue.cancel(message_id) for message_id in range(1, 61)]
    return 32 + sum(status is CancelStatus.CANCELLED for status in cancelled)


def test_reads_name_the_queue_and_a_pause_until_resumed(spark: Any,
                                                        conn: psycopg.Connection[Any]) -> None:
    from fairq.spark import read

    emails = Queue(conn, name="emails")
    emails.channel_set("a", weight=4)
    emails.send("a", b"x")
    emails.channel_pause("a")
    url, props = jdbc_url(conn.info.dsn), jdbc_properties(conn.info.dsn)
    [row] = read(spark, url, "channels", properties=props).collect()
    assert (row["queue"], row["channel"], row["weight"]) == ("emails", "a", 4)
    # 'infinity' is Spark's largest timestamp, as it is datetime.max for the binding.
    assert row["paused_until"].year == row["next_dequeue_at"].year == 9999


def test_reads_return_what_sql_returns(spark: Any, conn: psycopg.Connection[Any]) -> None:
    from fairq.spark import read

    settled = lifecycle(conn)
    assert 40 < settled < 60
    url, props = jdbc_url(conn.info.dsn), jdbc_properties(conn.info.dsn)
    expected = {
        "channels": "SELECT * FROM fairq.channels",
        "dead_letters": "SELECT * FROM fairq.dead_letters",
        "message_history": "SELECT * FROM fairq.message_history",
    }
    counts = {}
    for what, query in expected.items():
        df = read(spark, url, what, properties=props, num_partitions=3)
        want = sql_rows(conn, query)
        assert df.columns == [d.name for d in conn.execute(query + " LIMIT 0").description or []]
        assert spark_rows(df) == want, what
        counts[what] = len(want)
    assert counts == {"channels": 3, "dead_letters": 8, "message_history": settled}
    assert read(spark, url, "message_history", properties=props).rdd.getNumPartitions() == 2
    assert read(spark, url, "channels", properties=props).rdd.getNumPartitions() == 1

    # since: rows settled at or after a moment; bounds given skip the min/max query.
    cut = conn.execute("SELECT settled_at FROM fairq.message_history ORDER BY settled_at"
                       " OFFSET 20 LIMIT 1").fetchone()[0]  # type: ignore[index]
    recent = read(spark, url, "message_history", properties=props, since=cut, bounds=(1, 60))
    assert spark_rows(recent) == sql_rows(
        conn, f"SELECT * FROM fairq.message_history WHERE settled_at >= '{cut.isoformat()}'")
    empty = read(spark, url, "dead_letters", properties=props,
                 since=datetime(2100, 1, 1), num_partitions=4)
    assert empty.count() == 0
    with pytest.raises(ValueError, match="what must be one of"):
        read(spark, url, "message", properties=props)
    with pytest.raises(ValueError, match="num_partitions must be at least 1, not -3"):
        read(spark, url, "message_history", properties=props, num_partitions=-3)
    with pytest.raises(ValueError, match="fetch_size must be at least 1"):
        read(spark, url, "message_history", properties=props, fetch_size=0)


def test_jdbc_url_from_libpq_dsn() -> None:
    assert jdbc_url("host=127.0.0.1 port=5433 user=bob dbname=app") == \
        "jdbc:postgresql://127.0.0.1:5433/app"
    assert jdbc_url("postgresql://bob:s%40cret@db.example:6000/my%20db?sslmode=require"
                    "&application_name=rep") == \
        "jdbc:postgresql://db.example:6000/my%20db?sslmode=require&ApplicationName=rep"
    assert jdbc_properties("postgresql://bob:s%40cret@db.example/x") == \
        {"driver": "org.postgresql.Driver", "user": "bob", "password": "s@cret"}
    assert jdbc_url("host=a,b port=1,2 dbname=d") == "jdbc:postgresql://a:1,b:2/d"
    assert jdbc_url("host=::1 dbname=d") == "jdbc:postgresql://[::1]:5432/d"
    with pytest.raises(ValueError, match="Unix-domain socket"):
        jdbc_url("host=/var/run/postgresql dbname=d")


# -- the report -----------------------------------------------------------------------

BASE = datetime(2030, 1, 1, 10, 0, tzinfo=timezone.utc)


# matplotlib reads $...$ in a label as maths: this name made the report fail.
DOLLARS = "x$\\frac$"


def known_history(conn: psycopg.Connection[Any]) -> None:
    """120 history rows over four channels and three hours, with ms-precision times; a
    channel "a" in a second queue is another channel."""
    rnd = random.Random(7)
    rows = []
    for i in range(120):
        queue, channel = rnd.choices([("default", "a"), ("default", "b"), ("default", "c"),
                                      ("default", DOLLARS), ("emails", "a")],
                                     weights=[5, 3, 1, 1, 2])[0]
        created = BASE + timedelta(milliseconds=rnd.randrange(3 * 3600 * 1000))
        outcome = rnd.choices(["completed", "dead", "cancelled"], weights=[8, 2, 1])[0]
        first = None
        if outcome != "cancelled" or rnd.random() < 0.5:
            first = created + timedelta(milliseconds=rnd.randrange(1, 200_000))
        settled = (first or created) + timedelta(milliseconds=rnd.randrange(0, 60_000))
        attempts = 0 if first is None else rnd.choice([1, 1, 1, 2, 3])
        rows.append((i + 1, queue, channel, rnd.randrange(3), created, first, settled, attempts,
                     outcome))
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO fairq.message_history (id, queue, channel, priority, created_at,"
                        " first_dequeued_at, settled_at, num_attempts, outcome)"
                        " VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s)", rows)


FIGURES = """
    count(*) AS settled,
    count(*) FILTER (WHERE outcome = 'completed') AS completed,
    count(*) FILTER (WHERE outcome = 'dead') AS dead,
    count(*) FILTER (WHERE outcome = 'cancelled') AS cancelled,
    avg(num_attempts)::float8 AS mean_attempts,
    (count(*) FILTER (WHERE outcome = 'dead'))::float8
        / nullif(count(*) FILTER (WHERE outcome IN ('completed', 'dead')), 0) AS dead_letter_rate,
    percentile_cont(0.5) WITHIN GROUP (ORDER BY wait) AS wait_p50_ms,
    percentile_cont(0.95) WITHIN GROUP (ORDER BY wait) AS wait_p95_ms,
    percentile_cont(0.99) WITHIN GROUP (ORDER BY wait) AS wait_p99_ms,
    percentile_cont(0.5) WITHIN GROUP (ORDER BY proc) AS proc_p50_ms,
    percentile_cont(0.95) WITHIN GROUP (ORDER BY proc) AS proc_p95_ms,
    percentile_cont(0.99) WITHIN GROUP (ORDER BY proc) AS proc_p99_ms"""

HISTORY = """(SELECT *, extract(epoch FROM first_dequeued_at - created_at)::float8 * 1000 AS wait,
                     CASE WHEN outcome IN ('completed', 'dead')
                          THEN extract(epoch FROM settled_at - first_dequeued_at)::float8 * 1000
                     END AS proc
                FROM fairq.message_history WHERE settled_at >= %(since)s) h"""

FAIRNESS = """
WITH h AS (SELECT * FROM fairq.message_history WHERE settled_at >= %(since)s),
start AS (SELECT floor(extract(epoch FROM min(coalesce(first_dequeued_at, settled_at)))
                       / %(w)s)::bigint AS start_k FROM h),
waiting AS (
    SELECT DISTINCT queue, channel, k FROM h, start,
           generate_series(greatest(floor(extract(epoch FROM created_at) / %(w)s)::bigint,
                                    start_k),
                           floor(extract(epoch FROM coalesce(first_dequeued_at, settled_at))
                                 / %(w)s)::bigint) AS k),
delivered AS (
    SELECT queue, channel, floor(extract(epoch FROM first_dequeued_at) / %(w)s)::bigint AS k,
           count(*) AS x
      FROM h WHERE first_dequeued_at IS NOT NULL GROUP BY 1, 2, 3)
SELECT to_timestamp(k * %(w)s) AS window_start, to_timestamp((k + 1) * %(w)s) AS window_end,
       queue, count(*) AS channels, sum(coalesce(x, 0))::bigint AS deliveries,
       (sum(coalesce(x, 0))^2 / nullif(count(*) * sum(x * x), 0))::float8 AS jain_index
  FROM waiting LEFT JOIN delivered USING (queue, channel, k) GROUP BY k, queue ORDER BY k, queue"""


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(a - b) <= 1e-9 * max(1.0, abs(b))
    return bool(a == b)


def assert_same(got: list[dict[str, Any]], want: list[dict[str, Any]], table: str) -> None:
    assert len(got) == len(want), table
    for g, w in zip(got, want, strict=True):
        for key, value in w.items():
            assert _close(g[key], value), (table, key, g, w)


def test_report_figures_equal_sql(spark: Any, conn: psycopg.Connection[Any],
                                  tmp_path: Path) -> None:
    from fairq import report

    known_history(conn)
    since = BASE + timedelta(minutes=20)
    params = {"since": since, "w": 600}
    out = tmp_path / "report"
    assert report.main(["--dsn", conn.info.dsn, "--out", str(out), "--since", since.isoformat(),
                        "--window", "600", "--top", "2"]) == 0

    def parquet(name: str) -> list[dict[str, Any]]:
        df = spark.read.parquet(str(out / "parquet" / name))
        return [dict(zip(df.columns, row, strict=True)) for row in spark_rows(df)]

    def sql(query: str) -> list[dict[str, Any]]:
        with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
            return [{k: _micros(v) if isinstance(v, datetime) else v for k, v in row.items()}
                    for row in cur.execute(query, params)]  # type: ignore[arg-type]

    want_channels = sql(f"SELECT queue, channel, {FIGURES} FROM {HISTORY} GROUP BY queue, channel"
                        " ORDER BY queue, channel")
    assert [(r["queue"], r["channel"]) for r in want_channels] == [
        ("default", "a"), ("default", "b"), ("default", "c"), ("default", DOLLARS),
        ("emails", "a")]
    assert_same(sorted(parquet("channels"), key=lambda r: (r["queue"], r["channel"])),
                want_channels, "channels")
    want_hours = sql(f"SELECT date_trunc('hour', settled_at, 'UTC') AS hour,"
                     f" count(DISTINCT (queue, channel)) AS channels, {FIGURES}"
                     f" FROM {HISTORY} GROUP BY 1 ORDER BY 1")
    assert len(want_hours) >= 3
    assert_same(sorted(parquet("hours"), key=lambda r: r["hour"]), want_hours, "hours")
    want_summary = sql(f"SELECT count(DISTINCT (queue, channel)) AS channels, min(settled_at) AS"
                       f" first_settled_at, max(settled_at) AS last_settled_at, {FIGURES}"
                       f" FROM {HISTORY}")
    assert want_summary[0]["settled"] < 120  # --since left some out
    assert_same(parquet("summary"), want_summary, "summary")
    assert_same(sorted(parquet("channel_hours"),
                       key=lambda r: (r["hour"], r["queue"], r["channel"])),
                sql("SELECT date_trunc('hour', settled_at, 'UTC') AS hour, queue, channel,"
                    " count(*) AS settled, count(*) FILTER (WHERE outcome = 'completed')"
                    " AS completed FROM fairq.message_history WHERE settled_at >= %(since)s"
                    " GROUP BY 1, 2, 3 ORDER BY 1, 2, 3"), "channel_hours")
    assert_same(sorted(parquet("attempts"),
                       key=lambda r: (r["queue"], r["channel"], r["num_attempts"])),
                sql("SELECT queue, channel, num_attempts, count(*) AS messages FROM"
                    " fairq.message_history WHERE settled_at >= %(since)s GROUP BY 1, 2, 3"
                    " ORDER BY 1, 2, 3"), "attempts")
    want_fairness = sql(FAIRNESS)
    assert len(want_fairness) > 10
    assert any(r["jain_index"] is not None and r["jain_index"] < 1 for r in want_fairness)
    fairness = sorted(parquet("fairness"), key=lambda r: (r["window_start"], r["queue"]))
    assert_same(fairness, want_fairness, "fairness")
    summary = parquet("summary")[0]
    jains = [r["jain_index"] for r in want_fairness if r["jain_index"] is not None]
    assert _close(summary["jain_mean"], sum(jains) / len(jains))
    assert _close(summary["jain_min"], min(jains))

    # The CSV files say the same as the Parquet ones, timestamps in ISO 8601 UTC.
    with open(out / "csv" / "hours.csv", newline="") as fh:
        hours_csv = list(csv.DictReader(fh))
    assert [datetime.fromisoformat(r["hour"].replace("Z", "+00:00")) for r in hours_csv] == \
        [EPOCH + timedelta(microseconds=r["hour"]) for r in want_hours]
    assert [float(r["wait_p95_ms"]) for r in hours_csv] == \
        pytest.approx([r["wait_p95_ms"] for r in want_hours])
    page = (out / "index.html").read_text()
    for name in report.TABLES:
        assert f'href="csv/{name}.csv"' in page and f'href="parquet/{name}/"' in page
        assert (out / "csv" / f"{name}.csv").stat().st_size > 0
        assert list((out / "parquet" / name).glob("*.parquet"))
    charts = sorted(p.name for p in (out / "charts").glob("*.png"))
    assert charts == ["attempts.png", "channels.png", "fairness.png", "proc_time.png",
                      "throughput.png", "wait_time.png"]
    for chart in charts:
        assert f'src="charts/{chart}"' in page
        assert (out / "charts" / chart).read_bytes()[:4] == b"\x89PNG"


def test_report_of_an_empty_history(spark: Any, conn: psycopg.Connection[Any],
                                    tmp_path: Path) -> None:
    from fairq import report

    assert report.main(["--dsn", conn.info.dsn, "--out", str(tmp_path)]) == 0
    summary = spark.read.parquet(str(tmp_path / "parquet" / "summary")).collect()
    assert summary[0]["settled"] == 0 and summary[0]["windows"] == 0
    assert [summary[0][outcome] for outcome in ("completed", "dead", "cancelled")] == [0, 0, 0]
    assert "no history" not in (tmp_path / "index.html").read_text()  # charts say it
    assert (tmp_path / "charts" / "fairness.png").is_file()


def test_report_command_line() -> None:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fairq.report", *args], env=env,
                              capture_output=True, text=True, timeout=60)

    shown = run("--help")
    assert shown.returncode == 0 and "--since" in shown.stdout
    assert run("--out", "x").returncode == 2  # no DSN
    assert run("--dsn", "host=/tmp dbname=x", "--out", "x").returncode == 2
    bad_since = run("--dsn", "dbname=x", "--out", "x", "--since", "yesterday")
    assert bad_since.returncode == 2 and "24h" in bad_since.stderr
    # A negative count failed inside Spark's JDBC source, after the session started.
    for option in ("--partitions", "--top"):
        for value in ("-3", "0"):
            refused = run("--dsn", "dbname=x", "--out", "x", option, value)
            assert refused.returncode == 2 and option in refused.stderr, refused.stderr
            assert "Traceback" not in refused.stderr


def test_parse_since() -> None:
    from fairq.report import parse_since

    now = datetime(2030, 1, 2, tzinfo=timezone.utc)
    assert parse_since("24h", now) == datetime(2030, 1, 1, tzinfo=timezone.utc)
    assert parse_since("90m", now) == now - timedelta(minutes=90)
    assert parse_since("2030-01-01T05:00:00") == datetime(2030, 1, 1, 5, tzinfo=timezone.utc)
    assert parse_since("2030-01-01T05:00:00+02:00") == datetime(2030, 1, 1, 3, tzinfo=timezone.utc)


def test_report_fairness_is_bounded_by_the_period(spark: Any) -> None:
    """A message delayed 30 days made one row per minute of its wait: 43,201 windows
    for one message (ten years at one-second windows exhausted the heap). Waiting
    windows start at the history's first delivery, and a channel's waits are merged
    before they are spread over windows."""
    from fairq.report.queries import compute

    t0 = datetime(2030, 1, 1, tzinfo=timezone.utc)
    first = t0 + timedelta(days=30)
    rows = [(i, "default", "t", 0, t0, first, first + timedelta(seconds=1), 1, "completed")
            for i in range(3)]
    history = spark.createDataFrame(rows, "id long, queue string, channel string, priority int,"
                                    " created_at timestamp, first_dequeued_at timestamp,"
                                    " settled_at timestamp, num_attempts int, outcome string")
    fairness = compute(history)["fairness"].collect()
    assert [(r.channels, r.deliveries) for r in fairness] == [(1, 3)]
