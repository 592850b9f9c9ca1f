"""What the dashboard samples in the background: the queues, every few seconds.

One thread reads ``fairq.queues`` (which reads every message once) once
per interval, however many browsers and scrapers look: the pages and ``/metrics`` read
the latest :class:`Snapshot`, and an action asks for a fresh one at once. The samples
of the last hour feed the chart when the history is off. When the history holds rows,
the sampler also keeps the counters of settled messages (see :class:`SettledCounters`).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import psycopg

from fairq.dashboard.queries import (
    Connection,
    HistoryTotal,
    QueueRow,
    can_read_messages,
    history_totals,
    queues,
)

__all__ = ["HOUR", "SHOWN_QUEUES", "Sample", "Sampler", "SettledCounters", "Snapshot",
           "take_snapshot"]

HOUR = timedelta(hours=1)
#: Intervals without a new sample after which the pages and /metrics say so
#: (fairq_up 0): a read the database never answers fails no other way.
STALE_AFTER = 3
#: The queues a sample keeps for the chart, the busiest (ready + in flight): an hour of
#: samples of every queue grew without bound with the queues (3.5 MB/s at 20,000).
CHARTED_QUEUES = 10
#: The queues the Queues page and the per-queue metrics show: every paused one, then
#: those holding the most messages and dead letters. Queues are job kinds, and few, but
#: any producer may name a new one: a page of every queue ever named grew without
#: bound (20 MB at each refresh with 20,000 queues, 7 MB of metrics).
SHOWN_QUEUES = 200
#: How long stop() waits for a read in progress, beyond one interval.
STOP_WAIT_S = 5.0
log = logging.getLogger("fairq.dashboard")


@dataclass(frozen=True)
class Snapshot:
    """The queues as one read saw them."""

    taken_at: datetime  # the database's clock
    seconds: float  # how long the read took
    queues: list[QueueRow]
    reads_messages: bool  # whether fairq.message was readable (oldest ready ages)
    history: bool  # whether fairq.message_history holds rows or the setting is on

    def shown_queues(self) -> list[QueueRow]:
        """At most SHOWN_QUEUES of the queues, in name order (see SHOWN_QUEUES; among
        equals, the first names)."""
        ranked = sorted(self.queues,
                        key=lambda q: (not q.pause.active, -(q.size + q.dead), q.queue))
        return sorted(ranked[:SHOWN_QUEUES], key=lambda q: q.queue)


@dataclass(frozen=True)
class Sample:
    """One queue at one moment, for the sampled chart."""

    at: datetime
    queue: str
    ready: int
    in_flight: int
    oldest_ready_s: float | None


def _history_readable(conn: Connection) -> bool:
    """Whether the history may be read and is recorded (the setting is on, or it holds
    rows). Two statements: PostgreSQL checks the rights on every table a statement
    names before it runs, so "has_table_privilege(...) AND EXISTS (SELECT FROM
    fairq.message_history)" failed for a role without SELECT on it, and with it every
    sample: such a role saw no queue at all."""
    row = conn.execute("SELECT has_table_privilege('fairq.message_history', 'SELECT')"
                       ).fetchone()
    if row is None or not row[0]:
        return False
    row = conn.execute(
        # (On: a boolean's true spellings, as fairq.setting_on reads them.)
        "SELECT lower(trim(coalesce(current_setting('fairq.history', true), '')))"
        "      ~ '^(on|1|t(r(ue?)?)?|y(es?)?)$'"
        "      OR EXISTS (SELECT 1 FROM fairq.message_history)").fetchone()
    return row is not None and bool(row[0])


def take_snapshot(conn: Connection) -> Snapshot:
    reads = can_read_messages(conn)
    history = _history_readable(conn)
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    started: datetime = row[0]
    rows = queues(conn, with_oldest=reads)
    done = conn.execute("SELECT clock_timestamp()").fetchone()
    assert done is not None
    return Snapshot(started, (done[0] - started).total_seconds(), rows, reads, history)


@dataclass
class SettledCounters:
    """Settled messages per (queue, outcome) and their deliveries, as recorded in
    fairq.message_history: the totals of the whole table when first read, then what
    each read adds.

    A history row's settled_at is taken inside its transaction, which may commit a
    little later: a read of everything after the last read would miss such rows. So
    each read goes back ``overlap`` (whole seconds) and compares that window's counts,
    per second, with what it counted there before; seconds older than that are final."""

    overlap: timedelta = timedelta(seconds=60)
    totals: dict[tuple[str, str], HistoryTotal] = field(default_factory=dict)
    recent: dict[tuple[str, str, datetime], HistoryTotal] = field(default_factory=dict)
    since: datetime | None = None  # rows settled before it are in the totals for good

    def update(self, conn: Connection, now: datetime) -> None:
        horizon = (now - self.overlap).replace(microsecond=0)
        if self.since is None:
            for total in history_totals(conn, horizon):
                self._add(total.queue, total.outcome, total.messages, total.deliveries)
            self.since = horizon
        rows = conn.execute(
            "SELECT queue, outcome, date_trunc('second', settled_at), count(*),"
            " coalesce(sum(num_attempts), 0) FROM fairq.message_history"
            " WHERE settled_at >= %s GROUP BY 1, 2, 3", (self.since,)).fetchall()
        for queue, outcome, second, messages, deliveries in rows:
            key = (queue, outcome, second)
            seen = self.recent.get(key)
            self._add(queue, outcome, messages - (seen.messages if seen else 0),
                      deliveries - (seen.deliveries if seen else 0))
            self.recent[key] = HistoryTotal(queue, outcome, messages, deliveries)
        if horizon > self.since:
            self.since = horizon
            self.recent = {k: v for k, v in self.recent.items() if k[2] >= horizon}

    def _add(self, queue: str, outcome: str, messages: int, deliveries: int) -> None:
        # Counters only grow: a window that history_prune emptied must not lower them.
        if messages <= 0 and deliveries <= 0:
            return
        old = self.totals.get((queue, outcome), HistoryTotal(queue, outcome, 0, 0))
        self.totals[(queue, outcome)] = HistoryTotal(
            queue, outcome, old.messages + max(messages, 0),
            old.deliveries + max(deliveries, 0))


class Sampler:
    """Samples the queues every ``interval`` on a thread of its own (``start``/``stop``);
    ``latest()`` is the last snapshot, ``sample_now()`` takes one at once."""

    def __init__(self, connect: Callable[[], AbstractContextManager[Connection]],
                 interval: timedelta) -> None:
        self._connect = connect
        self.interval = interval
        # Two locks: _sampling makes reads of the database one at a time (the counters
        # add up what each finds), _lock guards what pages and /metrics read, and is
        # never held across a query: a read that waits (on a lock an upgrade holds)
        # made every page wait with it.
        self._sampling = threading.Lock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._latest: Snapshot | None = None
        self._latest_at = 0.0  # when it was taken (time.monotonic())
        self._settled: list[HistoryTotal] = []
        self._error: str | None = None
        self.started_at: datetime | None = None
        self.samples: deque[Sample] = deque()
        self.counters = SettledCounters()

    def start(self) -> None:
        self.sample_now()
        self._thread = threading.Thread(target=self._run, name="fairq-dashboard-sampler",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            # (A read the server never answers would hold the thread for ever; it is a
            # daemon, and ends with the process.)
            self._thread.join(self.interval.total_seconds() + STOP_WAIT_S)

    @property
    def error(self) -> str | None:
        """Why the queues shown may not be current: the last read's failure, or that no
        read has succeeded for STALE_AFTER intervals (a read still waiting)."""
        with self._lock:
            if self._error is not None or self._latest is None:
                return self._error
            age = time.monotonic() - self._latest_at
        if age > STALE_AFTER * self.interval.total_seconds():
            return f"no new sample for {age:.0f} s (the database has not answered)"
        return None

    def latest(self) -> Snapshot | None:
        with self._lock:
            return self._latest

    def sampled(self) -> Iterator[Sample]:
        with self._lock:
            return iter(list(self.samples))

    def settled(self) -> list[HistoryTotal] | None:
        """The counters of settled messages, or None while no history is recorded."""
        with self._lock:
            if self._latest is None or not self._latest.history:
                return None
            return list(self._settled)

    def sample_now(self) -> Snapshot | None:
        """Reads the queues now (and the history's new rows); on failure keeps the last
        snapshot and records the database's error."""
        with self._sampling:
            try:
                with self._connect() as conn:
                    snapshot = take_snapshot(conn)
                    if snapshot.history:
                        self.counters.update(conn, snapshot.taken_at)
            except psycopg.Error as exc:
                log.warning("sampling the queues failed: %s", exc)
                with self._lock:
                    self._error = str(exc).strip() or type(exc).__name__
                    return self._latest
            settled = sorted(self.counters.totals.values(), key=lambda t: (t.queue, t.outcome))
        with self._lock:
            self._error = None
            self._latest = snapshot
            self._latest_at = time.monotonic()
            self._settled = settled
            if self.started_at is None:
                self.started_at = snapshot.taken_at
            busiest = heapq.nlargest(CHARTED_QUEUES, snapshot.queues,
                                     key=lambda q: (q.ready + q.in_flight, q.queue))
            self.samples.extend(Sample(snapshot.taken_at, q.queue, q.ready, q.in_flight,
                                       q.oldest_ready_s) for q in busiest)
            while self.samples and self.samples[0].at < snapshot.taken_at - HOUR:
                self.samples.popleft()
        return snapshot

    def _run(self) -> None:
        while not self._stop.wait(self.interval.total_seconds()):
            self.sample_now()
