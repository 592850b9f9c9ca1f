"""Deterministic reproductions of what the model-based test (tests/test_model.py) found.

Each test is the shrunk counterexample, written out by hand so that it fails the same
way every time (the model test finds them by search, the last one only rarely because
it depends on two turns falling on the same instant).
"""

from __future__ import annotations

from datetime import datetime

from sqlq import Conn, call, create, dequeue, dequeue_one, problems, travel

HOUR = 3_600_000


def at(conn: Conn, hours: int) -> datetime:
    """An exact instant `hours` after the queue's clock now (the clock is frozen by travel)."""
    row = conn.execute("SELECT date_trunc('hour', fairq.clock()) + %s * interval '1 hour'",
                       (hours,)).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def test_cancelling_a_channels_only_scheduled_message_leaves_it_consistent(conn: Conn) -> None:
    """create (scheduled in the future) + cancel: the channel has no policy and no
    messages, so SPEC says it disappears on its own; and fairq.check() must stay empty."""
    create(conn, "a", dequeue_at=at(conn, 2))
    (mid,) = [r[0] for r in conn.execute("SELECT id FROM fairq.message")]
    assert call(conn, "message_cancel", mid) == "cancelled"
    assert problems(conn) == []


def test_raising_the_release_interval_keeps_check_consistent(conn: Conn) -> None:
    """A delivered message, another waiting, then channel_set raises the interval:
    fairq.check() must not report the channel's turn."""
    create(conn, "a")
    assert dequeue_one(conn) is not None
    create(conn, "a")
    call(conn, "channel_set", "a", None, HOUR)
    assert problems(conn) == []


def test_one_dequeue_of_n_equals_n_single_dequeues_when_turns_tie(conn: Conn) -> None:
    """SPEC: one call with p_max_messages = n behaves exactly like n single dequeues in
    a row (same fairness, limits and order).

    Channel a's ready message is cancelled (its due_at stays early, so a is picked and
    found idle) and it keeps a message scheduled at T; channel c has a ready message
    and one scheduled at T. A dequeue serves c and retires a: both get a turn at T.
    Whichever way the dequeue is split, at T the channels must come in the same order."""
    def scenario(split: bool) -> list[str]:
        conn.execute("TRUNCATE fairq.message, fairq.channel, fairq.channel_size, fairq.channel_size_change,"
                     " fairq.channel_wake,"
                     " fairq.dead_letter, fairq.message_history")
        travel(conn, 0)
        t = at(conn, 1)
        cancel_me, _ = create(conn, "a")
        create(conn, "a", dequeue_at=t)
        create(conn, "c")
        create(conn, "c", dequeue_at=t)
        assert call(conn, "message_cancel", cancel_me) == "cancelled"
        got = dequeue(conn, HOUR, 1) + dequeue(conn, HOUR, 1) if split else dequeue(conn, HOUR, 2)
        assert [d.channel for d in got] == ["c"]
        travel(conn, int((t - at(conn, 0)).total_seconds() * 1000) + 1)
        return [d.channel for d in dequeue(conn, HOUR, 2)]

    singles = scenario(split=True)
    one_call = scenario(split=False)
    assert one_call == singles, f"n=2: {one_call}, two n=1 calls: {singles}"


def test_an_idle_channel_first_in_turn_does_not_make_the_dequeue_empty(conn: Conn) -> None:
    """SPEC: zero rows means nothing is available. Channel b's only message was
    cancelled (its turn stays, see the first test); a's message waits behind it."""
    b, _ = create(conn, "b")
    assert call(conn, "message_cancel", b) == "cancelled"
    a, _ = create(conn, "a")
    got = dequeue(conn, HOUR, 1)
    assert [d.id for d in got] == [a]
