"""``fairq demo``: a multi-tenant scenario you can watch, then a report of what happened.

Without ``--dsn`` it starts a throwaway PostgreSQL on 127.0.0.1 (``fairq.cluster``),
runs ``CREATE EXTENSION fairq`` there and removes the cluster at the end (also on
Ctrl-C). With ``--dsn`` it runs in an existing database on channels named
``demo-*`` and cleans them up afterwards. ``DATABASE_URL`` is deliberately ignored:
the demo's workers dequeue from *every* channel (fairq's dequeue has no channel
filter), so it must only ever run where you asked it to, and it refuses to start
while any other channel holds messages.

The scenario (``--quick`` shortens 20 s to 5 s):

- ``demo-heavy`` floods the queue: it keeps hundreds of messages waiting at all times;
- ``demo-light-1..4`` send a few messages a second each;
- ``demo-limited`` has ``release_interval_ms`` 250 and sends a burst up front;
- ``demo-capped`` has ``max_concurrency`` 2, slow messages, and a burst up front;
- two :class:`fairq.Worker` s of four threads process everything; a few messages fail
  once (retried with back-off) and a few always fail (dead-lettered after 3
  attempts); a third "worker" takes five messages and dies holding them, so their
  locks expire and they come back as ``recovered``.

Every figure of the report comes from the database's own records
(``fairq.message_history``, recorded for the demo's sessions only), except the
count of handlers running at once, which the workers measure.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from fairq.cluster import Cluster
from fairq.codecs import JsonCodec
from fairq.queue import Queue
from fairq.types import CreateStatus, Message, NewMessage
from fairq.worker import Backoff, Worker

__all__ = ["add_arguments", "main", "run"]

PREFIX = "demo-"
WORKERS = 2
THREADS = 4  # per worker
MAX_ATTEMPTS = 3
Connection = psycopg.Connection[Any]


# -- the scenario -------------------------------------------------------------------

@dataclass(frozen=True)
class Tenant:
    name: str  # the channel
    kind: str  # heavy | light | limited | capped
    work_ms: int  # how long its handler "works"
    rate: float = 0.0  # messages per second, sent steadily
    burst: int = 0  # messages sent at the start
    backlog: int = 0  # heavy only: keep this many waiting
    max_concurrency: int | None = None
    release_interval_ms: int = 0
    fail_once: float = 0.0  # share of messages whose first attempt raises
    fail_always: float = 0.0  # share of messages that always raise ("poison")

    @property
    def policy(self) -> str:
        if self.max_concurrency is not None:
            return f"<= {self.max_concurrency} at once"
        if self.release_interval_ms:
            return f"1 per {self.release_interval_ms} ms"
        return "-"


@dataclass(frozen=True)
class Scenario:
    seconds: float  # how long producers produce; then the queue drains
    tenants: tuple[Tenant, ...]
    crash_at: float  # seconds after the start
    crash_messages: int
    crash_lock: timedelta

    @classmethod
    def build(cls, seconds: float) -> Scenario:
        interval_ms = 250
        cap, capped_work_ms = 2, 100
        tenants = (
            Tenant(f"{PREFIX}heavy", "heavy", work_ms=5, backlog=200 if seconds < 10 else 400,
                   fail_once=0.02, fail_always=0.002),
            *(Tenant(f"{PREFIX}light-{i}", "light", work_ms=10, rate=4.0, fail_once=0.05,
                     fail_always=0.02) for i in range(1, 5)),
            # A backlog it needs ~80 % of the run to work through at its pace.
            Tenant(f"{PREFIX}limited", "limited", work_ms=10,
                   burst=max(4, int(0.8 * seconds * 1000 / interval_ms)),
                   release_interval_ms=interval_ms),
            # Enough slow work to sit at its cap for ~70 % of the run.
            Tenant(f"{PREFIX}capped", "capped", work_ms=capped_work_ms,
                   burst=max(4, int(0.7 * seconds * cap * 1000 / capped_work_ms)),
                   max_concurrency=cap),
        )
        return cls(seconds=seconds, tenants=tenants, crash_at=0.3 * seconds, crash_messages=5,
                   crash_lock=timedelta(seconds=1 if seconds < 10 else 2))

    def tenant(self, channel: str) -> Tenant | None:
        return next((t for t in self.tenants if t.name == channel), None)


class HandlerError(Exception):
    """What the demo's handler raises to simulate a failing job."""


@dataclass
class Observed:
    """What the demo's own threads saw; the rest comes from the database."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    created: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    not_created: Counter[str] = field(default_factory=Counter)  # dropped | duplicate
    running: Counter[str] = field(default_factory=Counter)
    max_running: Counter[str] = field(default_factory=Counter)
    max_in_flight_sampled: Counter[str] = field(default_factory=Counter)
    raised: int = 0
    recovered: set[int] = field(default_factory=set)
    abandoned: dict[int, str] = field(default_factory=dict)  # id -> channel
    crashed_at: float | None = None
    foreign: int = 0  # messages of other channels that the workers handed back

    def total_created(self) -> int:
        with self.lock:
            return sum(len(ids) for ids in self.created.values())


# -- the workers' handler, the producer and the crash ---------------------------------

def make_handler(observed: Observed) -> Callable[[Message[Any]], None]:
    def handle(message: Message[Any]) -> None:
        if not message.channel.startswith(PREFIX):
            # Not ours: hand it straight back (refused at start, but a producer may
            # have sent one since).
            with observed.lock:
                observed.foreign += 1
            message.defer()
            return
        job = message.content
        channel = message.channel
        with observed.lock:
            if message.recovered:
                observed.recovered.add(message.id)
            observed.running[channel] += 1
            observed.max_running[channel] = max(observed.max_running[channel],
                                                observed.running[channel])
        try:
            time.sleep(job["ms"] / 1000)
            if job["fail"] == "always" or (job["fail"] == "once" and message.num_attempts == 1):
                with observed.lock:
                    observed.raised += 1
                raise HandlerError(f"simulated failure ({job['fail']})")
        finally:
            with observed.lock:
                observed.running[channel] -= 1
    return handle


class Producer(threading.Thread):
    """Sends every tenant's messages, and plays the worker that crashes."""

    TICK = 0.05

    def __init__(self, queue: Queue[Any], scenario: Scenario, observed: Observed,
                 started: float, seed: int) -> None:
        super().__init__(name="fairq-demo-producer", daemon=True)
        self.queue = queue
        self.scenario = scenario
        self.observed = observed
        self.started = started
        self.rng = random.Random(seed)
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def job(self, tenant: Tenant) -> dict[str, Any]:
        draw = self.rng.random()
        fail = ("always" if draw < tenant.fail_always
                else "once" if draw < tenant.fail_always + tenant.fail_once else None)
        return {"ms": tenant.work_ms, "fail": fail}

    def send(self, batch: list[NewMessage[Any]]) -> None:
        for start in range(0, len(batch), 500):
            chunk = batch[start:start + 500]
            results = self.queue.send_many(chunk)
            with self.observed.lock:
                for new, result in zip(chunk, results, strict=True):
                    if result.status is CreateStatus.CREATED and result.id is not None:
                        self.observed.created[new.channel].add(result.id)
                    else:
                        self.observed.not_created[new.channel] += 1

    def waiting(self, channel: str) -> int:
        stats = self.queue.channels(channel)
        return stats[0].ready + stats[0].scheduled if stats else 0

    def crash(self) -> None:
        """A worker takes a few messages, then dies: no heartbeat, no settlement."""
        # One call may hand out fewer than asked while other dequeues hold the
        # channels it would serve next; ask again until the worker holds its share.
        taken: list[Message[Any]] = []
        for _ in range(20):
            want = self.scenario.crash_messages - len(taken)
            if want == 0:
                break
            taken += self.queue.dequeue(self.scenario.crash_lock, want)
        with self.observed.lock:
            self.observed.crashed_at = time.monotonic() - self.started
            for message in taken:
                if message.channel.startswith(PREFIX):
                    self.observed.abandoned[message.id] = message.channel
                else:  # not ours: give it back at once
                    self.observed.foreign += 1
                    message.defer()

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    def _run(self) -> None:
        scenario = self.scenario
        self.send([NewMessage(t.name, self.job(t)) for t in scenario.tenants
                   for _ in range(t.burst)])
        next_send = {t.name: self.rng.expovariate(t.rate) for t in scenario.tenants if t.rate}
        crashed = False
        tick = 0
        while not self.stopping.is_set():
            now = time.monotonic() - self.started
            if now >= scenario.seconds:
                return
            batch: list[NewMessage[Any]] = []
            for tenant in scenario.tenants:
                if tenant.rate:
                    while next_send[tenant.name] <= now:
                        batch.append(NewMessage(tenant.name, self.job(tenant)))
                        next_send[tenant.name] += self.rng.expovariate(tenant.rate)
                if tenant.backlog and tick % 4 == 0:
                    missing = tenant.backlog - self.waiting(tenant.name)
                    batch.extend(NewMessage(tenant.name, self.job(tenant))
                                 for _ in range(max(0, missing)))
            if batch:
                self.send(batch)
            if not crashed and now >= scenario.crash_at:
                self.crash()
                crashed = True
            tick += 1
            self.stopping.wait(self.TICK)


# -- reading the database -------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    channel: str
    waiting: int
    in_flight: int
    done: int
    dead: int


def db_now(conn: Connection) -> datetime:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def live_rows(conn: Connection, scenario: Scenario, since: datetime) -> list[Row]:
    queued = {r[0]: (r[1], r[2]) for r in conn.execute(
        "SELECT channel, ready + scheduled, in_flight FROM fairq.channels"
        " WHERE channel LIKE 'demo-%'").fetchall()}
    settled: Counter[tuple[str, str]] = Counter()
    for channel, outcome, count in conn.execute(
            "SELECT channel, outcome, count(*) FROM fairq.message_history"
            " WHERE settled_at >= %s AND channel LIKE 'demo-%%' GROUP BY 1, 2", (since,)):
        settled[(channel, outcome)] = count
    return [Row(t.name, *queued.get(t.name, (0, 0)), settled[(t.name, "completed")],
                settled[(t.name, "dead")]) for t in scenario.tenants]


def demo_backlog(conn: Connection) -> int:
    row = conn.execute("SELECT coalesce(sum(size), 0) FROM fairq.channels"
                       " WHERE channel LIKE 'demo-%'").fetchone()
    return int(row[0]) if row else 0


def demo_channels(conn: Connection) -> int:
    row = conn.execute("SELECT count(*) FROM fairq.channels WHERE channel LIKE 'demo-%'").fetchone()
    return int(row[0]) if row else 0


def foreign_channels(conn: Connection) -> list[tuple[str, int]]:
    return [(r[0], int(r[1])) for r in conn.execute(
        "SELECT channel, size FROM fairq.channels WHERE size > 0 AND channel NOT LIKE 'demo-%'"
        " ORDER BY channel")]


@dataclass(frozen=True)
class Settled:
    id: int
    channel: str
    wait: float  # seconds from creation to first delivery
    settled: float  # seconds after the start
    first_delivery: datetime
    outcome: str


def history(conn: Connection, since: datetime) -> list[Settled]:
    rows = conn.execute(
        "SELECT id, channel, extract(epoch FROM first_dequeued_at - created_at),"
        " extract(epoch FROM settled_at - %s), first_dequeued_at, outcome"
        " FROM fairq.message_history WHERE settled_at >= %s AND channel LIKE 'demo-%%'"
        " ORDER BY settled_at", (since, since)).fetchall()
    return [Settled(r[0], r[1], float(r[2] or 0), float(r[3]), r[4], r[5]) for r in rows]


# -- the live table ---------------------------------------------------------------------

class Display:
    """A table redrawn in place on a terminal; a line every few seconds otherwise."""

    def __init__(self, out: TextIO, scenario: Scenario) -> None:
        self.out = out
        self.scenario = scenario
        self.tty = out.isatty()
        self.drawn = 0
        self.last_line = -math.inf

    def show(self, elapsed: float, phase: str, rows: list[Row], observed: Observed) -> None:
        if self.tty:
            self._table(elapsed, phase, rows, observed)
        elif elapsed - self.last_line >= 2.0 or phase == "done":
            self.last_line = elapsed
            cells = " | ".join(f"{r.channel.removeprefix(PREFIX)} {r.waiting}/{r.in_flight}/"
                               f"{r.done}" for r in rows)
            print(f"[{elapsed:5.1f}s {phase}] waiting/in flight/done: {cells}", file=self.out,
                  flush=True)

    def _table(self, elapsed: float, phase: str, rows: list[Row], observed: Observed) -> None:
        with observed.lock:
            sent = {name: len(ids) for name, ids in observed.created.items()}
            crashed_at, abandoned = observed.crashed_at, len(observed.abandoned)
            recovered, raised = len(observed.recovered), observed.raised
        lines = [f"\x1b[1mfairq demo\x1b[0m  {elapsed:5.1f} s  {phase}   "
                 f"{WORKERS} workers x {THREADS} threads",
                 "",
                 f"  {'tenant':<14}{'policy':<17}{'sent':>7}{'waiting':>9}{'in flight':>11}"
                 f"{'done':>8}{'dead':>6}"]
        for row in rows:
            tenant = self.scenario.tenant(row.channel)
            policy = tenant.policy if tenant else ""
            lines.append(f"  {row.channel:<14}{policy:<17}{sent.get(row.channel, 0):>7}"
                         f"{row.waiting:>9}{row.in_flight:>11}{row.done:>8}{row.dead:>6}")
        crash = ("" if crashed_at is None else
                 f"a worker died holding {abandoned} messages at {crashed_at:.1f} s, "
                 f"{recovered} came back recovered; ")
        lines += ["", f"  {crash}{raised} handler failures so far (retried with back-off)"]
        up = f"\x1b[{self.drawn}F" if self.drawn else ""
        self.out.write(up + "".join(f"{line}\x1b[K\n" for line in lines))
        self.out.flush()
        self.drawn = len(lines)


# -- the report -------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def fmt_s(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def add(self, line: str = "") -> None:
        self.lines.append(line)

    def check(self, ok: bool, line: str) -> None:
        self.lines.append(f"  [{'ok' if ok else 'FAILED'}] {line}")
        if not ok:
            self.failures.append(line)


def report(conn: Connection, scenario: Scenario, observed: Observed, since: datetime,
           drained: bool, elapsed: float) -> tuple[Report, list[Settled]]:
    settled = history(conn, since)
    rep = Report()
    by_channel: dict[str, list[Settled]] = defaultdict(list)
    for record in settled:
        by_channel[record.channel].append(record)

    rep.add(f"What happened ({elapsed:.1f} s: {scenario.seconds:g} s of sending, then draining)")
    rep.add()
    rep.add("  Waits from creation to first delivery (p50 / p99):")
    waits: dict[str, list[float]] = defaultdict(list)
    for tenant in scenario.tenants:
        mine = [r.wait for r in by_channel[tenant.name]]
        waits[tenant.kind].extend(mine)
        rep.add(f"    {tenant.name:<14} {tenant.policy:<17} {len(mine):>6} messages  "
                f"{fmt_s(percentile(mine, 50)):>8} / {fmt_s(percentile(mine, 99)):>8}")
    light_p50, light_p99 = percentile(waits["light"], 50), percentile(waits["light"], 99)
    heavy_p50, heavy_p99 = percentile(waits["heavy"], 50), percentile(waits["heavy"], 99)
    rep.add()
    rep.check(bool(waits["light"]) and bool(waits["heavy"]) and light_p50 < heavy_p50,
              f"fairness: light tenants waited {fmt_s(light_p50)} (p50) / {fmt_s(light_p99)} "
              f"(p99) while the heavy tenant's flood waited {fmt_s(heavy_p50)} / "
              f"{fmt_s(heavy_p99)}")
    rep.add("         (the limited and capped tenants queue behind their own limits, by design)")

    for tenant in scenario.tenants:
        if tenant.max_concurrency is not None:
            with observed.lock:
                handlers = observed.max_running[tenant.name]
                sampled = observed.max_in_flight_sampled[tenant.name]
            rep.check(max(handlers, sampled) <= tenant.max_concurrency,
                      f"{tenant.name} max_concurrency {tenant.max_concurrency}: at most "
                      f"{handlers} handlers ran at once (fairq.channels showed at most "
                      f"{sampled} in flight)")
        if tenant.release_interval_ms:
            releases = sorted(r.first_delivery for r in by_channel[tenant.name])
            gaps = [(b - a).total_seconds() * 1000 for a, b in itertools.pairwise(releases)]
            smallest = min(gaps) if gaps else math.nan
            rep.check(bool(gaps) and smallest >= tenant.release_interval_ms,
                      f"{tenant.name} release_interval_ms {tenant.release_interval_ms}: "
                      f"smallest gap between two releases {smallest:.1f} ms "
                      f"({len(releases)} releases, database clock)")

    with observed.lock:
        created = {i: ch for ch, ids in observed.created.items() for i in ids}
        not_created = sum(observed.not_created.values())
        abandoned = dict(observed.abandoned)
        recovered = set(observed.recovered)
        raised, foreign = observed.raised, observed.foreign
    outcome = {r.id: r.outcome for r in settled}
    completed = sum(1 for i in created if outcome.get(i) == "completed")
    dead = sum(1 for i in created if outcome.get(i) == "dead")
    missing = [i for i in created if i not in outcome]
    twice = len(settled) - len({r.id for r in settled})
    rep.check(not missing and twice == 0 and completed + dead == len(created) and drained,
              f"nothing lost: created {len(created)} = completed {completed} + dead {dead}"
              + (f"; {len(missing)} not settled" if missing else "")
              + (f"; {twice} settled twice" if twice else ""))
    if not_created:
        rep.add(f"         ({not_created} sends were not created: dropped or duplicate)")
    dead_letters = conn.execute("SELECT count(*) FROM fairq.dead_letters"
                                " WHERE channel LIKE 'demo-%'").fetchone()
    dead_rows = int(dead_letters[0]) if dead_letters else 0
    rep.check(dead_rows == dead,
              f"dead letters: the {dead} dead messages are in fairq.dead_letters "
              f"({dead_rows} rows there)")
    came_back = sum(1 for i in abandoned if i in recovered)
    fates = Counter(outcome.get(i, "unsettled") for i in abandoned)
    crashed_at = observed.crashed_at or 0.0
    rep.check(bool(abandoned) and came_back == len(abandoned),
              f"crash: a worker died holding {len(abandoned)} messages at {crashed_at:.1f} s; "
              f"their {scenario.crash_lock.total_seconds():g} s locks expired and {came_back} "
              f"came back with recovered = true ("
              + ", ".join(f"{n} {fate}" for fate, n in sorted(fates.items())) + ")")
    problems = conn.execute("SELECT channel, problem FROM fairq.check()").fetchall()
    rep.check(not problems, "fairq.check(): " + ("consistent" if not problems else
                                                 "; ".join(f"{c}: {p}" for c, p in problems)))
    rep.add(f"  {raised} handler failures: messages failing once were retried with back-off, "
            f"poison ones dead-lettered after {MAX_ATTEMPTS} attempts")
    if foreign:
        rep.add(f"  {foreign} messages of other channels were handed back untouched (deferred)")
    return rep, settled


def chart(path: Path, scenario: Scenario, settled: list[Settled], elapsed: float) -> str:
    """Writes the throughput chart; returns a line for the report."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart: skipped (matplotlib is not installed: pip install matplotlib)"
    width = max(0.25, elapsed / 60)
    bins = max(1, math.ceil(elapsed / width))
    edges = [i * width for i in range(bins + 1)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for tenant in scenario.tenants:
        mine = [r for r in settled if r.channel == tenant.name]
        counts = [0] * bins
        for record in mine:
            if record.outcome == "completed":
                counts[min(bins - 1, max(0, int(record.settled / width)))] += 1
        label = f"{tenant.name} ({tenant.policy})" if tenant.policy != "-" else tenant.name
        top.step(edges[:-1], [c / width for c in counts], where="post", label=label)
        bottom.scatter([r.settled for r in mine], [max(r.wait, 1e-3) for r in mine], s=4,
                       label=tenant.name)
    top.set_ylabel("completed messages / s")
    top.set_title("fairq demo: per-tenant throughput, and each message's wait")
    top.legend(fontsize=8, loc="upper right")
    top.axvline(scenario.seconds, color="grey", linestyle=":")
    bottom.set_yscale("log")
    bottom.set_ylabel("wait until first delivery (s)")
    bottom.set_xlabel("seconds since start (dotted: producers stop)")
    bottom.axvline(scenario.seconds, color="grey", linestyle=":")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"chart: {path}"


# -- setting up and cleaning up -----------------------------------------------------------

class DemoError(Exception):
    """The demo cannot run here; the message says why."""


def with_options(dsn: str, *settings: str) -> str:
    """The conninfo with these settings for its sessions only."""
    params = conninfo_to_dict(dsn)
    options = " ".join([str(params.get("options") or ""), *(f"-c {s}" for s in settings)])
    return make_conninfo(dsn, options=options.strip())


# The demo polls fairq.channels twice a second. Its plan is estimated far above
# jit_above_cost (fairq.clock_offset is never analyzed), and JIT compilation then
# costs ~0.5 s per query: the demo's own sessions go without JIT.
NO_JIT = "jit=off"


def check_database(conn: Connection) -> None:
    found = conn.execute(
        "SELECT to_regprocedure('fairq.message_dequeue(bigint, integer)') IS NOT NULL").fetchone()
    if not found or not found[0]:
        raise DemoError("fairq is not installed in this database "
                        "(CREATE EXTENSION fairq, or `fairq install`)")
    others = foreign_channels(conn)
    if others:
        listed = ", ".join(f"{name} ({size})" for name, size in others[:5])
        raise DemoError(
            "other channels hold messages here: " + listed + (", ..." if len(others) > 5 else "")
            + ". The demo's workers would dequeue them too (a dequeue serves every channel); "
              "run it on an empty or scratch database, or without --dsn")


def purge(conn: Connection, deadline: float, scenario: Scenario) -> None:
    """Removes what the demo left in channels demo-*: queued messages (taken and
    completed, waiting for abandoned locks to expire) and dead letters (requeued, then
    cancelled). Only runs where no other channel holds messages."""
    if foreign_channels(conn):
        return
    queue: Queue[bytes] = Queue(conn)
    while demo_backlog(conn) and time.monotonic() < deadline:
        taken = queue.dequeue(timedelta(seconds=10), 100)
        for message in taken:
            if message.channel.startswith(PREFIX):
                message.complete()
            else:
                message.defer()
        if not taken:
            time.sleep(0.2)
    while dead := [d for d in queue.dead_letters(limit=1000) if d.channel.startswith(PREFIX)]:
        for letter in dead:
            queue.dead_letter_retry(letter.id)
            queue.cancel(letter.id)
    for tenant in scenario.tenants:
        queue.channel_clear(tenant.name)
    # A cancel leaves its emptied channel for the next dequeue to collect: be it.
    for _ in range(5):
        if foreign_channels(conn) or not demo_channels(conn):
            break
        for message in queue.dequeue(timedelta(seconds=10), 1):
            if message.channel.startswith(PREFIX):
                message.complete()
            else:
                message.defer()


def cleanup(dsn: str, scenario: Scenario, since: datetime | None, out: TextIO) -> None:
    """Leaves an existing database as the demo found it (best effort, said aloud)."""
    with psycopg.connect(with_options(dsn, NO_JIT), autocommit=True) as conn:
        purge(conn, time.monotonic() + scenario.crash_lock.total_seconds() + 10, scenario)
        if since is not None:
            try:
                conn.execute("DELETE FROM fairq.message_history"
                             " WHERE channel LIKE 'demo-%%' AND settled_at >= %s", (since,))
            except psycopg.errors.InsufficientPrivilege:
                print("note: the demo's rows in fairq.message_history stay (no privilege to "
                      "delete them)", file=out)
        left = demo_backlog(conn)
        if left:
            print(f"note: {left} messages remain in channels demo-*", file=out)


@contextmanager
def throwaway_database(out: TextIO) -> Iterator[str]:
    cluster = Cluster()
    print(f"starting a throwaway {cluster.version} on 127.0.0.1 ...", file=out, flush=True)
    try:
        cluster.start()
        dsn = cluster.dsn("postgres")
        with psycopg.connect(dsn, autocommit=True) as conn:
            try:
                conn.execute("CREATE EXTENSION fairq")
            except psycopg.errors.UndefinedFile as exc:
                raise DemoError("the fairq extension is not installed in this PostgreSQL: "
                                "run `make install` (or `make demo`)") from exc
        print(f"PostgreSQL at {dsn} (removed at the end)", file=out, flush=True)
        yield dsn
    finally:
        with suppress(Exception):
            cluster.remove()


@contextmanager
def quiet_workers() -> Iterator[None]:
    """The demo reports failures itself. Kept until the server is gone: a Worker's
    LISTEN thread outlives ``run()`` by up to half a second."""
    log = logging.getLogger("fairq.worker")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        time.sleep(0.6)
        log.setLevel(level)


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- running it -----------------------------------------------------------------------------

def scenario_run(dsn: str, scenario: Scenario, chart_path: Path | None, out: TextIO,
                 seed: int, existing: bool) -> int:
    observed = Observed()
    dsn = with_options(dsn, NO_JIT)
    with psycopg.connect(dsn, autocommit=True) as conn:
        check_database(conn)
        if existing:
            purge(conn, time.monotonic() + 15, scenario)  # leftovers of an interrupted run
        queue: Queue[Any] = Queue(conn)
        for tenant in scenario.tenants:
            if tenant.policy != "-":
                queue.channel_set(tenant.name, max_concurrency=tenant.max_concurrency,
                                  release_interval=timedelta(
                                      milliseconds=tenant.release_interval_ms))
        since = db_now(conn)

    # The workers' sessions record history (the report's source); nobody else's do.
    work_dsn = with_options(dsn, "fairq.history=on")
    workers: list[Worker[Any]] = []
    threads: list[threading.Thread] = []
    queues: list[Queue[Any]] = []
    producer: Producer | None = None
    try:
        for i in range(WORKERS):
            wqueue = Queue(work_dsn, codec=JsonCodec(), pool_size=THREADS + 2)
            queues.append(wqueue)
            worker = Worker(wqueue, make_handler(observed), concurrency=THREADS,
                            lock=timedelta(seconds=5), max_attempts=MAX_ATTEMPTS,
                            backoff=Backoff(base=timedelta(milliseconds=100),
                                            cap=timedelta(milliseconds=500)),
                            poll_interval=timedelta(milliseconds=500),
                            grace_period=timedelta(seconds=2))
            workers.append(worker)
            threads.append(threading.Thread(target=worker.run, name=f"fairq-demo-worker-{i}",
                                            daemon=True))
        pqueue = Queue(work_dsn, codec=JsonCodec(), pool_size=2)
        queues.append(pqueue)
        started = time.monotonic()
        for thread in threads:
            thread.start()
        producer = Producer(pqueue, scenario, observed, started, seed)
        producer.start()

        display = Display(out, scenario)
        drained = False
        drain_limit = scenario.seconds + max(30.0, 2 * scenario.seconds)
        with psycopg.connect(dsn, autocommit=True) as monitor:
            while True:
                elapsed = time.monotonic() - started
                rows = live_rows(monitor, scenario, since)
                with observed.lock:
                    for row in rows:
                        sampled = observed.max_in_flight_sampled
                        sampled[row.channel] = max(sampled[row.channel], row.in_flight)
                if producer.error is not None:
                    raise producer.error
                producing = producer.is_alive()
                settled_all = sum(r.done + r.dead for r in rows) >= observed.total_created()
                if not producing and settled_all and demo_backlog(monitor) == 0:
                    drained = True
                    display.show(elapsed, "done", rows, observed)
                    break
                if elapsed > drain_limit:
                    display.show(elapsed, "gave up waiting", rows, observed)
                    break
                display.show(elapsed, "sending" if producing else "draining", rows, observed)
                time.sleep(0.5)
            elapsed = time.monotonic() - started
            for worker in workers:
                worker.stop()
            for thread in threads:
                thread.join(10)
            rep, settled = report(monitor, scenario, observed, since, drained, elapsed)
        print(file=out)
        for line in rep.lines:
            print(line, file=out)
        if chart_path is not None:
            print(f"  {chart(chart_path, scenario, settled, elapsed)}", file=out)
        if rep.failures:
            print(f"\n{len(rep.failures)} check(s) FAILED", file=out, flush=True)
            return 1
        print("\nall checks passed", file=out, flush=True)
        return 0
    finally:
        if producer is not None:
            producer.stopping.set()
            producer.join(5)
        for worker in workers:
            worker.stop()
        for thread in threads:
            thread.join(10)
        for q in queues:
            q.close()
        if existing:
            cleanup(dsn, scenario, since, out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", help="run in this existing database (channels demo-*, "
                                      "cleaned up afterwards) instead of a throwaway cluster; "
                                      "no other channel may hold messages there")
    parser.add_argument("--quick", action="store_true", help="a 5-second run instead of 20")
    parser.add_argument("--seconds", type=float, help="seconds of sending (default 20, or 5)")
    parser.add_argument("--chart", type=Path, default=Path("fairq-demo.png"),
                        help="where to write the PNG chart (default ./fairq-demo.png)")
    parser.add_argument("--no-chart", dest="chart", action="store_const", const=None,
                        help="write no chart")
    parser.add_argument("--seed", type=int, default=1, help="random seed of the workload")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Runs the demo as ``args`` (from :func:`add_arguments`) say; returns the exit code:
    0 when every check held, 1 when one failed, 2 when the demo could not run, 130 when
    interrupted."""
    out = out or sys.stdout
    seconds = args.seconds if args.seconds is not None else (5.0 if args.quick else 20.0)
    if seconds <= 0:
        print("fairq demo: --seconds must be positive", file=sys.stderr)
        return 2
    scenario = Scenario.build(seconds)
    try:
        with sigterm_as_interrupt(), quiet_workers():
            if args.dsn:
                return scenario_run(args.dsn, scenario, args.chart, out, args.seed, True)
            with throwaway_database(out) as dsn:
                return scenario_run(dsn, scenario, args.chart, out, args.seed, False)
    except KeyboardInterrupt:
        print("\nfairq demo: interrupted, cleaned up", file=sys.stderr)
        return 130
    except (DemoError, psycopg.Error, OSError) as exc:
        print(f"fairq demo: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:  # initdb / pg_ctl of the throwaway cluster
        print(f"fairq demo: {exc}\n{exc.stderr or ''}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fairq demo",
        description="Watch fairq share workers fairly between tenants, with limits, "
                    "failures and a crash, then read what happened.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

