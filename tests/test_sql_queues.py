"""SPEC revision 2 through plain SQL: named queues, channel weights (behaviour 1),
pauses (behaviour 10), and dead-letter delete and purge."""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timedelta

import psycopg
import pytest

from sqlq import (
    Conn,
    call,
    channels_of,
    complete,
    counts,
    create,
    create_many,
    dequeue,
    dequeue_one,
    problems,
    travel,
)


def now(conn: Conn) -> datetime:
    row = conn.execute("SELECT fairq.clock()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


# -- Queues ------------------------------------------------------------------------------


def test_a_dequeue_serves_only_its_own_queue(conn: Conn) -> None:
    create(conn, "t1", b"email", queue="emails")
    create(conn, "t1", b"report", queue="reports")
    create(conn, "t1", b"plain")  # the default queue
    assert [d.content for d in dequeue(conn, n=10, queue="reports")] == [b"report"]
    assert [d.content for d in dequeue(conn, n=10, queue="emails")] == [b"email"]
    assert [d.content for d in dequeue(conn, n=10)] == [b"plain"]
    assert dequeue(conn, n=10, queue="emails") == []
    assert dequeue(conn, n=10, queue="nobody-named-this") == []
    assert problems(conn) == []


def test_a_call_that_creates_nothing_makes_no_queue(conn: Conn) -> None:
    """Dequeues, resumes and empty batches name a queue without making it (a stray
    empty batch made one, and the queues view and dashboard showed it)."""
    assert conn.execute("SELECT * FROM fairq.message_create_batch('{}', '{}', p_queue => 'ghost')"
                        ).fetchall() == []
    assert dequeue(conn, queue="ghost") == []
    assert conn.execute("SELECT fairq.queue_resume('ghost')").fetchone() == (False,)
    assert conn.execute("SELECT count(*) FROM fairq.queue WHERE name = 'ghost'").fetchone() == (0,)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="p_queue"):
        conn.execute("SELECT * FROM fairq.message_create_batch('{}', '{}', p_queue => '')")


def test_a_channel_name_in_two_queues_is_two_channels(conn: Conn) -> None:
    conn.execute("SELECT fairq.channel_set('acme', p_max_concurrency => 1, p_queue => 'emails')")
    for _ in range(2):
        create(conn, "acme", queue="emails")
        create(conn, "acme", queue="reports")
    # The cap of emails/acme does not bind reports/acme.
    assert len(dequeue(conn, n=5, queue="emails")) == 1
    assert len(dequeue(conn, n=5, queue="reports")) == 2
    rows = conn.execute("SELECT queue, channel, max_concurrency, in_flight FROM fairq.channels"
                        " ORDER BY queue").fetchall()
    assert rows == [("emails", "acme", 1, 1), ("reports", "acme", None, 2)]


def test_queues_view_counts_each_queue(conn: Conn) -> None:
    create_many(conn, ["a", "a", "b"], queue="emails")
    create(conn, "c", queue="emails", dequeue_at=now(conn) + timedelta(hours=1))
    create(conn, "a")
    d = dequeue_one(conn, queue="emails")
    assert d is not None
    assert call(conn, "message_fail", d.id, d.num_attempts, "boom") == "dead"
    dequeue_one(conn, queue="emails")
    rows = conn.execute("SELECT * FROM fairq.queues ORDER BY queue").fetchall()
    assert rows == [("default", 1, 1, 1, 0, 0, 0, None),
                    ("emails", 3, 3, 1, 1, 1, 1, None)]
    dead = conn.execute("SELECT queue, channel, error FROM fairq.dead_letters").fetchall()
    assert dead == [("emails", "a", "boom")]


def test_queues_view_sums_what_the_channels_view_shows(conn: Conn) -> None:
    """fairq.queues counts its messages in one pass, not through fairq.channels: both
    must still agree, channel by channel kind (a policy or a pause and nothing else,
    an idle channel kept for the collector, future and come-due schedules, in flight,
    a paused queue)."""
    conn.execute("SELECT fairq.channel_set('capped', p_max_concurrency => 2, p_queue => 'emails')")
    conn.execute("SELECT fairq.channel_pause('held', p_queue => 'emails')")
    create(conn, "idle", queue="emails")
    d = dequeue_one(conn, queue="emails")
    assert d is not None and complete(conn, d) == "completed"  # kept idle, not shown
    create_many(conn, ["a", "a", "b"], queue="emails")
    create(conn, "soon", queue="emails", dequeue_at=now(conn) + timedelta(seconds=1))
    create(conn, "later", queue="emails", dequeue_at=now(conn) + timedelta(hours=1))
    create(conn, "capped", queue="emails")
    assert dequeue_one(conn, queue="emails") is not None
    create(conn, "x", queue="reports")
    conn.execute("SELECT fairq.queue_pause('reports')")
    conn.execute("SELECT fairq.queue_pause('quiet')")  # named, never used
    travel(conn, 2_000)
    summed = conn.execute(
        "SELECT q.name, count(c.channel), coalesce(sum(c.size), 0), coalesce(sum(c.ready), 0),"
        "       coalesce(sum(c.scheduled), 0), coalesce(sum(c.in_flight), 0)"
        "  FROM fairq.queue q LEFT JOIN fairq.channels c ON c.queue = q.name"
        " GROUP BY q.name ORDER BY q.name").fetchall()
    viewed = conn.execute("SELECT queue, channels, size, ready, scheduled, in_flight"
                          " FROM fairq.queues ORDER BY queue").fetchall()
    assert viewed == summed
    assert viewed == [("emails", 6, 6, 4, 1, 1), ("quiet", 0, 0, 0, 0, 0), ("reports", 1, 1, 1, 0, 0)]


def test_history_and_events_name_the_queue(conn: Conn) -> None:
    conn.execute("SET fairq.history = on")
    conn.execute("SET fairq.events = wake")  # every wake event, whoever sleeps
    conn.execute("LISTEN fairq")
    create(conn, "a", queue="emails")
    payload = json.loads(next(conn.notifies(timeout=60, stop_after=1)).payload)  # (a net)
    assert payload["queue"] == "emails" and payload["channel"] == "a"
    d = dequeue_one(conn, queue="emails")
    assert d is not None and complete(conn, d) == "completed"
    assert conn.execute("SELECT queue, channel, outcome FROM fairq.message_history"
                        ).fetchall() == [("emails", "a", "completed")]


def test_a_queue_rings_only_its_own_doorbell(dsn: str, conn: Conn) -> None:
    create(conn, "a", queue="emails")  # both queues exist
    with psycopg.connect(dsn, autocommit=True) as worker:
        worker.execute("LISTEN fairq")
        assert worker.execute("SELECT held, quiet FROM fairq.doorbell_hold('default')"
                              ).fetchone() == (True, True)
        create(conn, "b", queue="emails")   # no worker of emails sleeps: no event
        create(conn, "c")                   # a worker of default sleeps: its event
        conn.execute("SELECT pg_notify('fairq', 'marker')")
        heard = [n.payload for n in worker.notifies(timeout=30, stop_after=2)]
    assert heard[-1] == "marker" and len(heard) == 2
    assert json.loads(heard[0])["queue"] == "default"


def test_a_retried_dead_letter_goes_back_to_its_queue(conn: Conn) -> None:
    create(conn, "a", queue="emails")
    d = dequeue_one(conn, queue="emails")
    assert d is not None
    call(conn, "message_fail", d.id, d.num_attempts, None)
    assert call(conn, "dead_letter_retry", d.id) == "requeued"
    assert dequeue(conn) == []
    again = dequeue_one(conn, queue="emails")
    assert again is not None and again.id == d.id


# -- Weights (behaviour 1) ---------------------------------------------------------------


def weighted_setup(conn: Conn, weights: dict[str, int], backlog: int) -> None:
    for channel, weight in weights.items():
        conn.execute("SELECT fairq.channel_set(%s, p_weight => %s)", (channel, weight))
    for channel in weights:
        create_many(conn, [channel] * backlog)


def assert_shares(served: list[str], weights: dict[str, int]) -> None:
    """Any sum(weights) consecutive deliveries hold weight +- 1 from each channel."""
    total = sum(weights.values())
    assert len(served) >= 2 * total
    for start in range(len(served) - total + 1):
        window = Counter(served[start:start + total])
        for channel, weight in weights.items():
            assert abs(window[channel] - weight) <= 1, (start, channel, window)


@pytest.mark.parametrize("per_call", [1, 7, 100])
def test_weights_share_the_turns_spread_out(conn: Conn, per_call: int) -> None:
    weights = {f"w{w}": w for w in range(1, 11)}  # 55 turns a round
    weighted_setup(conn, weights, backlog=60)
    served: list[str] = []
    while len(served) < 3 * 55:
        got = dequeue(conn, lock_ms=600_000, n=per_call)
        assert got
        served += channels_of(got)
    assert_shares(served[:3 * 55], weights)
    # Spread, not in bursts: the heaviest channel never takes 3 turns in a row.
    assert all(served[i:i + 3] != ["w10"] * 3 for i in range(len(served) - 2))
    assert problems(conn) == []


def test_weight_one_everywhere_is_strict_round_robin(conn: Conn) -> None:
    weighted_setup(conn, {c: 1 for c in "abcde"}, backlog=6)
    served = channels_of(dequeue(conn, n=30))
    assert all(len(set(served[i:i + 5])) == 5 for i in range(0, 26))


def test_a_weight_never_passes_a_limit_and_idle_capacity_goes_to_others(conn: Conn) -> None:
    conn.execute("SELECT fairq.channel_set('heavy', p_max_concurrency => 2, p_weight => 50)")
    create_many(conn, ["heavy"] * 10 + ["light"] * 10)
    got = counts(dequeue(conn, n=12))
    assert got == Counter({"heavy": 2, "light": 10})


def test_a_weighted_channel_at_its_cap_between_dequeues_keeps_its_share(conn: Conn) -> None:
    """b (weight 5, max_concurrency 1) and a (weight 1), both backlogged; one worker
    completes each message before its next dequeue, so b is never at its cap when a
    dequeue runs. SPEC behaviour 1 asks for 5 ± 1 b in any 6 deliveries: b leaves the
    rotation full after each serve but keeps its place (turns.sql), so it rejoins
    where its stride puts it, not behind a (until 0.7.37: a, b, a, b, 3 of 6)."""
    conn.execute("SELECT fairq.channel_set('b', p_max_concurrency => 1, p_weight => 5)")
    create_many(conn, ["a"] * 20 + ["b"] * 20)
    served: list[str] = []
    for _ in range(24):
        (got,) = dequeue(conn)
        assert call(conn, "message_complete", got.id, got.num_attempts) == "completed"
        served.append(got.channel)
    assert_shares(served, {"a": 1, "b": 5})


def test_a_channel_full_for_long_rejoins_at_most_one_round_behind(conn: Conn) -> None:
    """b (weight 5, max_concurrency 1) is held full while a and c (weight 1) take 20
    turns. Its kept place is then far behind theirs: it rejoins at most one round of
    its weight behind the front, so it takes its share from there on, not a burst of
    the turns it missed; and check() accepts its kept place while it is full."""
    conn.execute("SELECT fairq.channel_set('b', p_max_concurrency => 1, p_weight => 5)")
    create_many(conn, ["a"] * 40 + ["c"] * 40 + ["b"] * 40)
    first = dequeue(conn, n=3)
    held = [g for g in first if g.channel == "b"]
    assert len(held) == 1
    assert conn.execute("SELECT turn_at IS NULL, turn_pass IS NOT NULL FROM fairq.channel"
                        " WHERE name = 'b'").fetchone() == (True, True)
    assert problems(conn) == []
    assert sorted(channels_of(dequeue(conn, lock_ms=600_000, n=20))) == ["a"] * 10 + ["c"] * 10
    assert call(conn, "message_complete", held[0].id, held[0].num_attempts) == "completed"
    served: list[str] = []
    for _ in range(28):
        (got,) = dequeue(conn)
        if got.channel == "b":
            assert call(conn, "message_complete", got.id, got.num_attempts) == "completed"
        served.append(got.channel)
    assert served[:4] == ["b"] * 4  # one round of its weight behind the front, no more
    assert_shares(served, {"a": 1, "b": 5, "c": 1})
    assert problems(conn) == []


def test_a_full_channel_freed_into_a_rate_limit_rejoins_at_the_back(conn: Conn) -> None:
    """Only a channel that waited for its slot alone keeps its place: freed while its
    release interval still runs, b waits for that, and joins behind a like any
    channel whose wait ended."""
    conn.execute("SELECT fairq.channel_set('b', p_max_concurrency => 1, p_weight => 5,"
                 " p_release_interval_ms => 60000)")
    create_many(conn, ["a"] * 10 + ["b"] * 10)
    got = dequeue(conn, n=2)
    (held,) = [g for g in got if g.channel == "b"]
    assert call(conn, "message_complete", held.id, held.num_attempts) == "completed"
    assert conn.execute("SELECT turn_at > fairq.clock(), turn_pass FROM fairq.channel"
                        " WHERE name = 'b'").fetchone() == (True, None)
    assert problems(conn) == []
    travel(conn, 61_000)
    assert channels_of(dequeue(conn, lock_ms=600_000, n=3)) == ["a", "b", "a"]


# -- Pauses (behaviour 10) ---------------------------------------------------------------


def test_a_paused_channel_keeps_everything_and_rejoins_at_the_back(conn: Conn) -> None:
    create_many(conn, ["a", "a"] + ["b", "c"] * 4)
    conn.execute("SELECT fairq.channel_pause('a')")
    assert channels_of(dequeue(conn, n=4)) == ["b", "c", "b", "c"]
    # 'infinity' (until resumed): psycopg cannot load it into a datetime by default.
    assert conn.execute("SELECT paused_until = 'infinity', size, ready, next_dequeue_at = 'infinity'"
                        " FROM fairq.channels WHERE channel = 'a'").fetchone() == (True, 2, 2, True)
    assert call(conn, "channel_resume", "a") is True
    assert call(conn, "channel_resume", "a") is False
    # Behind b and c, which were waiting when the pause ended.
    assert channels_of(dequeue(conn, n=10)) == ["b", "c", "a", "b", "c", "a"]
    assert problems(conn) == []


def test_a_pause_ends_by_itself_in_the_dequeue_that_finds_it_over(conn: Conn) -> None:
    create(conn, "a")
    conn.execute("SELECT fairq.channel_pause('a', fairq.clock() + interval '1 minute')")
    assert dequeue(conn) == []
    travel(conn, 61_000)
    assert channels_of(dequeue(conn)) == ["a"]


def test_a_paused_channel_is_not_collected_until_its_pause_is_over(conn: Conn) -> None:
    conn.execute("SET fairq.idle_channel_ttl = '0'")
    conn.execute("SELECT fairq.channel_pause('idle', fairq.clock() + interval '1 minute')")
    travel(conn, 5_000)
    conn.execute("SELECT fairq.collect_idle_channels(fairq.clock(), 1000)")
    assert conn.execute("SELECT count(*) FROM fairq.channel WHERE name = 'idle'").fetchone() == (1,)
    travel(conn, 65_000)
    conn.execute("SELECT fairq.collect_idle_channels(fairq.clock(), 1000)")
    assert conn.execute("SELECT count(*) FROM fairq.channel WHERE name = 'idle'").fetchone() == (0,)


def test_a_paused_queue_hands_nothing_out_but_everything_else_goes_on(conn: Conn) -> None:
    create_many(conn, ["a", "b"], queue="jobs")
    held = dequeue(conn, lock_ms=1_000, queue="jobs")[0]
    conn.execute("SELECT fairq.queue_pause('jobs')")
    create(conn, "c", queue="jobs")
    create(conn, "a")  # another queue is not paused
    assert channels_of(dequeue(conn)) == ["a"]
    travel(conn, 2_000)  # the held lock expires while the queue is paused: recovered, waits
    assert dequeue(conn, n=10, queue="jobs") == []
    assert conn.execute("SELECT paused_until = 'infinity', size, ready, in_flight FROM fairq.queues"
                        " WHERE queue = 'jobs'").fetchone() == (True, 3, 3, 0)
    assert call(conn, "queue_resume", "jobs") is True
    got = dequeue(conn, n=10, queue="jobs")
    assert sorted(d.channel for d in got) == ["a", "b", "c"]
    assert [d.recovered for d in got if d.id == held.id] == [True]
    assert problems(conn) == []


# -- Dead letters ------------------------------------------------------------------------


def kill(conn: Conn, channel: str, queue: str = "default") -> int:
    create(conn, channel, queue=queue)
    d = dequeue_one(conn, queue=queue)
    assert d is not None
    call(conn, "message_fail", d.id, d.num_attempts, None)
    return d.id


def test_dead_letter_delete_and_purge(conn: Conn) -> None:
    first, second = kill(conn, "a"), kill(conn, "b", "emails")
    assert call(conn, "dead_letter_delete", first) == "deleted"
    assert call(conn, "dead_letter_delete", first) == "not_found"
    third = kill(conn, "c")
    later = now(conn) + timedelta(seconds=1)
    assert call(conn, "dead_letter_purge", later, "reports") == 0
    assert call(conn, "dead_letter_purge", later, "emails") == 1
    assert conn.execute("SELECT id FROM fairq.dead_letters").fetchall() == [(third,)]
    assert call(conn, "dead_letter_purge", now(conn) - timedelta(hours=1), None) == 0
    assert call(conn, "dead_letter_purge", later, None) == 1
    assert second != third


# -- Bad input (SPEC §8) -----------------------------------------------------------------


@pytest.mark.parametrize(("sql", "args", "sqlstate", "names"), [
    ("SELECT fairq.channel_set('a', p_weight => %s)", (0,), "22023", "p_weight"),
    ("SELECT fairq.channel_set('a', p_weight => %s)", (1001,), "22023", "p_weight"),
    ("SELECT fairq.channel_set('a', p_weight => %s)", (None,), "22004", "p_weight"),
    ("SELECT fairq.channel_set('a', p_queue => %s)", ("",), "22023", "p_queue"),
    ("SELECT * FROM fairq.message_create('a', 'x', p_queue => %s)", ("",), "22023", "p_queue"),
    ("SELECT * FROM fairq.message_create('a', 'x', p_queue => %s)", (None,), "22004", "p_queue"),
    ("SELECT * FROM fairq.message_create('a', 'x', p_queue => %s)", ("q" * 256,), "22023", "p_queue"),
    ("SELECT * FROM fairq.message_create_batch('{a}', '{x}', p_queue => %s)", ("",), "22023", "p_queue"),
    ("SELECT * FROM fairq.message_dequeue(1000, 1, %s)", ("",), "22023", "p_queue"),
    ("SELECT fairq.channel_pause('a', %s)", ("2000-01-01",), "22023", "p_until"),
    ("SELECT fairq.channel_pause('a', %s)", (None,), "22004", "p_until"),
    ("SELECT fairq.queue_pause('q', %s)", ("-infinity",), "22023", "p_until"),
    ("SELECT fairq.queue_pause(%s)", ("",), "22023", "p_queue"),
    ("SELECT fairq.queue_resume(%s)", (None,), "22004", "p_queue"),
    ("SELECT fairq.channel_resume('a', %s)", ("",), "22023", "p_queue"),
    ("SELECT fairq.channel_clear('a', %s)", ("",), "22023", "p_queue"),
    ("SELECT fairq.dead_letter_purge(%s)", (None,), "22004", "p_before"),
    ("SELECT fairq.dead_letter_purge(now(), %s)", ("",), "22023", "p_queue"),
    ("SELECT fairq.dead_letter_delete(%s)", (None,), "22004", "p_id"),
])
def test_bad_arguments_are_refused_and_change_nothing(
        conn: Conn, sql: str, args: tuple[object, ...], sqlstate: str, names: str) -> None:
    def state() -> object:
        return conn.execute("SELECT (SELECT count(*) FROM fairq.queue), (SELECT count(*) FROM"
                            " fairq.channel), (SELECT count(*) FROM fairq.message)").fetchone()
    before = state()
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(sql, args)
    assert caught.value.sqlstate == sqlstate
    assert (caught.value.diag.message_primary or "").startswith(names)
    assert state() == before


def test_the_channels_view_shows_pauses_and_when_work_comes(conn: Conn) -> None:
    # A pause set ahead of traffic shows, on a channel with nothing in it yet.
    conn.execute("SELECT fairq.channel_pause('later', fairq.clock() + interval '1 hour')")
    assert conn.execute("SELECT channel, size, paused_until > fairq.clock() FROM fairq.channels"
                        ).fetchall() == [("later", 0, True)]
    # A message whose wake is not yet applied shows when it may be served: now.
    create(conn, "soon")
    row = conn.execute("SELECT next_dequeue_at <= fairq.clock() FROM fairq.channels"
                       " WHERE channel = 'soon'").fetchone()
    assert row == (True,)
    # A paused queue serves nothing before its pause ends.
    conn.execute("SELECT fairq.queue_pause('default', fairq.clock() + interval '1 hour')")
    row = conn.execute("SELECT next_dequeue_at > fairq.clock() + interval '59 minutes'"
                       " FROM fairq.channels WHERE channel = 'soon'").fetchone()
    assert row == (True,)
