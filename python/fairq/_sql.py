"""The one definition of what fairq's Python side sends to PostgreSQL.

Each function returns a :class:`Call`: the statement, its parameters and how to turn
the returned rows into results. ``Queue`` and ``AsyncQueue`` only differ in how they
execute a Call, so both speak exactly the same SQL. Parameters are passed by name
(``p_x => %(x)s``) so that the SQL's defaults apply to what we leave out.

Every call that concerns a queue takes its name as a required ``queue``: a call that
forgot it would silently act on the queue ``'default'``.

Relative delays are added to the *database's* clock (``clock_timestamp()``), so
producers and workers on hosts with skewed clocks still schedule consistently.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

from psycopg import pq

from fairq.codecs import Codec
from fairq.types import (
    CancelStatus,
    ChannelStats,
    CreateResult,
    CreateStatus,
    DeadLetter,
    DeleteStatus,
    HistoryOutcome,
    HistoryRecord,
    NewMessage,
    QueueStats,
    RetryStatus,
    SettleResult,
    SettleStatus,
    require_aware,
    require_one_due_time,
)

R = TypeVar("R")
T = TypeVar("T")
Row = tuple[Any, ...]

# PostgreSQL's integer and bigint: a Python int beyond them is sent as a numeric, which
# no fairq function takes, or fails to adapt.
INTEGER = range(-2**31, 2**31)
BIGINT = range(-2**63, 2**63)

#: fairq's limit on names (channels and queues), in bytes of UTF-8 (sql/validate.sql;
#: tests/test_spark.py checks it against the SQL at the edges).
MAX_NAME_BYTES = 255


def name_problem(name: str | None) -> str | None:
    """Why fairq refuses ``name`` as a channel's or a queue's, or None: the SQL's rule
    (fairq.require_channel_name: non-empty, at most MAX_NAME_BYTES), and no NUL, which
    PostgreSQL's text cannot hold."""
    if name is None:
        return "is NULL"
    size = len(name.encode())  # (a lone surrogate raises UnicodeEncodeError, a ValueError)
    if not 0 < size <= MAX_NAME_BYTES:
        return f"must be non-empty text of at most {MAX_NAME_BYTES} bytes, got {size} bytes"
    if "\x00" in name:
        return "holds a NUL character (PostgreSQL text cannot)"
    return None


def require_channel(channel: str, name: str) -> None:
    """Raises unless ``channel`` is a channel name fairq takes (:func:`name_problem`),
    for values checked long before they reach the SQL, such as a schedule's channel,
    whose every tick would fail."""
    if not isinstance(channel, str):
        raise TypeError(f"{name} must be a str, got {type(channel).__name__}")
    problem = name_problem(channel)
    if problem is not None:
        raise ValueError(f"{name} {problem}")


# Columns of fairq.message_dequeue, in the order ReceivedMessage takes them.
DEQUEUED_COLUMNS = "id, channel, content, state, num_attempts, priority, dequeue_at, recovered"


@dataclass(frozen=True)
class Call(Generic[R]):
    query: str
    params: Mapping[str, Any]
    decode: Callable[[list[Row]], R]
    # A settlement or heartbeat, fenced by the message's num_attempts: sent once more if
    # the connection it went out on was dead (:func:`sent_again`). One that did commit
    # before its answer was lost then answers not_found or stale, and changes nothing;
    # a send or a dequeue is never sent again (it might have created or taken a message).
    fenced: bool = False


def sent_again(call: Call[Any], conn: Any) -> bool:
    """Whether ``call``, which failed on ``conn`` (a connection of the queue's pool, not
    one the caller passed), goes once more on another: when it is fenced and ``conn``
    died under it. A pool hands out connections used within the last second unchecked,
    so after a server restart or a pooler's cut each busy connection failed one call;
    a worker's failed completion left its message locked, and its handler ran again
    when the lock expired."""
    return call.fenced and bool(conn.broken)


def milliseconds(duration: timedelta) -> int:
    """A duration as the SQL's whole milliseconds, rounded away from zero: no lock is
    0 ms, and a negative duration stays negative for the SQL to refuse (-1 µs was 0)."""
    ms = duration / timedelta(milliseconds=1)
    return math.ceil(ms) if ms >= 0 else math.floor(ms)


# What opens the transaction a non-autocommit connection begins at its next statement:
# a call made with conn= is part of it (psycopg's transaction() on such a connection
# with none open would commit a transaction of its own at the end of the block).
BEGIN_IMPLICIT = "SELECT"


def joins_implicit_transaction(autocommit: bool, status: pq.TransactionStatus) -> bool:
    """Whether a call given this connection must first open the transaction its caller's
    next statement would have begun, to make itself a savepoint in it."""
    return not autocommit and status == pq.TransactionStatus.IDLE


def _scalar(rows: list[Row]) -> Any:
    return rows[0][0]


def _none(rows: list[Row]) -> None:
    return None


def _until(until: datetime | None) -> str:
    """The ``p_until`` argument of a pause: none at all for None, so that the SQL's
    default (``'infinity'``: until resumed) applies."""
    return "" if until is None else ", p_until => %(until)s::timestamptz"


# -- queues -----------------------------------------------------------------------------

def queue_pause(queue: str, until: datetime | None) -> Call[None]:
    require_aware(until, "until")
    return Call(f"SELECT fairq.queue_pause(p_queue => %(queue)s::text{_until(until)})",
                {"queue": queue, "until": until}, _none)


def queue_resume(queue: str) -> Call[bool]:
    return Call("SELECT fairq.queue_resume(p_queue => %(queue)s::text)", {"queue": queue},
                lambda rows: bool(_scalar(rows)))


_QUEUE_COLUMNS = "queue, channels, size, ready, scheduled, in_flight, dead, paused_until"


def queues() -> Call[list[QueueStats]]:
    return Call(f"SELECT {_QUEUE_COLUMNS} FROM fairq.queues ORDER BY queue", {},
                lambda rows: [QueueStats(*row) for row in rows])


def queue_stats(queue: str) -> Call[QueueStats]:
    """The queue's row of ``fairq.queues``; zeros for a queue no call has named yet
    (queues exist implicitly: it is merely empty)."""
    return Call(f"SELECT {_QUEUE_COLUMNS} FROM fairq.queues WHERE queue = %(queue)s",
                {"queue": queue},
                lambda rows: QueueStats(*rows[0]) if rows
                else QueueStats(queue, 0, 0, 0, 0, 0, 0, None))


# -- channels ---------------------------------------------------------------------------

def channel_set(channel: str, *, queue: str, max_concurrency: int | None,
                release_interval: timedelta, max_size: int | None, max_attempts: int | None,
                weight: int) -> Call[None]:
    return Call(
        "SELECT fairq.channel_set(p_channel => %(channel)s,"
        " p_max_concurrency => %(max_concurrency)s::int,"
        " p_release_interval_ms => %(release_interval_ms)s,"
        " p_max_size => %(max_size)s::int, p_max_attempts => %(max_attempts)s::int,"
        " p_weight => %(weight)s::int, p_queue => %(queue)s::text)",
        {"channel": channel, "max_concurrency": max_concurrency,
         "release_interval_ms": milliseconds(release_interval), "max_size": max_size,
         "max_attempts": max_attempts, "weight": weight, "queue": queue},
        _none)


def channel_clear(channel: str, *, queue: str) -> Call[bool]:
    return Call("SELECT fairq.channel_clear(p_channel => %(channel)s, p_queue => %(queue)s::text)",
                {"channel": channel, "queue": queue}, lambda rows: bool(_scalar(rows)))


def channel_pause(channel: str, *, queue: str, until: datetime | None) -> Call[None]:
    require_aware(until, "until")
    return Call(
        f"SELECT fairq.channel_pause(p_channel => %(channel)s{_until(until)},"
        " p_queue => %(queue)s::text)",
        {"channel": channel, "queue": queue, "until": until}, _none)


def channel_resume(channel: str, *, queue: str) -> Call[bool]:
    return Call(
        "SELECT fairq.channel_resume(p_channel => %(channel)s, p_queue => %(queue)s::text)",
        {"channel": channel, "queue": queue}, lambda rows: bool(_scalar(rows)))


def channels(channel: str | None, *, queue: str) -> Call[list[ChannelStats]]:
    return Call(
        "SELECT queue, channel, max_concurrency, release_interval_ms, max_size, max_attempts,"
        " weight, paused_until, size, ready, scheduled, in_flight, next_dequeue_at"
        " FROM fairq.channels WHERE queue = %(queue)s"
        "   AND (%(channel)s::text IS NULL OR channel = %(channel)s) ORDER BY channel",
        {"channel": channel, "queue": queue},
        lambda rows: [_channel_stats(row) for row in rows])


def _channel_stats(row: Row) -> ChannelStats:
    queue, channel, max_concurrency, release_interval_ms, *rest = row
    return ChannelStats(queue, channel, max_concurrency,
                        timedelta(milliseconds=release_interval_ms), *rest)


# -- messages ---------------------------------------------------------------------------


def _create_result(id_: int | None, status: str) -> CreateResult:
    return CreateResult(id_, CreateStatus(status))


def create(channel: str, content: bytes, *, queue: str, dequeue_at: datetime | None,
           delay: timedelta | None, priority: int, dedup_key: str | None) -> Call[CreateResult]:
    require_one_due_time(dequeue_at, delay)
    return Call(
        "SELECT id, status FROM fairq.message_create(p_channel => %(channel)s,"
        " p_content => %(content)s::bytea,"
        " p_dequeue_at => coalesce(%(dequeue_at)s::timestamptz,"
        "                          clock_timestamp() + %(delay)s::interval),"
        " p_priority => %(priority)s::int, p_dedup_key => %(dedup_key)s::text,"
        " p_queue => %(queue)s::text)",
        {"channel": channel, "content": content, "dequeue_at": dequeue_at, "delay": delay,
         "priority": priority, "dedup_key": dedup_key, "queue": queue},
        lambda rows: _create_result(*rows[0]))


def create_batch(messages: Sequence[NewMessage[T]], codec: Codec[T], *,
                 queue: str) -> Call[list[CreateResult]]:
    return Call(
        "SELECT id, status FROM fairq.message_create_batch(p_channels => %(channels)b::text[],"
        " p_contents => %(contents)b::bytea[],"
        " p_dequeue_ats => (SELECT array_agg(coalesce(u.at, clock_timestamp() + u.delay)"
        "                                    ORDER BY u.i)"
        "                     FROM unnest(%(dequeue_ats)b::timestamptz[], %(delays)b::interval[])"
        "                          WITH ORDINALITY AS u(at, delay, i)),"
        " p_priorities => %(priorities)b::int[], p_dedup_keys => %(dedup_keys)b::text[],"
        " p_queue => %(queue)s::text) ORDER BY ord",
        {"channels": [m.channel for m in messages],
         "contents": [codec.encode(m.content) for m in messages],
         "dequeue_ats": [m.dequeue_at for m in messages],
         "delays": [m.delay for m in messages],
         "priorities": [m.priority for m in messages],
         "dedup_keys": [m.dedup_key for m in messages],
         "queue": queue},
        lambda rows: [_create_result(*row) for row in rows])


def clock() -> Call[datetime]:
    """The database's clock, read as relative delays read it (``clock_timestamp()``).
    It is ``fairq.clock()``, which hands messages out, except in tests that moved that
    one with ``fairq.clock_travel``: a worker may not call ``fairq.clock()`` (it is
    granted to nobody) nor read ``fairq.clock_offset``."""
    return Call("SELECT clock_timestamp()", {}, _scalar)


def dequeue(lock: timedelta, max_messages: int, *, queue: str) -> Call[list[Row]]:
    """Rows in DEQUEUED_COLUMNS order; the queues bind them to themselves."""
    return Call(
        f"SELECT {DEQUEUED_COLUMNS} FROM fairq.message_dequeue("
        # (Cast: a Python int past int4 found no function to call, a baffling error.)
        "p_lock_ms => %(lock_ms)s::bigint, p_max_messages => %(max_messages)s::integer,"
        " p_queue => %(queue)s::text)",
        {"lock_ms": milliseconds(lock), "max_messages": max_messages, "queue": queue},
        lambda rows: rows)


# -- the doorbell (a worker's own session; see fairq._work.Doorbell) --------------------

@dataclass(frozen=True)
class DoorbellAnswer:
    held: bool                     # this session holds the queue's doorbell
    quiet: bool                    # no call is between making work available and commit
    next_turn_at: datetime | None  # the earliest time a waiting channel may be served


def doorbell_hold(queue: str) -> Call[DoorbellAnswer]:
    return Call("SELECT held, quiet, next_turn_at"
                " FROM fairq.doorbell_hold(p_queue => %(queue)s::text)",
                {"queue": queue}, lambda rows: DoorbellAnswer(*rows[0]))


def doorbell_quiet(queue: str) -> Call[DoorbellAnswer]:
    return Call("SELECT true, quiet, next_turn_at"
                " FROM fairq.doorbell_quiet(p_queue => %(queue)s::text)",
                {"queue": queue}, lambda rows: DoorbellAnswer(*rows[0]))


def doorbell_release(queue: str) -> Call[None]:
    return Call("SELECT fairq.doorbell_release(p_queue => %(queue)s::text)", {"queue": queue},
                _none)


# Ids and tokens are cast to bigint, as counts are to integer (dequeue): a Python int past
# bigint went as a numeric, and the call failed with 42883, "function
# fairq.message_cancel(p_id => numeric) does not exist", instead of the cast's 22003.

def _settle_status(rows: list[Row]) -> SettleStatus:
    return SettleStatus(_scalar(rows))


def complete(id_: int, num_attempts: int) -> Call[SettleStatus]:
    return Call("SELECT fairq.message_complete(p_id => %(id)s::bigint,"
                " p_num_attempts => %(n)s::bigint)",
                {"id": id_, "n": num_attempts}, _settle_status, fenced=True)


def complete_batch(tokens: Sequence[tuple[int, int]]) -> Call[list[SettleResult]]:
    return Call(
        "SELECT id, status FROM fairq.message_complete_batch(p_ids => %(ids)s::bigint[],"
        " p_num_attempts => %(ns)s::bigint[])",
        {"ids": [id_ for id_, _ in tokens], "ns": [n for _, n in tokens]},
        lambda rows: [SettleResult(id_, SettleStatus(status)) for id_, status in rows],
        fenced=True)


def defer(id_: int, num_attempts: int, *, dequeue_at: datetime | None, delay: timedelta | None,
          state: bytes | None) -> Call[SettleStatus]:
    require_one_due_time(dequeue_at, delay)
    return Call(
        "SELECT fairq.message_defer(p_id => %(id)s::bigint, p_num_attempts => %(n)s::bigint,"
        " p_dequeue_at => coalesce(%(dequeue_at)s::timestamptz,"
        "                          clock_timestamp() + %(delay)s::interval),"
        " p_state => %(state)s::bytea)",
        {"id": id_, "n": num_attempts, "dequeue_at": dequeue_at, "delay": delay,
         "state": state},
        _settle_status, fenced=True)


#: The longest lock_timeout PostgreSQL takes, in milliseconds (about 24.8 days).
LONGEST_LOCK_TIMEOUT_MS = 2**31 - 1


def heartbeat(id_: int, num_attempts: int, lock: timedelta,
              lock_wait: timedelta | None = None) -> Call[SettleStatus]:
    """With ``lock_wait``, the statement waits no longer than that for the message's row
    while another transaction holds it (one settling the message), then fails with
    ``lock_not_available`` and changes nothing: ``lock_timeout`` is set for this
    statement's transaction first (a materialized CTE is scanned before the row it
    feeds is projected), and set back as the answer is projected, after the heartbeat
    ran: in a caller's transaction (``conn=``) the setting outlived the call, and every
    later statement of that transaction waited for a lock no longer than 100 ms."""
    params = {"id": id_, "n": num_attempts, "lock_ms": milliseconds(lock)}
    beat = ("fairq.message_heartbeat(p_id => %(id)s::bigint, p_num_attempts => %(n)s::bigint,"
            " p_lock_ms => %(lock_ms)s)")
    if lock_wait is None:
        return Call(f"SELECT {beat}", params, _settle_status, fenced=True)
    if lock_wait <= timedelta(0):
        raise ValueError(f"lock_wait must be positive, got {lock_wait}")
    if milliseconds(lock_wait) > LONGEST_LOCK_TIMEOUT_MS:
        # (set_config refused it naming lock_timeout, a setting the caller never named.)
        raise ValueError(f"lock_wait must be at most {LONGEST_LOCK_TIMEOUT_MS} ms"
                         f" (what lock_timeout holds), got {lock_wait}")
    return Call("WITH waiting AS MATERIALIZED"
                " (SELECT current_setting('lock_timeout') AS before,"
                "         set_config('lock_timeout', %(wait)s, true)),"
                f" beat AS MATERIALIZED (SELECT {beat} AS status FROM waiting)"
                " SELECT b.status, set_config('lock_timeout', w.before, true)"
                " FROM beat b CROSS JOIN waiting w",
                {**params, "wait": f"{milliseconds(lock_wait)}ms"}, _settle_status, fenced=True)


def fail(id_: int, num_attempts: int, error: str | None) -> Call[SettleStatus]:
    return Call(
        "SELECT fairq.message_fail(p_id => %(id)s::bigint, p_num_attempts => %(n)s::bigint,"
        " p_error => %(error)s::text)",
        {"id": id_, "n": num_attempts, "error": error}, _settle_status, fenced=True)


def cancel(id_: int) -> Call[CancelStatus]:
    return Call("SELECT fairq.message_cancel(p_id => %(id)s::bigint)", {"id": id_},
                lambda rows: CancelStatus(_scalar(rows)))


# -- dead letters and history -----------------------------------------------------------

def require_limit(limit: int) -> None:
    """A page's ``limit`` must be a count PostgreSQL's LIMIT takes: a negative one failed
    with its own error (2201W), one past bigint with 22003, neither naming ``limit``."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit < BIGINT.stop:
        raise ValueError(f"limit must be an integer from 0 to {BIGINT.stop - 1}, got {limit!r}")


def dead_letters(channel: str | None, limit: int, *, queue: str) -> Call[list[DeadLetter]]:
    require_limit(limit)
    return Call(
        "SELECT id, queue, channel, content, state, num_attempts, error, created_at, died_at"
        " FROM fairq.dead_letters WHERE queue = %(queue)s"
        "   AND (%(channel)s::text IS NULL OR channel = %(channel)s)"
        " ORDER BY died_at, id LIMIT %(limit)s",
        {"channel": channel, "limit": limit, "queue": queue},
        lambda rows: [DeadLetter(*row) for row in rows])


def dead_letter_retry(id_: int) -> Call[RetryStatus]:
    return Call("SELECT fairq.dead_letter_retry(p_id => %(id)s::bigint)", {"id": id_},
                lambda rows: RetryStatus(_scalar(rows)))


def dead_letter_delete(id_: int) -> Call[DeleteStatus]:
    return Call("SELECT fairq.dead_letter_delete(p_id => %(id)s::bigint)", {"id": id_},
                lambda rows: DeleteStatus(_scalar(rows)))


def dead_letter_purge(before: datetime, *, queue: str | None) -> Call[int]:
    """Of ``queue``, or of every queue when None."""
    require_aware(before, "before")
    return Call(
        "SELECT fairq.dead_letter_purge(p_before => %(before)s, p_queue => %(queue)s::text)",
        {"before": before, "queue": queue}, lambda rows: int(_scalar(rows)))


def history(channel: str | None, since: datetime | None, limit: int, *,
            queue: str) -> Call[list[HistoryRecord]]:
    require_aware(since, "since")
    require_limit(limit)
    return Call(
        "SELECT id, queue, channel, priority, created_at, first_dequeued_at, settled_at,"
        " num_attempts, outcome FROM fairq.message_history"
        " WHERE queue = %(queue)s AND (%(channel)s::text IS NULL OR channel = %(channel)s)"
        "   AND (%(since)s::timestamptz IS NULL OR settled_at >= %(since)s)"
        " ORDER BY settled_at, id LIMIT %(limit)s",
        {"channel": channel, "since": since, "limit": limit, "queue": queue},
        lambda rows: [_history_record(row) for row in rows])


def _history_record(row: Row) -> HistoryRecord:
    (id_, queue, channel, priority, created_at, first_dequeued_at, settled_at, num_attempts,
     outcome) = row
    return HistoryRecord(id_, queue, channel, priority, created_at, first_dequeued_at,
                         settled_at, num_attempts, HistoryOutcome(outcome))


def history_prune(before: datetime) -> Call[int]:
    require_aware(before, "before")
    return Call("SELECT fairq.history_prune(p_before => %(before)s)", {"before": before},
                lambda rows: int(_scalar(rows)))


def explain_missing_function(error: BaseException) -> None:
    """Adds a note to a call's "function ... does not exist" (42883): the binding sends
    only calls its own version defines, so the usual cause is an extension older than
    the package, which the error alone does not say. (Notes are Python 3.11's.)"""
    from fairq import __version__

    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        add_note(f"fairq {__version__} may be newer than the fairq installed in this database:"
                 " compare with SELECT extversion FROM pg_extension WHERE extname = 'fairq'"
                 " (or run `fairq doctor`), and upgrade it: ALTER EXTENSION fairq UPDATE (a"
                 " plain install: `fairq upgrade`)")

