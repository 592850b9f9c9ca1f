"""``fairq bench``: fairq against the physical floor, measured side by side.

Every scenario is measured in the same run as its reference, on the same server:

* throughput (``pgbench -M prepared`` custom scripts, 8 producer + 8 consumer clients
  in two concurrent pgbench processes, bounded by ``-T``): the plain-SQL *floor*
  (INSERT; ``UPDATE … WHERE id = (SELECT … FOR UPDATE SKIP LOCKED LIMIT 1)``; DELETE —
  three transactions per message), the seed article's FIFO queue, and fairq's
  create → dequeue → complete cycle over 100 channels; then all of it again with 100
  messages per call, and fairq's cycle while another session holds a REPEATABLE READ
  snapshot open. Two references carry no target: the floor under the same held
  snapshot, and fairq's batched cycle over ``wide_channels`` (1,000) channels. The
  same method is applied to floor, FIFO and fairq: producers
  pause while the backlog is at ``throughput_backlog`` (a steady state, see
  ``_gatekeeper``), and messages consumed = sequence advance minus backlog growth,
  over the measured seconds;
* dequeue latency (one client, Python, sequential calls): median against queue depth
  and against the number of non-empty channels;
* fairness (Python threads): p99 create → dequeue wait of light tenants with and
  without a heavy tenant's backlog, and Jain's index of service among backlogged
  tenants;
* soak (Python threads, batches of 100): throughput over a long run, table and index
  sizes before and after;
* tenants (fairq.bench_tenants): the throughput cycle, single and batched, over 100 to
  100,000 channels and over a Zipf spread, each against the floor, interleaved;
* churn (fairq.bench_tenants): the soak's driver over tenants that come and go;
  throughput and fairq.channel's size and rows per tenth.

Without ``--dsn`` a throwaway cluster with durable settings is started on 127.0.0.1
and removed afterwards. With ``--dsn`` the database must be dedicated to the bench:
the bench refuses to start if fairq already holds data, and it truncates fairq's
tables between scenarios.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import psycopg

__all__ = ["FULL", "QUICK", "TARGETS", "TINY", "Sizes", "main", "run"]

Conn = psycopg.Connection[tuple[Any, ...]]
Log = Callable[[str], None]

PAYLOAD = bytes(range(100))
PAYLOAD_SQL = "'\\x" + PAYLOAD.hex() + "'::bytea"
LOCK_MS = 300_000
SCHEMA = "fairq_bench"


@dataclass(frozen=True)
class Sizes:
    """How big every scenario is."""

    name: str
    throughput_s: int = 30          # each pgbench throughput run (-T)
    producers: int = 8
    consumers: int = 8
    channels: int = 100
    channel_spread: str = "uniform"  # how producers pick channels: "uniform" or "zipf"
    prefill: int = 4_000            # backlog before a throughput run, so consumers start busy
    throughput_backlog: int = 8_000  # producers of a throughput run pause above this backlog
    batch: int = 100
    wide_channels: int = 1_000      # the batched reference where channels outnumber batches
    depth_levels: tuple[int, ...] = (1_000, 10_000, 100_000, 1_000_000)
    depth_channels: int = 100
    latency_samples: int = 1_000
    channel_levels: tuple[int, ...] = (10, 100, 1_000, 10_000, 100_000)
    fair_heavy: int = 100_000
    fair_light_tenants: int = 20
    fair_light_rate: float = 200.0  # light messages per second, all light tenants together
    fair_consumers: int = 4
    fair_phase_s: float = 20.0
    jain_tenants: int = 10
    jain_window_s: float = 10.0
    soak_messages: int = 1_000_000
    soak_producers: int = 8
    soak_consumers: int = 8
    soak_backlog: int = 20_000      # producers pause above this backlog
    soak_max_s: float = 900.0       # the soak also stops here (then reports what it did)
    load_chunk: int = 300           # rows per message_create_batch call when loading
    load_workers: int = 2
    tenant_levels: tuple[int, ...] = (100, 1_000, 10_000, 100_000)  # the tenant axis
    churn_messages: int = 1_000_000
    churn_tenants: int = 100_000    # tenants the churn soak ever sees
    churn_window: int = 1_000       # tenants receiving messages at any one time
    churn_max_s: float = 1_200.0    # the churn soak also stops here


FULL = Sizes("full")
QUICK = Sizes(
    "quick", throughput_s=6, prefill=2_000, throughput_backlog=4_000,
    depth_levels=(1_000, 10_000, 100_000),
    latency_samples=300, channel_levels=(10, 1_000, 10_000), fair_heavy=10_000,
    fair_phase_s=6.0, jain_window_s=4.0, soak_messages=100_000, soak_backlog=10_000,
    soak_max_s=40.0, tenant_levels=(100, 1_000, 10_000), churn_messages=100_000,
    churn_tenants=10_000, churn_max_s=60.0)
TINY = Sizes(
    "tiny", throughput_s=1, producers=2, consumers=2, channels=10, prefill=200, batch=20,
    wide_channels=40,
    throughput_backlog=400,
    depth_levels=(100, 1_000), depth_channels=10, latency_samples=30,
    channel_levels=(10, 200), fair_heavy=300, fair_light_tenants=4, fair_light_rate=50.0,
    fair_consumers=2, fair_phase_s=1.0, jain_tenants=4, jain_window_s=0.5,
    soak_messages=2_000, soak_producers=2, soak_consumers=2, soak_backlog=1_000,
    soak_max_s=60.0, load_chunk=500, tenant_levels=(10, 100), churn_messages=2_000,
    churn_tenants=200, churn_window=20, churn_max_s=60.0)

# (key, comparison, threshold) for the full run on the project's 2-core machine. A key
# with dots names a nested value ("tenants.1000.single_vs_floor" is
# results["tenants"]["1000"]["single_vs_floor"]); a threshold that is a string is the
# key of another result of the same run (a relative target). The batched cycle over
# 100 channels (batched_msgs_per_s, batched_vs_floor), where one batch takes every
# channel, is reported without a target.
TARGETS: tuple[tuple[str, str, float | str], ...] = (
    ("cycle_vs_floor", ">=", 0.65),
    ("tenants.1000.single_vs_floor", ">=", 0.5),
    ("tenants.1000.batched_vs_floor", ">=", 0.5),
    ("tenants.10000.single_vs_floor", ">=", 0.5),
    ("tenants.10000.batched_vs_floor", ">=", 0.5),
    ("tenants.100000.single_vs_floor", ">=", 0.4),
    ("tenants.100000.batched_vs_floor", ">=", 0.4),
    ("depth_latency_ratio", "<=", 1.3),
    ("channels_latency_ratio", "<=", 1.3),
    ("fairness_wait_ratio", "<=", 1.5),
    ("jain_index", ">=", 0.99),
    ("held_snapshot_ratio", ">=", "floor_held_snapshot_ratio"),
    ("soak_ratio", ">=", 0.9),
    ("churn.last_vs_first", ">=", 0.9),
    ("spark_enqueue_rows_per_s", ">=", 20_000),
)

# Rows a DataFrame enqueues in the --spark scenario, by size preset.
SPARK_ROWS = {"full": 1_000_000, "quick": 100_000, "tiny": 2_000}

DURABLE_SETTINGS = {
    "fsync": "on", "synchronous_commit": "on", "full_page_writes": "on",
    "max_connections": "200", "shared_buffers": "1GB",
}


# --------------------------------------------------------------------------- helpers

class Progress:
    """Progress lines on stderr, stamped with the seconds since the start."""

    def __init__(self, stream: Any = None) -> None:
        self.start = time.monotonic()
        self.stream = stream if stream is not None else sys.stderr

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self.start:7.1f}s] {message}", file=self.stream, flush=True)


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


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one takes everything."""
    total = sum(values)
    squares = sum(v * v for v in values)
    if not values or squares == 0:
        return math.nan
    return total * total / (len(values) * squares)


def ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


class Threads:
    """Runs functions in threads and re-raises the first exception on join."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self.stop = threading.Event()

    def start(self, target: Callable[..., None], *args: Any) -> None:
        def wrapped() -> None:
            try:
                target(*args)
            except BaseException as exc:  # reported by join()
                self.errors.append(exc)
                self.stop.set()

        thread = threading.Thread(target=wrapped, daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self.threads:
            left = None if deadline is None else max(0.1, deadline - time.monotonic())
            thread.join(left)
        if any(t.is_alive() for t in self.threads):
            self.stop.set()
            for thread in self.threads:
                thread.join(30)
        if self.errors:
            raise self.errors[0]


# --------------------------------------------------------------------------- the database

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

FAIRQ_TABLES = ("fairq.message", "fairq.channel", "fairq.channel_size", "fairq.channel_wake",
                "fairq.dead_letter", "fairq.message_history")


def prepare_database(dsn: str) -> None:
    """Makes sure fairq is installed and empty, and creates the reference schema."""
    with connect(dsn) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS fairq")
        busy = scalar(conn, "SELECT (SELECT count(*) FROM (SELECT 1 FROM fairq.message LIMIT 1) m)"
                            " + (SELECT count(*) FROM (SELECT 1 FROM fairq.channel LIMIT 1) c)")
        if busy:
            raise RuntimeError("fairq bench: the database already holds fairq messages or"
                               " channels; point --dsn at a database dedicated to the bench")
    reset(dsn)


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
         log: Log | None = None, label: str = "") -> float:
    """Creates ``total`` messages through message_create_batch; returns the rows/s."""
    if total <= 0:
        return 0.0
    chunks = [(start, min(total, start + sizes.load_chunk))
              for start in range(0, total, sizes.load_chunk)]
    lock = threading.Lock()
    done = [0]
    begun = time.monotonic()
    last_report = [begun]

    def worker(index: int) -> None:
        with connect(dsn) as conn:
            for start, end in chunks[index::sizes.load_workers]:
                channels = [channel_of(i) for i in range(start, end)]
                conn.execute(
                    "SELECT count(*) FROM fairq.message_create_batch(%s::text[], %s::bytea[])",
                    (channels, [PAYLOAD] * len(channels)))
                with lock:
                    done[0] += end - start
                    now = time.monotonic()
                    if log and now - last_report[0] > 10:
                        last_report[0] = now
                        log(f"  loading {label}: {done[0]:,}/{total:,} "
                            f"({done[0] / (now - begun):,.0f} rows/s)")

    threads = Threads()
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


# --------------------------------------------------------------------------- pgbench throughput

def _producer_script(kind: str, sizes: Sizes, batched: bool) -> str:
    """One producer call, made only while the backlog gate is open (see ``_gatekeeper``)."""
    return (f"SELECT open::int AS open FROM {SCHEMA}.gate \\gset\n"
            "\\if :open\n" + _produce(kind, sizes, batched) + IDLE)


def _produce(kind: str, sizes: Sizes, batched: bool) -> str:
    n = sizes.batch
    if kind == "floor":
        if batched:
            return (f"INSERT INTO {SCHEMA}.floor (channel, content)"
                    f" SELECT {_channel_sql(sizes)}, {PAYLOAD_SQL}"
                    f" FROM generate_series(1, {n});\n")
        return (_channel_set(sizes) +
                f"INSERT INTO {SCHEMA}.floor (channel, content) VALUES (:ch, {PAYLOAD_SQL});\n")
    if kind == "fifo":
        return f"SELECT {SCHEMA}.message_create({PAYLOAD_SQL});\n"
    if batched:
        return ("SELECT count(*) FROM fairq.message_create_batch("
                f"ARRAY(SELECT 'bench-' || {_channel_sql(sizes)}"
                f" FROM generate_series(1, {n})),"
                f" array_fill({PAYLOAD_SQL}, ARRAY[{n}]));\n")
    return (_channel_set(sizes) +
            f"SELECT 1 FROM fairq.message_create('bench-' || :ch::text, {PAYLOAD_SQL});\n")


# The "zipf" spread: channel = floor((c + 1) ** u) for u uniform in [0, 1), so channel
# k of 1..c gets ln((k + 1) / k) / ln(c + 1) of the messages, about 1 / (k ln c): Zipf
# with exponent 1. A few channels are heavy, half the messages go to the first
# sqrt(c) channels, and the rest is a long tail. The same formula in pgbench (one
# message per call) and in SQL (batches), and for floor and fairq alike.

def _channel_set(sizes: Sizes) -> str:
    """pgbench: ``:ch``, the channel (1..channels) of a one-message call."""
    c = sizes.channels
    if sizes.channel_spread == "zipf":
        return f"\\set ch int(pow({c + 1}, random(0, 999999) / 1000000.0))\n"
    return f"\\set ch random(1, {c})\n"


def _channel_sql(sizes: Sizes) -> str:
    """SQL: the channel (1..channels) of one message of a batch."""
    c = sizes.channels
    if sizes.channel_spread == "zipf":
        return f"floor(power({c + 1}, random()))::int"
    return f"(1 + (random() * {c - 1})::int)"


def channel_number(sizes: Sizes, rng: random.Random) -> int:
    """Python: a channel (1..channels) drawn as the producers of ``sizes`` draw it."""
    if sizes.channel_spread == "zipf":
        return min(sizes.channels, int((sizes.channels + 1) ** rng.random()))
    return rng.randint(1, sizes.channels)


IDLE = "\\else\n\\sleep 1 ms\n\\endif\n"


def _consumer_script(kind: str, sizes: Sizes, batched: bool) -> str:
    n = sizes.batch
    if kind == "floor":
        claim = (f"UPDATE {SCHEMA}.floor SET status = 1, attempts = attempts + 1,"
                 f" locked_until = now() + interval '{LOCK_MS} ms'")
        if batched:
            return (f"WITH c AS ({claim} WHERE id IN (SELECT id FROM {SCHEMA}.floor"
                    f" WHERE status = 0 ORDER BY id LIMIT {n} FOR UPDATE SKIP LOCKED)"
                    " RETURNING id) SELECT coalesce(array_agg(id), '{}') AS ids,"
                    " count(*) AS n FROM c \\gset\n"
                    "\\if :n > 0\n"
                    f"DELETE FROM {SCHEMA}.floor WHERE id = ANY (:ids::bigint[]);\n" + IDLE)
        return (f"WITH c AS ({claim} WHERE id = (SELECT id FROM {SCHEMA}.floor"
                " WHERE status = 0 ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)"
                " RETURNING id) SELECT coalesce(max(id), 0) AS mid FROM c \\gset\n"
                "\\if :mid > 0\n"
                f"DELETE FROM {SCHEMA}.floor WHERE id = :mid;\n" + IDLE)
    if kind == "fifo":
        return (f"SELECT ({SCHEMA}.message_dequeue() IS NOT NULL)::int AS got \\gset\n"
                "\\if :got = 0\n\\sleep 1 ms\n\\endif\n")
    if batched:
        return ("SELECT coalesce(array_agg(id), '{}') AS ids,"
                " coalesce(array_agg(num_attempts), '{}') AS atts, count(*) AS n"
                f" FROM fairq.message_dequeue({LOCK_MS}, {n}) \\gset\n"
                "\\if :n > 0\n"
                "SELECT count(*) FROM fairq.message_complete_batch(:ids::bigint[],"
                " :atts::bigint[]);\n" + IDLE)
    return ("SELECT coalesce(max(id), 0) AS mid, coalesce(max(num_attempts), 0) AS att"
            f" FROM fairq.message_dequeue({LOCK_MS}, 1) \\gset\n"
            "\\if :mid > 0\n"
            "SELECT fairq.message_complete(:mid, :att);\n" + IDLE)


_COUNTERS = {
    "floor": (f"{SCHEMA}.floor_id_seq", f"{SCHEMA}.floor"),
    "fifo": (f"{SCHEMA}.message_id_seq", f"{SCHEMA}.message"),
    "fairq": ("fairq.message_id_seq", "fairq.message"),
}


def _counts(conn: Conn, kind: str) -> tuple[int, int]:
    """(messages ever created, messages still present) for a queue kind."""
    seq, table = _COUNTERS[kind]
    made = scalar(conn, f"SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END"
                        f" FROM {seq}")
    left = scalar(conn, f"SELECT count(*) FROM {table}")
    return int(made), int(left)


def _prefill(dsn: str, kind: str, sizes: Sizes) -> None:
    with connect(dsn) as conn:
        n, c = sizes.prefill, sizes.channels
        if kind == "floor":
            conn.execute(f"INSERT INTO {SCHEMA}.floor (channel, content)"
                         f" SELECT 1 + i % {c}, {PAYLOAD_SQL} FROM generate_series(1, {n}) i")
        elif kind == "fifo":
            conn.execute(f"INSERT INTO {SCHEMA}.message (content)"
                         f" SELECT {PAYLOAD_SQL} FROM generate_series(1, {n})")
    if kind == "fairq" and sizes.channel_spread == "zipf":
        rng = random.Random(11)
        names = [f"bench-{channel_number(sizes, rng)}" for _ in range(sizes.prefill)]
        load(dsn, names.__getitem__, sizes.prefill, sizes)
    elif kind == "fairq":
        load(dsn, lambda i: f"bench-{1 + i % sizes.channels}", sizes.prefill, sizes)
    with connect(dsn) as conn:
        settle(conn)


@dataclass
class Pgbench:
    """Runs pgbench scripts against one database."""

    dsn: str
    binary: str
    workdir: Path

    def start(self, name: str, script: str, clients: int, seconds: int,
              options: str = "") -> subprocess.Popen[str]:
        path = self.workdir / f"{name}.sql"
        path.write_text(script)
        # --max-tries: a deadlocked or serialization-failed script run is retried (and
        # counted), as a real client would; anything else aborts the client and fails.
        cmd = [self.binary, "-n", "-M", "prepared", "-c", str(clients), "-j", "1",
               "--max-tries", "10", "-T", str(seconds), "-f", str(path), self.dsn]
        env = dict(os.environ)
        if options:
            env["PGOPTIONS"] = (env.get("PGOPTIONS", "") + " " + options).strip()
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)

    @staticmethod
    def finish(proc: subprocess.Popen[str], seconds: int) -> str:
        try:
            out, err = proc.communicate(timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"pgbench failed ({proc.returncode}): {err.strip()[-2000:]}")
        return out


@contextlib.contextmanager
def _gatekeeper(dsn: str, kind: str, limit: int) -> Iterator[None]:
    """Closes the producers' gate while the backlog is at ``limit`` or above.

    A queue's throughput is the rate it sustains, so a run measures producers and
    consumers in a steady state. Unthrottled producers (a batched producer is 20 times
    faster than a consumer) would fill the table without bound and take the CPU from
    the consumers, and the result would say more about how the scheduler splits two
    cores than about the queue. The backlog is counted every 50 ms (up to ``limit``
    rows), the same way for floor, FIFO and fairq."""
    table = _COUNTERS[kind][1]
    stop = threading.Event()
    threads = Threads()

    def keep() -> None:
        with connect(dsn) as conn:
            is_open = True
            while not stop.wait(0.05):
                backlog = scalar(conn, f"SELECT count(*) FROM (SELECT FROM {table}"
                                       " LIMIT %s) b", (limit,))
                if (backlog < limit) != is_open:
                    is_open = not is_open
                    conn.execute(f"UPDATE {SCHEMA}.gate SET open = %s", (is_open,))
            conn.execute(f"UPDATE {SCHEMA}.gate SET open = true")

    threads.start(keep)
    try:
        yield
    finally:
        stop.set()
        threads.join(30)


def throughput(bench: Pgbench, kind: str, sizes: Sizes, batched: bool,
               during: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
               options: str = "", profile: bool = False) -> dict[str, Any]:
    """Producers and consumers side by side for ``sizes.throughput_s`` seconds."""
    reset(bench.dsn)
    _prefill(bench.dsn, kind, sizes)
    producer = _producer_script(kind, sizes, batched)
    consumer = _consumer_script(kind, sizes, batched)
    seconds = sizes.throughput_s
    with connect(bench.dsn) as conn:
        made0, left0 = _counts(conn, kind)
        if profile:
            conn.execute("SELECT pg_stat_statements_reset()")
        ctx = during() if during is not None else contextlib.nullcontext()
        with ctx, _gatekeeper(bench.dsn, kind, sizes.throughput_backlog):
            began = time.monotonic()
            procs = [bench.start(f"{kind}-producer", producer, sizes.producers, seconds,
                                 options),
                     bench.start(f"{kind}-consumer", consumer, sizes.consumers, seconds,
                                 options)]
            outputs = [Pgbench.finish(p, seconds) for p in procs]
            elapsed = time.monotonic() - began
        made1, left1 = _counts(conn, kind)
        statements = top_statements(conn) if profile else None
    produced = made1 - made0
    consumed = produced - (left1 - left0)
    # pgbench's -T window (its own clock), not the connection set-up around it.
    window = float(seconds) if elapsed > seconds else elapsed
    return {"msgs_per_s": consumed / window, "produced_per_s": produced / window,
            "consumed": consumed, "produced": produced, "seconds": window,
            "backlog_before": left0, "backlog_after": left1,
            "pgbench": {"producer": _pgbench_summary(outputs[0]),
                        "consumer": _pgbench_summary(outputs[1])},
            **({"top_statements": statements} if statements is not None else {})}


def top_statements(conn: Conn, limit: int = 25) -> list[dict[str, Any]]:
    """pg_stat_statements (track = all, so statements inside functions too), by total time."""
    return [{"calls": int(calls), "total_ms": round(float(total), 1),
             "mean_ms": round(float(mean), 4), "rows": int(rows), "query": str(query)[:300]}
            for calls, total, mean, rows, query in conn.execute(
                "SELECT calls, total_exec_time, mean_exec_time, rows,"
                "       regexp_replace(query, '\\s+', ' ', 'g')"
                "  FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT %s", (limit,))]


def _pgbench_summary(output: str) -> dict[str, float]:
    """tps, average latency (ms), failed and retried script runs from pgbench's output."""
    out: dict[str, float] = {}
    for line in output.splitlines():
        words = line.split()
        if line.startswith("tps ="):
            out["tps"] = float(words[2])
        elif line.startswith("latency average ="):
            out["latency_avg_ms"] = float(words[3])
        elif line.startswith("number of failed transactions:"):
            out["failed"] = float(words[4])
        elif line.startswith("number of transactions retried:"):
            out["retried"] = float(words[4])
    return out


@contextlib.contextmanager
def held_snapshot(dsn: str) -> Iterator[None]:
    """Another session holding a REPEATABLE READ snapshot open the whole time."""
    with psycopg.connect(dsn) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT count(*) FROM fairq.channel")
        try:
            yield
        finally:
            conn.rollback()


# --------------------------------------------------------------------------- latency

DEQUEUE_ONE = f"SELECT id, channel, num_attempts FROM fairq.message_dequeue({LOCK_MS}, 1)"


def dequeue_latencies(dsn: str, samples: int, warmup: int = 30) -> list[float]:
    """Sequential dequeues on one connection (seconds each). After each timed dequeue
    the message is completed and a new one created on its channel, so the depth and
    the number of channels stay what they were."""
    out: list[float] = []
    with connect(dsn) as conn:
        for i in range(warmup + samples):
            began = time.perf_counter()
            rows = conn.execute(DEQUEUE_ONE).fetchall()
            took = time.perf_counter() - began
            if not rows:
                raise RuntimeError("dequeue latency: the queue ran empty")
            row = rows[0]
            if i >= warmup:
                out.append(took)
            conn.execute("SELECT fairq.message_complete(%s, %s)", (row[0], row[2]))
            conn.execute("SELECT 1 FROM fairq.message_create(%s, %s)", (row[1], PAYLOAD))
    return out


def _latency_summary(values: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(values) * 1e3, "p90_ms": quantile(values, 0.9) * 1e3,
            "p99_ms": quantile(values, 0.99) * 1e3, "samples": len(values)}


def depth_scenario(dsn: str, sizes: Sizes, log: Log) -> dict[str, Any]:
    reset(dsn)
    levels: list[dict[str, Any]] = []
    have = 0
    for depth in sizes.depth_levels:
        rate = load(dsn, lambda i: f"depth-{i % sizes.depth_channels}", depth - have, sizes,
                    log, f"depth {depth:,}")
        have = depth
        with connect(dsn) as conn:
            settle(conn)
        summary = _latency_summary(dequeue_latencies(dsn, sizes.latency_samples))
        summary.update(depth=depth, channels=sizes.depth_channels, load_rows_per_s=rate)
        levels.append(summary)
        log(f"  depth {depth:>9,}: median dequeue {summary['median_ms']:.3f} ms"
            f" (p90 {summary['p90_ms']:.3f} ms)")
    return {"levels": levels,
            "ratio": ratio(levels[-1]["median_ms"], levels[0]["median_ms"])}


def _spread(prefix: str, count: int) -> Callable[[int], str]:
    """Message i goes to channel ``prefix-(i mod count)``."""
    def channel_of(i: int) -> str:
        return f"{prefix}-{i % count}"
    return channel_of


def channels_scenario(dsn: str, sizes: Sizes, log: Log) -> dict[str, Any]:
    """The same number of messages (the largest channel level) spread over more and
    more channels; every channel non-empty."""
    total = max(sizes.channel_levels)
    levels: list[dict[str, Any]] = []
    for count in sizes.channel_levels:
        reset(dsn)
        load(dsn, _spread("chan", count), total, sizes, log, f"{count:,} channels")
        with connect(dsn) as conn:
            settle(conn)
            live = int(scalar(conn, "SELECT count(*) FROM fairq.channel"))
        summary = _latency_summary(dequeue_latencies(dsn, sizes.latency_samples))
        summary.update(channels=live, messages=total)
        levels.append(summary)
        log(f"  channels {live:>8,}: median dequeue {summary['median_ms']:.3f} ms"
            f" (p90 {summary['p90_ms']:.3f} ms)")
    return {"levels": levels,
            "ratio": ratio(levels[-1]["median_ms"], levels[0]["median_ms"])}


# --------------------------------------------------------------------------- fairness

DEQUEUE_WAIT = ("SELECT d.id, d.channel, d.num_attempts,"
                " extract(epoch FROM clock_timestamp() - d.dequeue_at)::float8"
                f" FROM fairq.message_dequeue({LOCK_MS}, 1) d")


@dataclass
class Deliveries:
    """What consumers handed out: (seconds since start, channel, wait seconds)."""

    start: float = field(default_factory=time.monotonic)
    rows: list[tuple[float, str, float]] = field(default_factory=list)
    deadlocks: list[int] = field(default_factory=lambda: [0])
    lock: threading.Lock = field(default_factory=threading.Lock)


def _consume(dsn: str, stop: threading.Event, out: Deliveries) -> None:
    with connect(dsn) as conn:
        while not stop.is_set():
            rows = retrying(conn, DEQUEUE_WAIT, (), out.deadlocks, out.lock)
            if not rows:
                time.sleep(0.001)
                continue
            row = rows[0]
            out.rows.append((time.monotonic() - out.start, str(row[1]), float(row[3])))
            retrying(conn, "SELECT fairq.message_complete(%s, %s)", (row[0], row[2]),
                     out.deadlocks, out.lock)


def _light_producer(dsn: str, sizes: Sizes, stop: threading.Event, seconds: float,
                    sent: list[int]) -> None:
    rng = random.Random(7)
    interval = 1.0 / sizes.fair_light_rate
    with connect(dsn) as conn:
        began = time.monotonic()
        n = 0
        while not stop.is_set():
            due = began + n * interval
            if due - began >= seconds:
                break
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            channel = f"light-{rng.randrange(sizes.fair_light_tenants)}"
            retrying(conn, "SELECT 1 FROM fairq.message_create(%s, %s)", (channel, PAYLOAD),
                     [0], threading.Lock())
            n += 1
    sent[0] = n


def light_phase(dsn: str, sizes: Sizes) -> tuple[Deliveries, int]:
    """Light tenants at a steady rate, consumers polling, for fair_phase_s seconds."""
    out = Deliveries()
    sent = [0]
    consumers = Threads()
    producer = Threads()
    for _ in range(sizes.fair_consumers):
        consumers.start(_consume, dsn, consumers.stop, out)
    producer.start(_light_producer, dsn, sizes, producer.stop, sizes.fair_phase_s, sent)
    producer.join(sizes.fair_phase_s + 60)
    # Let the last light messages through, then stop.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if sum(1 for r in out.rows if r[1].startswith("light-")) >= sent[0]:
            break
        time.sleep(0.05)
    consumers.stop.set()
    consumers.join(60)
    return out, sent[0]


def fairness_scenario(dsn: str, sizes: Sizes, log: Log) -> dict[str, Any]:
    reset(dsn)
    base, base_sent = light_phase(dsn, sizes)
    base_waits = [r[2] for r in base.rows if r[1].startswith("light-")]
    log(f"  without heavy tenant: {len(base_waits)} light messages,"
        f" p99 wait {quantile(base_waits, 0.99) * 1e3:.2f} ms")

    reset(dsn)
    load(dsn, lambda i: "heavy", sizes.fair_heavy, sizes, log, "heavy backlog")
    with connect(dsn) as conn:
        settle(conn)
    loaded, loaded_sent = light_phase(dsn, sizes)
    light_waits = [r[2] for r in loaded.rows if r[1].startswith("light-")]
    heavy_served = sum(1 for r in loaded.rows if r[1] == "heavy")
    log(f"  with heavy backlog {sizes.fair_heavy:,}: {len(light_waits)} light messages,"
        f" p99 wait {quantile(light_waits, 0.99) * 1e3:.2f} ms; heavy served {heavy_served:,}")

    # Jain's index: several tenants backlogged for the whole window (heavy among them).
    # Enough that none drains within the window: four times what the consumers served
    # per second in the phase before (which the heavy backlog's size may have capped).
    phase_rate = len(loaded.rows) / max(sizes.fair_phase_s, 0.1)
    each = int(phase_rate * sizes.jain_window_s * 4 / sizes.jain_tenants) + 200
    # A tenant that drains within the window does not count; if any did, the
    # backlogs were too small for these consumers: load twice as much and measure again.
    for _attempt in range(4):
        load(dsn, lambda i: f"bulk-{i % (sizes.jain_tenants - 1)}",
             each * (sizes.jain_tenants - 1), sizes, log, "backlogged tenants")
        with connect(dsn) as conn:
            settle(conn)
        window = Deliveries()
        consumers = Threads()
        for _ in range(sizes.fair_consumers):
            consumers.start(_consume, dsn, consumers.stop, window)
        time.sleep(sizes.jain_window_s)
        consumers.stop.set()
        consumers.join(60)
        with connect(dsn) as conn:
            remaining = {str(name): int(size) for name, size in conn.execute(
                "SELECT channel, size FROM fairq.channels")}
        served: dict[str, int] = {}
        for _, channel, _ in window.rows:
            served[channel] = served.get(channel, 0) + 1
        backlogged = {c: n for c, n in served.items() if remaining.get(c, 0) > 0}
        if len(backlogged) == len(served) >= 2:
            break
        each *= 2
    jain_index = jain(list(backlogged.values()))
    log(f"  {len(backlogged)} backlogged tenants served {sum(backlogged.values()):,} messages"
        f" in {sizes.jain_window_s:g} s: Jain index {jain_index:.4f}")
    return {
        "baseline": {"light_sent": base_sent, "light_served": len(base_waits),
                     "p50_wait_ms": quantile(base_waits, 0.5) * 1e3,
                     "p99_wait_ms": quantile(base_waits, 0.99) * 1e3},
        "heavy": {"light_sent": loaded_sent, "light_served": len(light_waits),
                  "heavy_served": heavy_served, "heavy_backlog": sizes.fair_heavy,
                  "p50_wait_ms": quantile(light_waits, 0.5) * 1e3,
                  "p99_wait_ms": quantile(light_waits, 0.99) * 1e3},
        "ratio": ratio(quantile(light_waits, 0.99), quantile(base_waits, 0.99)),
        "deadlocks_retried": base.deadlocks[0] + loaded.deadlocks[0] + window.deadlocks[0],
        "jain": {"index": jain_index, "served": backlogged,
                 "tenants_drained": sorted(set(served) - set(backlogged)),
                 "window_s": sizes.jain_window_s},
        "series": {"heavy_phase": [(round(t, 4), c, round(w * 1e3, 3)) for t, c, w in loaded.rows],
                   "baseline_phase": [(round(t, 4), c, round(w * 1e3, 3)) for t, c, w in base.rows],
                   "jain_phase": [(round(t, 4), c) for t, c, _ in window.rows]},
    }


# --------------------------------------------------------------------------- soak

@dataclass
class BatchRun:
    """What ``batch_run`` did; times are seconds since its start."""

    total: int
    produced: int = 0               # messages claimed by producers
    created: int = 0                # messages whose create call has returned
    completed: int = 0
    events: list[tuple[float, int]] = field(default_factory=list)  # (time, completed)
    produced_until: float = 0.0     # when the last create call returned
    deadlocks: int = 0
    seconds: float = 0.0


def batch_run(dsn: str, sizes: Sizes, log: Log, label: str, total: int,
              channels_for: Callable[[int, int, random.Random], list[str]], max_s: float,
              on_created: Callable[[int, float], None] | None = None) -> BatchRun:
    """``total`` messages through soak_producers and soak_consumers threads in batches
    of ``sizes.batch``; producers stay at most ``soak_backlog`` ahead of consumers.

    ``channels_for(first, count, rng)`` names the channels of messages first ..
    first + count - 1 (a producer's own seeded ``rng``). ``on_created(created,
    seconds)`` is called after every create call (under the run's lock: keep it short).
    Stops after ``max_s`` seconds, and then reports what it did."""
    n = sizes.batch
    lock = threading.Lock()
    run = BatchRun(total)
    produced = [0]
    completed = [0]
    deadlocks = [0]
    threads = Threads()
    began = time.monotonic()
    deadline = began + max_s

    def producer(seed: int) -> None:
        rng = random.Random(seed)
        with connect(dsn) as conn:
            while not threads.stop.is_set() and time.monotonic() < deadline:
                with lock:
                    if produced[0] >= total:
                        break
                    if produced[0] - completed[0] > sizes.soak_backlog:
                        wait = True
                    else:
                        wait = False
                        first = produced[0]
                        take = min(n, total - first)
                        produced[0] += take
                if wait:
                    time.sleep(0.002)
                    continue
                channels = channels_for(first, take, rng)
                retrying(conn,
                         "SELECT count(*) FROM fairq.message_create_batch(%s::text[], %s::bytea[])",
                         (channels, [PAYLOAD] * take), deadlocks, lock)
                with lock:
                    now = time.monotonic() - began
                    run.produced_until = max(run.produced_until, now)
                    run.created += take
                    if on_created is not None:
                        on_created(run.created, now)

    def consumer() -> None:
        with connect(dsn) as conn:
            while not threads.stop.is_set() and time.monotonic() < deadline:
                with lock:
                    if completed[0] >= total:
                        break
                rows = retrying(
                    conn, f"SELECT id, num_attempts FROM fairq.message_dequeue({LOCK_MS}, {n})",
                    (), deadlocks, lock)
                if not rows:
                    time.sleep(0.001)
                    continue
                retrying(conn,
                         "SELECT count(*) FROM fairq.message_complete_batch(%s::bigint[],"
                         " %s::bigint[])", ([r[0] for r in rows], [r[1] for r in rows]),
                         deadlocks, lock)
                with lock:
                    completed[0] += len(rows)
                    run.events.append((time.monotonic() - began, len(rows)))

    def reporter() -> None:
        last = 0
        while not threads.stop.wait(10):
            with lock:
                done = completed[0]
            if done >= total:
                return
            log(f"  {label}: {done:,}/{total:,} completed ({(done - last) / 10:,.0f} msgs/s)")
            last = done

    for i in range(sizes.soak_producers):
        threads.start(producer, i)
    for _ in range(sizes.soak_consumers):
        threads.start(consumer)
    report = threading.Thread(target=reporter, daemon=True)
    report.start()
    threads.join(deadline - time.monotonic() + 60)
    threads.stop.set()
    run.seconds = time.monotonic() - began
    run.produced, run.completed, run.deadlocks = produced[0], completed[0], deadlocks[0]
    if run.completed < total:
        log(f"  {label} stopped at its time cap ({max_s:g} s):"
            f" {run.completed:,} of {total:,} messages completed")
    return run


def soak_scenario(dsn: str, sizes: Sizes, log: Log) -> dict[str, Any]:
    """A long batched run: producers stay at most soak_backlog ahead of consumers."""
    reset(dsn)
    with connect(dsn) as conn:
        before = relation_sizes(conn)
    total = sizes.soak_messages

    def channels_for(first: int, count: int, rng: random.Random) -> list[str]:
        return [f"soak-{rng.randrange(sizes.channels)}" for _ in range(count)]

    # Generous time cap: 200 messages/s would be a pathological collapse.
    run = batch_run(dsn, sizes, log, "soak", total, channels_for, sizes.soak_max_s)
    events, elapsed = run.events, run.seconds
    with connect(dsn) as conn:
        after = relation_sizes(conn)
        stats = table_stats(conn)
        remaining = int(scalar(conn, "SELECT count(*) FROM fairq.message"))
    problems = check(dsn)

    # Throughput over the producing period, from the first completion (connections and
    # the first batches are set up) to the last creation (the final drain is not steady
    # state): the first tenth of that span against the last tenth.
    start = events[0][0] if events else 0.0
    end = run.produced_until if run.produced_until > start else elapsed
    tenth = (end - start) / 10 or math.nan
    first = sum(k for t, k in events if start <= t <= start + tenth) / tenth
    last = sum(k for t, k in events if end - tenth < t <= end) / tenth
    span = end
    bucket = max(span / 100, 0.5)
    series: list[tuple[float, float]] = []
    for b in range(math.ceil(elapsed / bucket)):
        lo, hi = b * bucket, (b + 1) * bucket
        series.append((round(hi, 3), sum(k for t, k in events if lo < t <= hi) / bucket))
    return {"messages": total, "completed": run.completed, "remaining": remaining,
            "produced": run.produced, "deadlocks_retried": run.deadlocks,
            "stopped_by_time_cap": run.completed < total,
            "seconds": elapsed, "producing_seconds": span, "measured_from_s": start,
            "msgs_per_s": run.completed / elapsed if elapsed else math.nan,
            "first_tenth_msgs_per_s": first, "last_tenth_msgs_per_s": last,
            "ratio": ratio(last, first), "sizes": {"before": before, "after": after},
            "table_stats": stats, "check": [list(p) for p in problems],
            "series": series}


# --------------------------------------------------------------------------- machine

SETTINGS = ("server_version", "fsync", "synchronous_commit", "full_page_writes", "wal_level",
            "shared_buffers", "max_connections", "max_wal_size", "checkpoint_timeout",
            "autovacuum", "autovacuum_naptime", "autovacuum_vacuum_cost_limit",
            "autovacuum_vacuum_cost_delay", "wal_sync_method", "jit", "shared_preload_libraries")


def machine(dsn: str, pgbench_binary: str, sizes: Sizes, cluster: str) -> dict[str, Any]:
    with connect(dsn) as conn:
        settings = {name: str(scalar(conn, f"SHOW {name}")) for name in SETTINGS}
        events = scalar(conn, "SELECT current_setting('fairq.events', true)")
        fairq_version = scalar(conn, "SELECT extversion FROM pg_extension WHERE extname = 'fairq'")
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    script = Path(_sharedir()) / "extension" / f"fairq--{fairq_version}.sql"
    digest = None
    with contextlib.suppress(OSError):
        digest = hashlib.sha256(script.read_bytes()).hexdigest()
    pgbench_version = subprocess.run([pgbench_binary, "--version"], capture_output=True,
                                     text=True, check=False).stdout.strip()
    return {
        "cores": os.cpu_count(), "cpu": cpu, "memory_bytes": mem,
        "platform": platform.platform(), "python": platform.python_version(),
        "postgresql": settings.pop("server_version"), "settings": settings,
        "fairq_version": fairq_version, "fairq_script_sha256": digest,
        "fairq_events": events or "wake (default)",
        "cluster": cluster, "pgbench": pgbench_version,
        "load_average_start": list(os.getloadavg()), "sizes": asdict(sizes),
        "clients": (f"throughput: pgbench -M prepared, {sizes.producers} producer +"
                    f" {sizes.consumers} consumer clients (two concurrent processes, -j 1 each)"
                    f" for {sizes.throughput_s} s; latency: one psycopg connection, sequential;"
                    f" fairness and soak: Python threads, one psycopg connection each"),
    }


# --------------------------------------------------------------------------- the run

SCENARIOS = ("throughput", "events", "batched", "held", "depth", "channels", "fairness", "soak",
             "tenants", "churn")


def describe(key: str, result: dict[str, Any]) -> str:
    """The progress line of one throughput run."""
    return (f"  {key}: {result['msgs_per_s']:,.0f} msgs/s"
            f" (produced {result['produced_per_s']:,.0f}/s,"
            f" backlog {result['backlog_before']:,} -> {result['backlog_after']:,})")


def run(dsn: str, sizes: Sizes, log: Log | None = None,
        scenarios: Sequence[str] = SCENARIOS, cluster: str = "external",
        profile: bool = False) -> dict[str, Any]:
    """Runs the scenarios against ``dsn`` and returns the results (see the module doc).

    With ``profile`` (the server must preload pg_stat_statements) each throughput
    scenario also reports its top statements, nested ones included."""
    log = log or Progress()
    binary = pgbench_binary()
    prepare_database(dsn)
    if profile:
        with connect(dsn) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    out: dict[str, Any] = {"machine": machine(dsn, binary, sizes, cluster)}
    details: dict[str, Any] = {}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fairq-bench-") as work:
        bench = Pgbench(dsn, binary, Path(work))

        def measure(key: str, kind: str, batched: bool, scale: Sizes = sizes,
                    **kw: Any) -> float:
            result = throughput(bench, kind, scale, batched, profile=profile, **kw)
            details[key] = result
            log(describe(key, result))
            return float(result["msgs_per_s"])

        if "throughput" in scenarios or "held" in scenarios:
            log(f"throughput, one message per call ({sizes.throughput_s} s each)")
            out["floor_msgs_per_s"] = measure("floor", "floor", False)
            out["cycle_msgs_per_s"] = measure("cycle", "fairq", False)
            out["cycle_vs_floor"] = ratio(out["cycle_msgs_per_s"], out["floor_msgs_per_s"])
        if "held" in scenarios:
            log("held REPEATABLE READ snapshot during the cycle")
            held = measure("cycle_held_snapshot", "fairq", False,
                           during=lambda: held_snapshot(dsn))
            with connect(dsn) as conn:
                details["cycle_held_snapshot"]["table_stats_after"] = table_stats(conn)
            out["held_snapshot_ratio"] = ratio(held, out["cycle_msgs_per_s"])
            # Reference: the same snapshot against the plain-SQL floor. Its claims leave
            # dead entries in floor_ready_ix just as fairq's dequeues do in its indexes.
            floor_held = measure("floor_held_snapshot", "floor", False,
                                 during=lambda: held_snapshot(dsn))
            out["floor_held_snapshot_ratio"] = ratio(floor_held, out["floor_msgs_per_s"])
        if "throughput" in scenarios:
            out["fifo_msgs_per_s"] = measure("fifo", "fifo", False)
        if "events" in scenarios:
            log("reference: the fairq cycle with fairq.events = off (no NOTIFY)")
            measure("cycle_events_off", "fairq", False, options="-c fairq.events=off")
        if "batched" in scenarios:
            log(f"throughput, {sizes.batch} messages per call")
            out["batched_floor_msgs_per_s"] = measure("batched_floor", "floor", True)
            out["batched_msgs_per_s"] = measure("batched", "fairq", True)
            out["batched_vs_floor"] = ratio(out["batched_msgs_per_s"],
                                            out["batched_floor_msgs_per_s"])
            # Reference: with 100 channels one batch of 100 takes every channel (one call
            # of n is n single dequeues), so batch consumers run one at a time. Over more
            # channels than batches in flight they hold disjoint channels.
            wide = replace(sizes, channels=sizes.wide_channels)
            log(f"reference: {sizes.batch} messages per call over {wide.channels:,} channels")
            out["batched_wide_msgs_per_s"] = measure("batched_wide", "fairq", True, scale=wide)
            out["batched_wide_vs_floor"] = ratio(out["batched_wide_msgs_per_s"],
                                                 out["batched_floor_msgs_per_s"])
        if "depth" in scenarios:
            log(f"dequeue latency vs depth {sizes.depth_levels}")
            details["depth"] = depth_scenario(dsn, sizes, log)
            out["depth_latency_ratio"] = details["depth"]["ratio"]
        if "channels" in scenarios:
            log(f"dequeue latency vs non-empty channels {sizes.channel_levels}")
            details["channels"] = channels_scenario(dsn, sizes, log)
            out["channels_latency_ratio"] = details["channels"]["ratio"]
        if "fairness" in scenarios:
            log(f"fairness: {sizes.fair_light_tenants} light tenants at"
                f" {sizes.fair_light_rate:g} msgs/s, {sizes.fair_consumers} consumers")
            details["fairness"] = fairness_scenario(dsn, sizes, log)
            out["fairness_wait_ratio"] = details["fairness"]["ratio"]
            out["jain_index"] = details["fairness"]["jain"]["index"]
        if "soak" in scenarios:
            log(f"soak: {sizes.soak_messages:,} messages, batches of {sizes.batch}")
            details["soak"] = soak_scenario(dsn, sizes, log)
            out["soak_ratio"] = details["soak"]["ratio"]
            out["soak_sizes"] = details["soak"]["sizes"]
            log(f"  soak: {details['soak']['msgs_per_s']:,.0f} msgs/s overall, first tenth"
                f" {details['soak']['first_tenth_msgs_per_s']:,.0f}, last tenth"
                f" {details['soak']['last_tenth_msgs_per_s']:,.0f}")
        if "tenants" in scenarios:
            from fairq.bench_tenants import tenants_scenario
            log(f"tenant axis: channels {sizes.tenant_levels} and a Zipf spread, 1 and"
                f" {sizes.batch} msgs per call, floor and fairq interleaved")
            out["tenants"], details["tenants"] = tenants_scenario(bench, sizes, log, profile)
        if "churn" in scenarios:
            from fairq.bench_tenants import churn_scenario
            log(f"churn: {sizes.churn_messages:,} messages to {sizes.churn_tenants:,} tenants,"
                f" {sizes.churn_window:,} active at a time")
            churn = churn_scenario(dsn, sizes, log)
            details["churn"] = {key: churn.pop(key) for key in ("check", "table_stats")}
            out["churn"] = churn
    reset(dsn)
    with connect(dsn) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    out["machine"]["load_average_end"] = list(os.getloadavg())
    out["machine"]["bench_seconds"] = time.monotonic() - began
    out["targets"] = targets(out)
    out["details"] = details
    return out


def spark_scenario(dsn: str, rows: int, results: dict[str, Any], log: Log) -> None:
    """``--spark``: enqueue ``rows`` DataFrame rows through fairq.spark (local[2]) and
    add ``spark_enqueue_rows_per_s`` and its target to ``results``."""
    from fairq.spark import bench_enqueue, local_session

    log(f"spark: enqueueing {rows:,} DataFrame rows (local[2])")
    reset(dsn)
    spark = local_session("local[2]")
    try:
        rate = bench_enqueue(spark, dsn, rows)
    finally:
        spark.stop()
        reset(dsn)
        with connect(dsn) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    log(f"  spark: {rate:,.0f} rows/s")
    results["spark_enqueue_rows_per_s"] = rate
    results.setdefault("targets", {}).update(targets(results, "spark_enqueue_rows_per_s"))


def lookup(results: dict[str, Any], key: str) -> Any:
    """The result a key names; dots walk nested objects ("tenants.1000.single_vs_floor")."""
    value: Any = results
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def targets(results: dict[str, Any], only: str | None = None) -> dict[str, dict[str, Any]]:
    """Each target of TARGETS whose key the results hold: the target, the value and
    whether it is met (None when the value, or the reference it is compared with, is
    missing or NaN). A relative target also gives the ``threshold`` it resolved to."""
    out: dict[str, dict[str, Any]] = {}
    for key, op, limit in TARGETS:
        value = lookup(results, key)
        if value is None or (only is not None and key != only):
            continue
        entry: dict[str, Any] = {"target": _target_text(op, limit), "value": value}
        if isinstance(limit, str):
            resolved = lookup(results, limit)
            threshold = float(resolved) if isinstance(resolved, (int, float)) else math.nan
            entry["threshold"] = threshold
        else:
            threshold = limit
        entry["met"] = _met(value, op, threshold)
        out[key] = entry
    return out


def _target_text(op: str, limit: float | str) -> str:
    return f"{op} {limit}" if isinstance(limit, str) else f"{op} {limit:g}"


def _met(value: Any, op: str, limit: float) -> bool | None:
    if not isinstance(value, (int, float)) or math.isnan(value) or math.isnan(limit):
        return None
    return value >= limit if op == ">=" else value <= limit


def _sharedir() -> str:
    try:
        from fairq.cluster import pg_config
        out = subprocess.run([pg_config(), "--sharedir"], capture_output=True, text=True,
                             check=True)
    except (OSError, subprocess.CalledProcessError):
        return "/nonexistent"
    return out.stdout.strip()


def pgbench_binary() -> str:
    """pgbench on PATH, else the one beside the server that pg_config names."""
    return shutil.which("pgbench") or str(Path(_bindir()) / "pgbench")


def _bindir() -> str:
    from fairq.cluster import pg_bindir
    return str(pg_bindir())


# --------------------------------------------------------------------------- report

ROWS = (
    ("floor_msgs_per_s", "plain-SQL floor, 1 msg/call", "{:,.0f}"),
    ("fifo_msgs_per_s", "seed FIFO queue", "{:,.0f}"),
    ("cycle_msgs_per_s", "fairq cycle, 1 msg/call", "{:,.0f}"),
    ("cycle_vs_floor", "  cycle / floor", "{:.3f}"),
    ("batched_floor_msgs_per_s", "plain-SQL floor, batched", "{:,.0f}"),
    ("batched_msgs_per_s", "fairq cycle, batched", "{:,.0f}"),
    ("batched_vs_floor", "  batched / floor", "{:.3f}"),
    ("batched_wide_msgs_per_s", "fairq batched, wide channels (ref.)", "{:,.0f}"),
    ("batched_wide_vs_floor", "  wide batched / floor", "{:.3f}"),
    ("depth_latency_ratio", "dequeue latency, deep / shallow", "{:.3f}"),
    ("channels_latency_ratio", "dequeue latency, many / few channels", "{:.3f}"),
    ("fairness_wait_ratio", "light p99 wait, heavy / none", "{:.3f}"),
    ("jain_index", "Jain index, backlogged tenants", "{:.4f}"),
    ("held_snapshot_ratio", "cycle with held snapshot / without", "{:.3f}"),
    ("floor_held_snapshot_ratio", "  floor with held snapshot (ref.)", "{:.3f}"),
    ("soak_ratio", "soak, last tenth / first tenth", "{:.3f}"),
    ("churn.last_vs_first", "churn, last tenth / first tenth", "{:.3f}"),
    ("spark_enqueue_rows_per_s", "Spark DataFrame enqueue (rows/s)", "{:,.0f}"),
)


def _rows(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """ROWS, with two rows per level of the tenant axis after the churn row."""
    tenant_rows: list[tuple[str, str, str]] = []
    for name, level in results.get("tenants", {}).items():
        where = (f"{level['channels']:,} ch." if name != "zipf"
                 else f"Zipf {level['channels']:,} ch.")
        for mode in ("single", "batched"):
            tenant_rows += [(f"tenants.{name}.{mode}_msgs_per_s", f"{where}, fairq {mode}",
                             "{:,.0f}"),
                            (f"tenants.{name}.{mode}_vs_floor", f"  {where}, {mode} / floor",
                             "{:.3f}")]
    at = next(i for i, row in enumerate(ROWS) if row[0] == "churn.last_vs_first")
    return [*ROWS[:at], *tenant_rows, *ROWS[at:]]


def table(results: dict[str, Any]) -> str:
    declared = {key: (op, limit) for key, op, limit in TARGETS}
    met_by_key = results.get("targets", {})
    lines = [f"{'metric':<38} {'value':>12}  {'target':<14} met",
             f"{'-' * 38} {'-' * 12}  {'-' * 14} ---"]
    for key, label, fmt in _rows(results):
        value = lookup(results, key)
        if value is None and key not in results:
            continue
        shown = "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) \
            else fmt.format(value)
        target = ""
        if key in declared:
            op, limit = declared[key]
            threshold = met_by_key.get(key, {}).get("threshold")
            target = (f"{op} {limit:,g}" if not isinstance(limit, str)
                      else f"{op} ref" if not isinstance(threshold, float)
                      or math.isnan(threshold) else f"{op} {threshold:.3f} ref")
        met = met_by_key.get(key, {}).get("met")
        mark = "" if key not in declared else ("yes" if met else "NO" if met is False else "?")
        lines.append(f"{label:<38} {shown:>12}  {target:<14} {mark}")
    m = results.get("machine", {})
    lines.append(f"machine: {m.get('cores')} cores, {m.get('cpu')}, PostgreSQL"
                 f" {m.get('postgresql')}, fsync={m.get('settings', {}).get('fsync')},"
                 f" synchronous_commit={m.get('settings', {}).get('synchronous_commit')}")
    return "\n".join(lines)


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


def _clean(value: Any) -> Any:
    """NaN is not JSON: write null instead."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


# --------------------------------------------------------------------------- CLI

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fairq bench", description="fairq against the physical floor, side by side.")
    parser.add_argument("--dsn", help="a database dedicated to the bench (default: start a"
                        " throwaway cluster on 127.0.0.1 and remove it afterwards)")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes: the whole run takes a few minutes")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results here")
    parser.add_argument("--plots", type=Path, metavar="DIR", help="write PNG plots here")
    parser.add_argument("--spark", action="store_true",
                        help="also measure enqueueing a DataFrame through fairq.spark"
                             " (needs the spark extra and the JDBC driver)")
    parser.add_argument("--sizes", choices=("full", "quick", "tiny"), help=argparse.SUPPRESS)
    parser.add_argument("--only", help=argparse.SUPPRESS)  # comma-separated scenarios
    # Own cluster only: preload pg_stat_statements and report top statements per
    # throughput scenario (adds overhead: not for the reported numbers).
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    return parser


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sizes = {"full": FULL, "quick": QUICK, "tiny": TINY}[args.sizes or
                                                         ("quick" if args.quick else "full")]
    scenarios = tuple(args.only.split(",")) if args.only else SCENARIOS
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        print(f"fairq bench: unknown scenarios {sorted(unknown)}", file=sys.stderr)
        return 2
    log = Progress()
    cluster = None
    # SIGTERM (a CI timeout, `kill`) ends the run like Ctrl-C: the throwaway cluster
    # is removed on the way out instead of being left running.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        if args.dsn:
            dsn, where = args.dsn, "external (--dsn)"
        else:
            from fairq.cluster import Cluster
            settings = dict(DURABLE_SETTINGS)
            if args.profile:
                settings.update({"shared_preload_libraries": "pg_stat_statements",
                                 "pg_stat_statements.track": "all"})
            cluster = Cluster(settings=settings)
            log(f"starting a throwaway cluster of {cluster.version} (durable settings)")
            cluster.start()
            dsn, where = cluster.dsn(), f"throwaway, {DURABLE_SETTINGS}"
        log(f"fairq bench ({sizes.name}) against {dsn}")
        results = run(dsn, sizes, log, scenarios, where, profile=args.profile)
        if args.spark:
            spark_scenario(dsn, SPARK_ROWS[sizes.name], results, log)
    except KeyboardInterrupt:
        print("fairq bench: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if cluster is not None:
            cluster.remove()
    results = _clean(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=_json_default) + "\n")
        log(f"wrote {args.json}")
    if args.plots:
        from fairq.bench_plots import write_plots
        for path in write_plots(results, args.plots):
            log(f"wrote {path}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

