"""Periodic schedules: by interval or by cron expression, ticked by ``periodic_tick``.

Cron ticks are checked where they land, in the driver's ``dequeue_at`` and in what
``periodic_tick`` computes for a given ``now``, never by waiting for the wall clock.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

import fairq.aio
import fairq.queue
from fairq import (
    AsyncQueue,
    AsyncWorker,
    Backoff,
    CreateStatus,
    Message,
    NewMessage,
    Queue,
    SettleStatus,
    Worker,
    periodic,
)
from fairq.codecs import BytesCodec
from fairq.periodic import PERIODIC_CHANNEL, Schedule, tick
from fairq.types import ReceivedMessage
from test_worker import FAST, eventually, running

UTC = timezone.utc


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


@pytest.fixture
def queue(dsn: str) -> Iterator[Queue[bytes]]:
    with Queue(dsn) as q:
        yield q


def driver_row(dsn: str) -> tuple[int, datetime, int]:
    """(id, dequeue_at, num_attempts) of the one driver message."""
    with psycopg.connect(dsn) as conn:
        [row] = conn.execute("SELECT m.id, m.dequeue_at, m.num_attempts FROM fairq.message m"
                             " JOIN fairq.channel c ON c.id = m.channel_id"
                             " WHERE c.name = %s", (PERIODIC_CHANNEL,)).fetchall()
    return int(row[0]), row[1], int(row[2])


def work_messages(dsn: str, channel: str) -> list[bytes]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT m.content FROM fairq.message m"
                            " JOIN fairq.channel c ON c.id = m.channel_id"
                            " WHERE c.name = %s ORDER BY m.id", (channel,)).fetchall()
    return [bytes(r[0]) for r in rows]


def message_count(dsn: str) -> int:
    """How many messages there are, in every channel."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM fairq.message").fetchone()
    assert row is not None
    return int(row[0])


# -- the schedule's arithmetic ----------------------------------------------------------

def cron(expr: str, zone: str | None = None) -> Schedule:
    return Schedule("s", None, "c", b"", cron=expr, timezone=zone)


def test_a_cron_schedule_starts_at_its_first_time_at_or_after_start_at() -> None:
    now = at("2026-11-23T10:02:30+00:00")
    every5 = cron("*/5 * * * *")
    assert every5.first_at(None, now) == at("2026-11-23T10:05:00+00:00")
    assert every5.first_at(at("2026-11-23T10:10:00+00:00"), now) == at("2026-11-23T10:10:00+00:00")
    assert every5.first_at(at("2026-11-23T10:10:00.5+00:00"), now) == at("2026-11-23T10:15:00+00:00")
    # An interval schedule starts at start_at, or (None) at the database's now.
    interval = Schedule("s", timedelta(minutes=5), "c", b"")
    assert interval.first_at(None, now) is None
    assert interval.first_at(now, now) == now


def test_cron_times_are_utc_unless_a_time_zone_is_given() -> None:
    nine = cron("0 9 * * *")
    assert nine.first_at(at("2026-01-10T00:00:00+00:00"), at("2026-01-01T00:00:00+00:00")) \
        == at("2026-01-10T09:00:00+00:00")
    riga = cron("0 9 * * *", "Europe/Riga")  # UTC+2 in winter, UTC+3 in summer
    assert riga.first_at(at("2026-01-10T00:00:00+00:00"), at("2026-01-01T00:00:00+00:00")) \
        == at("2026-01-10T07:00:00+00:00")
    assert riga.first_at(at("2026-07-10T00:00:00+00:00"), at("2026-07-01T00:00:00+00:00")) \
        == at("2026-07-10T06:00:00+00:00")
    # Across the spring DST change (2026-03-29, 03:00 -> 04:00 local), 09:00 stays 09:00.
    assert riga.next_after(at("2026-03-28T07:00:00+00:00"), at("2026-03-28T07:00:01+00:00")) \
        == at("2026-03-29T06:00:00+00:00")


def test_a_time_zone_follows_debian_crons_dst_rules() -> None:
    night = cron("30 3 * * *", "Europe/Riga")
    # Spring (2026-03-29): 03:00 jumps to 04:00; the skipped 03:30 runs at 04:00.
    assert night.next_after(at("2026-03-28T01:30:00+00:00"), at("2026-03-28T01:30:01+00:00")) \
        == at("2026-03-29T01:00:00+00:00")
    # Autumn (2026-10-25): 04:00 goes back to 03:00; 03:30 comes twice and runs once.
    first = night.next_after(at("2026-10-24T00:30:00+00:00"), at("2026-10-24T00:30:01+00:00"))
    assert first == at("2026-10-25T00:30:00+00:00")  # 03:30 summer time
    assert night.next_after(first, first) == at("2026-10-26T01:30:00+00:00")  # not 01:30 on the 25th


def test_a_time_in_the_hour_the_autumn_change_repeats_is_never_answered_for_a_later_one() -> None:
    """cronsim counts in wall time: from 01:10 EST (the second pass of the hour New
    York repeats on 2026-11-01) it answers 01:30 EDT, forty minutes before. 0.7.37 made
    that the next tick: a tick run late was deferred to its own due time and ran again
    at once, for the rest of the hour. The first tick of a schedule made then was in
    the past."""
    nightly = cron("30 1 * * *", "America/New_York")
    due = at("2026-11-01T05:30:00+00:00")  # 01:30 EDT, the hour's first pass
    late = at("2026-11-01T06:10:00+00:00")  # 01:10 EST, the second
    tomorrow = at("2026-11-02T06:30:00+00:00")  # 01:30 EST
    assert nightly.next_after(due, late) == tomorrow
    assert nightly.first_at(None, late) == tomorrow
    assert nightly.first_at(late, at("2026-10-01T00:00:00+00:00")) == tomorrow
    # A schedule that fires within the hour still does, on each pass.
    every20 = cron("*/20 * * * *", "America/New_York")
    assert every20.next_after(at("2026-11-01T05:40:00+00:00"), late) \
        == at("2026-11-01T06:20:00+00:00")


def test_missed_ticks_are_skipped_not_replayed() -> None:
    every5 = cron("*/5 * * * *")
    due = at("2026-11-23T10:00:00+00:00")
    assert every5.next_after(due, due) == at("2026-11-23T10:05:00+00:00")
    # A worker that was down for an hour: one tick now, then the next on the schedule.
    assert every5.next_after(due, at("2026-11-23T11:02:00+00:00")) == at("2026-11-23T11:05:00+00:00")
    assert every5.next_after(due, at("2026-11-23T11:05:00+00:00")) == at("2026-11-23T11:10:00+00:00")
    # A worker whose clock is behind the database's still moves past the tick it ran.
    assert every5.next_after(due, at("2026-11-23T09:59:58+00:00")) == at("2026-11-23T10:05:00+00:00")
    interval = Schedule("s", timedelta(minutes=5), "c", b"")
    assert interval.next_after(due, at("2026-11-23T11:02:00+00:00")) == at("2026-11-23T11:05:00+00:00")


@pytest.mark.parametrize("kwargs", [
    {"interval": None, "cron": None},
    {"interval": timedelta(minutes=1), "cron": "* * * * *"},
    {"interval": timedelta(0)},
    {"interval": None, "cron": "every monday"},
    {"interval": None, "cron": "61 * * * *"},
    {"interval": None, "cron": "0 9 * * *", "timezone": "Mars/Olympus_Mons"},
    {"interval": timedelta(minutes=1), "timezone": "Europe/Riga"},
])
def test_a_schedule_needs_exactly_one_valid_interval_or_cron(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Schedule("s", channel="c", content=b"", **kwargs)


@pytest.mark.parametrize(("field", "kwargs"), [
    ("priority", {"priority": 2**31}),
    ("priority", {"priority": -2**31 - 1}),
    ("priority", {"priority": 1.5}),
    ("channel", {"channel": ""}),
    ("channel", {"channel": "j" * 256}),
    ("channel", {"channel": "é" * 128}),  # 128 characters, 256 bytes
    ("channel", {"channel": "a\x00b"}),
    ("channel", {"channel": PERIODIC_CHANNEL}),
    ("interval", {"interval": timedelta(days=365 * 8000)}),
    ("interval", {"interval": timedelta(days=3650, milliseconds=1)}),
])
def test_a_schedule_whose_every_tick_would_fail_is_refused(queue: Queue[bytes], dsn: str,
                                                           field: str,
                                                           kwargs: dict[str, Any]) -> None:
    """Each of these made a driver (0.7.37) whose every tick failed: the database
    refused the work (an integer priority, a channel name), the next tick was past
    what a timestamp holds, or the work was a message on the drivers' own channel (one
    more driver per tick). Now refused, naming the field, before anything is sent."""
    args: dict[str, Any] = {"interval": timedelta(minutes=1), "channel": "reports", **kwargs}
    with pytest.raises(ValueError, match=f"^{field} "):
        queue.schedule_periodic("s", args.pop("interval"), args.pop("channel"), b"r", **args)
    assert message_count(dsn) == 0
    # The limits themselves are fine.
    Schedule("s", timedelta(days=3650), "é" * 127 + "x", b"", priority=-2**31)
    Schedule("s", timedelta(seconds=1), "c" * 255, b"", priority=2**31 - 1)


def test_a_schedule_round_trips_through_its_driver_content() -> None:
    for sched in (Schedule("s", timedelta(seconds=90), "c", b"\x00x", 3),
                  Schedule("s", None, "c", b"y", 1, cron="0 9 * * MON", timezone="Europe/Riga")):
        assert Schedule.decode(sched.encode()) == sched
    # A driver written by fairq 0.6.0 (no cron keys) still reads.
    old = (b'{"name": "r", "interval_ms": 300, "channel": "c", "priority": 0,'
           b' "content": "eA=="}')
    assert Schedule.decode(old) == Schedule("r", timedelta(milliseconds=300), "c", b"x")


def test_a_tick_is_keyed_by_its_due_time() -> None:
    sched = cron("*/5 * * * *")
    driver = ReceivedMessage(9, PERIODIC_CHANNEL, sched.encode(), None, 4, 0,
                             at("2026-11-23T10:00:00+00:00"), False, codec=BytesCodec())
    t = tick(driver, at("2026-11-23T10:00:01+00:00"), "emails")
    assert (t.due_at, t.next_at) == (driver.dequeue_at, at("2026-11-23T10:05:00+00:00"))
    assert t.work.params["dedup_key"] == f"{PERIODIC_CHANNEL}:9@2026-11-23T10:00:00+00:00"
    assert t.work.params["queue"] == "emails"  # the work goes to the driver's queue
    assert (t.reschedule.params["n"], t.reschedule.params["dequeue_at"]) == (4, t.next_at)
    # The same tick received in another session time zone has the same key.
    tokyo = ReceivedMessage(9, PERIODIC_CHANNEL, sched.encode(), None, 5, 0,
                            datetime.fromisoformat("2026-11-23T19:00:00+09:00"), False,
                            codec=BytesCodec())
    again = tick(tokyo, at("2026-11-23T10:00:02+00:00"), "emails")
    assert again.work.params["dedup_key"] == t.work.params["dedup_key"]


# -- against the database ---------------------------------------------------------------

def test_a_cron_driver_is_created_at_its_first_tick(queue: Queue[bytes], dsn: str) -> None:
    start = at("2026-11-23T10:02:30+00:00")
    created = queue.schedule_periodic("five", None, "reports", b"r", cron="*/5 * * * *",
                                      start_at=start)
    assert created.status is CreateStatus.CREATED
    again = queue.schedule_periodic("five", None, "reports", b"other", cron="0 * * * *")
    assert (again.status, again.id) == (CreateStatus.DUPLICATE, created.id)
    assert driver_row(dsn)[1] == at("2026-11-23T10:05:00+00:00")
    with pytest.raises(ValueError):
        queue.schedule_periodic("bad", timedelta(minutes=5), "reports", b"r", cron="* * * * *")


def test_periodic_tick_fires_once_and_moves_the_driver_to_the_next_cron_time(
        queue: Queue[bytes], dsn: str) -> None:
    # Scheduled in the past: the driver is due at once, with an hour of ticks missed.
    queue.schedule_periodic("five", None, "reports", b"r", cron="*/5 * * * *",
                            start_at=datetime.now(UTC) - timedelta(hours=1))
    [driver] = queue.dequeue(timedelta(seconds=30))
    assert driver.channel == PERIODIC_CHANNEL
    now = datetime.now(UTC)
    result = queue.periodic_tick(driver, now=now)
    assert result.status is SettleStatus.DEFERRED
    assert result.work is not None and result.work.status is CreateStatus.CREATED
    assert result.due_at == driver.dequeue_at
    expected = cron("*/5 * * * *").next_after(driver.dequeue_at, now)
    assert result.next_at == expected > now
    assert expected.minute % 5 == 0 and (expected.second, expected.microsecond) == (0, 0)
    driver_id, dequeue_at, attempts = driver_row(dsn)
    assert (driver_id, dequeue_at, attempts) == (driver.id, expected, 1)
    assert work_messages(dsn, "reports") == [b"r"]  # one message, not twelve


def test_a_tick_run_late_in_the_hour_the_autumn_change_repeats_runs_once(
        queue: Queue[bytes], dsn: str) -> None:
    """A nightly 01:30 New York job ticked forty minutes late, at 01:10 EST on the
    night the clocks go back: the driver moves to the next night. 0.7.37 deferred it
    to its own due time, and the job ran again and again for the rest of the hour."""
    queue.schedule_periodic("nightly", None, "jobs", b"run", cron="30 1 * * *",
                            timezone="America/New_York", start_at=at("2026-11-01T05:00:00+00:00"))
    [driver] = queue.dequeue(timedelta(seconds=30))
    assert driver.dequeue_at == at("2026-11-01T05:30:00+00:00")  # 01:30 EDT
    result = queue.periodic_tick(driver, now=at("2026-11-01T06:10:00+00:00"))
    assert result.next_at == at("2026-11-02T06:30:00+00:00")  # 01:30 EST, the next night
    assert driver_row(dsn)[1:] == (result.next_at, 1)
    assert work_messages(dsn, "jobs") == [b"run"]


def test_periodic_tick_of_a_driver_no_longer_ours_changes_nothing(queue: Queue[bytes],
                                                                  dsn: str) -> None:
    queue.schedule_periodic("p", timedelta(minutes=1), "reports", b"r")
    [driver] = queue.dequeue(timedelta(seconds=30))
    # Its lock lapsed and it went elsewhere (here: handed back by someone else).
    assert queue.defer(driver) is SettleStatus.DEFERRED
    handed_back = driver_row(dsn)
    result = queue.periodic_tick(driver)
    assert (result.status, result.work) == (SettleStatus.STALE, None)
    assert work_messages(dsn, "reports") == []
    assert driver_row(dsn) == handed_back  # not rescheduled either


def test_periodic_tick_joins_the_callers_transaction(queue: Queue[bytes], dsn: str) -> None:
    queue.schedule_periodic("p", timedelta(minutes=1), "reports", b"r")
    [driver] = queue.dequeue(timedelta(seconds=30))
    with psycopg.connect(dsn) as conn, conn.transaction():
        result = queue.periodic_tick(driver, conn=conn)  # a savepoint inside the caller's
        raise psycopg.Rollback
    assert result.work is not None  # it ran, but was rolled back with the caller
    assert work_messages(dsn, "reports") == []


def test_periodic_tick_joins_a_transaction_the_caller_has_not_begun(queue: Queue[bytes],
                                                                   dsn: str) -> None:
    """A non-autocommit connection with no transaction open yet: the tick is part of
    the transaction the connection's next statement begins, as a send with conn= is
    (0.7.31 committed a transaction of its own there)."""
    queue.schedule_periodic("p", timedelta(minutes=1), "reports", b"r")
    [driver] = queue.dequeue(timedelta(seconds=30))
    before = driver_row(dsn)
    with psycopg.connect(dsn) as conn:
        result = queue.periodic_tick(driver, conn=conn)
        assert conn.info.transaction_status is psycopg.pq.TransactionStatus.INTRANS
        conn.rollback()
    assert result.work is not None
    assert work_messages(dsn, "reports") == []
    assert driver_row(dsn) == before


def test_async_periodic_tick_joins_a_transaction_the_caller_has_not_begun(dsn: str) -> None:
    async def scenario() -> None:
        async with AsyncQueue(dsn) as queue:
            await queue.schedule_periodic("p", timedelta(minutes=1), "reports", b"r")
            [driver] = await queue.dequeue(timedelta(seconds=30))
            async with await psycopg.AsyncConnection.connect(dsn) as conn:
                result = await queue.periodic_tick(driver, conn=conn)
                await conn.rollback()
            assert result.work is not None
    asyncio.run(scenario())
    assert work_messages(dsn, "reports") == []


def test_a_message_that_is_no_schedule_is_unreadable_and_changes_nothing(
        queue: Queue[bytes], dsn: str) -> None:
    queue.send(PERIODIC_CHANNEL, b"not a schedule")
    [driver] = queue.dequeue(timedelta(seconds=30))
    with pytest.raises(periodic.Unreadable, match="is not a schedule"):
        queue.periodic_tick(driver)
    assert driver_row(dsn)[2] == 1  # still locked by us, delivered once


def test_async_periodic_tick_and_cron_schedule(dsn: str) -> None:
    async def scenario() -> tuple[datetime, periodic.TickResult]:
        async with AsyncQueue(dsn) as queue:
            await queue.schedule_periodic("five", None, "reports", b"r", cron="*/5 * * * *",
                                          start_at=datetime.now(UTC) - timedelta(hours=1))
            [driver] = await queue.dequeue(timedelta(seconds=30))
            now = datetime.now(UTC)
            result = await queue.periodic_tick(driver, now=now)
            assert result.work is not None and result.work.status is CreateStatus.CREATED
            assert result.next_at == cron("*/5 * * * *").next_after(driver.dequeue_at, now)
            return now, result
    now, result = asyncio.run(scenario())
    # The driver moved past the tick's now (not past the real time of this line: a
    # five-minute mark may pass in between).
    assert result.next_at > now
    assert driver_row(dsn)[1] == result.next_at
    assert work_messages(dsn, "reports") == [b"r"]


def test_a_worker_ticks_a_cron_schedule_at_its_computed_time(queue: Queue[bytes],
                                                            dsn: str) -> None:
    """A worker that was down for the last hour of a five-minute cron schedule sends
    one message, and leaves the driver due at the next five-minute mark."""
    queue.schedule_periodic("five", None, "reports", b"r", cron="*/5 * * * *",
                            start_at=datetime.now(UTC) - timedelta(hours=1))
    _, first_due, _ = driver_row(dsn)
    before = datetime.now(UTC)
    work: list[Message[bytes]] = []
    with running(Worker(queue, work.append, **FAST)):
        eventually(lambda: work)
        eventually(lambda: driver_row(dsn)[2] == 1 and driver_row(dsn)[1] != first_due)
    after = datetime.now(UTC)
    _, due, attempts = driver_row(dsn)
    every5 = cron("*/5 * * * *")
    assert due in {every5.next_after(first_due, before), every5.next_after(first_due, after)}
    assert [m.content for m in work] == [b"r"]
    assert attempts == 1


def message_state(dsn: str, message_id: int) -> tuple[str, int, bool] | None:
    """(status, num_attempts, due later than now) of a message, None once it is gone."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT status::text, num_attempts, dequeue_at > clock_timestamp()"
                           " FROM fairq.message WHERE id = %s", (message_id,)).fetchone()
    return None if row is None else (str(row[0]), int(row[1]), bool(row[2]))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_worker_defers_a_periodic_message_it_cannot_read(queue: Queue[bytes], dsn: str,
                                                           kind: str) -> None:
    """Another application's message on the periodic channel (or a driver of a newer
    version) is deferred with back-off, not left locked: 0.7.31's workers logged "could
    not be settled" and it came back after every lock, forever. Never dead-lettered
    (max_attempts=1 here): a driver's attempts count its ticks."""
    sent = queue.send(PERIODIC_CHANNEL, b"not a schedule")
    assert sent.id is not None
    options: dict[str, Any] = {"lock": timedelta(minutes=5), "max_attempts": 1,
                               "backoff": Backoff(base=timedelta(minutes=1)), **FAST}
    handled: list[object] = []
    if kind == "sync":
        with running(Worker(queue, handled.append, **options)):
            eventually(lambda: message_state(dsn, sent.id) == ("scheduled", 1, True))
    else:
        async def scenario() -> None:
            async def handler(message: object) -> None:
                handled.append(message)
            async with AsyncQueue(dsn) as aqueue:
                worker = AsyncWorker(aqueue, handler, **options)
                run = asyncio.create_task(worker.run())
                while message_state(dsn, sent.id) != ("scheduled", 1, True):
                    await asyncio.sleep(0.05)
                worker.stop()
                await run
        asyncio.run(asyncio.wait_for(scenario(), 60))
    assert handled == []


@pytest.mark.parametrize("doc", [
    {"priority": 2**31},
    {"channel": ""},
    {"channel": "j" * 300},
    {"channel": PERIODIC_CHANNEL},  # a tick would add a driver, its tick one more, ...
    {"interval_ms": 365 * 8000 * 86_400_000},
    {"interval_ms": 10**20},  # past what a timedelta holds: OverflowError
])
def test_a_driver_whose_tick_would_fail_is_unreadable_and_changes_nothing(
        queue: Queue[bytes], dsn: str, doc: dict[str, Any]) -> None:
    """A driver sent to the channel as raw JSON (not through schedule_periodic) gets
    the schedule's checks as it is read: its tick raises Unreadable, which a worker
    defers with back-off, and creates no work."""
    raw = {"name": "raw", "interval_ms": 60_000, "channel": "reports", "priority": 0,
           "content": "eA==", **doc}
    queue.send(PERIODIC_CHANNEL, json.dumps(raw).encode())
    [driver] = queue.dequeue(timedelta(seconds=30))
    with pytest.raises(periodic.Unreadable, match="is not a schedule"):
        queue.periodic_tick(driver, now=driver.dequeue_at)
    assert message_count(dsn) == 1  # the driver: no work, no second driver
    assert driver_row(dsn)[2] == 1  # still locked by us, delivered once


@contextmanager
def role_dsn(server: Any, dsn: str, *grants: str) -> Iterator[str]:
    """The conninfo of a new login role of ``dsn``'s database given ``grants``
    (``grant_worker``, ...), dropped afterwards."""
    role = f"fairq_periodic_{uuid.uuid4().hex[:12]}"
    server.admin(f'CREATE ROLE "{role}" LOGIN')
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for grant in grants:
                conn.execute(f"SELECT fairq.{grant}(%s::regrole)", [role])  # type: ignore[arg-type]
        yield psycopg.conninfo.make_conninfo(dsn, user=role)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP OWNED BY "{role}"')  # type: ignore[arg-type]
        server.admin(f'DROP ROLE "{role}"')


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_worker_defers_a_driver_whose_tick_fails(queue: Queue[bytes], dsn: str, server: Any,
                                                  kind: str) -> None:
    """A tick the database refuses (here: the worker's role was not given
    grant_producer, which a tick needs to create its work) is deferred with back-off
    like an unreadable driver: 0.7.37's workers logged "could not be settled" and left
    the driver locked, to fail again after every lock, forever."""
    created = queue.schedule_periodic("p", timedelta(minutes=1), "reports", b"r")
    assert created.id is not None
    options: dict[str, Any] = {"lock": timedelta(minutes=5), "max_attempts": 1,
                               "backoff": Backoff(base=timedelta(minutes=1)), **FAST}
    deferred = ("scheduled", 1, True)
    handled: list[object] = []
    with role_dsn(server, dsn, "grant_worker") as worker_dsn:
        if kind == "sync":
            with Queue(worker_dsn) as wqueue, running(Worker(wqueue, handled.append, **options)):
                eventually(lambda: message_state(dsn, created.id) == deferred)
        else:
            async def scenario() -> None:
                async def handler(message: object) -> None:
                    handled.append(message)
                async with AsyncQueue(worker_dsn) as aqueue:
                    worker = AsyncWorker(aqueue, handler, **options)
                    run = asyncio.create_task(worker.run())
                    while message_state(dsn, created.id) != deferred:
                        await asyncio.sleep(0.05)
                    worker.stop()
                    await run
            asyncio.run(asyncio.wait_for(scenario(), 60))
    assert handled == [] and work_messages(dsn, "reports") == []


def skew_host_clock(monkeypatch: pytest.MonkeyPatch, skew: timedelta) -> None:
    """Makes ``datetime.now()`` in the queues' modules read ``skew`` off the real time."""
    class Skewed(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.now(tz) + skew
    for module in (fairq.queue, fairq.aio, periodic):
        monkeypatch.setattr(module, "datetime", Skewed)


def database_now(dsn: str) -> datetime:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("skew", [timedelta(days=400), -timedelta(days=400)])
def test_a_cron_schedules_first_tick_follows_the_databases_clock_not_the_hosts(
        queue: Queue[bytes], dsn: str, monkeypatch: pytest.MonkeyPatch, kind: str,
        skew: timedelta) -> None:
    """Without ``start_at``, a cron schedule's first tick is the first time after the
    database's now (the clock that hands drivers out). 0.7.37 read the host's clock:
    a host ahead skipped the ticks in between, one behind put the first in the past."""
    def next_new_year(moment: datetime) -> datetime:
        return datetime(moment.year + 1, 1, 1, tzinfo=UTC)
    before = next_new_year(database_now(dsn))
    skew_host_clock(monkeypatch, skew)
    if kind == "sync":
        queue.schedule_periodic("yearly", None, "reports", b"r", cron="0 0 1 1 *")
    else:
        async def scenario() -> None:
            async with AsyncQueue(dsn) as aqueue:
                await aqueue.schedule_periodic("yearly", None, "reports", b"r", cron="0 0 1 1 *")
        asyncio.run(scenario())
    after = next_new_year(database_now(dsn))
    assert driver_row(dsn)[1] in (before, after)


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("skew", [timedelta(days=1), -timedelta(days=1)])
def test_a_tick_reads_the_databases_clock_not_the_hosts(
        queue: Queue[bytes], dsn: str, server: Any, monkeypatch: pytest.MonkeyPatch,
        kind: str, skew: timedelta) -> None:
    """The database hands drivers out by its clock, so a tick without ``now=`` moves
    to the first tick after the database's now, read in the tick's transaction (by a
    role with only the worker's and producer's grants). 0.7.37 read the worker host's
    clock: one a day ahead silenced the schedule for a day; one a day behind deferred
    the driver to a tick already past, and it ran again at once, once per tick missed
    during an outage: twelve, not one."""
    start = database_now(dsn) - timedelta(hours=10, minutes=30)  # 10 h of ticks missed
    queue.schedule_periodic("hourly", timedelta(hours=1), "reports", b"r", start_at=start)
    expected = start + timedelta(hours=11)  # the database's now + 30 min
    skew_host_clock(monkeypatch, skew)
    with role_dsn(server, dsn, "grant_worker", "grant_producer") as worker_dsn:
        if kind == "sync":
            with Queue(worker_dsn) as wqueue:
                [driver] = wqueue.dequeue(timedelta(seconds=30))
                result = wqueue.periodic_tick(driver)
        else:
            async def scenario() -> periodic.TickResult:
                async with AsyncQueue(worker_dsn) as aqueue:
                    [driver] = await aqueue.dequeue(timedelta(seconds=30))
                    return await aqueue.periodic_tick(driver)
            result = asyncio.run(scenario())
    assert (result.status, result.next_at) == (SettleStatus.DEFERRED, expected)
    assert driver_row(dsn)[1:] == (expected, 1)  # not due again before then
    assert work_messages(dsn, "reports") == [b"r"]  # one, not eleven


@pytest.mark.parametrize("weight", [1, 5])
def test_drivers_due_together_take_the_periodic_channels_turns(queue: Queue[bytes],
                                                               weight: int) -> None:
    """Every driver is a message of the one channel ``fairq.periodic``, which takes its
    turns like any tenant's: schedules due at the same time go out one a round of the
    rotation beside busy tenants, and as many a round as its weight (docs/python.md,
    "Periodic messages": give it a weight as large as the schedules due together)."""
    tenants = [f"tenant-{i}" for i in range(10)]
    queue.send_many([NewMessage(tenant, b"t") for tenant in tenants for _ in range(10)])
    for k in range(5):
        queue.schedule_periodic(f"report-{k}", timedelta(hours=1), "reports", b"r")
    if weight > 1:
        queue.channel_set(PERIODIC_CHANNEL, weight=weight)
    order = []
    while len([c for c in order if c == PERIODIC_CHANNEL]) < 5:
        [message] = queue.dequeue(timedelta(minutes=5))
        order.append(message.channel)
        if message.channel != PERIODIC_CHANNEL:
            message.complete()
    drivers_at = [i for i, channel in enumerate(order) if channel == PERIODIC_CHANNEL]
    if weight == 1:  # every tenant served between two drivers: 10 rounds for 5 drivers
        assert [b - a for a, b in itertools.pairwise(drivers_at)] == [11] * 4
    else:  # all five as the rotation comes round once (weight 1 takes five rounds)
        assert drivers_at[-1] < 2 * (len(tenants) + 1)
