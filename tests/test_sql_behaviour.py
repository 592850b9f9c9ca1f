"""SPEC §2 behaviours 1-5 and 7, one or more tests each, through plain SQL."""

from __future__ import annotations

import itertools
import json
from datetime import datetime, timedelta, timezone

import psycopg
import pytest

from sqlq import (
    Conn,
    call,
    channel_row,
    channels_of,
    complete,
    counts,
    create,
    create_many,
    dequeue,
    dequeue_one,
    drain,
    problems,
    travel,
)

# -- 1. Fairness ---------------------------------------------------------------------


def test_backlogged_channels_take_strict_turns_across_single_calls(conn: Conn) -> None:
    channels = [f"tenant-{i}" for i in range(5)]
    # A heavy tenant first, then the others: arrival order must not matter.
    create_many(conn, ["tenant-0"] * 50)
    for ch in channels[1:]:
        create_many(conn, [ch] * 10)
    served = channels_of(drain(conn, limit=40))
    for start in range(0, len(served) - len(channels) + 1):
        window = served[start : start + len(channels)]
        assert len(set(window)) == len(channels), (start, window)


def test_a_channel_due_after_a_serve_waits_behind_the_served_channel(conn: Conn) -> None:
    """A dequeue of one serves a channel waiting to join straight from where it joins
    when it would be first in the rotation, and lets it join otherwise: a channel
    that became due after another was served and kept its place goes behind it."""
    create_many(conn, ["a", "a"])
    assert channels_of(dequeue(conn)) == ["a"]  # a keeps its place, given now
    create(conn, "b")  # b waits to join since later
    assert channels_of(dequeue(conn)) == ["a"]
    assert channels_of(dequeue(conn)) == ["b"]
    assert problems(conn) == []


def test_a_channel_woken_after_a_serve_waits_behind_the_served_channel(conn: Conn) -> None:
    """The same for an idle channel a producer wakes: its wake gives it its turn, and a
    dequeue of one serves it straight from the wake only when that turn puts it first
    in the rotation."""
    create(conn, "b")
    (served,) = dequeue(conn)
    call(conn, "message_complete", served.id, served.num_attempts)  # b idle, kept
    create_many(conn, ["a", "a"])
    assert channels_of(dequeue(conn)) == ["a"]  # a keeps its place, given now
    create(conn, "b")  # b's wake is queued, later
    assert conn.execute("SELECT count(*) FROM fairq.channel_wake").fetchone() == (1,)
    assert channels_of(dequeue(conn)) == ["a"]
    assert channels_of(dequeue(conn)) == ["b"]
    assert problems(conn) == []


def test_a_channel_joined_behind_the_rotation_keeps_its_place_for_later_ones(conn: Conn) -> None:
    """A channel that joins behind a rotation channel is given its place as of its own
    turn: one that becomes due after it, even within the same second, goes behind it."""
    create_many(conn, ["a"] * 3)
    assert channels_of(dequeue(conn)) == ["a"]
    create(conn, "b")  # b joins behind a, which was given its place first
    assert channels_of(dequeue(conn)) == ["a"]
    create(conn, "c")  # c is due after b joined: behind b (and a, given its place before c)
    assert channels_of(dequeue(conn)) == ["b"]
    assert channels_of(dequeue(conn)) == ["a"]
    assert channels_of(dequeue(conn)) == ["c"]
    assert problems(conn) == []


def test_a_channel_that_joins_level_with_the_front_goes_behind_it(conn: Conn) -> None:
    """A channel that joins at the same pass as the front of the rotation goes behind
    it (the channel already there goes first), so a dequeue of one serves the front,
    not the channel that just joined."""
    create_many(conn, ["f"] * 5)
    assert channels_of(dequeue(conn)) == ["f"]
    create_many(conn, ["r"] * 5)
    assert channels_of(dequeue(conn)) == ["f"]  # r joins behind f
    create(conn, "j")
    create(conn, "k")
    assert channels_of(dequeue(conn)) == ["r"]  # j joins at the back; r is served after k's turn
    # k joins just ahead of r, where f stands too: level with f, behind it.
    assert channels_of(dequeue(conn)) == ["f"]
    assert channels_of(dequeue(conn)) == ["k"]
    assert problems(conn) == []


def test_one_batch_call_is_fair_within_the_same_instant(conn: Conn) -> None:
    channels = [f"c{i}" for i in range(7)]
    for ch in channels:
        create_many(conn, [ch] * 20)
    got = dequeue(conn, n=70)
    served = channels_of(got)
    assert len(served) == 70
    for start in range(0, 70 - 7 + 1):
        assert len(set(served[start : start + 7])) == 7, served


def test_batch_dequeue_equals_single_dequeues(dsn: str) -> None:
    def run(batch: bool) -> list[tuple[str, bytes]]:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("TRUNCATE fairq.message, fairq.channel, fairq.channel_wake")
            for ch, n in (("a", 5), ("b", 3), ("c", 6)):
                for i in range(n):
                    create(c, ch, f"{ch}{i}".encode(), priority=i % 3)
            if batch:
                got = dequeue(c, n=100)
            else:
                got = []
                while (d := dequeue_one(c)) is not None:
                    got.append(d)
            return [(d.channel, d.content) for d in got]

    singles = run(batch=False)
    assert len(singles) == 14
    assert run(batch=True) == singles


def test_channels_that_join_during_a_batch_wait_behind_the_rotation(conn: Conn) -> None:
    """Two idle tenants woken after three busy ones were served join the rotation
    behind them. A batch of two lets both join (their places kept in memory, not in
    the index) and must still serve the first two of the rotation, which it reads
    only partly: the joined channels wait for their turns."""
    create_many(conn, ["a", "a", "b", "b", "c", "c"])
    assert channels_of(dequeue(conn, n=3)) == ["a", "b", "c"]
    create_many(conn, ["w1", "w2"])
    assert channels_of(dequeue(conn, n=2)) == ["a", "b"]
    assert channels_of(dequeue(conn, n=3)) == ["c", "w1", "w2"]
    assert problems(conn) == []


def test_served_channel_goes_to_the_back(conn: Conn) -> None:
    create_many(conn, ["a", "a", "a"])
    create_many(conn, ["b"])
    create_many(conn, ["c", "c"])
    assert channels_of(dequeue(conn, n=6)) == ["a", "b", "c", "a", "c", "a"]


def test_recovered_messages_take_turns(conn: Conn) -> None:
    # Tenant "crash" had 5 messages in flight when its worker died; "steady" has a backlog.
    create_many(conn, ["crash"] * 5)
    crashed = dequeue(conn, lock_ms=100, n=5)
    assert counts(crashed) == {"crash": 5}
    create_many(conn, ["steady"] * 10)
    travel(conn, 1_000)  # every "crash" lock has expired
    got = dequeue(conn, n=10)
    assert [d.recovered for d in got if d.channel == "crash"] == [True] * 5
    assert {d.id for d in got if d.channel == "crash"} == {d.id for d in crashed}
    # Recovered messages come back one per turn, never ahead of every other channel.
    assert channels_of(got) == ["crash", "steady"] * 5 or channels_of(got) == ["steady", "crash"] * 5


# -- 2. Concurrency --------------------------------------------------------------------


def test_max_concurrency_caps_in_flight_messages(conn: Conn) -> None:
    call(conn, "channel_set", "capped", 2)
    create_many(conn, ["capped"] * 5 + ["free"] * 5)
    got = dequeue(conn, n=10)
    assert counts(got) == {"capped": 2, "free": 5}
    assert dequeue(conn) == []
    assert complete(conn, next(d for d in got if d.channel == "capped")) == "completed"
    again = dequeue(conn, n=10)
    assert channels_of(again) == ["capped"]
    assert channel_row(conn, "capped")["in_flight"] == 2  # type: ignore[index]


def test_concurrency_cap_counts_recovered_messages(conn: Conn) -> None:
    call(conn, "channel_set", "capped", 1)
    create_many(conn, ["capped"] * 3)
    first = dequeue(conn, lock_ms=50)
    assert len(first) == 1
    travel(conn, 1_000)
    got = dequeue(conn, n=10)
    assert len(got) == 1 and got[0].id == first[0].id and got[0].recovered
    assert got[0].num_attempts == 2
    assert dequeue(conn, n=10) == []


def test_lowering_max_concurrency_waits_for_the_channel_to_drain(conn: Conn) -> None:
    create_many(conn, ["c"] * 6)
    got = dequeue(conn, n=4)
    call(conn, "channel_set", "c", 2)
    assert dequeue(conn) == []
    for d in got[:2]:
        complete(conn, d)
    assert dequeue(conn) == []  # still 2 in flight
    complete(conn, got[2])
    assert len(dequeue(conn, n=5)) == 1
    assert problems(conn) == []


# -- 3. Rate limit -------------------------------------------------------------------


def test_release_interval_spaces_fresh_releases(conn: Conn) -> None:
    call(conn, "channel_set", "slow", None, 1_000)
    create_many(conn, ["slow"] * 3 + ["fast"] * 3)
    first = dequeue(conn, n=10)
    assert counts(first) == {"slow": 1, "fast": 3}
    travel(conn, 500)
    assert dequeue(conn, n=10) == []
    travel(conn, 1_010)
    assert channels_of(dequeue(conn, n=10)) == ["slow"]
    travel(conn, 1_500)
    assert dequeue(conn, n=10) == []
    travel(conn, 2_020)
    assert channels_of(dequeue(conn, n=10)) == ["slow"]


def test_rate_limit_applies_to_a_message_arriving_after_a_release(conn: Conn) -> None:
    call(conn, "channel_set", "slow", None, 10_000)
    create(conn, "slow")
    assert len(dequeue(conn)) == 1
    create(conn, "slow")
    assert dequeue(conn) == []
    travel(conn, 10_050)
    assert len(dequeue(conn)) == 1


# -- 4. Schedule and priority --------------------------------------------------------------


def test_no_message_before_its_dequeue_at(conn: Conn) -> None:
    now = conn.execute("SELECT fairq.clock()").fetchone()[0]  # type: ignore[index]
    create(conn, "s", b"later", dequeue_at=now + timedelta(seconds=60), priority=100)
    create(conn, "s", b"now", priority=0)
    got = dequeue(conn, lock_ms=3_600_000, n=5)
    assert [d.content for d in got] == [b"now"]
    travel(conn, 61_000)
    assert [d.content for d in dequeue(conn, n=5)] == [b"later"]


def test_due_messages_order_by_priority_then_dequeue_at_then_id(conn: Conn) -> None:
    now = conn.execute("SELECT fairq.clock()").fetchone()[0]  # type: ignore[index]
    create(conn, "p", b"low-old", priority=0, dequeue_at=now - timedelta(hours=1))
    create(conn, "p", b"high-2", priority=5)
    create(conn, "p", b"high-1-earlier", priority=5, dequeue_at=now - timedelta(minutes=1))
    create(conn, "p", b"high-scheduled", priority=9, dequeue_at=now + timedelta(seconds=5))
    create(conn, "p", b"mid", priority=1)
    create(conn, "p", b"high-3", priority=5)
    got = [d.content for d in dequeue(conn, n=10)]
    assert got == [b"high-1-earlier", b"high-2", b"high-3", b"mid", b"low-old"]
    travel(conn, 6_000)
    create(conn, "p", b"urgent-now", priority=8)
    # Once due, the scheduled message competes by priority with everything due.
    assert [d.content for d in dequeue(conn, n=10)] == [b"high-scheduled", b"urgent-now"]


FLOOD = 5_000  # scheduled messages of one channel due together: over two calls' bound


def test_a_flood_of_due_messages_is_promoted_a_bounded_number_a_call_in_priority_order(
        conn: Conn) -> None:
    """A campaign scheduled for one instant is moved to 'ready' a bounded number of
    messages a call (0.7.39 moved them all in the first: seconds for a million, and
    past a statement_timeout every dequeue that picked the channel failed), and still
    every delivery is the best due message: by priority, then dequeue_at, then id."""
    bound = conn.execute("SELECT fairq.promotions_per_serve()").fetchone()[0]  # type: ignore[index]
    assert 4 * bound < FLOOD
    now = conn.execute("SELECT fairq.clock()").fetchone()[0]  # type: ignore[index]
    # Due in the next 6 s, one a ms; priorities unrelated to that order; and one
    # message of top priority that stays in the future.
    conn.execute(
        "SELECT fairq.message_create_batch(array_fill('flood'::text, ARRAY[%(n)s]),"
        " array_agg(i::text::bytea ORDER BY i), array_agg(%(now)s + i * interval '1 ms' ORDER BY i),"
        " array_agg((i * 7919) %% 5 ORDER BY i)) FROM generate_series(1, %(n)s) AS i",
        {"n": FLOOD, "now": now + timedelta(seconds=1)})
    create(conn, "flood", b"future", dequeue_at=now + timedelta(hours=1), priority=100)
    travel(conn, 10_000)  # all due
    expected = [str(i).encode() for i in sorted(range(1, FLOOD + 1),
                                                key=lambda i: (-((i * 7919) % 5), i))]
    still_scheduled = ("SELECT count(*) FROM fairq.message m JOIN fairq.channel c"
                       " ON c.id = m.channel_id WHERE c.name = 'flood' AND m.status = 'scheduled'")
    got = [d.content for d in dequeue(conn)]
    # Bounded: the rest wait for later calls, also when a call takes many messages
    # from the channel, one a round (each round promoted again: all of them).
    assert conn.execute(still_scheduled).fetchone() == (FLOOD + 1 - 2 * bound - 1,)
    got += [d.content for d in dequeue(conn, n=400)]
    assert conn.execute(still_scheduled).fetchone() == (FLOOD + 1 - 4 * bound - 2,)
    while len(got) < FLOOD:
        more = [d.content for d in dequeue(conn, n=400)]
        assert more
        got += more
    assert got == expected
    assert dequeue(conn) == []  # the future one still waits, however urgent
    assert problems(conn) == []


def test_priority_never_skips_the_round_robin(conn: Conn) -> None:
    for _ in range(5):
        create(conn, "vip", priority=1000)
    for _ in range(5):
        create(conn, "plain")
    assert channels_of(dequeue(conn, n=4)) == ["vip", "plain", "vip", "plain"]


def test_scheduled_channel_wakes_when_a_message_is_due(conn: Conn) -> None:
    now = conn.execute("SELECT fairq.clock()").fetchone()[0]  # type: ignore[index]
    create(conn, "w", b"in-an-hour", dequeue_at=now + timedelta(hours=1))
    assert dequeue(conn) == []
    create(conn, "w", b"now")
    assert [d.content for d in dequeue(conn)] == [b"now"]
    assert dequeue(conn) == []
    row = channel_row(conn, "w")
    assert row is not None and row["scheduled"] == 1 and row["next_dequeue_at"] > now


def test_a_channel_whose_pending_messages_were_cancelled_shows_no_next_dequeue(conn: Conn) -> None:
    """A cancel leaves the channel's turn for the next dequeue to recompute (it never
    locks the row): meanwhile fairq.channels must not say it will be served."""
    create(conn, "k", b"in flight")
    cancelled, _ = create(conn, "k", b"cancelled")
    assert dequeue_one(conn) is not None
    assert call(conn, "message_cancel", cancelled) == "cancelled"
    row = channel_row(conn, "k")
    assert row is not None and (row["ready"], row["in_flight"], row["next_dequeue_at"]) == (0, 1, None)
    assert problems(conn) == []


def test_a_channel_served_as_it_joins_spends_the_wakes_queued_while_it_waited(conn: Conn) -> None:
    """A producer in bulk queues a wake for every channel it writes to, even one whose
    wait is already over (nobody has dequeued since). A dequeue that lets such a
    channel join and serves it at once applies that wake first: it is spent, not
    left queued to act after the serve."""
    now = conn.execute("SELECT fairq.clock()").fetchone()[0]  # type: ignore[index]
    create(conn, "w", b"in-a-minute", dequeue_at=now + timedelta(minutes=1))
    travel(conn, 90_000)  # due: the channel waits to join
    with conn.transaction():
        create_many(conn, [f"bulk-{i}" for i in range(300)])  # past fairq.bulk_channels()
        create(conn, "w", b"second")
    wakes_of_w = ("SELECT count(*) FROM fairq.channel_wake w JOIN fairq.channel c"
                  " ON c.id = w.channel_id WHERE c.name = 'w'")
    assert conn.execute(wakes_of_w).fetchone() == (1,)
    assert [d.content for d in dequeue(conn)] == [b"in-a-minute"]
    assert conn.execute(wakes_of_w).fetchone() == (0,)
    assert problems(conn) == []


# -- 5. Durability, fencing, dead letters ----------------------------------------------------


def test_expired_lock_comes_back_with_next_attempt_and_fences_the_old_holder(conn: Conn) -> None:
    create(conn, "d")
    first = dequeue_one(conn, lock_ms=100)
    assert first is not None and first.num_attempts == 1 and not first.recovered
    travel(conn, 500)
    second = dequeue_one(conn)
    assert second is not None and second.id == first.id
    assert second.num_attempts == 2 and second.recovered
    assert complete(conn, first) == "stale"
    assert call(conn, "message_heartbeat", first.id, 1, 1000) == "stale"
    assert call(conn, "message_defer", first.id, 1, None, None) == "stale"
    assert call(conn, "message_fail", first.id, 1, "x") == "stale"
    assert complete(conn, second) == "completed"
    assert complete(conn, second) == "not_found"


def test_expired_but_unrecovered_lock_still_belongs_to_its_holder(conn: Conn) -> None:
    create(conn, "d")
    d = dequeue_one(conn, lock_ms=50)
    assert d is not None
    travel(conn, 1_000)
    assert complete(conn, d) == "completed"
    assert dequeue(conn) == []
    assert problems(conn) == []


def test_heartbeat_extends_and_never_shortens(conn: Conn) -> None:
    create(conn, "h")
    d = dequeue_one(conn, lock_ms=1_000)
    assert d is not None
    assert call(conn, "message_heartbeat", d.id, d.num_attempts, 60_000) == "heartbeated"
    travel(conn, 5_000)
    assert dequeue(conn) == []  # lock now runs to +60 s
    assert call(conn, "message_heartbeat", d.id, d.num_attempts, 1) == "heartbeated"
    travel(conn, 30_000)
    assert dequeue(conn) == []  # the short heartbeat did not shorten it
    travel(conn, 61_000)
    again = dequeue_one(conn)
    assert again is not None and again.recovered


def test_defer_keeps_attempts_and_state_unless_replaced(conn: Conn) -> None:
    create(conn, "d")
    d = dequeue_one(conn)
    assert d is not None
    assert call(conn, "message_defer", d.id, d.num_attempts, None, b"checkpoint-1") == "deferred"
    d2 = dequeue_one(conn)
    assert d2 is not None and d2.state == b"checkpoint-1" and d2.num_attempts == 2
    assert not d2.recovered
    assert call(conn, "message_defer", d2.id, d2.num_attempts, None, None) == "deferred"
    d3 = dequeue_one(conn)
    assert d3 is not None and d3.state == b"checkpoint-1" and d3.num_attempts == 3


def test_defer_to_the_future_frees_the_slot_and_waits(conn: Conn) -> None:
    call(conn, "channel_set", "d", 1)
    create_many(conn, ["d", "d"])
    d = dequeue_one(conn)
    assert d is not None
    now = conn.execute("SELECT fairq.clock()").fetchone()[0]  # type: ignore[index]
    assert call(conn, "message_defer", d.id, d.num_attempts, now + timedelta(seconds=30), None) == "deferred"
    other = dequeue_one(conn)
    assert other is not None and other.id != d.id
    complete(conn, other)
    assert dequeue(conn) == []
    travel(conn, 31_000)
    back = dequeue_one(conn)
    assert back is not None and back.id == d.id


def test_max_attempts_moves_to_dead_letters_instead_of_delivering(conn: Conn) -> None:
    call(conn, "channel_set", "m", None, 0, None, 2)
    create(conn, "m", b"poison")
    for attempt in (1, 2):
        d = dequeue_one(conn, lock_ms=10)
        assert d is not None and d.num_attempts == attempt
        travel(conn, 1_000 * attempt)
    assert dequeue(conn) == []
    dead = conn.execute("SELECT channel, content, num_attempts, error FROM fairq.dead_letters").fetchall()
    assert len(dead) == 1 and dead[0][0] == "m" and dead[0][1] == b"poison" and dead[0][2] == 2
    assert "max_attempts" in dead[0][3]
    assert channel_row(conn, "m")["in_flight"] == 0  # type: ignore[index]


def test_deferred_message_on_its_last_attempt_dies_at_next_dequeue(conn: Conn) -> None:
    call(conn, "channel_set", "m", None, 0, None, 1)
    create(conn, "m")
    d = dequeue_one(conn)
    assert d is not None
    call(conn, "message_defer", d.id, 1, None, None)
    assert dequeue(conn) == []
    assert conn.execute("SELECT count(*) FROM fairq.dead_letters").fetchone() == (1,)


def test_fail_and_retry_round_trip(conn: Conn) -> None:
    create(conn, "f", b"payload", priority=7)
    d = dequeue_one(conn)
    assert d is not None
    assert call(conn, "message_fail", d.id, d.num_attempts, "it broke") == "dead"
    row = conn.execute("SELECT id, error, num_attempts FROM fairq.dead_letters").fetchone()
    assert row == (d.id, "it broke", 1)
    assert call(conn, "dead_letter_retry", d.id) == "requeued"
    assert call(conn, "dead_letter_retry", d.id) == "not_found"
    again = dequeue_one(conn)
    # num_attempts keeps counting across the retry: the token of an id never repeats.
    assert again is not None and again.id == d.id and again.num_attempts == 2
    assert again.content == b"payload" and again.priority == 7


def test_a_holder_from_before_a_dead_letter_retry_stays_fenced_out(conn: Conn) -> None:
    call(conn, "channel_set", "z", None, 0, None, 1)
    create(conn, "z")
    zombie = dequeue_one(conn, lock_ms=1)  # attempt 1; its lock expires at once
    assert zombie is not None and zombie.num_attempts == 1
    travel(conn, 1_000)
    assert dequeue(conn) == []  # the expired lock is recovered: past max_attempts 1, it dies
    assert conn.execute("SELECT num_attempts FROM fairq.dead_letters").fetchall() == [(1,)]
    assert call(conn, "dead_letter_retry", zombie.id) == "requeued"
    second = dequeue_one(conn)
    assert second is not None and second.id == zombie.id
    assert second.num_attempts != zombie.num_attempts
    # The first holder's late settlements are stale; the second holder's are not.
    for fn, args in (("message_complete", ()), ("message_heartbeat", (60_000,)),
                     ("message_defer", (None, None)), ("message_fail", ("late",))):
        assert call(conn, fn, zombie.id, zombie.num_attempts, *args) == "stale", fn
    assert conn.execute("SELECT * FROM fairq.message_complete_batch(%s, %s)",
                        ([zombie.id], [zombie.num_attempts])).fetchall() == [(zombie.id, "stale")]
    assert complete(conn, second) == "completed"
    assert problems(conn) == []


def test_a_retried_dead_letter_gets_a_fresh_max_attempts_budget(conn: Conn) -> None:
    call(conn, "channel_set", "r", None, 0, None, 2)
    create(conn, "r")
    for attempt in (1, 2):
        d = dequeue_one(conn)
        assert d is not None and d.num_attempts == attempt
        assert call(conn, "message_defer", d.id, d.num_attempts, None, None) == "deferred"
    assert dequeue(conn) == []  # a third delivery would pass max_attempts 2: it dies
    assert conn.execute("SELECT num_attempts FROM fairq.dead_letters").fetchall() == [(2,)]
    assert d is not None
    assert call(conn, "dead_letter_retry", d.id) == "requeued"
    for attempt in (3, 4):  # two more deliveries: the budget restarted, the count did not
        again = dequeue_one(conn)
        assert again is not None and again.num_attempts == attempt
        assert call(conn, "message_defer", again.id, again.num_attempts, None, None) == "deferred"
    assert dequeue(conn) == []
    assert conn.execute("SELECT num_attempts, error FROM fairq.dead_letters").fetchall() == [
        (4, "max_attempts 2 reached after 2 deliveries since the last retry (4 in all)")]
    assert problems(conn) == []


def test_cancel(conn: Conn) -> None:
    a, _ = create(conn, "x")
    b, _ = create(conn, "x")
    d = dequeue_one(conn)
    assert d is not None and d.id == a
    assert call(conn, "message_cancel", a) == "locked"
    assert call(conn, "message_cancel", b) == "cancelled"
    assert call(conn, "message_cancel", b) == "not_found"
    assert dequeue(conn) == []
    assert problems(conn) == []


# -- create statuses, dedup, size, channel lifecycle -----------------------------------------------


def test_dedup_key_returns_the_existing_message(conn: Conn) -> None:
    first = create(conn, "u", dedup_key="job-1")
    assert first[1] == "created"
    assert create(conn, "u", dedup_key="job-1") == (first[0], "duplicate")
    assert create(conn, "other", dedup_key="job-1")[1] == "created"
    rows = create_many(conn, ["u", "u", "u"], dedup_keys=["job-1", "job-2", "job-2"])
    assert rows[0] == (1, first[0], "duplicate")
    assert rows[1][2] == "created" and rows[2] == (3, rows[1][1], "duplicate")
    d = dequeue_one(conn)
    while d is not None and d.id != first[0]:
        complete(conn, d)
        d = dequeue_one(conn)
    assert d is not None
    complete(conn, d)
    assert create(conn, "u", dedup_key="job-1")[1] == "created"  # the old one is gone


def test_max_size_drops_and_counts_in_flight(conn: Conn) -> None:
    call(conn, "channel_set", "b", None, 0, 2)
    assert create(conn, "b")[1] == "created"
    assert create(conn, "b")[1] == "created"
    assert create(conn, "b") == (None, "dropped")
    d = dequeue_one(conn)
    assert d is not None
    assert create(conn, "b")[1] == "dropped"  # in flight still counts
    complete(conn, d)
    rows = create_many(conn, ["b", "b"])
    assert [r[2] for r in rows] == ["created", "dropped"]
    assert problems(conn) == []


def test_channel_set_validates_and_clear_reverts(conn: Conn) -> None:
    call(conn, "channel_set", "p", 3, 250, 10, 4)
    row = channel_row(conn, "p")
    assert row is not None
    assert (row["max_concurrency"], row["release_interval_ms"], row["max_size"], row["max_attempts"]) == (3, 250, 10, 4)
    assert row["size"] == 0
    assert call(conn, "channel_clear", "p") is True
    assert call(conn, "channel_clear", "p") is False
    assert channel_row(conn, "p") is None  # no policy, no messages: gone


def collect_idle(conn: Conn, ttl: str = "0") -> int:
    """Runs the idle-channel collector now, as a dequeue does once a second."""
    conn.execute("SELECT set_config('fairq.idle_channel_ttl', %s, false)", (ttl,))
    try:
        return int(conn.execute("SELECT fairq.collect_idle_channels(fairq.clock(), 1000)"
                                ).fetchone()[0])  # type: ignore[index]
    finally:
        conn.execute("RESET fairq.idle_channel_ttl")


def test_channels_without_policy_disappear_when_empty(conn: Conn) -> None:
    for i in range(50):
        create(conn, f"one-off-{i}")
    drain(conn)
    # Kept idle for a while (a tenant that comes back finds its row), never shown...
    assert conn.execute("SELECT count(*) FROM fairq.channels").fetchone() == (0,)
    assert collect_idle(conn, "1 hour") == 0
    # ... and collected once idle for the setting fairq.idle_channel_ttl.
    assert collect_idle(conn) == 50
    create(conn, "gone")
    m = dequeue_one(conn)
    assert m is not None
    call(conn, "message_fail", m.id, m.num_attempts, None)
    a, _ = create(conn, "cancelled")
    call(conn, "message_cancel", a)
    assert dequeue(conn) == []
    assert conn.execute("SELECT count(*) FROM fairq.channels").fetchone() == (0,)
    assert collect_idle(conn) == 2
    assert conn.execute("SELECT count(*) FROM fairq.channel").fetchone() == (0,)
    assert problems(conn) == []


def test_the_collector_keeps_channels_with_messages_policies_or_queued_wakes(conn: Conn) -> None:
    call(conn, "channel_set", "policy", 2)
    create(conn, "held")
    held = dequeue_one(conn)
    assert held is not None
    create(conn, "waiting", dequeue_at=datetime.now(timezone.utc) + timedelta(hours=1))
    with psycopg.connect(conn.info.dsn, autocommit=True) as producer:
        producer.execute("BEGIN")
        create(producer, "open")  # its producer lock: the collector must not wait for it
        assert collect_idle(conn) == 0
        producer.execute("COMMIT")
    names = {r[0] for r in conn.execute("SELECT name FROM fairq.channel")}
    assert names == {"policy", "held", "waiting", "open"}
    assert complete(conn, held) == "completed"
    assert collect_idle(conn) == 1  # "held", now empty
    assert [d.channel for d in dequeue(conn, n=5)] == ["open"]
    assert problems(conn) == []


def test_recreated_channel_is_one_row_with_one_limit(conn: Conn) -> None:
    call(conn, "channel_set", "t", 1)
    create_many(conn, ["t", "t", "t"])
    d = dequeue_one(conn)
    call(conn, "channel_clear", "t")
    call(conn, "channel_set", "t", 1)
    assert d is not None
    assert dequeue(conn, n=5) == []  # still one in flight: the limit is not doubled
    assert conn.execute("SELECT count(*) FROM fairq.channel WHERE name = 't'").fetchone() == (1,)


def test_view_counts(conn: Conn) -> None:
    now = conn.execute("SELECT fairq.clock()").fetchone()[0]  # type: ignore[index]
    create_many(conn, ["v"] * 3)
    create(conn, "v", dequeue_at=now + timedelta(minutes=5))
    dequeue(conn)
    row = channel_row(conn, "v")
    assert row is not None
    assert (row["size"], row["ready"], row["scheduled"], row["in_flight"]) == (4, 2, 1, 1)


# -- clock -------------------------------------------------------------------------------------


def test_clock_is_the_servers_real_time_per_call(conn: Conn) -> None:
    with conn.transaction():
        conn.execute("SELECT pg_sleep(0.05)")
        # fairq.clock() is read between two readings of the real time (a target list
        # is evaluated in order): no bound on how long that takes on this machine.
        row = conn.execute("SELECT clock_timestamp(), fairq.clock(), clock_timestamp(), now()"
                           ).fetchone()
    assert row is not None
    before, clock, after, txn_start = row
    assert before <= clock <= after
    assert (clock - txn_start).total_seconds() >= 0.05


def test_clock_travel_moves_every_sessions_clock_and_returns_exactly(dsn: str, conn: Conn) -> None:
    """The shift lives in fairq.clock()'s own body (so that reading the clock costs no
    statement): another session, whose cached plans inlined the old clock, reads the
    new one from its next transaction on, in its calls and in the views; travelling
    back to 0 leaves the clock exactly as installed."""
    installed = conn.execute("SELECT prosrc FROM pg_proc WHERE oid = 'fairq.clock()'::regprocedure"
                             ).fetchone()

    def created_at_and_handed_out(other: Conn, channel: str) -> datetime:
        create(other, channel)
        got = dequeue(other)
        assert len(got) == 1
        call(other, "message_complete", got[0].id, got[0].num_attempts)
        return got[0].dequeue_at

    with psycopg.connect(dsn, autocommit=True) as other:
        before = created_at_and_handed_out(other, "a")  # its plans now hold the clock as it was
        travel(conn, 3_600_000)
        assert timedelta(minutes=59) < created_at_and_handed_out(other, "a") - before < timedelta(minutes=61)
        create(other, "b")
        row = other.execute("SELECT next_dequeue_at - clock_timestamp() FROM fairq.channels"
                            " WHERE channel = 'b'").fetchone()
        assert row is not None and row[0] > timedelta(minutes=59)
        assert len(dequeue(other)) == 1
        travel(conn, 0)
        assert created_at_and_handed_out(other, "c") - before < timedelta(minutes=1)
    assert conn.execute("SELECT prosrc FROM pg_proc WHERE oid = 'fairq.clock()'::regprocedure"
                        ).fetchone() == installed


# -- 7. Events -----------------------------------------------------------------------------------


_markers = itertools.count()


def _events(listener: psycopg.Connection[tuple[object, ...]], dsn: str) -> list[dict[str, object]]:
    """The events heard so far: every one committed before this call, because a marker
    NOTIFY committed now arrives after them (notifications come in commit order). No
    waiting for silence, so a slow machine cannot cut the list short."""
    marker = {"event": "test-marker", "n": next(_markers)}
    with psycopg.connect(dsn, autocommit=True) as sender:
        sender.execute("SELECT pg_notify('fairq', %s)", (json.dumps(marker),))
    got: list[dict[str, object]] = []
    for notify in listener.notifies(timeout=60):  # a failure net only
        event = json.loads(notify.payload)
        if event == marker:
            return got
        got.append(event)
    raise AssertionError(f"the marker notification never arrived; heard {got}")


def _doorbell(conn: psycopg.Connection[tuple[object, ...]], function: str = "doorbell_hold") -> tuple[object, ...]:
    row = conn.execute(f"SELECT * FROM fairq.{function}('default')").fetchone()
    assert row is not None
    return row


def test_by_default_events_are_sent_on_commit_when_work_becomes_available(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as listener, psycopg.connect(dsn, autocommit=True) as c:
        listener.execute("LISTEN fairq")
        assert _doorbell(listener) == (True, True, None)  # a worker sleeps: events are wanted
        call(c, "channel_set", "capped", 1, 0, None, None)
        mid, _ = create(c, "e", b"1")     # e had nothing: wakes
        create(c, "e", b"2")              # e already had work due: no event
        d = dequeue_one(c)
        assert d is not None and d.id == mid
        call(c, "message_defer", d.id, d.num_attempts, None, None)   # pending again: wakes
        d = dequeue_one(c)
        assert d is not None
        complete(c, d)                    # e has no cap: the slot wakes nobody
        for _ in range(2):
            create(c, "capped")
        c.execute("BEGIN")
        create(c, "uncommitted")          # heard only once committed
        got = _events(listener, dsn)
        assert [(e["event"], e["channel"]) for e in got] == [
            ("created", "e"), ("deferred", "e"), ("created", "capped")]
        c.execute("COMMIT")
        held = []
        while (d := dequeue_one(c)) is not None:
            held.append(d)
        capped = next(d for d in held if d.channel == "capped")
        complete(c, capped)               # capped was full with work waiting: wakes
        got = _events(listener, dsn)
    assert [(e["event"], e["channel"]) for e in got] == [
        ("created", "uncommitted"), ("completed", "capped")]
    assert got[1]["id"] == capped.id


def test_a_batch_of_many_new_channels_wakes_sleeping_workers_with_one_event(dsn: str) -> None:
    """One event wakes every worker of the queue (each listener hears it), and they find
    all the batch made available: a batch of 4,000 new channels sent 4,000 until 0.7.37.
    The one sent is the message due first (the first element is due later), so a
    worker that sleeps until an event's dequeue_at wakes in time. For listeners that do
    not hold the doorbell, fairq.events = wake still announces every woken channel.

    The statement timeout is a failure net: the query that picked the woken channels'
    events joined two arrays in a nested loop and tested every woken id for each pair,
    so a batch of 4,000 new channels took 88 s (n³); it takes a fraction of a second."""
    channels = [f"wide-{i}" for i in range(3000)]
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    with psycopg.connect(dsn, autocommit=True) as listener, psycopg.connect(dsn, autocommit=True) as c:
        listener.execute("LISTEN fairq")
        _doorbell(listener)
        c.execute("SET statement_timeout = '30s'")
        rows = c.execute("SELECT count(*) FROM fairq.message_create_batch(%s, %s, p_dequeue_ats => %s)",
                         (channels, [b"x"] * len(channels),
                          [later] + [None] * (len(channels) - 1))).fetchone()
        assert rows == (len(channels),)
        got = _events(listener, dsn)
        assert [(e["event"], e["channel"]) for e in got] == [("created", "wide-1")]
        c.execute("SET fairq.events = wake")
        woken = [f"more-{i}" for i in range(3000)]
        c.execute("SELECT count(*) FROM fairq.message_create_batch(%s, %s)", (woken, [b"x"] * len(woken)))
        got = _events(listener, dsn)
    assert sorted(e["channel"] for e in got) == sorted(woken)
    assert all(e["event"] == "created" for e in got)


def test_a_batch_completion_freeing_many_capped_channels_sends_one_event(dsn: str) -> None:
    """A completion that frees a slot of a full capped channel with work waiting wakes
    workers; a batch freeing several sends one event per queue with the doorbell (one
    per channel until 0.7.37), and one per channel with fairq.events = wake."""
    capped = ["cap-a", "cap-b", "cap-c"]
    with psycopg.connect(dsn, autocommit=True) as listener, psycopg.connect(dsn, autocommit=True) as c:
        listener.execute("LISTEN fairq")
        for events in ("doorbell", "wake"):
            c.execute("SELECT set_config('fairq.events', %s, false)", (events,))
            for name in capped:
                call(c, "channel_set", name, 1, 0, None, None)
                create(c, name)
                create(c, name)
            held = dequeue(c, n=3)
            assert sorted(d.channel for d in held) == capped
            _doorbell(listener)
            _events(listener, dsn)  # (with wake, the creates' own)
            done = c.execute("SELECT status FROM fairq.message_complete_batch(%s, %s)",
                             ([d.id for d in held], [d.num_attempts for d in held])).fetchall()
            assert done == [("completed",)] * 3
            got = _events(listener, dsn)
            assert all(e["event"] == "completed" for e in got)
            names = sorted(str(e["channel"]) for e in got)
            assert names == (capped[:1] if events == "doorbell" else capped)
            assert listener.execute("SELECT fairq.doorbell_release('default')").fetchone() == (True,)
            assert sorted(d.channel for d in drain(c)) == capped


def test_a_resume_or_a_policy_that_makes_work_available_wakes_sleeping_workers(dsn: str) -> None:
    """A channel or queue paused until resumed gives a sleeping worker no time to wake
    at (doorbell_quiet's next_turn_at is NULL): until 0.7.37 a resume sent nothing, and
    the worker slept until its next poll with work ready. A policy that brings a
    turn earlier (a cap raised on a full channel) tells it too; one that changes
    nothing due does not."""
    with psycopg.connect(dsn, autocommit=True) as listener, psycopg.connect(dsn, autocommit=True) as c:
        listener.execute("LISTEN fairq")
        create(c, "held")
        c.execute("SELECT fairq.channel_pause('held')")
        c.execute("SELECT fairq.queue_pause('default')")
        create(c, "other")
        assert _doorbell(listener)[2] is None  # nothing to wake at
        _events(listener, dsn)  # (the creates')
        assert call(c, "queue_resume", "default") is True
        assert call(c, "channel_resume", "held", "default") is True
        got = _events(listener, dsn)
        assert [(e["event"], e["channel"], e["id"]) for e in got] == [
            ("policy", None, None), ("policy", "held", None)]
        assert all(e["queue"] == "default" for e in got)
        for d in drain(c):
            assert d.channel in ("held", "other")
        call(c, "channel_set", "full", 1, 0, None, None)
        create(c, "full")
        create(c, "full")
        held = dequeue(c)
        _events(listener, dsn)
        call(c, "channel_set", "full", 2, 0, None, None)   # a slot for the waiting one
        call(c, "channel_set", "full", 2, 0, 9, None)      # nothing new due: no event
        assert [(e["event"], e["channel"]) for e in _events(listener, dsn)] == [("policy", "full")]
        assert [d.channel for d in held] == ["full"]


def test_with_no_worker_asleep_no_event_is_sent_unless_events_is_wake(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as listener, psycopg.connect(dsn, autocommit=True) as c:
        listener.execute("LISTEN fairq")
        create(c, "a")                    # wakes a, but nobody holds the doorbell
        assert _events(listener, dsn) == []
        c.execute("SET fairq.events = wake")  # for listeners that never hold it
        create(c, "b")
        assert [e["channel"] for e in _events(listener, dsn)] == ["b"]
        c.execute("RESET fairq.events")
        _doorbell(listener)
        create(c, "c")
        assert listener.execute("SELECT fairq.doorbell_release('default')").fetchone() == (True,)
        create(c, "d")
        assert [e["channel"] for e in _events(listener, dsn)] == ["c"]


def test_a_worker_that_heard_quiet_sees_every_message_no_event_announced(dsn: str) -> None:
    """The doorbell's race: producers that tried the doorbell before the worker held it
    sent nothing, so the worker must not sleep until their work is visible to it. Every
    message must be announced by an event or seen by the worker's look after quiet."""
    with psycopg.connect(dsn, autocommit=True) as worker, \
            psycopg.connect(dsn, autocommit=True) as p1, psycopg.connect(dsn, autocommit=True) as p2:
        # The queue exists (a producer that creates it makes others wait for its commit).
        create(p1, "first")
        first = dequeue_one(worker)
        assert first is not None
        complete(worker, first)
        worker.execute("LISTEN fairq")

        def look() -> set[int]:
            got = set()
            while (d := dequeue_one(worker)) is not None:
                got.add(d.id)
            return got

        # The worker follows the protocol: hold, and look once more only after quiet.
        p1.execute("BEGIN")
        early, _ = create(p1, "early")    # tries the doorbell before the worker holds it
        held, quiet, _ = _doorbell(worker)
        assert held
        seen = look() if quiet else set()  # after a quiet answer it would sleep
        p2.execute("BEGIN")
        late, _ = create(p2, "late")      # tries after: rings
        p1.execute("COMMIT")
        p2.execute("COMMIT")
        while not quiet:                  # both have committed: the next answer is quiet
            quiet = _doorbell(worker, "doorbell_quiet")[0]
            seen |= look() if quiet else set()
        announced = {e["id"] for e in _events(worker, dsn)}
    assert announced == {late}
    unannounced_and_unseen = {early, late} - announced - seen
    assert unannounced_and_unseen == set()


def test_a_producer_never_waits_for_a_worker_asking_the_doorbell(dsn: str) -> None:
    """The worker's try of the producing lock lasts to the end of its transaction;
    inside a long one, producers go on (and send their events) instead of waiting."""
    with psycopg.connect(dsn) as worker, psycopg.connect(dsn, autocommit=True) as c, \
            psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN fairq")
        assert _doorbell(worker) == (True, True, None)  # in a transaction left open
        c.execute("SET statement_timeout = '60s'")  # a wait fails, not hangs
        created, _ = create(c, "a")
        assert [e["id"] for e in _events(listener, dsn)] == [created]
        worker.rollback()


def test_a_paused_queue_sets_no_wake_up_time_until_resumed(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as worker:
        create(worker, "a")
        worker.execute("SELECT fairq.queue_pause('default')")  # until resumed: 'infinity'
        assert _doorbell(worker)[2] is None


def test_a_sleeping_worker_learns_when_a_scheduled_message_is_due(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as worker, psycopg.connect(dsn, autocommit=True) as c:
        due = c.execute("SELECT fairq.clock() + interval '1 hour'").fetchone()[0]  # type: ignore[index]
        c.execute("SELECT fairq.message_create('later', 'x', %s)", (due,))  # no event: nobody sleeps
        assert _doorbell(worker)[2] == due


def test_a_sleeping_worker_learns_when_a_lock_expires(dsn: str) -> None:
    """A crashed holder's message comes back when its lock expires, with no event: the
    doorbell said nothing of it, and a worker slept through, up to its poll interval."""
    with psycopg.connect(dsn, autocommit=True) as worker, psycopg.connect(dsn, autocommit=True) as c:
        create(c, "crashed")
        held = dequeue_one(c, lock_ms=3_600_000)
        assert held is not None
        expires = c.execute("SELECT locked_until FROM fairq.message WHERE id = %s",
                            (held.id,)).fetchone()
        assert expires is not None and _doorbell(worker)[2] == expires[0]


def test_events_all_sends_every_event_and_off_none(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as listener, psycopg.connect(dsn, autocommit=True) as c:
        listener.execute("LISTEN fairq")
        c.execute("SET fairq.events = 'all'")
        mid, _ = create(c, "e", b"1")
        create(c, "e", b"2")
        d = dequeue_one(c)
        assert d is not None
        call(c, "message_defer", d.id, d.num_attempts, None, None)
        d = dequeue_one(c)
        assert d is not None
        complete(c, d)
        c.execute("SET fairq.events = off")
        create(c, "f", b"3")
        d = dequeue_one(c)
        assert d is not None
        complete(c, d)
        events = _events(listener, dsn)
    assert [e["event"] for e in events] == ["created", "created", "deferred", "completed"]
    assert all(e["channel"] == "e" for e in events)
    assert events[0]["id"] == mid and events[0]["dequeue_at"] is not None


def test_history_records_every_outcome_when_switched_on(conn: Conn) -> None:
    conn.execute("SET fairq.history = on")
    a, _ = create(conn, "h")
    b, _ = create(conn, "h")
    c, _ = create(conn, "h")
    call(conn, "message_cancel", c)
    d1 = dequeue_one(conn)
    d2 = dequeue_one(conn)
    assert d1 is not None and d2 is not None
    complete(conn, d1)
    call(conn, "message_fail", d2.id, d2.num_attempts, None)
    rows = conn.execute("SELECT id, outcome, num_attempts, first_dequeued_at IS NOT NULL FROM fairq.message_history ORDER BY id").fetchall()
    assert rows == [(a, "completed", 1, True), (b, "dead", 1, True), (c, "cancelled", 0, False)]
    future = conn.execute("SELECT fairq.clock() + interval '1 minute'").fetchone()[0]  # type: ignore[index]
    assert call(conn, "history_prune", future) == 3
    conn.execute("SET fairq.history = off")
    create(conn, "h")
    drain(conn)
    assert conn.execute("SELECT count(*) FROM fairq.message_history").fetchone() == (0,)


def test_invariants_hold_after_a_mixed_workload(conn: Conn) -> None:
    call(conn, "channel_set", "capped", 2, 0, 5, 3)
    for i in range(30):
        create(conn, ["capped", "a", "b"][i % 3], priority=i % 4)
    got = dequeue(conn, lock_ms=100, n=10)
    for i, d in enumerate(got):
        if i % 3 == 0:
            complete(conn, d)
        elif i % 3 == 1:
            call(conn, "message_defer", d.id, d.num_attempts, None, b"s")
    travel(conn, 1_000)
    dequeue(conn, n=5)
    assert problems(conn) == []


@pytest.mark.parametrize("lock_ms", [1, 10])
def test_tiny_locks_are_valid(conn: Conn, lock_ms: int) -> None:
    create(conn, "t")
    assert len(dequeue(conn, lock_ms=lock_ms)) == 1


def advisory_locks(conn: Conn) -> int:
    row = conn.execute("SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid()"
                       " AND locktype = 'advisory'").fetchone()
    assert row is not None
    return int(row[0])


def test_a_transaction_producing_for_thousands_of_tenants_holds_few_locks(conn: Conn) -> None:
    """A Spark partition or an import creates messages for thousands of tenants in one
    transaction. PostgreSQL's lock table is shared and bounded (64 entries per
    connection by default): a lock per channel held until commit would fill it, and
    every session's next lock would fail ("out of shared memory"). Past
    fairq.bulk_channels() channels the transaction holds one lock per queue
    instead, and every message is still delivered once."""
    names = [f"small-{i}" for i in range(10)]
    with conn.transaction():
        conn.execute("SELECT fairq.message_create_batch(%s, %s)", (names, [b"x"] * 10))
        assert advisory_locks(conn) >= 10  # one producer lock per channel, so far
        for chunk in range(3):
            names = [f"tenant-{chunk}-{i}" for i in range(1_000)]
            conn.execute("SELECT fairq.message_create_batch(%s, %s)", (names, [b"x"] * 1_000))
        most = advisory_locks(conn)
        create(conn, "small-1")
        create(conn, "one-more")
        assert advisory_locks(conn) <= most <= 2 * 256 + 5
    ids = [row[0] for _ in range(4)
           for row in conn.execute("SELECT id FROM fairq.message_dequeue(30000, 1000)")]
    assert len(ids) == len(set(ids)) == 10 + 3_000 + 2
    assert dequeue_one(conn) is None
    assert problems(conn) == []


def test_draining_and_completing_thousands_of_tenants_at_once_holds_few_locks(conn: Conn) -> None:
    """A worker that takes and completes messages in thousands at a time, one each
    from thousands of sparse tenants: a dequeue held a settle lock, and a completion a
    policy lock, per channel until commit (3,000 each on 0.7.6), enough to fill
    PostgreSQL's shared lock table on a default server. Past fairq.bulk_channels()
    channels a transaction holds one lock per queue instead; every channel still goes
    idle when emptied, and a message created after is delivered."""
    names = [f"tenant-{i}" for i in range(3_000)]
    conn.execute("SELECT fairq.message_create_batch(%s, %s)", (names, [b"x"] * 3_000))
    with conn.transaction():
        got = conn.execute("SELECT id, num_attempts FROM fairq.message_dequeue(30000, 3000)").fetchall()
        assert len(got) == len({g[0] for g in got}) == 3_000
        assert advisory_locks(conn) <= 256 + 5
    with conn.transaction():
        done = conn.execute("SELECT status, count(*) FROM fairq.message_complete_batch(%s, %s)"
                            " GROUP BY status", ([g[0] for g in got], [g[1] for g in got])).fetchall()
        assert done == [("completed", 3_000)]
        assert advisory_locks(conn) <= 5
    assert conn.execute("SELECT count(*) FROM fairq.channel WHERE turn_at IS NOT NULL").fetchone() == (0,)
    create(conn, "tenant-2999")
    assert [d.channel for d in dequeue(conn, n=10)] == ["tenant-2999"]
    assert problems(conn) == []


def test_a_transaction_of_single_calls_for_thousands_of_tenants_holds_few_locks(conn: Conn) -> None:
    """The same bound for a loop of single calls in one transaction (an application
    enqueueing per tenant inside its own transaction, a script completing what it
    handled): message_create and message_complete count their channel too (0.7.6
    held two locks per channel created into, once the channels existed, and one per
    channel completed)."""
    names = [f"tenant-{i}" for i in range(1_000)]
    conn.execute("SELECT fairq.message_create_batch(%s, %s)", (names, [b"x"] * 1_000))
    conn.execute("SELECT fairq.message_complete_batch(array_agg(id), array_agg(num_attempts))"
                 " FROM fairq.message_dequeue(30000, 1000)")  # the tenants are known, and idle
    with conn.transaction():
        for name in names:
            create(conn, name)
        assert advisory_locks(conn) <= 2 * 256 + 5
    got = conn.execute("SELECT id, num_attempts FROM fairq.message_dequeue(30000, 1000)").fetchall()
    assert len(got) == 1_000
    with conn.transaction():
        for message_id, attempts in got:
            assert call(conn, "message_complete", message_id, attempts) == "completed"
        assert advisory_locks(conn) <= 256 + 5
    create(conn, "tenant-7")
    assert [d.channel for d in dequeue(conn, n=10)] == ["tenant-7"]
    assert problems(conn) == []


def test_a_channel_a_producer_makes_carries_its_wake_in_its_row(conn: Conn) -> None:
    """A producer queues wakes for dequeues to apply because it must not lock a row
    that others see; nobody sees a row the producer made until it commits. So the
    first message of a new channel (the usual case with many sparse tenants) queues
    no wake: the row is made due, with its turn, and the next dequeue finds it
    waiting to join (0.7.16 queued a wake that a dequeue then read, applied and
    deleted). Single and batch creates alike, a scheduled message's turn at its due
    time, and the turns are those the wakes would have given."""
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    create(conn, "single")
    conn.execute("SELECT fairq.message_create_batch(%s, %s, %s)",
                 (["b1", "b2", "b1", "scheduled"], [b"x"] * 4, [None, None, None, later]))
    assert conn.execute("SELECT count(*) FROM fairq.channel_wake").fetchone() == (0,)
    rows = dict(conn.execute("SELECT name, (idle_since, due_at IS NOT NULL, turn_at IS NOT NULL)::text"
                             " FROM fairq.channel").fetchall())
    assert rows == dict.fromkeys(["single", "b1", "b2", "scheduled"], "(,t,t)")
    assert conn.execute("SELECT due_at, turn_at FROM fairq.channel WHERE name = 'scheduled'"
                        ).fetchone() == (later, later)
    assert channels_of(drain(conn)) == ["single", "b1", "b2", "b1"]
    assert problems(conn) == []


def test_concurrent_batch_dequeues_take_different_waiting_channels(dsn: str) -> None:
    """A dequeue that finds wakes queued compares the channels waiting to join with
    the woken ones and locks only those that join. A second dequeue running
    meanwhile finds most of the channels it compares held, and must still fill its
    batch from the waiting channels after them, different from the first's."""
    with psycopg.connect(dsn, autocommit=True) as a, psycopg.connect(dsn, autocommit=True) as b:
        create(a, "old")
        drain(a)                      # "old" stays, idle: its next message queues a wake
        create(a, "old")
        for i in range(20):
            create(a, f"new-{i:02}")  # made by their messages: waiting to join, after the wake
        with a.transaction():
            first = channels_of(dequeue(a, n=5))
            second = channels_of(dequeue(b, n=5))
        assert first == ["old", "new-00", "new-01", "new-02", "new-03"]
        assert len(second) == 5 and not set(first) & set(second), second
        assert problems(a) == []


def test_a_transaction_gone_bulk_queues_one_wake_per_channel(conn: Conn) -> None:
    """An import that loads batch after batch over the same tenants in one transaction
    goes bulk, takes no channel's settle lock, and so wakes every channel it fills;
    but once: its own wake commits with each later message of the channel (0.7.7
    queued one per channel per batch, and each batch read more of them: loading
    10^6 messages over 1,000 tenants slowed from 11,000 to under 1,000 a second).
    A message due before its own wake's time still queues one, and a wake of a
    rolled-back savepoint does not count. A channel it makes needs no wake at all:
    its wake is written into the row, which it holds."""
    names = [f"tenant-{i}" for i in range(1_000)]
    conn.execute("SELECT fairq.message_create_batch(%s, %s)", (names, [b"x"] * 1_000))
    drain(conn)  # the tenants' channels stay, idle
    with conn.transaction():
        create(conn, "later", dequeue_at=datetime.now(timezone.utc) + timedelta(hours=1))
        for _ in range(5):
            conn.execute("SELECT fairq.message_create_batch(%s, %s)", (names, [b"x"] * 1_000))
        for name in names[:100]:
            create(conn, name)
        with pytest.raises(psycopg.errors.DivisionByZero), conn.transaction():
            create(conn, "rolled-back")
            conn.execute("SELECT 1 / 0")
        create(conn, "rolled-back")
        create(conn, "later")
        row = conn.execute("SELECT current_setting('fairq.producer_locks', true),"
                           " (SELECT count(*) FROM fairq.channel_wake)").fetchone()
    # The tenants', once each, and "later"'s for now (made for in an hour, its row
    # says so); "rolled-back" was made twice, its wake in the row each time.
    assert row == ("bulk", 1_000 + 1)
    ids: list[int] = []
    while got := conn.execute("SELECT id FROM fairq.message_dequeue(30000, 1000)").fetchall():
        ids += [g[0] for g in got]
    assert len(ids) == len(set(ids)) == 5 * 1_000 + 100 + 2
    assert problems(conn) == []


def test_bulk_batches_each_in_its_own_transaction_read_one_wake_per_channel(conn: Conn) -> None:
    """A loader whose every batch is a transaction of its own (autocommit), over more
    tenants than a transaction locks one by one: each batch goes bulk and wakes every
    channel it fills, and until workers apply the wakes they add up. A batch must
    look at one of a channel's wakes, not all: 0.7.8 read every earlier wake of its
    channels twice over, so such a load slowed as it went (the bench's deep queue,
    10^6 messages over 1,000 tenants in batches of 300: 5,000 rows/s falling to
    1,000 and below). Everything loaded is still delivered once."""
    names = [f"tenant-{i}" for i in range(300)]
    batch = "SELECT count(*) FROM fairq.message_create_batch(%s, %s)"
    for _ in range(20):
        conn.execute(batch, (names, [b"x"] * 300))
    # (The first batch made the channels, with their wakes in their rows.)
    assert conn.execute("SELECT count(*) FROM fairq.channel_wake").fetchone() == (19 * 300,)
    read = ("SELECT pg_stat_get_xact_tuples_returned('fairq.channel_wake_channel_ix'::regclass)"
            " + pg_stat_get_xact_tuples_returned('fairq.channel_wake'::regclass)")
    with conn.transaction():
        before = conn.execute(read).fetchone()
        conn.execute(batch, (names, [b"x"] * 300))
        after = conn.execute(read).fetchone()
    assert before is not None and after is not None
    assert after[0] - before[0] <= 4 * 300
    ids: list[int] = []
    while got := conn.execute("SELECT id FROM fairq.message_dequeue(30000, 1000)").fetchall():
        ids += [g[0] for g in got]
    assert len(ids) == len(set(ids)) == 21 * 300
    assert conn.execute("SELECT count(*) FROM fairq.channel_wake").fetchone() == (0,)
    assert problems(conn) == []


def test_a_transaction_of_many_single_creates_in_few_channels_queues_few_wakes(conn: Conn) -> None:
    """Counting every call toward the lock bound must not push a transaction that
    enqueues hundreds of messages for a few tenants into bulk mode, which wakes
    every channel it fills (rows the workers then delete) and takes no settle lock:
    past the bound it counts the locks it really holds."""
    for i in range(3):
        create(conn, f"tenant-{i}")
    drain(conn)  # the channels stay, idle: each message now needs a wake
    with conn.transaction():
        for i in range(600):
            create(conn, f"tenant-{i % 3}")
        row = conn.execute("SELECT current_setting('fairq.producer_locks', true),"
                           " (SELECT count(*) FROM fairq.channel_wake)").fetchone()
    assert row is not None and row[0] != "bulk" and row[1] == 3
    assert len(dequeue(conn, n=1_000)) == 600
    assert problems(conn) == []
