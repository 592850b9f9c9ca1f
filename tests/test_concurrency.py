"""Concurrency: several producer and worker *processes* on two queues, with crashes.

Worker processes (tests/queue_process.py) are killed with SIGKILL and replaced: each
stops itself after picking up a random number of messages, at a random point where it
holds some (after the dequeue, before a settlement, inside an uncommitted completion),
and the test kills it there once the database shows those messages locked. Kills are
tied to progress, never to the clock, so a loaded machine cannot finish the run
before the first kill. Meanwhile a monitor samples, in one
snapshot each time, every channel's in_flight counter and its actually locked
messages, and runs fairq.check() now and then. At the end:

* every created message was completed exactly once (completions are recorded in
  the same transaction as message_complete, and only when it answered 'completed'),
  by a worker of its own queue (producers spread batches over two queues, and each
  worker serves one; the channel names are the same in both);
* nothing was lost and the queue is empty;
* no channel ever had more messages in flight than its max_concurrency (SPEC §2.2),
  and a capped channel's in_flight always equalled its number of locked messages;
* fairq.check() was empty throughout and is empty at the end.

Also: a session holding a REPEATABLE READ snapshot open for the whole run does not
stop workers from draining a backlog.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

SCRIPT = Path(__file__).with_name("queue_process.py")

TABLES = """
CREATE TABLE created (id bigint PRIMARY KEY, channel text NOT NULL,
                      queue text NOT NULL DEFAULT 'default');
CREATE TABLE completion (id bigint NOT NULL, channel text NOT NULL, attempts bigint NOT NULL,
                         recovered boolean NOT NULL, worker text NOT NULL,
                         queue text NOT NULL DEFAULT 'default');
"""


def spawn(cfg: dict[str, Any], logdir: Path) -> subprocess.Popen[bytes]:
    with open(logdir / f"{cfg['name']}.err", "ab") as err:  # the child keeps its own copy
        return subprocess.Popen([sys.executable, str(SCRIPT), json.dumps(cfg)], stderr=err)


@dataclass
class Monitor:
    """Samples caps and counters in one snapshot per query, from a thread."""

    dsn: str
    samples: int = 0
    checks: int = 0  # fairq.check() runs
    error: BaseException | None = None  # what ended the thread early, if anything
    cap_violations: list[tuple[Any, ...]] = field(default_factory=list)
    counter_drift: list[tuple[Any, ...]] = field(default_factory=list)
    problems: list[tuple[Any, ...]] = field(default_factory=list)
    max_seen: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Monitor:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(10)

    def assert_ran(self) -> None:
        """A thread's exception only warns: had the monitor failed, every count it
        keeps would read zero."""
        if self.error is not None:
            raise AssertionError(f"the monitor failed after {self.samples} samples") from self.error
        assert self._thread is not None and not self._thread.is_alive(), "the monitor did not stop"
        assert self.checks > 0, "fairq.check() never ran during the load"

    def _run(self) -> None:
        try:
            self._sample()
        except BaseException as exc:
            self.error = exc

    def _sample(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            last_check = 0.0
            while not self._stop.is_set():
                rows = conn.execute("""
                    SELECT c.queue_id || '/' || c.name, c.max_concurrency, c.in_flight,
                           coalesce(l.n, 0)
                      FROM fairq.channel c
                      LEFT JOIN (SELECT channel_id, count(*)::int AS n FROM fairq.message
                                  WHERE status = 'locked' GROUP BY channel_id) l
                        ON l.channel_id = c.id""").fetchall()
                self.samples += 1
                for name, cap, in_flight, locked in rows:
                    if cap is not None:
                        self.max_seen[name] = max(self.max_seen.get(name, 0), locked)
                        if locked > cap or in_flight > cap:
                            self.cap_violations.append((name, cap, in_flight, locked))
                    # Only a capped channel counts its messages in flight.
                    if in_flight != (locked if cap is not None else 0):
                        self.counter_drift.append((name, in_flight, locked))
                if time.monotonic() - last_check > 0.5:
                    last_check = time.monotonic()
                    self.problems += conn.execute("SELECT * FROM fairq.check()").fetchall()
                    self.checks += 1
                time.sleep(0.01)


@pytest.fixture
def logdir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TABLES)
        yield conn


def wait_until(predicate: Any, timeout: float, step: float = 0.2) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step)
    return bool(predicate())


def stopped(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the child has stopped itself (SIGSTOP); records its exit if it ended."""
    if proc.returncode is not None:
        return False
    pid, status = os.waitpid(proc.pid, os.WNOHANG | os.WUNTRACED)
    if pid == 0:
        return False
    if os.WIFSTOPPED(status):
        return True
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    return False


def run_load(dsn: str, db: psycopg.Connection[Any], logdir: Path, *, channels: list[str],
             caps: dict[str, int], per_producer: int, producers: int = 2, workers: int = 4,
             stop_after: tuple[int, int] = (30, 120), seed: int = 0,
             queues: tuple[str, ...] = ("default", "other")) -> dict[str, int]:
    """Runs producers and workers until every message is completed. Each worker stops
    itself once it has picked up a random number (``stop_after``) of messages, at a
    point where it holds some (see queue_process.py); the test then checks in the
    database that it holds locked messages, kills it and starts a new one.

    Kills are tied to progress, not to time: a worker that has picked up fewer than
    ``stop_after[1]`` messages has not been killed yet, so no more than
    ``workers * stop_after[1]`` deliveries can happen without a kill. With more
    messages than that, the run cannot finish without killing a worker, whatever the
    machine's load."""
    total = producers * per_producer
    assert workers * stop_after[1] < total, "the run could finish without a kill"
    rnd = random.Random(seed)
    for name, cap in caps.items():
        for queue in queues:
            db.execute("SELECT fairq.channel_set(%s, %s, p_queue => %s)", (name, cap, queue))
    deadline = time.time() + 300  # a safety net: processes stop on their own
    base = {"dsn": dsn, "deadline": deadline}
    prods = [spawn({**base, "role": "producer", "name": f"p{i}", "seed": seed * 100 + i,
                    "channels": channels, "queues": list(queues), "count": per_producer,
                    "log_table": True,
                    "pause": 0.004}, logdir) for i in range(producers)]
    serial = 0

    def new_worker(queue: str) -> subprocess.Popen[bytes]:
        """A worker of ``queue`` (a killed worker's replacement serves its queue)."""
        nonlocal serial
        serial += 1
        return spawn({**base, "role": "worker", "name": f"w{serial}", "seed": seed * 100 + serial,
                      "queue": queue,
                      "lock_ms": 1000, "work_ms": 4, "defer_p": 0.03, "max_batch": 3,
                      "stop_after": rnd.randint(*stop_after), "logdir": str(logdir)}, logdir)

    pool = [new_worker(queues[i % len(queues)]) for i in range(workers)]
    queue_of = [queues[i % len(queues)] for i in range(workers)]
    names = {p.pid: f"w{i + 1}" for i, p in enumerate(pool)}
    monitor = Monitor(dsn).start()
    killed = 0
    killed_holding = 0  # kills of a worker whose held messages the database showed locked
    held_at_kills = 0
    stop_points = dict.fromkeys(("dequeued", "working", "committing"), 0)
    finished = False
    try:
        def remaining() -> int:
            return int(db.execute("SELECT count(*) FROM fairq.message").fetchone()[0])  # type: ignore[index]

        hard_end = time.monotonic() + 240  # a failure net only: the run ends by progress
        while time.monotonic() < hard_end and monitor.error is None:
            for i, proc in enumerate(pool):
                if not stopped(proc):
                    continue
                report = json.loads((logdir / f"{names[proc.pid]}.held").read_text())
                held = [tuple(h) for h in report["held"]]
                stop_points[report["point"]] += 1
                # The worker is stopped between two statements: what the database shows
                # of its messages cannot change under it (short of its locks expiring).
                locked = int(db.execute(
                    "SELECT count(*) FROM fairq.message m"
                    " JOIN unnest(%s::bigint[], %s::bigint[]) AS h(id, n)"
                    "   ON h.id = m.id AND h.n = m.num_attempts"
                    " WHERE m.status = 'locked'",
                    ([h[0] for h in held], [h[1] for h in held])).fetchone()[0])  # type: ignore[index]
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                killed += 1
                held_at_kills += len(held)
                killed_holding += locked > 0
                pool[i] = new_worker(queue_of[i])
                names[pool[i].pid] = f"w{serial}"
            if (all(p.poll() is not None for p in prods) and remaining() == 0
                    and monitor.checks > 0):
                finished = True
                break
            time.sleep(0.02)
    finally:
        monitor.stop()
        for p in pool + prods:
            if p.poll() is None:  # running, or stopped and not yet killed
                p.kill()
            p.wait()
    monitor.assert_ran()
    for p in prods:
        assert p.returncode == 0, (logdir / "p0.err").read_text()

    def one(sql: str) -> int:
        return int(db.execute(sql).fetchone()[0])  # type: ignore[index]

    counts = {
        "created": one("SELECT count(*) FROM created"),
        "completions": one("SELECT count(*) FROM completion"),
        "lost": one("SELECT count(*) FROM created c"
                    " WHERE NOT EXISTS (SELECT 1 FROM completion d WHERE d.id = c.id)"),
        "duplicated completions": one("SELECT count(*) - count(DISTINCT id) FROM completion"),
        "completed by another queue's worker": one(
            "SELECT count(*) FROM completion d JOIN created c ON c.id = d.id"
            " WHERE c.queue <> d.queue"),
        "completed but never created": one(
            "SELECT count(*) FROM completion d WHERE NOT EXISTS"
            " (SELECT 1 FROM created c WHERE c.id = d.id)"),
        "left in queue": one("SELECT count(*) FROM fairq.message"),
        "dead letters": one("SELECT count(*) FROM fairq.dead_letter"),
        "recovered deliveries completed": one("SELECT count(*) FROM completion WHERE recovered"),
        "workers killed": killed,
        "killed while holding locked messages": killed_holding,
        "messages held at the kills": held_at_kills,
        **{f"kills {k}": v for k, v in stop_points.items()},
        "monitor samples": monitor.samples,
        "check() runs during load": monitor.checks,
        "cap violations": len(monitor.cap_violations),
        "in_flight drift samples": len(monitor.counter_drift),
        "check() problems during load": len(monitor.problems),
    }
    problems_at_end = db.execute("SELECT * FROM fairq.check()").fetchall()
    orphans = db.execute(
        "SELECT m.id, m.channel_id, m.status::text, m.num_attempts, c.channel, m.created_at::text"
        " FROM fairq.message m LEFT JOIN created c ON c.id = m.id"
        " WHERE NOT EXISTS (SELECT 1 FROM fairq.channel k WHERE k.id = m.channel_id)").fetchall()
    print(f"\n{len(channels)} channels, caps {sorted(set(caps.values()))}: " +
          ", ".join(f"{k} {v}" for k, v in counts.items()) +
          f"; highest in flight on capped channels: "
          f"{ {k: v for k, v in sorted(monitor.max_seen.items())[:6]} }")
    must_be_zero = ("lost", "duplicated completions", "completed but never created",
                    "completed by another queue's worker",
                    "left in queue", "dead letters", "cap violations", "in_flight drift samples",
                    "check() problems during load")
    details = (f"cap violations {monitor.cap_violations[:5]}, drift {monitor.counter_drift[:5]},"
               f" check() during load {monitor.problems[:5]}, check() at the end {problems_at_end},"
               f" messages without a channel (id, channel_id, status, attempts, channel, created)"
               f" {orphans}, channels {db.execute('SELECT id, name FROM fairq.channel').fetchall()}")
    assert finished, f"the run did not finish in time: {counts}"
    assert {k: counts[k] for k in must_be_zero} == dict.fromkeys(must_be_zero, 0), details
    assert counts["created"] == producers * per_producer
    assert problems_at_end == []
    assert killed > 0 and monitor.checks > 0
    assert held_at_kills >= killed  # each worker stopped itself holding messages
    assert killed_holding > 0, "no kill hit a worker while the database showed its messages locked"
    return counts


def test_few_channels_with_caps_and_crashing_workers(dsn: str, db: Any, logdir: Path) -> None:
    run_load(dsn, db, logdir, channels=["a", "b", "c", "d"], caps={"a": 1, "b": 2, "c": 3},
             per_producer=350, seed=1)


def test_many_channels_with_caps_and_crashing_workers(dsn: str, db: Any, logdir: Path) -> None:
    channels = [f"t{i:03d}" for i in range(150)]
    caps = {name: 1 + i % 3 for i, name in enumerate(channels) if i % 5 == 0}
    run_load(dsn, db, logdir, channels=channels, caps=caps, per_producer=400, seed=2)


@pytest.mark.slow
def test_many_channels_long(dsn: str, db: Any, logdir: Path) -> None:
    channels = [f"t{i:04d}" for i in range(1000)]
    caps = {name: 1 + i % 3 for i, name in enumerate(channels) if i % 4 == 0}
    run_load(dsn, db, logdir, channels=channels, caps=caps, per_producer=4000, workers=6,
             seed=3)


def test_held_snapshot_does_not_stop_the_queue(dsn: str, db: Any, logdir: Path) -> None:
    """A REPEATABLE READ transaction with a snapshot, open for the whole run, while
    worker processes drain a backlog: the queue keeps serving and empties."""
    channels = [f"s{i}" for i in range(40)]
    total = 1500
    for start in range(0, total, 500):
        names = [channels[i % len(channels)] for i in range(start, start + 500)]
        db.execute("WITH c AS (SELECT * FROM fairq.message_create_batch(%s::text[], %s::bytea[]))"
                   " INSERT INTO created SELECT c.id, u.ch FROM c"
                   " JOIN unnest(%s::text[]) WITH ORDINALITY AS u(ch, i) ON u.i = c.ord",
                   (names, [b"x"] * len(names), names))
    with psycopg.connect(dsn) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        seen = holder.execute("SELECT count(*) FROM fairq.message").fetchone()
        assert seen == (total,)
        deadline = time.time() + 90
        pool = [spawn({"dsn": dsn, "deadline": deadline, "role": "worker", "name": f"h{i}",
                       "seed": i, "lock_ms": 30_000, "work_ms": 0, "max_batch": 10}, logdir)
                for i in range(3)]
        started = time.monotonic()
        try:
            drained = wait_until(lambda: db.execute("SELECT count(*) FROM fairq.message")
                                 .fetchone() == (0,), timeout=60)
        finally:
            for p in pool:
                p.kill()
                p.wait()
        elapsed = time.monotonic() - started
        # The snapshot is still held and still sees the whole backlog.
        assert holder.execute("SELECT count(*) FROM fairq.message").fetchone() == (total,)
        assert holder.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    completions = db.execute("SELECT count(*), count(DISTINCT id) FROM completion").fetchone()
    print(f"\nheld snapshot: {total} messages on {len(channels)} channels drained: {drained}"
          f" in {elapsed:.1f}s, completions {completions}")
    assert drained
    assert completions == (total, total)
    assert db.execute("SELECT * FROM fairq.check()").fetchall() == []


# The race below runs until it has created this many messages and queued this many
# wakes (a few seconds on an idle 2-core machine), not for a fixed time.
RACE_MIN_CREATED = 10_000
RACE_MIN_WAKES = 1
RACE_MAX_BACKLOG = 2_000  # producers pause above it: the final drain stays short


# Past fairq.bulk_channels() (256) channels settled in one transaction, a dequeue
# settles in bulk: the "bulk" race has workers take 400 messages a call over 1,500
# sparse channels, while producers (single calls, which rely on a due channel staying
# due, and batches) keep filling them, and runs until enough such calls happened.
RACE_BULK_CALLS = 20
# Bulk workers dequeue only once this many messages wait (producers pause at
# RACE_MAX_BACKLOG): spread over 1,500 channels they fill ~700, so a call of 400
# settles past the bound whatever the relative speed of producers and workers.
RACE_BULK_BACKLOG = 1_000


@pytest.mark.parametrize("shape", ["batch", "bulk"])
def test_batch_producers_racing_on_idle_channels_strand_nothing(dsn: str, db: Any, shape: str) -> None:
    """Batch producers over many sparse channels, with batch workers draining them as
    fast as they fill: channels go idle and are woken again all the time (producers
    queue wakes, fairq.channels_wake; they never lock a channel row). Every created
    message is completed exactly once, the queue and the queued wakes end empty, and
    the race did queue wakes. In the bulk shape the workers' calls settle hundreds of
    channels each (bulk settle and policy locks) while single producers rely on
    channels staying due. (That any given interleaving happened is not checked here:
    the deterministic ones are tests/test_sql_interleave.py's and the isolation
    specs'.)"""
    bulk = shape == "bulk"
    channels = [f"w{i}" for i in range(1_500 if bulk else 60)]
    per_call = 400 if bulk else 10
    bulk_calls = [0]  # worker calls that handed out more than 256 messages
    stop = threading.Event()
    produced = threading.Event()  # every producer has stopped
    errors: list[BaseException] = []
    created: list[int] = []
    completed: list[int] = []
    lock = threading.Lock()

    def produce(seed: int) -> None:
        rnd = random.Random(seed)
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                while not stop.is_set():
                    with lock:
                        backlog = len(created) - len(completed)
                    if backlog > RACE_MAX_BACKLOG:  # keep the drain at the end short
                        time.sleep(0.005)
                        continue
                    names = [rnd.choice(channels) for _ in range(20)]
                    if bulk and seed % 2 == 0:
                        rows = [conn.execute("SELECT id FROM fairq.message_create(%s, %s)",
                                             (name, b"x")).fetchone() for name in names]
                    else:
                        rows = conn.execute("SELECT id FROM fairq.message_create_batch(%s, %s)",
                                            (names, [b"x"] * len(names))).fetchall()
                    with lock:
                        created.extend(r[0] for r in rows)
        except BaseException as exc:  # reported below
            errors.append(exc)

    def work() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                while True:
                    with lock:
                        backlog = len(created) - len(completed)
                    if bulk and not produced.is_set() and backlog < RACE_BULK_BACKLOG:
                        time.sleep(0.005)  # let a call's worth of tenants fill, however fast
                        continue
                    got = conn.execute("SELECT id, num_attempts FROM fairq.message_dequeue(30000, %s)",
                                       (per_call,)).fetchall()
                    if len(got) > 256:
                        with lock:
                            bulk_calls[0] += 1
                    if got:
                        done = conn.execute(
                            "SELECT id FROM fairq.message_complete_batch(%s, %s)"
                            " WHERE status = 'completed'",
                            ([g[0] for g in got], [g[1] for g in got])).fetchall()
                        with lock:
                            completed.extend(d[0] for d in done)
                    elif produced.is_set() and conn.execute(
                            "SELECT NOT EXISTS (SELECT FROM fairq.message)").fetchone() == (True,):
                        return  # nothing more will come and nothing is left
        except BaseException as exc:  # reported below
            errors.append(exc)

    producers = [threading.Thread(target=produce, args=(i,), daemon=True) for i in range(4)]
    workers = [threading.Thread(target=work, daemon=True) for _ in range(4)]
    threads = producers + workers

    def wakes_queued() -> int:
        # Each autocommit statement is a new transaction: a fresh statistics snapshot.
        # Backends report their counts within about a second, and at their exit.
        return int(db.execute("SELECT n_tup_ins FROM pg_stat_user_tables"
                              " WHERE relid = 'fairq.channel_wake'::regclass").fetchone()[0])

    def raced_enough() -> bool:
        with lock:
            made = len(created)
            big = bulk_calls[0]
        return bool(errors) or (made >= RACE_MIN_CREATED and wakes_queued() >= RACE_MIN_WAKES
                                and (not bulk or big >= RACE_BULK_CALLS))

    for t in threads:
        t.start()
    # Run until the race has happened, however long that takes on this machine: at
    # least RACE_MIN_CREATED messages, and producers have queued wakes for held rows.
    # Then the producers stop and the workers drain the queue.
    try:
        raced = wait_until(raced_enough, timeout=180, step=0.05)
    finally:
        stop.set()
        for t in producers:
            t.join(60)
        produced.set()
        for t in workers:
            t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), (
        "a producer or worker did not stop: "
        f"{db.execute('SELECT count(*) FROM fairq.message').fetchone()} messages left,"
        f" check(): {db.execute('SELECT * FROM fairq.check()').fetchall()}")
    db.execute("SELECT pg_stat_clear_snapshot()")
    queued = wakes_queued()
    lost = set(created) - set(completed)
    print(f"\n{shape} producers on idle channels: created {len(created)}, completed"
          f" {len(completed)}, lost {len(lost)}, completed twice"
          f" {len(completed) - len(set(completed))}, wakes queued {queued},"
          f" calls of more than 256 {bulk_calls[0]}")
    assert not lost
    assert len(completed) == len(set(completed)) == len(created)
    assert db.execute("SELECT count(*) FROM fairq.message").fetchone() == (0,)
    assert db.execute("SELECT count(*) FROM fairq.channel_wake").fetchone() == (0,)
    assert db.execute("SELECT * FROM fairq.check()").fetchall() == []
    assert raced and queued >= RACE_MIN_WAKES, \
        "no channel went idle and was woken again: the race did not test what it claims"
    assert not bulk or bulk_calls[0] >= RACE_BULK_CALLS, "too few calls settled in bulk"
