"""The bench's database: fairq emptied between scenarios, the reference tables beside it
(the plain-SQL floor, the seed article's FIFO queue, the producers' backlog gate), bulk
loading, and the sizes and statistics of fairq's tables."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from fairq.bench.progress import Log
from fairq.bench.sizes import Sizes
from fairq.bench.threads import Threads

__all__ = ["LOCK_MS", "PAYLOAD", "PAYLOAD_SQL", "SCHEMA", "Conn", "DatabaseInUse", "check",
           "clean_up", "connect", "load", "prepare_database", "relation_sizes", "reset", "retrying",
           "scalar", "settle", "table_stats"]

Conn = psycopg.Connection[tuple[Any, ...]]

PAYLOAD = bytes(range(100))
PAYLOAD_SQL = "'\\x" + PAYLOAD.hex() + "'::bytea"
LOCK_MS = 300_000
SCHEMA = "fairq_bench"


def connect(dsn: str) -> Conn:
    return psycopg.connect(dsn, autocommit=True)


def scalar(conn: Conn, sql: str, params: Sequence[Any] | None = None) -> Any:
    row = conn.execute(sql, params).fetchone()
    return None if row is None else row[0]


def retrying(conn: Conn, sql: str, params: Sequence[Any], counter: list[int],
             lock: threading.Lock) -> list[tuple[Any, ...]]:
    """Runs one autocommit call, again after a deadlock (as a real client would)."""
    for attempt in range(20):
        try:
            return conn.execute(sql, params).fetchall()
        except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):
            with lock:
                counter[0] += 1
            time.sleep(0.001 * (attempt + 1))
    raise RuntimeError(f"still deadlocking after 20 attempts: {sql}")


FLOOR_DDL = f"""
CREATE TABLE {SCHEMA}.floor (
    id           bigserial   PRIMARY KEY,
    channel      integer     NOT NULL,
    status       smallint    NOT NULL DEFAULT 0,
    locked_until timestamptz,
    attempts     integer     NOT NULL DEFAULT 0,
    content      bytea       NOT NULL
);
CREATE INDEX floor_ready_ix ON {SCHEMA}.floor (id) WHERE status = 0;
"""

# One row the producers of a throughput run read before each call: the backlog gate.
GATE_DDL = f"""
CREATE TABLE {SCHEMA}.gate (open boolean NOT NULL);
INSERT INTO {SCHEMA}.gate VALUES (true);
"""

# The seed article's simple FIFO queue (seeds/000: "A simple FIFO queue").
FIFO_DDL = f"""
CREATE TABLE {SCHEMA}.message (
    id      bigserial PRIMARY KEY,
    content bytea     NOT NULL
);
CREATE FUNCTION {SCHEMA}.message_create(p_content bytea) RETURNS void AS $$
BEGIN
    INSERT INTO {SCHEMA}.message (content) VALUES (p_content);
END;
$$ LANGUAGE plpgsql;
CREATE FUNCTION {SCHEMA}.message_dequeue() RETURNS bytea AS $$
DECLARE
    v_message RECORD;
BEGIN
    SELECT id, content FROM {SCHEMA}.message
     ORDER BY id ASC
     LIMIT 1
       FOR UPDATE SKIP LOCKED
      INTO v_message;
    IF v_message.id IS NULL THEN
        RETURN NULL::bytea;
    END IF;
    DELETE FROM {SCHEMA}.message WHERE id = v_message.id;
    RETURN v_message.content;
END;
$$ LANGUAGE plpgsql;
"""

FAIRQ_TABLES = ("fairq.message", "fairq.channel", "fairq.channel_size", "fairq.channel_size_change",
                "fairq.channel_wake", "fairq.dead_letter", "fairq.message_history", "fairq.queue")


class DatabaseInUse(Exception):
    """The database holds fairq data: the bench, which empties fairq's tables, refuses it."""


def prepare_database(dsn: str) -> None:
    """Makes sure fairq is installed and empty, and creates the reference schema."""
    with connect(dsn) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS fairq")
        # Every table the bench empties (it checked two, and wiped dead letters, history
        # and queues' pauses).
        held = [table for table in FAIRQ_TABLES
                if scalar(conn, f"SELECT EXISTS (SELECT FROM {table})")]
        if held:
            raise DatabaseInUse(f"the database already holds fairq data"
                               f" ({', '.join(held)}); point --dsn at a database dedicated"
                               " to the bench")
    reset(dsn)


def clean_up(dsn: str) -> None:
    """Leaves a database as prepare_database found it: fairq's tables empty, no
    reference schema (so the next run accepts it)."""
    with connect(dsn) as conn:
        conn.execute(f"TRUNCATE {', '.join(FAIRQ_TABLES)}")
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")


def reset(dsn: str) -> None:
    """Empties fairq's tables and recreates the reference tables; checks consistency."""
    with connect(dsn) as conn:
        conn.execute(f"TRUNCATE {', '.join(FAIRQ_TABLES)}")
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        conn.execute(f"CREATE SCHEMA {SCHEMA}")
        conn.execute(FLOOR_DDL)
        conn.execute(FIFO_DDL)
        conn.execute(GATE_DDL)
        problems = conn.execute("SELECT * FROM fairq.check()").fetchall()
        if problems:
            raise RuntimeError(f"fairq.check() after reset: {problems}")
        settle(conn)


def settle(conn: Conn) -> None:
    """Starts the next scenario from a clean slate: the load's dead rows vacuumed (or
    autovacuum would catch up on them during the measurement), statistics fresh,
    dirty pages written."""
    conn.execute("VACUUM ANALYZE")
    with contextlib.suppress(psycopg.Error):
        conn.execute("CHECKPOINT")


def check(dsn: str) -> list[tuple[Any, ...]]:
    with connect(dsn) as conn:
        return conn.execute("SELECT * FROM fairq.check()").fetchall()


def load(dsn: str, channel_of: Callable[[int], str], total: int, sizes: Sizes,
         log: Log | None = None, label: str = "", queue: str = "default") -> float:
    """Creates ``total`` messages in ``queue`` through message_create_batch; returns the
    rows/s."""
    if total <= 0:
        return 0.0
    chunks = [(start, min(total, start + sizes.load_chunk))
              for start in range(0, total, sizes.load_chunk)]
    lock = threading.Lock()
    done = [0]
    begun = time.monotonic()
    last_report = [begun]

    threads = Threads()

    def worker(index: int) -> None:
        with connect(dsn) as conn:
            for start, end in chunks[index::sizes.load_workers]:
                if threads.stop.is_set():  # the run was interrupted
                    return
                channels = [channel_of(i) for i in range(start, end)]
                conn.execute(
                    "SELECT count(*) FROM fairq.message_create_batch(%s::text[], %s::bytea[],"
                    " p_queue => %s)", (channels, [PAYLOAD] * len(channels), queue))
                with lock:
                    done[0] += end - start
                    now = time.monotonic()
                    if log and now - last_report[0] > 10:
                        last_report[0] = now
                        log(f"  loading {label}: {done[0]:,}/{total:,} "
                            f"({done[0] / (now - begun):,.0f} rows/s)")

    for index in range(min(sizes.load_workers, len(chunks))):
        threads.start(worker, index)
    threads.join()
    return total / (time.monotonic() - begun)


RELATIONS = ("fairq.message", "fairq.channel")


def relation_sizes(conn: Conn) -> dict[str, dict[str, int]]:
    """Heap and index sizes (bytes) of fairq's hot tables, index by index."""
    out: dict[str, dict[str, int]] = {}
    for rel in RELATIONS:
        sizes = {"table": int(scalar(conn, "SELECT pg_relation_size(%s::regclass)", (rel,))),
                 "indexes": int(scalar(conn, "SELECT pg_indexes_size(%s::regclass)", (rel,)))}
        for name, size in conn.execute(
                "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid)"
                "  FROM pg_index WHERE indrelid = %s::regclass ORDER BY 1", (rel,)):
            sizes[str(name)] = int(size)
        out[rel] = sizes
    return out


def table_stats(conn: Conn) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for row in conn.execute(
            "SELECT schemaname || '.' || relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del,"
            "       n_live_tup, n_dead_tup, autovacuum_count, autoanalyze_count"
            "  FROM pg_stat_user_tables WHERE schemaname = 'fairq'"
            "   AND relname IN ('message', 'channel')"):
        out[str(row[0])] = dict(zip(
            ("n_tup_ins", "n_tup_upd", "n_tup_hot_upd", "n_tup_del", "n_live_tup",
             "n_dead_tup", "autovacuum_count", "autoanalyze_count"), row[1:], strict=True))
    return out
