"""A local SparkSession set up the way fairq's tests and benchmarks run Spark."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from fairq.spark.jdbc import DEFAULT_JDBC_JAR

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


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
