"""fairq._work: the decisions Worker and AsyncWorker share, without a database."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

from fairq import _work
from fairq._sql import DoorbellAnswer
from fairq._work import Backoff, Doorbell, Options, Wakeups, parse_event, wakes
from fairq.codecs import BytesCodec
from fairq.types import ReceivedMessage, SettleStatus

UTC = timezone.utc
NOW = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)


def payload(**doc: Any) -> str:
    return json.dumps({"event": "message_create", "channel": "c", "id": 7,
                       "dequeue_at": None, **doc})


def test_an_event_without_a_queue_is_the_default_queues() -> None:
    event = parse_event(payload())
    assert event is not None
    assert (event.queue, event.event, event.channel, event.id) == ("default", "message_create",
                                                                   "c", 7)
    null_queue = parse_event(payload(queue=None))
    assert null_queue is not None and null_queue.queue == "default"


def test_only_the_workers_own_queue_wakes_it() -> None:
    assert wakes(parse_event(payload(queue="emails")), "emails")
    assert not wakes(parse_event(payload(queue="emails")), "default")
    assert not wakes(parse_event(payload(queue="default")), "emails")
    assert wakes(parse_event(payload()), "default")  # the extension before named queues
    assert not wakes(parse_event(payload()), "emails")


def test_an_unreadable_payload_wakes_rather_than_risk_a_missed_message() -> None:
    for garbage in ("", "not json", "[1, 2]", "null", "42"):
        assert parse_event(garbage) is None
        assert wakes(None, "default")
        assert Wakeups("default", timedelta(seconds=5)).heard(garbage, NOW)


def test_dequeue_at_is_read_as_postgresql_writes_it() -> None:
    for text, expected in [
        ("2026-11-23T12:00:05.12345+00:00", datetime(2026, 11, 23, 12, 0, 5, 123450, tzinfo=UTC)),
        ("2026-11-23T14:00:05+02:00", datetime(2026, 11, 23, 12, 0, 5, tzinfo=UTC)),
        ("2026-11-23T12:00:05.5Z", datetime(2026, 11, 23, 12, 0, 5, 500000, tzinfo=UTC)),
    ]:
        event = parse_event(payload(dequeue_at=text))
        assert event is not None and event.dequeue_at == expected, text
    for bad in ("yesterday", 5, "2026-11-23T12:00:05"):  # a naive time means nothing here
        event = parse_event(payload(dequeue_at=bad))
        assert event is not None and event.dequeue_at is None


def test_wakeups_sleep_until_the_earliest_announced_message_of_its_own_queue() -> None:
    wakeups = Wakeups("default", timedelta(seconds=5))
    assert wakeups.idle_timeout(NOW) == timedelta(seconds=5)
    soon = (NOW + timedelta(seconds=2)).isoformat()
    # Another queue's message due soon does not shorten the sleep.
    assert not wakeups.heard(payload(queue="emails", dequeue_at=soon), NOW)
    assert wakeups.idle_timeout(NOW) == timedelta(seconds=5)
    assert wakeups.heard(payload(dequeue_at=(NOW + timedelta(seconds=3)).isoformat()), NOW)
    assert wakeups.heard(payload(dequeue_at=soon), NOW)
    assert wakeups.heard(payload(dequeue_at=(NOW + timedelta(seconds=4)).isoformat()), NOW)
    assert wakeups.idle_timeout(NOW) == timedelta(seconds=2)
    assert wakeups.idle_timeout(NOW + timedelta(seconds=2)) == timedelta(0)  # due: look now
    assert wakeups.idle_timeout(NOW + timedelta(seconds=2)) == timedelta(seconds=1)  # the next


def test_a_due_time_that_has_come_does_not_hide_a_later_one() -> None:
    wakeups = Wakeups("default", timedelta(seconds=5))
    wakeups.expect(NOW + timedelta(seconds=1), NOW)
    later = NOW + timedelta(seconds=2)
    wakeups.expect(NOW + timedelta(seconds=3), later)  # heard once the first had come
    assert wakeups.idle_timeout(later) == timedelta(0)  # the first: look now
    assert wakeups.idle_timeout(later) == timedelta(seconds=1)  # then the second, not the poll
    assert wakeups.idle_timeout(NOW + timedelta(seconds=3)) == timedelta(0)
    assert wakeups.idle_timeout(NOW + timedelta(seconds=3)) == timedelta(seconds=5)


def test_the_doorbell_is_asked_again_after_work_and_once_a_poll_interval() -> None:
    quiet = DoorbellAnswer(held=True, quiet=True, next_turn_at=None)
    doorbell = Doorbell("default", timedelta(seconds=5))
    hold = doorbell.before_sleep(0.0)
    assert hold is not None and "doorbell_hold" in hold.query
    assert doorbell.answered(quiet, 0.0) is None  # look once more, then sleep
    assert doorbell.before_sleep(1.0) is None
    doorbell.took_work()  # when may the channels just served come again? ask
    again = doorbell.before_sleep(1.0)
    assert again is not None and "doorbell_quiet" in again.query
    assert doorbell.answered(quiet, 1.0) is None
    assert doorbell.before_sleep(5.9) is None
    assert doorbell.before_sleep(6.0) is not None  # a lost session shows within a poll


def test_queue_name_comes_from_the_binding_when_it_has_one() -> None:
    class Named:
        name = "emails"

    assert _work.queue_name(Named()) == "emails"
    assert _work.queue_name(object()) == "default"


def _message(num_attempts: int) -> ReceivedMessage[bytes]:
    return ReceivedMessage(1, "c", b"", None, num_attempts, 0, NOW, False, codec=BytesCodec())


def test_a_failure_defers_with_back_off_until_the_last_attempt_dead_letters() -> None:
    options = Options(max_attempts=3, backoff=Backoff(base=timedelta(seconds=1),
                                                      cap=timedelta(seconds=3)))
    first = _work.after_failure(_message(1), ValueError("nope"), options)
    assert first.outcome is SettleStatus.DEFERRED and first.delay is not None
    assert timedelta(seconds=0.5) <= first.delay <= timedelta(seconds=1)
    second = _work.after_failure(_message(2), ValueError("nope"), options)
    assert second.delay is not None and timedelta(seconds=1) <= second.delay <= timedelta(seconds=2)
    last = _work.after_failure(_message(3), ValueError("nope"), options)
    assert (last.outcome, last.error) == (SettleStatus.DEAD, "ValueError: nope")
    never = _work.after_failure(_message(99), ValueError("x"), Options(max_attempts=None))
    assert never.outcome is SettleStatus.DEFERRED


def test_backoff_doubles_up_to_its_cap_with_equal_jitter() -> None:
    backoff = Backoff(base=timedelta(seconds=1), cap=timedelta(seconds=10))
    for attempt, ceiling in [(1, 1), (2, 2), (3, 4), (4, 8), (5, 10), (500, 10)]:
        delay = backoff.delay(attempt)
        assert timedelta(seconds=ceiling) / 2 <= delay <= timedelta(seconds=ceiling)
    # base * 2**32 does not fit in a timedelta: the cap must rule before it is computed.
    slow = Backoff(base=timedelta(hours=6), cap=timedelta(days=1))
    for attempt in (33, 64, 10**6):
        assert timedelta(hours=12) <= slow.delay(attempt) <= timedelta(days=1)


@pytest.mark.parametrize("bad", [
    {"concurrency": 0}, {"lock": timedelta(0)}, {"lock": timedelta(days=3651)},
    {"max_attempts": 0},
    {"poll_interval": timedelta(0)}, {"grace_period": timedelta(seconds=-1)},
])
def test_options_refuse_what_cannot_work(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Options(**bad)


def test_heartbeats_come_three_times_per_lock() -> None:
    assert Options(lock=timedelta(seconds=30)).heartbeat_interval == timedelta(seconds=10)


def test_a_listen_outage_is_logged_once_then_once_a_minute_then_its_end(
        caplog: pytest.LogCaptureFixture) -> None:
    """The LISTEN loop tries to connect again every poll interval while the database
    is away: each failure logged its traceback (a dozen a minute per worker)."""
    outage = _work.ListenOutage()
    down = psycopg.OperationalError("connection refused")
    with caplog.at_level(logging.INFO, logger="fairq.worker"):
        for second in range(0, 65, 5):
            outage.failed(down, 1000.0 + second)
        outage.connected(1070.0)
        outage.failed(down, 2000.0)
    records = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert records == [
        ("WARNING", "LISTEN connection lost; polling until it is back", True),
        ("WARNING", "LISTEN connection still lost after 60 s (13 tries to connect);"
                    " polling meanwhile: connection refused", False),
        ("INFO", "LISTEN connection back after 70 s", False),
        ("WARNING", "LISTEN connection lost; polling until it is back", True),
    ]
