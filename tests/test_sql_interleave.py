"""Interleavings: one transaction held open while another session calls.

Each test pins down one race the design must win: a message committed by a
producer is never stranded, an open producer transaction never hides a busy
channel, two dequeues on one channel never answer "empty" while work waits, and
fencing holds when settlement and lock recovery cross.

Whether a call waits is read from the server (pg_blocking_pids: it waits for a lock
that the other session holds), never guessed from how long it took, so a loaded
machine cannot change a verdict.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

from sqlq import (
    Conn,
    Delivery,
    call,
    channel_row,
    channels_of,
    complete,
    create,
    create_many,
    dequeue,
    dequeue_one,
    drain,
    problems,
    travel,
)


@pytest.fixture
def other(dsn: str) -> Iterator[Conn]:
    """A second session on the same database."""
    with psycopg.connect(dsn, autocommit=True) as c:
        yield c


@contextmanager
def open_transaction(conn: Conn) -> Iterator[Conn]:
    """Runs the block inside a transaction that stays open until the block ends."""
    with conn.transaction():
        yield conn


FAILURE_NET = 30.0  # seconds; only a test that is going to fail waits this long
GATE_KEY = 4_242_424_242  # an advisory lock of the tests' own (one-bigint form)


def blocked_by(watch: Conn, pid: int, holder: Conn) -> bool:
    """Whether backend ``pid`` waits for a lock that ``holder``'s session holds, or
    for a session that waits for it in turn."""
    row = watch.execute("""
        WITH RECURSIVE blocker(pid) AS (
            SELECT unnest(pg_blocking_pids(%(pid)s))
            UNION
            SELECT unnest(pg_blocking_pids(b.pid)) FROM blocker b)
        SELECT %(holder)s IN (SELECT pid FROM blocker)""",
                        {"pid": pid, "holder": holder.info.backend_pid}).fetchone()
    return bool(row and row[0])


def waits_for(watch: Conn, pid: int, holder: Conn, running: Callable[[], bool]) -> bool:
    """True as soon as backend ``pid`` is seen waiting for ``holder``; False if its call
    finishes (``running()`` turns false) first."""
    deadline = time.monotonic() + FAILURE_NET
    while running() and time.monotonic() < deadline:
        if blocked_by(watch, pid, holder):
            return True
        time.sleep(0.001)
    return False


class Background:
    """Runs one call on its own connection in a thread, so it may block."""

    def __init__(self, dsn: str, fn: Any) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._conn = psycopg.connect(dsn, autocommit=True)
        self._pid = self._conn.info.backend_pid
        self._watch = psycopg.connect(dsn, autocommit=True)
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Any) -> None:
        try:
            self.result = fn(self._conn)
        except BaseException as exc:  # reported by join()
            self.error = exc

    def waits_for(self, holder: Conn) -> bool:
        """True once the call is seen waiting for a lock that ``holder`` holds; False
        if it finishes first."""
        return waits_for(self._watch, self._pid, holder, self._thread.is_alive)

    def finishes_without_waiting_for(self, holder: Conn) -> bool:
        """True if the call finishes, never seen waiting for ``holder``'s locks (which
        ``holder`` keeps meanwhile, so a call that waited for them could not finish)."""
        deadline = time.monotonic() + FAILURE_NET
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                return True
            if blocked_by(self._watch, self._pid, holder):
                return False
            self._thread.join(0.005)
        return False

    def join(self) -> Any:
        self._thread.join(FAILURE_NET)
        assert not self._thread.is_alive(), "background call never finished"
        self._conn.close()
        self._watch.close()
        if self.error:
            raise self.error
        return self.result


def test_message_created_while_the_channel_drains_is_not_stranded(conn: Conn, other: Conn) -> None:
    # The channel is due (one message waiting), so the producer only share-locks it.
    create(conn, "x", b"first")
    with open_transaction(other):
        create(other, "x", b"second")
        # Meanwhile a worker takes the last visible message of the channel.
        got = dequeue(conn, n=5)
        assert [d.content for d in got] == [b"first"]
    # The producer committed after the channel looked empty: it must still be served.
    assert [d.content for d in dequeue(conn, n=5)] == [b"second"]
    assert problems(conn) == []


def test_message_created_on_an_idle_channel_during_a_dequeue(conn: Conn, other: Conn) -> None:
    with open_transaction(other):
        create(other, "idle", b"m")
        assert dequeue(conn) == []  # not committed yet: invisible
    assert [d.content for d in dequeue(conn)] == [b"m"]


def test_open_producer_transaction_does_not_hide_a_backlogged_channel(conn: Conn, other: Conn) -> None:
    create_many(conn, ["busy"] * 3)
    with open_transaction(other):
        create(other, "busy", b"uncommitted")
        got = dequeue(conn, n=3)
        assert len(got) == 3  # the producer's share lock does not block workers
        for d in got:
            assert complete(conn, d) == "completed"  # nor settlements


def test_open_producer_transaction_on_a_scheduled_channel_wakes_it_on_commit(conn: Conn, other: Conn) -> None:

    now = conn.execute("SELECT fairq.clock()").fetchone()[0]  # type: ignore[index]
    create(conn, "s", b"later", dequeue_at=now + timedelta(hours=1))
    with open_transaction(other):
        create(other, "s", b"now")
    assert [d.content for d in dequeue(conn)] == [b"now"]


def test_two_dequeues_on_one_busy_channel_do_not_answer_empty(dsn: str, conn: Conn, other: Conn) -> None:
    create_many(conn, ["only"] * 2)
    with open_transaction(other):
        first = dequeue(other)
        assert len(first) == 1
        # The channel row is locked by the open dequeue; a second dequeue must wait
        # for it, not report an empty queue. It waits at most fairq.dequeue_busy_wait
        # (by the server's clock) before it answers "nothing available": widened to
        # the failure net, and the test commits as soon as it sees the wait.
        second = Background(dsn, lambda c: (
            c.execute(f"SET fairq.dequeue_busy_wait = '{int(FAILURE_NET)}s'"), dequeue(c))[1])
        assert second.waits_for(other)
    got = second.join()
    assert len(got) == 1 and got[0].id != first[0].id


@pytest.mark.parametrize("path", ["batch", "bounded"])
def test_a_dedup_key_a_concurrent_producer_commits_is_a_duplicate(
        dsn: str, conn: Conn, other: Conn, path: str) -> None:
    """Two producers with one dedup key: the second inserts while the first has not
    committed, waits for it in ON CONFLICT, and must then answer duplicate with the
    first's id. 0.7.31's batch path (and message_create on a bounded channel, which
    takes it) failed there with 42804."""
    create(conn, "c", b"seed")
    if path == "bounded":
        conn.execute("SELECT fairq.channel_set('c', p_max_size => 100)")
    with open_transaction(other):
        first, status = create(other, "c", b"first", dedup_key="k")
        assert status == "created"
        second = Background(dsn, lambda c: (
            create_many(c, ["c"], dedup_keys=["k"]) if path == "batch"
            else [(1, *create(c, "c", b"second", dedup_key="k"))]))
        assert second.waits_for(other)
    assert second.join() == [(1, first, "duplicate")]
    assert problems(conn) == []


@pytest.mark.parametrize(("settle", "admin"), [
    ("defer", "channel_set('c', p_max_concurrency => 3)"),
    ("fail", "channel_set('c', p_max_concurrency => 3)"),
    ("complete", "channel_set('c', p_max_concurrency => 3)"),
    ("complete", "channel_pause('c', fairq.clock() + interval '1 hour')"),
    ("complete", "channel_clear('c')"),
])
def test_a_worker_that_settles_then_produces_does_not_deadlock_with_a_policy_change(
        dsn: str, conn: Conn, other: Conn, settle: str, admin: str) -> None:
    """A worker's transaction settles a message (which writes its channel's row: a
    defer, a fail, a capped channel's completion) and then produces on that channel,
    while a policy change of the channel waits for it. 0.7.31's policy change waited
    for the row holding the channel's producer lock, and the two deadlocked."""
    conn.execute("SELECT fairq.channel_set('c', p_max_concurrency => 2)")
    create(conn, "c", b"m1")
    held = dequeue_one(conn)
    assert held is not None
    with open_transaction(other):
        assert call(other, f"message_{settle}", held.id, held.num_attempts) in {
            "deferred", "dead", "completed"}
        change = Background(dsn, lambda c: c.execute(f"SELECT fairq.{admin}").fetchall())
        assert change.waits_for(other)
        assert create(other, "c", b"m2")[1] == "created"
    change.join()
    assert problems(conn) == []


@pytest.mark.parametrize("busy_wait", ["25 days", "1000 years"])
def test_a_busy_wait_longer_than_lock_timeout_takes_still_waits(
        dsn: str, conn: Conn, other: Conn, busy_wait: str) -> None:
    """fairq.dequeue_busy_wait may be up to 1,000 years; PostgreSQL's lock_timeout,
    which the wait sets, takes at most 2^31 - 1 ms (24.8 days). 0.7.31 failed such a
    dequeue with lock_timeout's error instead of waiting."""
    create_many(conn, ["only"] * 2)
    with open_transaction(other):
        assert len(dequeue(other)) == 1
        second = Background(dsn, lambda c: (
            c.execute(f"SET fairq.dequeue_busy_wait = '{busy_wait}'"), dequeue(c))[1])
        assert second.waits_for(other)
    assert len(second.join()) == 1


def test_dequeue_does_not_hang_on_a_channel_held_by_a_long_transaction(
        dsn: str, conn: Conn, other: Conn) -> None:
    create_many(conn, ["only"] * 2)
    with open_transaction(other):
        assert len(dequeue(other)) == 1  # ...and the transaction stays open
        # It answers while the channel is still held (a dequeue that waited for the
        # transaction to end would never answer here).
        blocked = Background(dsn, lambda c: dequeue(c))
        assert blocked.join() == []


def test_a_dequeue_that_waited_and_found_nothing_keeps_no_channel_locked(
        dsn: str, conn: Conn, other: Conn) -> None:
    """The waiting fallback locks nothing it does not serve: a dequeue that waited for
    a busy channel, found it drained, and answered empty leaves its transaction
    holding no channel row, so a producer can still wake the channel. (Before 0.3.0
    the waiting scan kept every drained row it stepped over, which also let two
    waiters deadlock.)"""
    create_many(conn, ["a", "b"])
    waiter_conn = psycopg.connect(dsn)  # not autocommit: its transaction stays open
    answered: list[list[Delivery]] = []
    try:
        with open_transaction(other):
            assert len(dequeue(other, n=2)) == 2  # drains both channels, holds both rows
            waiter_pid = waiter_conn.info.backend_pid
            waiter = threading.Thread(target=lambda: answered.append(dequeue(waiter_conn)),
                                      daemon=True)
            waiter.start()
            assert waits_for(conn, waiter_pid, other, waiter.is_alive), \
                "the dequeue should wait for the busy channels"
        waiter.join(FAILURE_NET)
        assert answered == [[]]  # both drained; its transaction is still open
        conn.execute("SET lock_timeout = '2s'")
        assert create(conn, "a", b"next")[1] == "created"  # wakes "a": takes its row
        got = dequeue(conn)
        assert [d.channel for d in got] == ["a"]
    finally:
        waiter_conn.rollback()
        waiter_conn.close()
    assert problems(conn) == []


@pytest.mark.parametrize("channel", ["idle", "new", "busy"])
def test_two_producers_racing_on_one_dedup_key_create_it_once(
        dsn: str, conn: Conn, other: Conn, channel: str) -> None:
    """The second producer waits for the first, then answers duplicate with the first
    one's id. It waits on the row of the channel both wake (idle), on the channel's
    insertion (new), or on the key itself (busy: neither wakes the channel, so the
    second finds the key only when its insert conflicts). A channel woken for the
    duplicate keeps a consistent turn."""
    waiting: list[int] = []
    if channel == "idle":  # a policy keeps the empty channel's row: both producers wake it
        conn.execute("SELECT fairq.channel_set('race', p_max_attempts => 5)")
    if channel == "busy":
        waiting.append(create(conn, "race", b"already due")[0] or 0)
    with open_transaction(other):
        first = create(other, "race", b"one", dedup_key="k")
        assert first[1] == "created"
        second = Background(dsn, lambda c: create(c, "race", b"two", dedup_key="k"))
        assert second.waits_for(other)
    assert second.join() == (first[0], "duplicate")
    assert problems(conn) == []
    assert [d.id for d in dequeue(conn, n=5)] == [*waiting, first[0]]
    assert dequeue(conn) == []


@pytest.mark.parametrize("first", ["commits", "rolls back"])
def test_batch_producer_does_not_wait_for_a_channel_another_producer_wakes(
        dsn: str, conn: Conn, other: Conn, first: str) -> None:
    """A batch wakes the idle channels whose rows are free and queues a wake for a row
    that another transaction holds, instead of waiting for it. The next dequeue
    applies the queued wake: if the first producer commits, the channel keeps the
    earlier turn that producer gave it; if it rolls back, the queued wake alone
    brings the batch's message to its turn. Either way nothing is stranded."""
    for name in ("a", "b"):  # policies keep the empty channels' rows: both are idle
        conn.execute("SELECT fairq.channel_set(%s, p_max_attempts => 5)", (name,))
    with other.transaction():
        assert create_many(other, ["b"])[0][2] == "created"  # wakes b, holds its row
        batch = Background(dsn, lambda c: create_many(c, ["a", "b", "a"]))
        assert batch.finishes_without_waiting_for(other), "the batch must not wait for b's row"
        assert [status for _, _, status in batch.join()] == ["created"] * 3
        queued = conn.execute("SELECT count(*) FROM fairq.channel_wake w"
                              " JOIN fairq.channel c ON c.id = w.channel_id"
                              " WHERE c.name = 'b'").fetchone()
        assert queued == (1,)
        assert problems(conn) == []  # a queued wake counts as the channel's due_at
        if first == "rolls back":
            raise psycopg.Rollback()
    # Committed, b keeps the turn it took first (before a's); rolled back, the queued
    # wake gives b the batch's turn, after a's.
    expected = ["b", "a", "b", "a"] if first == "commits" else ["a", "b", "a"]
    assert channels_of(dequeue(conn, n=10)) == expected
    assert conn.execute("SELECT count(*) FROM fairq.channel_wake").fetchone() == (0,)
    assert dequeue(conn) == []
    assert problems(conn) == []


def test_channel_collected_while_a_producer_queues_its_wake_keeps_the_message(
        dsn: str, conn: Conn, other: Conn) -> None:
    """The collector picks an idle channel, then takes its producer lock. A producer
    meanwhile puts a message on the channel and queues its wake (it never waits for
    the row the collector holds), and commits before the collector takes the lock.
    The collector must look again under that lock and keep the channel: the message
    is delivered. Here fairq.channel_quiet first waits for an advisory lock that the
    test holds until the producer has committed, to hold that window open."""
    create(conn, "x", b"first")
    first = dequeue_one(conn)
    assert first is not None and complete(conn, first) == "completed"  # x is idle
    original = conn.execute(
        "SELECT pg_get_functiondef('fairq.channel_quiet(integer, text)'::regprocedure)").fetchone()
    assert original is not None
    conn.execute(f"""
        CREATE OR REPLACE FUNCTION fairq.channel_quiet(p_queue_id integer, p_channel text)
        RETURNS boolean
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_advisory_xact_lock_shared({GATE_KEY});  -- the producer commits meanwhile
            RETURN pg_try_advisory_xact_lock(fairq.producer_lock_class(),
                                             fairq.producer_lock_key(p_queue_id, p_channel));
        END $$""")
    gate = psycopg.connect(dsn, autocommit=True)
    try:
        gate.execute(f"SELECT pg_advisory_lock({GATE_KEY})")
        collector = Background(dsn, lambda c: c.execute(
            "SELECT set_config('fairq.idle_channel_ttl', '0', false),"
            " fairq.collect_idle_channels(fairq.clock(), 100)").fetchone())
        assert collector.waits_for(gate), "the collector should be collecting x"
        # x's row is held by the collector: the producer queues the wake, it does not
        # wait (a wait would last until the failure net, the collector being held).
        other.execute(f"SET lock_timeout = '{int(FAILURE_NET)}s'")
        created = create(other, "x", b"second")
        assert created[1] == "created"
        gate.execute(f"SELECT pg_advisory_unlock({GATE_KEY})")
        assert collector.join() == ("0", 0)
    finally:
        gate.close()
        conn.execute(original[0])
    assert problems(conn) == []
    got = dequeue(conn)
    assert [d.id for d in got] == [created[0]]


def test_concurrent_dequeues_spread_over_channels_without_waiting(dsn: str, conn: Conn, other: Conn) -> None:
    create_many(conn, ["a", "a", "b", "b"])
    with open_transaction(other):
        first = dequeue(other)
        second = Background(dsn, lambda c: dequeue(c))
        assert second.finishes_without_waiting_for(other), \
            "SKIP LOCKED must move on to the next channel"
        got = second.join()
    assert {first[0].channel, got[0].channel} == {"a", "b"}


def test_complete_racing_lock_recovery_settles_once(dsn: str, conn: Conn, other: Conn) -> None:
    create(conn, "r")
    d = dequeue_one(conn, lock_ms=50)
    assert d is not None
    travel(conn, 1_000)
    with open_transaction(other):
        assert complete(other, d) == "completed"  # holds the message row until commit
        assert dequeue(conn) == []  # recovery skips the row being settled
    assert dequeue(conn) == []
    assert problems(conn) == []


def test_lock_recovery_racing_complete_fences_the_old_holder(dsn: str, conn: Conn, other: Conn) -> None:
    create(conn, "r")
    d = dequeue_one(conn, lock_ms=50)
    assert d is not None
    travel(conn, 1_000)
    with open_transaction(other):
        again = dequeue(other)  # recovers and re-delivers with attempt 2
        assert len(again) == 1 and again[0].num_attempts == 2 and again[0].recovered
        late = Background(dsn, lambda c: complete(c, d))
        assert late.waits_for(other)
    assert late.join() == "stale"
    assert complete(conn, again[0]) == "completed"
    assert problems(conn) == []


def test_heartbeat_racing_expiry_keeps_the_lock(dsn: str, conn: Conn, other: Conn) -> None:
    create(conn, "h")
    d = dequeue_one(conn, lock_ms=50)
    assert d is not None
    travel(conn, 1_000)
    with open_transaction(other):
        assert call(other, "message_heartbeat", d.id, d.num_attempts, 60_000) == "heartbeated"
        assert dequeue(conn) == []  # the row is being heartbeated: not recovered
    assert dequeue(conn) == []  # and now the lock runs for another minute
    assert complete(conn, d) == "completed"


def test_expiry_racing_heartbeat_fences_the_heartbeat(dsn: str, conn: Conn, other: Conn) -> None:
    create(conn, "h")
    d = dequeue_one(conn, lock_ms=50)
    assert d is not None
    travel(conn, 1_000)
    with open_transaction(other):
        again: list[Delivery] = dequeue(other)
        assert len(again) == 1
        late = Background(dsn, lambda c: call(c, "message_heartbeat", d.id, d.num_attempts, 60_000))
        assert late.waits_for(other)
    assert late.join() == "stale"


def test_two_completes_of_one_message_settle_once(dsn: str, conn: Conn, other: Conn) -> None:
    call(conn, "channel_set", "c", 2)  # capped: in_flight counts its locked messages
    create(conn, "c")
    d = dequeue_one(conn)
    assert d is not None
    in_flight = "SELECT in_flight FROM fairq.channel WHERE name = 'c'"
    assert conn.execute(in_flight).fetchone() == (1,)
    with open_transaction(other):
        assert complete(other, d) == "completed"
        twin = Background(dsn, lambda c: complete(c, d))
        assert twin.waits_for(other)
    assert twin.join() == "not_found"
    assert conn.execute(in_flight).fetchone() == (0,)  # freed once, not twice
    assert problems(conn) == []


def test_cancel_racing_dequeue_of_the_same_message(dsn: str, conn: Conn, other: Conn) -> None:
    mid, _ = create(conn, "x")
    create(conn, "x")
    with open_transaction(other):
        assert call(other, "message_cancel", mid) == "cancelled"
        got = dequeue(conn)  # the head being cancelled is skipped, the next one served
        assert len(got) == 1 and got[0].id != mid
    assert dequeue(conn) == []
    assert problems(conn) == []


# -- An open producer transaction never hides its channel nor blocks its settlements ----


@pytest.mark.parametrize("policy", [None, 2], ids=["uncapped", "capped"])
def test_open_producer_transaction_on_an_idle_channel_hides_no_committed_message(
        conn: Conn, other: Conn, dsn: str, policy: int | None) -> None:
    """A producer that wakes an idle channel and stays open must not keep workers from
    the channel's other messages (0.5.0 locked the row for the wake until commit)."""
    conn.execute("SELECT fairq.channel_set('p', p_max_concurrency => %s)", (policy,))
    with open_transaction(other):
        create(other, "p", b"uncommitted")  # the channel was idle: this wakes it
        late = Background(dsn, lambda c: create(c, "p", b"committed"))
        assert late.finishes_without_waiting_for(other)
        assert late.join()[1] == "created"
        assert [d.content for d in dequeue(conn, n=5)] == [b"committed"]
    assert [d.content for d in dequeue(conn, n=5)] == [b"uncommitted"]
    assert problems(conn) == []


def test_open_producer_transaction_hides_no_scheduled_message_that_came_due(
        conn: Conn, other: Conn) -> None:
    now = conn.execute("SELECT fairq.clock()").fetchone()[0]  # type: ignore[index]
    create(conn, "s", b"scheduled", dequeue_at=now + timedelta(hours=1))
    assert dequeue(conn) == []  # s now waits for its scheduled message
    with open_transaction(other):
        create(other, "s", b"uncommitted")  # due now, before s's turn: wakes it
        travel(conn, 2 * 3_600_000)
        assert [d.content for d in dequeue(conn, n=5)] == [b"scheduled"]
    assert problems(conn) == []


POLICIES = {"uncapped": None, "capped": "p_max_concurrency => 2", "bounded": "p_max_size => 10"}


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_open_producer_transaction_does_not_block_completions(
        conn: Conn, other: Conn, dsn: str, policy: str | None) -> None:
    """A tenant holding a long enqueue transaction must not freeze its channel's
    completions until leases expire (0.5.0 made them wait for its commit; until
    0.7.30, a channel with a max_size too)."""
    if policy is not None:
        conn.execute(f"SELECT fairq.channel_set('p', {policy})")
    create(conn, "p", b"in flight")
    held = dequeue_one(conn)
    assert held is not None  # p has nothing pending: the next message wakes it
    with open_transaction(other):
        create(other, "p", b"uncommitted")
        completion = Background(dsn, lambda c: complete(c, held))
        assert completion.finishes_without_waiting_for(other)
        assert completion.join() == "completed"
    assert [d.content for d in dequeue(conn, n=5)] == [b"uncommitted"]
    assert problems(conn) == []


# Each changes the count of a bounded channel: of the message in flight (d), or of a
# pending one (pending: its id).
SETTLEMENTS: dict[str, Callable[[Conn, Delivery, int], str]] = {
    "complete": lambda c, d, pending: complete(c, d),
    "complete_batch": lambda c, d, pending: str(
        c.execute("SELECT status FROM fairq.message_complete_batch(%s, %s)",
                  ([d.id], [d.num_attempts])).fetchone()[0]),  # type: ignore[index]
    "fail": lambda c, d, pending: str(call(c, "message_fail", d.id, d.num_attempts, "boom")),
    "cancel": lambda c, d, pending: str(call(c, "message_cancel", pending)),
    "dead_letter_retry": lambda c, d, pending: str(call(c, "dead_letter_retry", d.id)),
}

# What each settlement answers when it goes through.
SETTLED_AS = {"complete": "completed", "complete_batch": "completed", "fail": "dead",
              "cancel": "cancelled", "dead_letter_retry": "requeued"}


@pytest.mark.parametrize("settlement", SETTLEMENTS)
def test_a_bounded_channels_settlements_never_wait_for_an_open_producer(
        conn: Conn, other: Conn, dsn: str, settlement: str) -> None:
    """A producer of a channel with a max_size holds the channel's count (its
    channel_size row) until it commits. Completions, failures, cancels and retries
    change that count too; until 0.7.30 they waited for the producer's commit, and a
    failure waited while holding the channel's row, so dequeues skipped the channel
    and its committed, due work with it. They record their change apart, and the
    next producer counts it: max_size still holds exactly."""
    conn.execute("SELECT fairq.channel_set('p', p_max_size => 4)")
    last = create_many(conn, ["p", "p", "p"])[-1][1]
    assert last is not None
    held = dequeue_one(conn)
    assert held is not None
    if settlement == "dead_letter_retry":
        assert call(conn, "message_fail", held.id, held.num_attempts, "boom") == "dead"
    with open_transaction(other):
        assert create(other, "p", b"uncommitted")[1] == "created"  # 4 of 4
        settling = Background(dsn, lambda c: SETTLEMENTS[settlement](c, held, last))
        assert settling.finishes_without_waiting_for(other)
        assert settling.join() == SETTLED_AS[settlement]
        # Committed work is handed out meanwhile (the settlement holds no row).
        assert len(dequeue(conn)) == 1
    assert problems(conn) == []
    # The count is exact: as many are admitted as max_size leaves room for.
    live = conn.execute("SELECT count(*) FROM fairq.message").fetchone()[0]  # type: ignore[index]
    statuses = [create(conn, "p", b"more")[1] for _ in range(4)]
    assert statuses == ["created"] * (4 - live) + ["dropped"] * live
    assert problems(conn) == []


def test_workers_that_complete_and_produce_across_bounded_channels_do_not_deadlock(
        conn: Conn, other: Conn, dsn: str) -> None:
    """Two workers each complete a message of one bounded tenant and enqueue a
    follow-up for the other's, in one transaction. Until 0.7.30 the second
    completion waited for the first worker's producer, whose transaction then waited
    for the second's: PostgreSQL failed one of them as a deadlock."""
    for channel in ("a", "b"):
        conn.execute("SELECT fairq.channel_set(%s, p_max_size => 10)", (channel,))
        create(conn, channel)
    first, second = dequeue(conn, n=2)
    assert {first.channel, second.channel} == {"a", "b"}
    with open_transaction(other):
        assert complete(other, first) == "completed"
        create(other, second.channel, b"follow-up of " + first.channel.encode())
        worker = Background(dsn, lambda c: (complete(c, second),
                                            create(c, first.channel, b"follow-up")[1]))
        assert worker.finishes_without_waiting_for(other)
        assert worker.join() == ("completed", "created")
    assert sorted(d.channel for d in dequeue(conn, n=5)) == ["a", "b"]
    assert problems(conn) == []


@pytest.mark.parametrize("first", ["complete", "create"])
def test_a_policy_change_never_deadlocks_a_worker_that_completes_and_produces(
        conn: Conn, other: Conn, dsn: str, first: str) -> None:
    """A worker may complete a message and enqueue a follow-up on its channel in one
    transaction, in either order, while an operator changes the channel's policy.
    Until 0.7.10 channel_set held the channel's producer lock while it waited for the
    completion, and the completion's transaction then waited for that lock:
    PostgreSQL broke the cycle after deadlock_timeout by failing one of them."""
    create(conn, "p", b"first")
    held = dequeue_one(conn)
    assert held is not None
    with open_transaction(other):
        if first == "complete":
            assert complete(other, held) == "completed"
        else:
            create(other, "p", b"follow-up")
        setter = Background(dsn, lambda c: c.execute(
            "SELECT fairq.channel_set('p', p_max_concurrency => 2)"))
        assert setter.waits_for(other)
        if first == "complete":
            create(other, "p", b"follow-up")
        else:
            assert complete(other, held) == "completed"
    setter.join()
    row = channel_row(conn, "p")
    assert row is not None and row["max_concurrency"] == 2
    assert [d.content for d in dequeue(conn, n=5)] == [b"follow-up"]
    assert problems(conn) == []


BULK = [f"bulk-{i}" for i in range(257)]  # more channels than fairq.bulk_channels(): a bulk producer


def test_a_policy_call_waiting_for_a_bulk_producer_holds_up_none_of_the_channels_producers(
        conn: Conn, other: Conn, dsn: str) -> None:
    """channel_set waits for open bulk producers of its queue. Until 0.7.36 it did so
    holding the channel's producer lock, and every producer of the channel waited with
    it, for as long as the bulk transaction stayed open."""
    create(conn, "x", b"first")
    with open_transaction(other):
        create_many(other, BULK)
        setter = Background(dsn, lambda c: c.execute(
            "SELECT fairq.channel_set('x', p_weight => 2)"))
        assert setter.waits_for(other)
        producer = Background(dsn, lambda c: create(c, "x", b"second"))
        # (Finished while the bulk transaction is still open; before, it waited for it.)
        assert producer.join()[1] == "created"
    setter.join()
    row = channel_row(conn, "x")
    assert row is not None and row["weight"] == 2
    assert problems(conn) == []


def test_a_policy_call_never_deadlocks_a_bulk_producer_and_a_producer_it_waits_for(
        conn: Conn, other: Conn, dsn: str) -> None:
    """A producer's open transaction made channel n; a bulk producer creating on n waits
    for that row; channel_set('x') waits for the bulk producer. Until 0.7.36 it held
    x's producer lock meanwhile, so the first producer's create on x closed a cycle and
    PostgreSQL failed one of them with 40P01."""
    create(conn, "x", b"first")
    with psycopg.connect(dsn, autocommit=True) as worker, open_transaction(other):
        create_many(other, BULK)
        with open_transaction(worker):
            create(worker, "n", b"w1")
            setter = Background(dsn, lambda c: c.execute(
                "SELECT fairq.channel_set('x', p_max_size => 5)"))
            assert setter.waits_for(other)
            done: dict[str, Any] = {}

            def run(name: str, c: Conn, channel: str, content: bytes) -> None:
                try:
                    done[name] = create(c, channel, content)
                except psycopg.Error as exc:
                    done[name] = exc

            bulk_n = threading.Thread(target=run, args=("bulk", other, "n", b"b2"), daemon=True)
            bulk_n.start()
            assert waits_for(conn, other.info.backend_pid, worker, bulk_n.is_alive)
            run("worker", worker, "x", b"w2")
            assert isinstance(done["worker"], tuple), done["worker"]
        bulk_n.join(FAILURE_NET)
        assert isinstance(done.get("bulk"), tuple), done.get("bulk")
    setter.join()
    row = channel_row(conn, "x")
    assert row is not None and row["max_size"] == 5
    contents = sorted(d.content for d in dequeue(conn, n=300) if d.channel in ("x", "n"))
    assert contents == [b"b2", b"first", b"w1", b"w2"]
    assert problems(conn) == []


# -- Two queues ----------------------------------------------------------------------------


def test_a_dequeue_never_waits_for_another_queues_busy_channels(
        dsn: str, conn: Conn, other: Conn) -> None:
    """Queue "b"'s only channel is held by an open dequeue (and has more work due): a
    dequeue of queue "a" hands out a's message without waiting for it, and an empty
    queue "c" answers "nothing available" without waiting for it either, although
    both wait up to the failure net for busy channels of their own queue."""
    create_many(conn, ["x", "x", "x"], queue="b")
    first = dequeue(conn, queue="b")  # b/x is in b's rotation, committed
    assert complete(conn, first[0]) == "completed"
    create(conn, "x", b"a's", queue="a")
    with open_transaction(other):
        assert len(dequeue(other, queue="b")) == 1  # holds b/x, which has one more due
        widened = f"SET fairq.dequeue_busy_wait = '{int(FAILURE_NET)}s'"
        of_a = Background(dsn, lambda c: (c.execute(widened), dequeue(c, queue="a"))[1])
        assert of_a.finishes_without_waiting_for(other)
        assert [d.content for d in of_a.join()] == [b"a's"]
        create(conn, "x", b"c's", queue="c")
        assert len(dequeue(conn, queue="c")) == 1  # "c" exists, and is empty now
        of_c = Background(dsn, lambda c: (c.execute(widened), dequeue(c, queue="c"))[1])
        assert of_c.finishes_without_waiting_for(other)
        assert of_c.join() == []
    assert [d.channel for d in dequeue(conn, queue="b")] == ["x"]
    assert problems(conn) == []


def test_an_open_producer_transaction_of_one_queue_blocks_nothing_in_another(
        dsn: str, conn: Conn, other: Conn) -> None:
    """A producer holding the producer lock of b/x in an open transaction: channel x of
    queue a takes messages, hands them out and completes them without waiting."""
    with open_transaction(other):
        create(other, "x", b"uncommitted", queue="b")
        conn.execute("SET lock_timeout = '2s'")  # a wait would be an error, not a hang
        create(conn, "x", b"a's", queue="a")
        got = dequeue(conn, queue="a")
        assert [d.content for d in got] == [b"a's"]
        assert complete(conn, got[0]) == "completed"
        conn.execute("SELECT fairq.channel_set('x', 1, p_queue => 'a')")
    assert [d.content for d in dequeue(conn, queue="b")] == [b"uncommitted"]


def test_a_call_that_waited_for_a_busy_channel_releases_at_its_new_clock(
        conn: Conn, other: Conn, dsn: str) -> None:
    """A dequeue that found only a busy channel waits for it, then goes on with a new
    clock: a rate-limited channel whose interval ended during that wait joins the
    rotation and is released at the new clock, so the interval holds between its two
    releases. (A build that let channels join at the new clock but served them at the
    clock read before the wait released it early.) The interval ends by clock travel
    while the call is seen waiting, not by sleeping."""
    conn.execute("SELECT fairq.channel_set('limited', p_release_interval_ms => 60000)")
    create(conn, "limited", b"first")
    create(conn, "limited", b"second")
    first = dequeue(conn, n=1)
    assert [d.content for d in first] == [b"first"]
    complete(conn, first[0])
    create(conn, "busy", b"waiting")
    released = "SELECT last_release_at FROM fairq.channel WHERE name = 'limited'"
    first_release = conn.execute(released).fetchone()[0]  # type: ignore[index]

    def waiting_dequeue(c: Conn) -> list[Delivery]:
        c.execute("SET fairq.dequeue_busy_wait = '30s'")
        return dequeue(c, n=2)

    with open_transaction(other):
        other.execute("SELECT 1 FROM fairq.channel WHERE name = 'busy' FOR NO KEY UPDATE")
        call_ = Background(dsn, waiting_dequeue)
        assert call_.waits_for(other)
        travel(conn, 61_000)  # the interval is over before the busy channel is free
    got = call_.join()
    assert sorted(d.content for d in got) == [b"second", b"waiting"]
    second_release = conn.execute(released).fetchone()[0]  # type: ignore[index]
    assert second_release - first_release >= timedelta(milliseconds=60_000)


# -- Producers never wait for dequeues; batch dequeues never wait for each other -------

@pytest.mark.parametrize("batch", [False, True], ids=["one message", "batch"])
@pytest.mark.parametrize("outcome", ["commits", "rolls back"])
def test_a_producer_does_not_wait_for_a_dequeue_that_drained_its_channel(
        dsn: str, conn: Conn, other: Conn, batch: bool, outcome: str) -> None:
    """A dequeue that serves a channel's last message decides, under the channel's
    settle lock, that the channel goes idle, and keeps that lock until it commits. A
    producer that puts a message on the channel meanwhile does not wait for it: it
    finds the lock taken and queues a wake, committed with its message. Whether the
    dequeue then commits (the channel idle) or rolls back (the channel due again),
    the message is delivered, once. (0.7.1 made the producer wait for the dequeue's
    commit.)"""
    create(conn, "x", b"first")
    with other.transaction():
        assert [d.content for d in dequeue(other)] == [b"first"]  # x drained: settling

        def produce(c: Conn) -> int | None:
            if batch:
                return create_many(c, ["x"])[0][1]
            return create(c, "x", b"x")[0]
        producer = Background(dsn, produce)
        assert producer.finishes_without_waiting_for(other), \
            "the producer must not wait for the dequeue settling its channel"
        second = producer.join()
        if outcome == "rolls back":
            raise psycopg.Rollback()
    got = drain(conn)
    expected = [b"x"] if outcome == "commits" else [b"first", b"x"]
    assert sorted(d.content for d in got) == expected
    assert second in [d.id for d in got]
    assert problems(conn) == []


def test_concurrent_batch_dequeues_take_the_wakes_after_each_others(
        dsn: str, conn: Conn, other: Conn) -> None:
    """Sixty idle channels are woken. A batch dequeue of 40 holds the first 40 (its
    transaction open); a second, of 20, reads the wakes in windows of 20 + 8: the
    first has no free channel, the second 16, so it reads a third and gets its 20 at
    once, from the other channels, without waiting. (0.7.1 read one window, of
    20 + 32 wakes, and answered with the 12 free ones.)"""
    names = [f"t{i:02d}" for i in range(60)]
    create_many(conn, names)
    with open_transaction(other):
        first = dequeue(other, n=40)
        assert len(first) == 40
        second = Background(dsn, lambda c: dequeue(c, n=20))
        assert second.finishes_without_waiting_for(other), \
            "the second dequeue must read past the wakes the first one holds"
        got = second.join()
    assert len(got) == 20
    assert sorted(channels_of(first) + channels_of(got)) == names
    assert problems(conn) == []


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_an_open_cancel_hides_no_message_and_blocks_no_settlement(
        conn: Conn, other: Conn, dsn: str, policy: str | None) -> None:
    """A producer that cancels its channel's last pending message and stays open must
    not hide the channel's other messages from workers, nor make its settlements wait
    (0.7.32 locked the channel's row to drop its turn, until the cancel committed: a
    dequeue waited for it and answered empty, and a defer waited)."""
    if policy is not None:
        conn.execute(f"SELECT fairq.channel_set('p', {policy})")
    create(conn, "p", b"in flight")
    cancelled, _ = create(conn, "p", b"cancelled")
    held = dequeue_one(conn)
    assert held is not None and held.content == b"in flight"
    with open_transaction(other):
        assert call(other, "message_cancel", cancelled) == "cancelled"  # nothing pending now
        created, _ = create(conn, "p", b"committed")
        taking = Background(dsn, lambda c: dequeue(c, n=5))
        assert taking.finishes_without_waiting_for(other)
        got = taking.join()
        assert [d.id for d in got] == [created]
        deferring = Background(dsn, lambda c: call(c, "message_defer", held.id, held.num_attempts))
        assert deferring.finishes_without_waiting_for(other)
        assert deferring.join() == "deferred"
        assert complete(conn, got[0]) == "completed"
    assert [d.id for d in dequeue(conn, n=5)] == [held.id]
    assert problems(conn) == []


def test_a_cancel_committed_after_a_dequeue_read_the_message_leaves_no_wait_for_it(
        conn: Conn, other: Conn) -> None:
    """A dequeue that serves a channel while a cancel of its only other message, due
    in an hour, is open sees that message pending and makes the channel wait an hour
    for it. Once the cancel commits, the channel must not wait for a message that is
    gone (fairq.check() reported it; the collector would have kept the channel)."""
    create(conn, "s", b"now")
    later, _ = create(conn, "s", b"in an hour",
                      dequeue_at=datetime.now(timezone.utc) + timedelta(hours=1))
    with open_transaction(other):
        assert call(other, "message_cancel", later) == "cancelled"
        served = dequeue_one(conn)
        assert served is not None and served.content == b"now"
    assert problems(conn) == []
    assert complete(conn, served) == "completed"
    assert dequeue(conn, n=5) == []  # the channel's turn is recomputed: it goes idle
    row = conn.execute("SELECT due_at, idle_since IS NOT NULL FROM fairq.channel WHERE name = 's'").fetchone()
    assert row == (None, True)
    assert problems(conn) == []


def run_collector_in(conn: Conn) -> None:
    """Opens a transaction on ``conn`` and runs the idle-channel collector in it, as a
    dequeue of another queue does once a second, on every channel idle until now."""
    conn.execute("BEGIN")
    conn.execute("SELECT set_config('fairq.idle_channel_ttl', '0', true)")
    conn.execute("UPDATE fairq.channel_collection SET collected_at = '-infinity'")
    assert dequeue(conn, queue="elsewhere") == []  # runs the collector
    assert conn.execute("SELECT collected_at > '-infinity' FROM fairq.channel_collection").fetchone() == (True,)


def test_the_collector_locks_nothing_of_a_channel_with_messages_in_flight(
        dsn: str, conn: Conn, other: Conn) -> None:
    """A channel whose messages are all in flight has nothing pending (idle), but the
    collector cannot remove it: it must not keep its producer lock or its row until
    the dequeue that ran it ends (0.7.32 did: the channel's producers, a worker's
    follow-up on its own channel among them, and its settlements waited)."""
    conn.execute("SELECT fairq.channel_set('elsewhere-policy', p_queue => 'elsewhere')")  # names the queue
    create(conn, "a", b"in flight")
    held = dequeue_one(conn)
    assert held is not None
    try:
        run_collector_in(other)
        producing = Background(dsn, lambda c: create(c, "a", b"follow-up"))
        assert producing.finishes_without_waiting_for(other)
        assert producing.join()[1] == "created"
        deferring = Background(dsn, lambda c: call(c, "message_defer", held.id, held.num_attempts))
        assert deferring.finishes_without_waiting_for(other)
        assert deferring.join() == "deferred"
    finally:
        other.execute("ROLLBACK")
    assert sorted(d.content for d in dequeue(conn, n=5)) == [b"follow-up", b"in flight"]
    assert problems(conn) == []


def test_the_collector_keeps_no_lock_of_a_channel_it_leaves_to_a_bulk_producer(
        dsn: str, conn: Conn, other: Conn) -> None:
    """While a producer gone bulk is open in a queue, the collector removes none of its
    idle channels (it cannot take the queue's bulk producer lock), and must then hold
    none of their producer locks either (0.7.32 kept them until the dequeue that ran it
    ended, and those channels' producers waited for it)."""
    conn.execute("SELECT fairq.channel_set('elsewhere-policy', p_queue => 'elsewhere')")
    create(conn, "idle")
    drained = drain(conn)
    assert channels_of(drained) == ["idle"]
    with psycopg.connect(dsn, autocommit=True) as bulk:
        bulk.execute("BEGIN")
        create_many(bulk, [f"bulk-{i}" for i in range(300)])  # past fairq.bulk_channels()
        try:
            run_collector_in(other)
            assert other.execute("SELECT count(*) FROM fairq.channel WHERE name = 'idle'").fetchone() == (1,)
            producing = Background(dsn, lambda c: create(c, "idle", b"again"))
            assert producing.finishes_without_waiting_for(other)
            assert producing.join()[1] == "created"
        finally:
            other.execute("ROLLBACK")
            bulk.execute("ROLLBACK")
    assert channels_of(dequeue(conn, n=5)) == ["idle"]
    assert problems(conn) == []


@pytest.mark.parametrize("replaced", [False, True], ids=["cancelled", "replaced"])
@pytest.mark.parametrize("outcome", ["commits", "rolls back"])
def test_channels_whose_last_message_an_open_transaction_cancels_cost_a_dequeue_once(
        conn: Conn, other: Conn, outcome: str, replaced: bool) -> None:
    """While a transaction that cancelled the last message of many channels is open,
    dequeues see those messages pending but cannot take them. Each channel is looked
    at, then left for as long as its message has been due (at least 100 ms, at most
    5 s: fairq.held_message_wait): the first form of 0.7.33 kept it due, and every
    dequeue picked and rewrote every such channel again (each call slower than the
    one before, the old row versions kept by the open transaction). Then the channels
    go idle (commit), or their messages are served (rollback). When the transaction
    also creates a replacement on each channel, it relies on the channels staying due
    (their settle locks): each is left for 100 ms, every time (a second form of
    0.7.34 kept them due, and every dequeue looked at all of them again). Read from
    the turns the dequeues give, on the queue's clock, not from how long anything
    took."""
    ids = [create(conn, f"c{i}")[0] for i in range(50)]

    def waits_after(dequeue_at_shift_ms: int) -> tuple[float, float]:
        """Dequeues (nothing available) with the clock moved to real time + the shift,
        and returns the shortest and longest wait it gave the channels, in seconds."""
        travel(conn, dequeue_at_shift_ms)
        before = conn.execute("SELECT fairq.clock()").fetchone()[0]  # type: ignore[index]
        assert dequeue(conn, n=5) == []
        # (A channel in the rotation, at '-infinity', waits for nothing: 0.)
        row = conn.execute("SELECT extract(epoch FROM min(GREATEST(turn_at, %(t)s)) - %(t)s),"
                           "       extract(epoch FROM max(GREATEST(turn_at, %(t)s)) - %(t)s)"
                           "  FROM fairq.channel WHERE name LIKE 'c%%'", {"t": before}).fetchone()
        assert row is not None
        return float(row[0]), float(row[1])

    other.execute("BEGIN")
    try:
        for i, mid in enumerate(ids):
            assert call(other, "message_cancel", mid) == "cancelled"
            if replaced:
                create(other, f"c{i}", b"replacement")
        shortest, _ = waits_after(0)
        assert shortest >= 0.1  # none left due now
        shortest, _ = waits_after(2_000)  # each message due for 2 s by now
        assert shortest >= (0.1 if replaced else 2.0)
        shortest, longest = waits_after(3_600_000)
        assert shortest >= (0.1 if replaced else 5.0)
        assert longest <= 5.0 + 60  # (the margin: a slow machine's calls)
    finally:
        other.execute("COMMIT" if outcome == "commits" else "ROLLBACK")
    travel(conn, 7_200_000)
    got = dequeue(conn, n=100)
    if outcome == "commits" and replaced:
        assert sorted(channels_of(got)) == sorted(f"c{i}" for i in range(50))
        assert {d.content for d in got} == {b"replacement"}
    elif outcome == "commits":
        assert got == []
        assert conn.execute("SELECT count(*) FROM fairq.channel WHERE idle_since IS NOT NULL"
                            ).fetchone() == (50,)
    else:
        assert sorted(d.id for d in got) == sorted(ids)
    assert problems(conn) == []


def test_a_channel_put_off_for_a_held_message_is_back_when_its_next_one_falls_due(
        conn: Conn, other: Conn) -> None:
    """A dequeue that finds a channel's due message held by an open cancel puts the
    channel off (up to 5 s), but never past its next scheduled message: with the cancel
    committed, that one is served when it falls due, not when the wait ends."""
    now = conn.execute("SELECT fairq.clock()").fetchone()[0]  # type: ignore[index]
    held, _ = create(conn, "h", b"held")
    later, _ = create(conn, "h", b"in two hours", dequeue_at=now + timedelta(hours=2))
    with open_transaction(other):
        assert call(other, "message_cancel", held) == "cancelled"
        # The clock 4.5 s before "later" is due ("held" due for 2 h: the longest wait),
        # set from the server's real time just before the dequeue.
        real = conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
        travel(conn, int((now + timedelta(hours=2, seconds=-4.5) - real).total_seconds() * 1000))
        assert dequeue(conn) == []
        turn = conn.execute("SELECT CASE WHEN isfinite(turn_at) THEN turn_at END"
                            "  FROM fairq.channel WHERE name = 'h'").fetchone()
        assert turn == (now + timedelta(hours=2),)
    travel(conn, 2 * 3_600_000)
    assert [d.id for d in dequeue(conn)] == [later]
    assert problems(conn) == []


@pytest.mark.parametrize("producer", ["message_create", "message_create_batch"])
@pytest.mark.parametrize("due", ["now", "in two seconds"])
@pytest.mark.parametrize("outcome", ["commits", "rolls back"])
def test_a_message_created_on_a_channel_put_off_for_a_held_message_wakes_it(
        conn: Conn, other: Conn, producer: str, due: str, outcome: str) -> None:
    """A dequeue that finds a channel's due message held by an open cancel puts the
    channel off (here 5 s: the message has been due for an hour). A message created on
    it meanwhile is served when it is due, like one on an idle channel: 0.7.33 gave it
    no wake (the channel had a message due), so it waited for the rest of the put-off."""
    held, _ = create(conn, "h", b"held")
    other.execute("BEGIN")
    try:
        assert call(other, "message_cancel", held) == "cancelled"
        travel(conn, 3_600_000)
        assert dequeue(conn) == []
        now = conn.execute("SELECT fairq.clock()").fetchone()[0]  # type: ignore[index]
        dequeue_at = now if due == "now" else now + timedelta(seconds=2)
        if producer == "message_create":
            new, _ = create(conn, "h", b"new", dequeue_at=dequeue_at)
        else:
            [(_, new, _)] = create_many(conn, ["h"], dequeue_ats=[dequeue_at])
        if due != "now":
            assert dequeue(conn) == []
            # (Due 2 s after the clock read above, however long the calls took; the
            # put-off lasts until 5 s after the first dequeue.)
            travel(conn, 3_602_500)
        got = dequeue(conn)
        assert [d.id for d in got] == [new]
        assert complete(conn, got[0]) == "completed"
    finally:
        other.execute("COMMIT" if outcome == "commits" else "ROLLBACK")
    travel(conn, 7_200_000)
    assert [d.id for d in drain(conn)] == ([] if outcome == "commits" else [held])
    assert problems(conn) == []


@pytest.mark.parametrize("outcome", ["commits", "rolls back"])
def test_a_channel_a_producer_relies_on_is_not_put_off_for_a_held_message(
        dsn: str, conn: Conn, other: Conn, outcome: str) -> None:
    """An open producer transaction created a message on a channel that had one due,
    so it queued no wake: it relies on the channel staying due (it holds the settle
    lock shared). Then an open cancel holds that due message. A dequeue that can take
    nothing from the channel puts it off for the shortest wait, 100 ms, and once the
    producer commits, its message is served then; a first form of 0.7.34 put the
    channel off (here for 5 s: the held message has been due for an hour) under the
    producer's feet. (Kept due now, as a second form did, it was looked at again by
    every dequeue while the producer stayed open.)"""
    held, _ = create(conn, "h", b"held")
    travel(conn, 3_600_000)
    with psycopg.connect(dsn, autocommit=True) as producer:
        producer.execute("BEGIN")
        other.execute("BEGIN")
        try:
            new, _ = create(producer, "h", b"new")
            assert producer.execute("SELECT count(*) FROM fairq.channel_wake").fetchone() == (0,)
            assert call(other, "message_cancel", held) == "cancelled"
            before = conn.execute("SELECT fairq.clock()").fetchone()[0]  # type: ignore[index]
            assert dequeue(conn) == []
            # 100 ms from the dequeue's clock (the first form: 5 s; the second: none,
            # the channel in the rotation, at '-infinity', read as NULL)
            turn = conn.execute("SELECT CASE WHEN isfinite(turn_at) THEN turn_at END"
                                "  FROM fairq.channel WHERE name = 'h'").fetchone()
            assert turn is not None and turn[0] is not None
            assert before + timedelta(milliseconds=100) <= turn[0] <= before + timedelta(seconds=4)
            producer.execute("COMMIT")
            travel(conn, 3_601_000)  # (past the put-off, which began before this shift)
            got = dequeue(conn)
            assert [d.id for d in got] == [new]
            assert complete(conn, got[0]) == "completed"
        finally:
            producer.execute("ROLLBACK")  # (a no-op after the commit)
            other.execute("COMMIT" if outcome == "commits" else "ROLLBACK")
    travel(conn, 7_200_000)
    assert [d.id for d in drain(conn)] == ([] if outcome == "commits" else [held])
    assert problems(conn) == []
