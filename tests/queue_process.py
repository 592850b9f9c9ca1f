"""A producer or worker process for tests/test_concurrency.py and tests/test_crash.py.

    python queue_process.py '<json config>'

Producer: creates ``count`` messages on random channels in small batches, each batch
on a random one of its ``queues`` (default: the default queue). With
``log_table`` it records the ids in the test's ``created`` table in the same
transaction (transactional enqueue); with ``ids_file`` it appends the ids to a file
only after the commit has returned.

Worker: dequeues from its ``queue`` (random batch sizes), "works" a few milliseconds
per message, defers
a few, and completes the rest. A completion is recorded in the ``completion`` table in
the same transaction as ``message_complete`` and only when it answered 'completed',
so the table says exactly which completions took effect; with ``ids_file`` the id is
also appended to a file after the commit returned.

Both reconnect when the server goes away (crash test) and stop at ``deadline``.

Events are tied to progress, not to the clock, so that a loaded machine changes only
how long a test takes, never what it tests:

* a producer with ``gate_at`` and ``gate_file`` stops after creating ``gate_at``
  messages until the test creates ``gate_file`` (so work is still to come when the
  test makes something happen);
* a worker with ``stop_after`` stops itself (SIGSTOP) once it has picked up that many
  messages, at a point where it holds some: right after the dequeue, before settling
  one of the batch, or inside the transaction of a completion before its commit. It
  first writes the (id, num_attempts) it holds to ``<logdir>/<name>.held``. The test
  sees the stop (waitpid WUNTRACED), checks in the database that those messages are
  locked, and kills it with SIGKILL.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path
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
        queue = rnd.choice(cfg.get("queues", ["default"]))
        try:
            with conn.transaction():
                rows = conn.execute(
                    "SELECT id, status FROM fairq.message_create_batch(%s, %s, NULL, %s, NULL, %s)",
                    (channels, contents, priorities, queue)).fetchall()
                assert all(status == "created" for _, status in rows), rows
                if cfg.get("log_table"):
                    conn.execute("INSERT INTO created (id, channel, queue)"
                                 " SELECT u.*, %s FROM unnest(%s::bigint[], %s::text[]) AS u",
                                 (queue, [r[0] for r in rows], channels))
        except psycopg.OperationalError:
            conn = connect(cfg["dsn"], deadline)  # outcome unknown: nothing recorded
            continue
        record(cfg, [r[0] for r in rows])
        made += size
        if cfg.get("gate_at") is not None and made >= cfg["gate_at"]:
            gate = Path(cfg["gate_file"])
            while not gate.exists() and time.time() < deadline:
                time.sleep(0.01)
        if cfg.get("pause"):
            time.sleep(rnd.uniform(0, cfg["pause"]))


def stop_holding(cfg: dict[str, Any], point: str, held: list[tuple[int, int]]) -> None:
    """Writes where it stopped and what it holds, then stops until the test kills it."""
    path = Path(cfg["logdir"]) / f"{cfg['name']}.held"
    path.write_text(json.dumps({"point": point, "held": held}))
    os.kill(os.getpid(), signal.SIGSTOP)
    # Only a test that lets it go on gets here: carry on as if nothing happened.


def worker(cfg: dict[str, Any]) -> None:
    rnd = random.Random(cfg["seed"])
    deadline = cfg["deadline"]
    conn = connect(cfg["dsn"], deadline)
    taken = 0  # messages picked up so far (deliveries)
    stop_after = cfg.get("stop_after")
    queue = cfg.get("queue", "default")
    while time.time() < deadline:
        try:
            rows = conn.execute(
                "SELECT id, channel, num_attempts, recovered FROM fairq.message_dequeue(%s, %s, %s)",
                (cfg["lock_ms"], rnd.randint(1, cfg.get("max_batch", 3)), queue)).fetchall()
            if not rows:
                time.sleep(0.01)
                continue
            taken += len(rows)
            # Where to stop, if this batch reaches stop_after: (point, index in the batch).
            stop_at: tuple[str, int] | None = None
            if stop_after is not None and taken >= stop_after:
                stop_after = None  # once
                stop_at = (rnd.choice(["dequeued", "working", "committing"]),
                           rnd.randrange(len(rows)))
                if stop_at[0] == "dequeued":
                    stop_holding(cfg, "dequeued", [(r[0], r[2]) for r in rows])
            for i, (mid, channel, attempts, recovered) in enumerate(rows):
                held = [(r[0], r[2]) for r in rows[i:]]
                if stop_at == ("working", i):
                    stop_holding(cfg, "working", held)
                time.sleep(rnd.uniform(0, cfg["work_ms"]) / 1000)
                if rnd.random() < cfg.get("defer_p", 0.0):
                    if stop_at == ("committing", i):  # a deferral is one statement
                        stop_holding(cfg, "working", held)
                    conn.execute("SELECT fairq.message_defer(%s, %s)", (mid, attempts))
                    continue
                with conn.transaction():
                    status = conn.execute("SELECT fairq.message_complete(%s, %s)",
                                          (mid, attempts)).fetchone()[0]  # type: ignore[index]
                    if status == "completed":
                        conn.execute("INSERT INTO completion (id, channel, attempts, recovered,"
                                     " worker, queue) VALUES (%s, %s, %s, %s, %s, %s)",
                                     (mid, channel, attempts, recovered, cfg["name"], queue))
                    if stop_at == ("committing", i):
                        # Completed in the open transaction, not committed: a kill now
                        # must leave the message locked, to be delivered again.
                        stop_holding(cfg, "committing", held)
                if status == "completed":
                    record(cfg, [mid])
        except psycopg.OperationalError:
            conn = connect(cfg["dsn"], deadline)


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    {"producer": producer, "worker": worker}[config["role"]](config)
