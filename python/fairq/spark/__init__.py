"""fairq from Apache Spark: enqueue a DataFrame, feed a streaming query into the queue,
read the queue's tables into Spark.

``enqueue`` writes each partition of a DataFrame through ``fairq.message_create_batch``
(one psycopg connection per partition, one transaction per batch). ``QueueSink`` (a
``foreachBatch`` function) and ``stream_to_queue`` write each micro-batch of a
Structured Streaming query exactly once, also when Spark replays it after a failure
(see :mod:`fairq.spark.stream`). ``read`` loads ``fairq.channels``,
``fairq.dead_letters`` or ``fairq.message_history`` through Spark's JDBC source. All
need a classic (non-Connect) SparkSession; ``read`` needs the PostgreSQL JDBC driver on
Spark's classpath (``spark.jars``; on Debian the ``libpostgresql-jdbc-java`` package
installs ``/usr/share/java/postgresql.jar``).

**enqueue under task retries.** Spark re-runs a failed task from the start of its
partition, and a task may fail after some of its batches were committed. With a dedup
key per row, the rerun finds those rows still queued and reports them as
``duplicate``: every row is enqueued once. Without a dedup key, a retried task
enqueues the rows its failed attempt had already committed a second time. Derive a
deterministic key from the columns that identify a row with :func:`dedup_key_from`.
(A dedup key only guards while its message exists: a row whose message was already
completed by a worker when the retry runs is enqueued again.)
"""

from fairq.spark.bench import bench_enqueue
from fairq.spark.dataframe import EnqueueResult, enqueue
from fairq.spark.jdbc import DEFAULT_JDBC_JAR, jdbc_properties, jdbc_url, read
from fairq.spark.messages import InvalidRows, dedup_key_from
from fairq.spark.session import local_session
from fairq.spark.stream import QueueSink, SinkBatchResult, stream_to_queue

__all__ = [
    "DEFAULT_JDBC_JAR",
    "EnqueueResult",
    "InvalidRows",
    "QueueSink",
    "SinkBatchResult",
    "bench_enqueue",
    "dedup_key_from",
    "enqueue",
    "jdbc_properties",
    "jdbc_url",
    "local_session",
    "read",
    "stream_to_queue",
]
