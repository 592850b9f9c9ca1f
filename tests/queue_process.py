"""A producer or worker process for tests/test_concurrency.py and tests/test_crash.py.

    python queue_process.py '<json config>'

Producer: creates ``count`` messages on random channels in small batches. With
``log_table`` it records the ids in the test's ``created`` table in the same
transaction (transactional enqueue); with ``ids_file`` it appends the ids to a file
only after the commit has returned.

Worker: dequeues (random batch sizes), "works" a few milliseconds per message, defers
a few, and completes the rest. A completion is recorded in the ``completion`` table in
the same transaction as ``message_complete`` and only when it answered 'completed',
so the table says exactly which completions took effect; with ``ids_file`` the id is
also appended to a file after the commit returned.

Both reconnect when the server goes away (crash test) and stop at ``deadline``.
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

import psycopg


def connect(dsn: str, deadline: float) -> psycopg.Connection[Any]:
    while True:
        try:
            return psycopg.connect(dsn, autocommit=True, connect_timeout=3)
        except psycopg.OperationalError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)


def record(cfg: dict[str, Any], ids: list[int]) -> None:
    """Appends ids to the process's ids_file, if it has one (after the commit returned)."""
    if cfg.get("ids_file"):
        with open(cfg["ids_file"], "a") as out:
            out.write("".join(f"{i}\n" for i in ids))


def producer(cfg: dict[str, Any]) -> None:
    rnd = random.Random(cfg["seed"])
    deadline = cfg["deadline"]
    conn = connect(cfg["dsn"], deadline)
    made = 0
    while made < cfg["count"] and time.time() < deadline:
        size = min(rnd.choice([1, 1, 2, 5]), cfg["count"] - made)
        channels = [rnd.choice(cfg["channels"]) for _ in range(size)]
        contents = [f"{cfg['name']}-{made + i}".encode() for i in range(size)]
        priorities = [rnd.choice([0, 0, 0, 1, 5]) for _ in range(size)]
        try:
            with conn.transaction():
                rows = conn.execute(
                    "SELECT id, status FROM fairq.message_create_batch(%s, %s, NULL, %s)",
                    (channels, contents, priorities)).fetchall()
                assert all(status == "created" for _, status in rows), rows
                if cfg.get("log_table"):
                    conn.execute("INSERT INTO created (id, channel)"
                                 " SELECT * FROM unnest(%s::bigint[], %s::text[])",
                                 ([r[0] for r in rows], channels))
        except psycopg.OperationalError:
            conn = connect(cfg["dsn"], deadline)  # outcome unknown: nothing recorded
            continue
        record(cfg, [r[0] for r in rows])
        made += size
        if cfg.get("pause"):
            time.sleep(rnd.uniform(0, cfg["pause"]))


def worker(cfg: dict[str, Any]) -> None:
    rnd = random.Random(cfg["seed"])
    deadline = cfg["deadline"]
    conn = connect(cfg["dsn"], deadline)
    while time.time() < deadline:
        try:
            rows = conn.execute(
                "SELECT id, channel, num_attempts, recovered FROM fairq.message_dequeue(%s, %s)",
                (cfg["lock_ms"], rnd.randint(1, cfg.get("max_batch", 3)))).fetchall()
            if not rows:
                time.sleep(0.01)
                continue
            for mid, channel, attempts, recovered in rows:
                time.sleep(rnd.uniform(0, cfg["work_ms"]) / 1000)
                if rnd.random() < cfg.get("defer_p", 0.0):
                    conn.execute("SELECT fairq.message_defer(%s, %s)", (mid, attempts))
                    continue
                with conn.transaction():
                    status = conn.execute("SELECT fairq.message_complete(%s, %s)",
                                          (mid, attempts)).fetchone()[0]  # type: ignore[index]
                    if status == "completed":
                        conn.execute("INSERT INTO completion (id, channel, attempts, recovered,"
                                     " worker) VALUES (%s, %s, %s, %s, %s)",
                                     (mid, channel, attempts, recovered, cfg["name"]))
                if status == "completed":
                    record(cfg, [mid])
        except psycopg.OperationalError:
            conn = connect(cfg["dsn"], deadline)


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    {"producer": producer, "worker": worker}[config["role"]](config)
