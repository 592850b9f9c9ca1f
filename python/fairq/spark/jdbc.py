"""Reading fairq's observer relations into Spark through its JDBC source."""

from __future__ import annotations

import getpass
import os
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from psycopg.conninfo import conninfo_to_dict

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: Where Debian's libpostgresql-jdbc-java puts the PostgreSQL JDBC driver.
DEFAULT_JDBC_JAR = "/usr/share/java/postgresql.jar"
JDBC_DRIVER = "org.postgresql.Driver"

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
    "channels": ("queue, channel, max_concurrency, release_interval_ms, max_size,"
                 " max_attempts, weight, paused_until, size, ready, scheduled, in_flight,"
                 " next_dequeue_at", "fairq.channels", None, None),
    "dead_letters": ("id, queue, channel, content, state, num_attempts, error, created_at,"
                     " died_at", "fairq.dead_letters", "id", "died_at"),
    "message_history": ("id, queue, channel, priority, created_at, first_dequeued_at,"
                        " settled_at, num_attempts, outcome", "fairq.message_history", "id",
                        "settled_at"),
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
    if num_partitions is not None and num_partitions < 1:
        raise ValueError(f"num_partitions must be at least 1, not {num_partitions}")
    if fetch_size < 1:
        raise ValueError(f"fetch_size must be at least 1, not {fetch_size}")
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
