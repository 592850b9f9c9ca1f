"""The binding's named queues, weights, pauses, dead-letter delete and purge, and queue
stats (SPEC revision 2), sync and async, against a real database; and how infinite
timestamps (a pause until resumed) load."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from fairq import (
    AsyncQueue,
    CreateStatus,
    DeleteStatus,
    HistoryOutcome,
    NewMessage,
    Queue,
    QueueStats,
    RetryStatus,
    SettleStatus,
    Worker,
)
from fairq._timestamps import register
from test_worker import FAST, eventually, running

LOCK = timedelta(seconds=30)
UTC = timezone.utc
# What a pause until resumed ('infinity') loads as.
FOREVER = datetime.max.replace(tzinfo=UTC)


def soon() -> datetime:
    """A pause's end that is in the future for the whole test."""
    return datetime.now(UTC) + timedelta(hours=1)


@pytest.fixture
def queues(dsn: str) -> Iterator[tuple[Queue[bytes], Queue[bytes], Queue[bytes]]]:
    """The queues "default", "emails" and "reports" of one database."""
    with Queue(dsn) as default, Queue(dsn, name="emails") as emails, \
            Queue(dsn, name="reports") as reports:
        yield default, emails, reports


# -- named queues -------------------------------------------------------------------


def test_queues_are_independent(queues: tuple[Queue[bytes], Queue[bytes], Queue[bytes]]) -> None:
    default, emails, reports = queues
    assert (default.name, emails.name, reports.name) == ("default", "emails", "reports")
    emails.channel_set("acme", max_concurrency=1)
    for queue in queues:
        queue.send("acme", queue.name.encode())
        queue.send_many([NewMessage("acme", queue.name.encode()),
                         NewMessage("other", queue.name.encode())])

    # Same channel name, three channels: the cap of emails/acme binds only there.
    assert [(s.queue, s.channel, s.max_concurrency) for s in emails.channels()] == [
        ("emails", "acme", 1), ("emails", "other", None)]
    assert [(s.queue, s.size) for s in reports.channels("acme")] == [("reports", 2)]
    taken = {queue.name: queue.dequeue(LOCK, 10) for queue in queues}
    assert {name: sorted(m.raw for m in got) for name, got in taken.items()} == {
        "default": [b"default"] * 3, "emails": [b"emails"] * 2, "reports": [b"reports"] * 3}
    assert all(queue.dequeue(LOCK, 10) == [] for queue in (default, reports))

    # Settling goes by id; dead letters and history are listed per queue.
    [first, *_] = taken["emails"]
    assert first.fail("bounced") is SettleStatus.DEAD
    [dead] = emails.dead_letters()
    assert (dead.id, dead.queue, dead.channel, dead.error) == (first.id, "emails", "acme",
                                                               "bounced")
    assert default.dead_letters() == [] and reports.dead_letters("acme") == []
    # Ids are unique across queues: a retry by id puts it back on its own queue's channel.
    assert default.dead_letter_retry(dead.id) is RetryStatus.REQUEUED
    assert [(s.channel, s.size) for s in emails.channels("acme")] == [("acme", 2)]
    assert default.channels("acme")[0].size == 2  # unchanged


@pytest.mark.parametrize("name", ["", "q" * 256, "é" * 128, "a\x00b", None])
def test_a_queue_name_the_sql_refuses_is_refused_by_the_constructor(dsn: str,
                                                                     name: str | None) -> None:
    """Every write names the queue, and the SQL refuses such a name (22023), but the
    listings only filter by it: a queue named "" (an unset environment variable)
    answered zeros to stats() for ever, and nothing to channels(), dead_letters() and
    history(), while each send failed. The names at the edge are taken, by both."""
    kind = TypeError if name is None else ValueError
    with pytest.raises(kind, match=r"^name (must|holds)"):
        Queue(dsn, name=name)  # type: ignore[arg-type]
    with pytest.raises(kind, match=r"^name (must|holds)"):
        AsyncQueue(dsn, name=name)  # type: ignore[arg-type]
    for edge in ("q" * 255, "é" * 127, "q"):
        with Queue(dsn, name=edge) as queue:
            assert queue.send("a", b"x").status is CreateStatus.CREATED
            assert queue.stats().size == 1


def test_history_is_listed_per_queue(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("ALTER DATABASE {} SET fairq.history = on")
                     .format(psycopg.sql.Identifier(conn.info.dbname)))
    with Queue(dsn) as default, Queue(dsn, name="emails") as emails:
        for queue in (default, emails):
            queue.send("a", b"x")
            [message] = queue.dequeue(LOCK)
            message.complete()
        [record] = emails.history()
        assert (record.queue, record.channel, record.outcome) == ("emails", "a",
                                                                  HistoryOutcome.COMPLETED)
        assert [r.queue for r in default.history("a")] == ["default"]
        assert emails.history_prune(soon()) == 2  # the SQL prunes every queue's history


def test_a_periodic_schedule_ticks_in_its_own_queue(dsn: str) -> None:
    with Queue(dsn, name="emails") as emails, Queue(dsn) as default:
        emails.schedule_periodic("digest", timedelta(milliseconds=200), "digests", b"send")
        work: list[str] = []
        with running(Worker(emails, lambda m: work.append(m.channel), **FAST)):
            eventually(lambda: len(work) >= 2)
        assert set(work) == {"digests"}
        assert default.channels() == []  # neither the driver nor its work went elsewhere
        assert [s.channel for s in emails.channels()] == ["fairq.periodic"]


def test_async_periodic_ticks_in_its_own_queue(dsn: str) -> None:
    async def scenario() -> None:
        async with AsyncQueue(dsn, name="emails") as emails, AsyncQueue(dsn) as default:
            await emails.schedule_periodic("digest", timedelta(hours=1), "digests", b"send")
            [driver] = await emails.dequeue(LOCK)
            result = await emails.periodic_tick(driver)
            assert result.work is not None and result.work.status is CreateStatus.CREATED
            assert [(s.channel, s.size) for s in await emails.channels()] == [
                ("digests", 1), ("fairq.periodic", 1)]
            assert await default.channels() == []
    asyncio.run(scenario())


def test_async_queues_are_independent(dsn: str) -> None:
    async def scenario() -> None:
        async with AsyncQueue(dsn, name="emails") as emails, AsyncQueue(dsn) as default:
            assert (emails.name, default.name) == ("emails", "default")
            await emails.channel_set("acme", max_attempts=1)
            await emails.send("acme", b"e")
            await emails.send_many([NewMessage("acme", b"e2")])
            await default.send("acme", b"d")
            assert [(s.queue, s.max_attempts, s.size) for s in await emails.channels()] == [
                ("emails", 1, 2)]
            [got] = await default.dequeue(LOCK, 10)
            assert got.raw == b"d"
            first, second = await emails.dequeue(LOCK, 10)
            assert await first.fail("x") is SettleStatus.DEAD
            assert [d.queue for d in await emails.dead_letters()] == ["emails"]
            assert await default.dead_letters() == []
            assert await second.complete() is SettleStatus.COMPLETED
    asyncio.run(scenario())


# -- weights --------------------------------------------------------------------------


def test_weights_round_trip_and_share_turns(queues: tuple[Queue[bytes], ...]) -> None:
    _, emails, _ = queues
    emails.channel_set("heavy", weight=3)
    assert [(s.channel, s.weight) for s in emails.channels()] == [("heavy", 3)]
    emails.send_many([NewMessage(c, b"") for c in ("heavy", "light") for _ in range(8)])
    assert emails.channels("light")[0].weight == 1  # no policy: the default weight

    served = [m.channel for m in emails.dequeue(LOCK, 8)]
    # Any 4 (= 3 + 1) consecutive deliveries hold 3 +- 1 from heavy, 1 +- 1 from light.
    for start in range(len(served) - 3):
        assert 2 <= Counter(served[start:start + 4])["heavy"] <= 4, served
    assert Counter(served)["heavy"] >= 5, served

    emails.channel_set("heavy", max_concurrency=5)  # a new policy: weight back to 1
    assert emails.channels("heavy")[0].weight == 1


def test_an_invalid_weight_is_refused(queues: tuple[Queue[bytes], ...]) -> None:
    default, _, _ = queues
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="p_weight"):
        default.channel_set("a", weight=0)


# -- pauses ---------------------------------------------------------------------------


def test_channel_pause_until_resumed_and_resume(queues: tuple[Queue[bytes], ...]) -> None:
    default, emails, _ = queues
    for queue in (default, emails):
        queue.send("a", b"a")
        queue.send("b", b"b")
    assert emails.channel_resume("a") is False  # not paused
    emails.channel_pause("a")
    [a] = emails.channels("a")
    assert (a.paused_until, a.next_dequeue_at, a.ready) == (FOREVER, FOREVER, 1)
    assert default.channels("a")[0].paused_until is None  # default/a is another channel

    assert [m.raw for m in emails.dequeue(LOCK, 10)] == [b"b"]
    assert sorted(m.raw for m in default.dequeue(LOCK, 10)) == [b"a", b"b"]
    assert emails.channel_resume("a") is True
    assert emails.channels("a")[0].paused_until is None
    assert [m.raw for m in emails.dequeue(LOCK, 10)] == [b"a"]
    assert emails.channel_resume("a") is False


def test_channel_pause_until_a_time_and_clear(queues: tuple[Queue[bytes], ...]) -> None:
    _, emails, _ = queues
    until = soon()
    emails.channel_pause("a", until)  # before its first message: kept for the pause
    emails.send("a", b"x")
    [a] = emails.channels()
    assert (a.channel, a.paused_until, a.size) == ("a", until, 1)
    assert emails.dequeue(LOCK) == []
    assert emails.channel_clear("a") is True  # forgets the pause with the policy
    assert [m.raw for m in emails.dequeue(LOCK)] == [b"x"]


def test_a_pause_must_end_in_the_future(queues: tuple[Queue[bytes], ...]) -> None:
    default, _, _ = queues
    past = datetime.now(UTC) - timedelta(minutes=1)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="p_until"):
        default.channel_pause("a", past)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="p_until"):
        default.pause(past)


def test_queue_pause_and_resume(queues: tuple[Queue[bytes], ...]) -> None:
    default, emails, _ = queues
    assert emails.resume() is False
    emails.pause()
    assert emails.stats().paused_until == FOREVER
    for queue in (default, emails):
        assert queue.send("a", b"x").status is CreateStatus.CREATED  # creates go on
    assert emails.dequeue(LOCK, 10) == []
    assert len(default.dequeue(LOCK, 10)) == 1  # another queue is not paused
    assert emails.resume() is True
    assert emails.stats().paused_until is None
    [message] = emails.dequeue(LOCK, 10)

    until = soon()
    emails.pause(until)
    assert emails.stats().paused_until == until
    assert message.complete() is SettleStatus.COMPLETED  # settlements go on
    assert [q.paused_until for q in emails.queues()] == [None, until]
    assert emails.resume() is True


def test_async_weights_pauses_dead_letters_and_stats(dsn: str) -> None:
    async def scenario() -> None:
        async with AsyncQueue(dsn, name="emails") as emails, AsyncQueue(dsn) as default:
            await emails.channel_set("a", weight=7)
            await emails.send("a", b"x")
            await emails.channel_pause("a")
            [a] = await emails.channels()
            assert (a.weight, a.paused_until, a.next_dequeue_at) == (7, FOREVER, FOREVER)
            assert await emails.dequeue(LOCK) == []
            assert await emails.channel_resume("a") is True
            await emails.pause()
            assert (await emails.stats()).paused_until == FOREVER
            assert await emails.dequeue(LOCK) == []
            assert await emails.resume() is True
            [message] = await emails.dequeue(LOCK)
            assert await emails.stats() == QueueStats("emails", 1, 1, 0, 0, 1, 0, None)
            assert [q.queue for q in await emails.queues()] == ["emails"]
            assert await message.fail("x") is SettleStatus.DEAD
            await default.send("b", b"y")
            [other] = await default.dequeue(LOCK)
            assert await other.fail("y") is SettleStatus.DEAD
            assert await emails.dead_letter_purge(soon()) == 1
            assert await emails.dead_letter_delete(message.id) is DeleteStatus.NOT_FOUND
            assert await emails.dead_letter_delete(other.id) is DeleteStatus.DELETED
            await default.send("b", b"z")
            [last] = await default.dequeue(LOCK)
            assert await last.fail("z") is SettleStatus.DEAD
            assert await emails.dead_letter_purge(soon(), all_queues=True) == 1
            assert await default.dead_letters() == []
    asyncio.run(scenario())


# -- infinite timestamps ------------------------------------------------------------


def test_infinite_timestamps_load_as_datetime_max_and_min(conn: psycopg.Connection[Any]) -> None:
    with conn.cursor() as cur:
        register(cur)
        row = cur.execute("SELECT 'infinity'::timestamptz, '-infinity'::timestamptz,"
                          " '2030-01-02 03:04:05.678+00'::timestamptz").fetchone()
    assert row == (FOREVER, datetime.min.replace(tzinfo=UTC),
                   datetime(2030, 1, 2, 3, 4, 5, 678000, tzinfo=UTC))


def test_a_pause_until_datetime_max_lists_in_any_time_zone(
        queues: tuple[Queue[bytes], ...], conn: psycopg.Connection[Any]) -> None:
    """datetime.max is finite in PostgreSQL: east of UTC it prints in the year 10000,
    which psycopg refuses; every listing of the database failed, and the worker's
    doorbell with it."""
    _, emails, _ = queues
    emails.pause(FOREVER)
    emails.channel_pause("a", FOREVER)
    conn.execute("SET TimeZone = 'Asia/Tokyo'")
    tokyo = Queue(conn, name="emails")
    assert tokyo.stats().paused_until == FOREVER
    assert [c.paused_until for c in tokyo.channels()] == [FOREVER]
    with conn.cursor() as cur:
        register(cur)
        row = cur.execute("SELECT '0001-01-01 00:00:00+00 BC'::timestamptz").fetchone()
    assert row == (datetime.min.replace(tzinfo=UTC),)


def test_infinity_loads_on_every_source_and_leaves_the_callers_connection_alone(
        dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        Queue(conn).send("a", b"x")
        Queue(conn).channel_pause("a")
    with psycopg.connect(dsn) as conn, ConnectionPool(dsn, min_size=1, max_size=1) as pool:
        for queue in (Queue(conn), Queue(pool)):
            assert queue.channels()[0].paused_until == FOREVER
        with Queue(dsn) as owned:
            assert owned.channels(conn=conn)[0].paused_until == FOREVER
        # The binding's loader stays on its own cursors: the caller's queries load
        # timestamps as psycopg does.
        with pytest.raises(psycopg.DataError, match="too large"):
            conn.execute("SELECT paused_until FROM fairq.channels").fetchone()

    async def scenario() -> None:
        async with AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False) as apool, \
                await psycopg.AsyncConnection.connect(dsn) as aconn:
            for queue in (AsyncQueue(apool), AsyncQueue(aconn)):
                assert (await queue.channels())[0].paused_until == FOREVER
    asyncio.run(scenario())


# -- dead letters ---------------------------------------------------------------------


def kill(queue: Queue[bytes], channel: str, count: int) -> list[int]:
    """Sends ``count`` messages to ``channel`` and fails them into the dead letters."""
    queue.send_many([NewMessage(channel, b"poison") for _ in range(count)])
    dead = queue.dequeue(LOCK, count)
    assert [m.fail("boom") for m in dead] == [SettleStatus.DEAD] * count
    return [m.id for m in dead]


def test_dead_letter_delete(queues: tuple[Queue[bytes], ...]) -> None:
    default, emails, _ = queues
    [mine, kept] = kill(emails, "a", 2)
    assert emails.dead_letter_delete(mine) is DeleteStatus.DELETED
    assert emails.dead_letter_delete(mine) is DeleteStatus.NOT_FOUND
    assert default.dead_letter_retry(mine) is RetryStatus.NOT_FOUND
    assert [d.id for d in emails.dead_letters()] == [kept]


def test_dead_letter_purge_of_this_queue_or_all(queues: tuple[Queue[bytes], ...]) -> None:
    default, emails, reports = queues
    kill(default, "a", 1)
    kill(emails, "a", 2)
    kill(reports, "b", 3)
    assert emails.dead_letter_purge(datetime.now(UTC) - timedelta(hours=1)) == 0  # none died then
    assert emails.stats().dead == 2
    assert emails.dead_letter_purge(soon()) == 2
    assert emails.dead_letters() == []
    assert [len(q.dead_letters()) for q in (default, reports)] == [1, 3]
    assert emails.dead_letter_purge(soon(), all_queues=True) == 4
    assert [q.dead for q in emails.queues()] == [0, 0, 0]


# -- stats ----------------------------------------------------------------------------


def test_stats_per_queue(queues: tuple[Queue[bytes], ...]) -> None:
    default, emails, reports = queues
    assert emails.stats() == QueueStats("emails", 0, 0, 0, 0, 0, 0, None)  # never used
    assert emails.queues() == []  # queues exist from the first call that names them
    emails.send_many([NewMessage("a", b""), NewMessage("a", b""), NewMessage("b", b""),
                      NewMessage("c", b"", delay=timedelta(hours=1))])
    default.send("a", b"")
    taken = {m.channel: m for m in emails.dequeue(LOCK, 2)}
    assert taken["b"].fail() is SettleStatus.DEAD  # b is empty now: no longer a channel
    assert emails.stats() == QueueStats("emails", channels=2, size=3, ready=1, scheduled=1,
                                        in_flight=1, dead=1, paused_until=None)
    reports.pause()
    assert emails.queues() == [
        QueueStats("default", 1, 1, 1, 0, 0, 0, None), emails.stats(),
        QueueStats("reports", 0, 0, 0, 0, 0, 0, FOREVER)]
    assert taken["a"].complete() is SettleStatus.COMPLETED
