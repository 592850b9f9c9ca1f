"""Every SQL statement the dashboard runs, and the rows they return.

The dashboard talks to the database directly (not through ``fairq.Queue``) because it
reads views across queues and pages through them, which the binding does not offer.
Two kinds of statements live here:

- the public interface: the views ``fairq.queues``, ``fairq.channels``,
  ``fairq.dead_letters``, ``fairq.message_history`` and the pause, resume and
  dead-letter functions. An observer role (``fairq.grant_observer``) may read the views;
  the functions need the owner or explicit grants, and the database's refusal is shown;
- the internal table ``fairq.message``, for what 0.7.0 exposes in no view: the age of
  the oldest ready message, messages in flight and their lock expiry, recovered
  messages. These need SELECT on it and on fairq.channel and fairq.queue, which they
  join (the owner has it, an observer has not);
  :func:`can_read_messages` says whether to try, and the pages say when they cannot.

Timestamps of pauses may be ``'infinity'`` (paused until resumed), which psycopg
cannot load: the statements split them into a finite time and a flag. Finite times
past the year 9999 (a tenant may schedule a message for the year 20000) load as
``datetime.max`` (:mod:`fairq._timestamps`, registered on every connection).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from typing import Any

import psycopg
from psycopg.rows import class_row
from psycopg_pool import ConnectionPool

from fairq import _pools, _timestamps

__all__ = [
    "CONNECTION_OPTIONS",
    "STATEMENT_TIMEOUT_MS",
    "ChannelPage",
    "ChannelRow",
    "ChannelSort",
    "Connection",
    "DeadLetterPage",
    "DeadLetterRow",
    "HistoryBucket",
    "HistoryTotal",
    "InFlightRow",
    "Pause",
    "QueueRow",
    "RecoveredRow",
    "can_read_messages",
    "channel_page",
    "connect",
    "connection_pool",
    "dead_letter_delete",
    "dead_letter_page",
    "dead_letter_retry",
    "expiring",
    "history_buckets",
    "history_recent",
    "history_totals",
    "pause_channel",
    "pause_queue",
    "prepare_session",
    "queues",
    "recovered",
    "resume_channel",
    "resume_queue",
    "role_summary",
    "top_channels",
]

Connection = psycopg.Connection[Any]

#: The characters of a dead letter's error that its page shows (``fairq dead list`` and
#: the view show all of it).
ERROR_CHARS = 2000
#: How long any dashboard read may take: one that waits longer (for a lock an upgrade or
#: a VACUUM FULL holds) fails, and the pages and /metrics say so, instead of freezing.
STATEMENT_TIMEOUT_MS = 10_000
#: Every dashboard connection's options: a server that stops answering is given up on
#: (connect in 5 s; TCP keepalives find a dead peer in about 25 s).
CONNECTION_OPTIONS: dict[str, Any] = {
    "autocommit": True, "application_name": "fairq dashboard", "connect_timeout": 5,
    "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}


def prepare_session(conn: Connection) -> None:
    """Sets up a new connection of the dashboard (the pages', the sampler's, ``fairq
    metrics``'s)."""
    # The views' plans are estimated far above jit_above_cost (fairq.clock_offset is
    # never analyzed): JIT would add ~0.5 s to every read (see fairq.demo.database).
    conn.execute("SET jit = off")
    conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")
    conn.execute(_pools.SESSION_SETUP)  # (the actions call fairq, which needs it)
    _timestamps.register(conn)


def connect(dsn: str) -> Connection:
    """A connection of the dashboard's own (``fairq metrics --once``)."""
    conn = psycopg.connect(dsn, **CONNECTION_OPTIONS)
    prepare_session(conn)
    return conn


def connection_pool(dsn: str, max_size: int) -> ConnectionPool[Connection]:
    """The connections of a running dashboard or exporter (opened by the caller):
    at most ``max_size``, however many requests come at once; a request waits for one
    as long as a read may take, no longer (with the database down, pages answered
    after the pool's default 30 s), then fails with PoolTimeout, a psycopg.Error.

    Each connection is checked (an empty query) before it is handed out: after a
    restart or failover of the server, or a pooler's idle timeout, the pool handed
    out its dead connections, and each failed a page (500) or a scrape (fairq_up 0)
    before it was thrown away. The dashboard's requests are few: one round trip more
    each is nothing."""
    return ConnectionPool(dsn, min_size=1, max_size=max_size, open=False,
                          configure=prepare_session, kwargs=CONNECTION_OPTIONS,
                          check=ConnectionPool.check_connection,
                          timeout=STATEMENT_TIMEOUT_MS / 1000)

# A pause read back as two columns: psycopg cannot load timestamptz 'infinity'.
_PAUSE = ("CASE WHEN isfinite({col}) THEN {col} END AS paused_until,"
          " coalesce({col} = 'infinity', false) AS paused_forever")

# The oldest ready message's wait, in seconds, of one channel (id :expr): a message is
# ready when its status is 'ready', or 'scheduled' with a dequeue_at already passed
# (the view fairq.channels counts both). Both minima come from the partial indexes
# message_ready_ix and message_scheduled_ix. A message waits from when it was due,
# but not from before it existed: a producer may pass any dequeue_at, and one backdated
# to 2000 showed a wait of 26 years (and fired the falling-behind alert at will).
_OLDEST_READY = """extract(epoch FROM clock_timestamp() - LEAST(
    (SELECT min(GREATEST(m.dequeue_at, m.created_at)) FROM fairq.message m
      WHERE m.channel_id = {id} AND m.status = 'ready'),
    (SELECT min(m.dequeue_at) FROM fairq.message m
      WHERE m.channel_id = {id} AND m.status = 'scheduled'
        AND m.dequeue_at <= clock_timestamp())))::float8"""


@dataclass(frozen=True)
class Pause:
    """Until when something is paused: not (both empty), until a time, or until resumed."""

    until: datetime | None
    forever: bool

    @property
    def active(self) -> bool:
        return self.forever or self.until is not None


@dataclass(frozen=True)
class QueueRow:
    queue: str
    channels: int
    size: int
    ready: int
    scheduled: int
    in_flight: int
    dead: int
    pause: Pause
    oldest_ready_s: float | None  # None: nothing ready, or fairq.message is not readable


@dataclass(frozen=True)
class ChannelRow:
    queue: str
    channel: str
    max_concurrency: int | None
    release_interval_ms: int
    max_size: int | None
    weight: int
    pause: Pause
    size: int
    ready: int
    scheduled: int
    in_flight: int
    next_dequeue_at: datetime | None
    oldest_ready_s: float | None

    @property
    def at_cap(self) -> bool:
        return self.max_concurrency is not None and self.in_flight >= self.max_concurrency


class ChannelSort(Enum):
    """The orders of the channel table. Only ``name`` follows an index (the view's rows
    come from fairq.channel by (queue, name)): it pages by keyset, any page as cheap as
    the first. The others are computed per channel by the view (its counts are index
    lookups per channel), so they cost one pass over the queue's channels whatever the
    page, and page by offset."""

    NAME = "name"
    BACKLOG = "backlog"
    OLDEST = "oldest"
    IN_FLIGHT = "in_flight"
    RATE = "rate"
    WEIGHT = "weight"
    NEXT_TURN = "next_turn"
    PAUSED = "paused"

    @property
    def order_by(self) -> str:
        """The order over the view ``v``. Its columns are qualified: a bare name in an
        ORDER BY means the output column, and the output's paused_until is split."""
        return {
            ChannelSort.NAME: "v.channel",
            ChannelSort.BACKLOG: "v.ready DESC, v.channel",
            ChannelSort.OLDEST: "oldest_ready_s DESC NULLS LAST, v.channel",
            # Channels at their cap first (they are what "stuck" looks like), then the busiest.
            ChannelSort.IN_FLIGHT: "coalesce(v.in_flight >= v.max_concurrency, false) DESC,"
                                   " v.in_flight DESC, v.channel",
            ChannelSort.RATE: "v.release_interval_ms DESC, v.channel",
            ChannelSort.WEIGHT: "v.weight DESC, v.channel",
            ChannelSort.NEXT_TURN: "v.next_dequeue_at NULLS LAST, v.channel",
            # Paused ones first, the longest pause ('infinity': until resumed) first.
            ChannelSort.PAUSED: "v.paused_until DESC NULLS LAST, v.channel",
        }[self]


@dataclass(frozen=True)
class ChannelPage:
    rows: list[ChannelRow]
    # Keyset cursors of the name order: the name to continue after / before.
    next_after: str | None
    prev_before: str | None
    # Offset paging of the other orders.
    offset: int
    has_more: bool


@dataclass(frozen=True)
class InFlightRow:
    id: int
    queue: str
    channel: str
    num_attempts: int
    recovered: bool
    expires_in_s: float  # negative: the lock expired, the next dequeue recovers it
    first_dequeued_at: datetime | None


@dataclass(frozen=True)
class RecoveredRow:
    id: int
    queue: str
    channel: str
    num_attempts: int
    status: str  # ready | scheduled | locked (delivered again)


@dataclass(frozen=True)
class DeadLetterRow:
    id: int
    queue: str
    channel: str
    num_attempts: int
    error: str | None
    content_bytes: int
    died_at: datetime


@dataclass(frozen=True)
class DeadLetterPage:
    rows: list[DeadLetterRow]
    next_before: str | None  # cursor "died_at|id" of the next (older) page


@dataclass(frozen=True)
class HistoryBucket:
    queue: str
    start: datetime
    delivered: int  # settled messages first delivered in the bucket
    wait_avg_s: float


@dataclass(frozen=True)
class HistoryTotal:
    queue: str
    outcome: str  # completed | dead | cancelled
    messages: int
    deliveries: int  # their num_attempts summed: every delivery of them


def _one(conn: Connection, query: str, params: Sequence[object] = ()) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def can_read_messages(conn: Connection) -> bool:
    """Whether this role may read the internal tables fairq.message, fairq.channel and
    fairq.queue, which the reads of messages join (see the module doc): with the first
    alone, every page and /metrics failed."""
    return bool(_one(conn, "SELECT has_table_privilege('fairq.message', 'SELECT')"
                           " AND has_table_privilege('fairq.channel', 'SELECT')"
                           " AND has_table_privilege('fairq.queue', 'SELECT')"))


def role_summary(conn: Connection) -> tuple[str, bool]:
    """The role the dashboard runs as, and whether it may use the dashboard's actions
    (checked on dead_letter_retry, which the owner holds and an observer does not)."""
    row = conn.execute(
        "SELECT current_user::text,"
        " has_function_privilege('fairq.dead_letter_retry(bigint)', 'EXECUTE')").fetchone()
    assert row is not None
    return str(row[0]), bool(row[1])


def queues(conn: Connection, with_oldest: bool) -> list[QueueRow]:
    """Every queue (fairq.queues), with its oldest ready message's wait when readable.
    The view reads every message once, so its cost grows with the queues' contents."""
    oldest, join = "NULL::float8", ""
    if with_oldest:
        # One scan of fairq.message for every queue: no index leads with the status. A
        # paused channel's work is not behind: it waits by choice (as _OLDEST_READY).
        oldest = "extract(epoch FROM clock_timestamp() - o.oldest)::float8"
        join = ("LEFT JOIN (SELECT q.name, min(GREATEST(m.dequeue_at, m.created_at)) AS oldest"
                " FROM fairq.message m JOIN fairq.queue q ON q.id = m.queue_id"
                " JOIN fairq.channel c ON c.id = m.channel_id"
                " WHERE (m.status = 'ready'"
                " OR (m.status = 'scheduled' AND m.dequeue_at <= clock_timestamp()))"
                " AND NOT coalesce(c.paused_until > clock_timestamp(), false)"
                " GROUP BY q.name) o ON o.name = v.queue")
    query = (f"SELECT v.queue, v.channels, v.size, v.ready, v.scheduled, v.in_flight, v.dead,"
             f" {_PAUSE.format(col='v.paused_until')}, {oldest} AS oldest_ready_s"
             f" FROM fairq.queues v {join} ORDER BY v.queue")
    return [QueueRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], Pause(r[7], r[8]), r[9])
            for r in conn.execute(query)]


# The view's columns, the pause split in two (see _PAUSE).
_CHANNEL_COLUMNS = ("v.queue, v.channel, v.max_concurrency, v.release_interval_ms, v.max_size,"
                    " v.weight, " + _PAUSE.format(col="v.paused_until") +
                    ", v.size, v.ready, v.scheduled, v.in_flight,"
                    # 'infinity' for a channel paused until resumed: no turn to show.
                    " CASE WHEN isfinite(v.next_dequeue_at) THEN v.next_dequeue_at END"
                    " AS next_dequeue_at")
_ROW_COLUMNS = ("queue, channel, max_concurrency, release_interval_ms, max_size, weight,"
                " paused_until, paused_forever, size, ready, scheduled, in_flight,"
                " next_dequeue_at")
_OLDEST_OF = ("(SELECT " + _OLDEST_READY.format(id="c.id") + " FROM fairq.channel c"
              " JOIN fairq.queue q ON q.id = c.queue_id"
              " WHERE q.name = {row}.queue AND c.name = {row}.channel)")


def _row(r: Sequence[Any]) -> ChannelRow:
    return ChannelRow(r[0], r[1], r[2], r[3], r[4], r[5], Pause(r[6], r[7]), *r[8:])


def _channels(conn: Connection, where: str, order: str, window: str, with_oldest: bool,
              params: dict[str, object]) -> list[ChannelRow]:
    """Rows of fairq.channels ``v`` in ``order``, limited by ``window``; the oldest
    ready wait (which needs the channel's id: the view has only names) is computed
    for those rows only, after the limit."""
    inner = (f"SELECT {_CHANNEL_COLUMNS}, row_number() OVER (ORDER BY {order}) AS position"
             f" FROM fairq.channels v WHERE {where} ORDER BY {order} {window}")
    oldest = _OLDEST_OF.format(row="t") if with_oldest else "NULL::float8"
    query = f"SELECT {_ROW_COLUMNS}, {oldest} FROM ({inner}) t ORDER BY t.position"
    return [_row(r) for r in conn.execute(query, params)]


def channel_page(conn: Connection, queue: str, sort: ChannelSort, limit: int,
                 with_oldest: bool, *, after: str | None = None, before: str | None = None,
                 offset: int = 0) -> ChannelPage:
    """One page of a queue's channels: never every row (see :class:`ChannelSort`).
    Conditions are left out rather than written "%s IS NULL OR ...": a plan that
    psycopg prepares for a repeated statement must fit every call."""
    params: dict[str, object] = {"queue": queue, "limit": limit + 1, "offset": offset,
                                 "after": after, "before": before}
    window = "LIMIT %(limit)s"
    if sort is ChannelSort.NAME and before is not None:
        rows = _channels(conn, "v.queue = %(queue)s AND v.channel < %(before)s", "v.channel DESC",
                         window, with_oldest, params)[::-1]
        more_before = len(rows) > limit
        rows = rows[1:] if more_before else rows
        return ChannelPage(rows, rows[-1].channel if rows else None,
                           rows[0].channel if more_before and rows else None, 0, True)
    if sort is ChannelSort.NAME:
        where = "v.queue = %(queue)s" + (" AND v.channel > %(after)s" if after else "")
        rows = _channels(conn, where, "v.channel", window, with_oldest, params)
        has_more = len(rows) > limit
        rows = rows[:limit]
        return ChannelPage(rows, rows[-1].channel if has_more else None,
                           rows[0].channel if after is not None and rows else None, 0, has_more)
    window = "LIMIT %(limit)s OFFSET %(offset)s"
    if sort is ChannelSort.OLDEST:
        if not with_oldest:  # nothing to sort by without fairq.message
            return channel_page(conn, queue, ChannelSort.BACKLOG, limit, False, offset=offset)
        # The one order that needs the wait of every channel before the limit.
        query = (f"SELECT {_ROW_COLUMNS}, oldest_ready_s FROM (SELECT {_CHANNEL_COLUMNS},"
                 f" {_OLDEST_OF.format(row='v')} AS oldest_ready_s FROM fairq.channels v"
                 f" WHERE v.queue = %(queue)s ORDER BY {sort.order_by} {window}) p"
                 f" ORDER BY p.oldest_ready_s DESC NULLS LAST, p.channel")
        rows = [_row(r) for r in conn.execute(query, params)]
    else:
        rows = _channels(conn, "v.queue = %(queue)s", sort.order_by, window, with_oldest,
                         params)
    return ChannelPage(rows[:limit], None, None, offset, len(rows) > limit)


def top_channels(conn: Connection, limit: int, with_oldest: bool) -> list[ChannelRow]:
    """The ``limit`` channels of all queues with the largest ready backlog (for the
    metrics' bounded per-channel gauges): one pass over fairq.channels."""
    return _channels(conn, "true", "v.ready DESC, v.queue, v.channel", "LIMIT %(limit)s",
                     with_oldest, {"limit": limit})


#: The in-flight page's locks, the soonest expiry first; EXPLAINed by the tests. A lock is
#: found by its locked_until, not by status = 'locked' (the same messages): the partial
#: index message_locked_ix is defined by that column, and asked by the status the plan
#: read every lock of the queue (message_locked_channel_ix) to sort them for a page of 50.
EXPIRING_SQL = """
    SELECT m.id, q.name AS queue, c.name AS channel, m.num_attempts, m.recovered,
           extract(epoch FROM m.locked_until - clock_timestamp())::float8 AS expires_in_s,
           m.first_dequeued_at
      FROM fairq.queue q
     CROSS JOIN LATERAL (SELECT * FROM fairq.message m
                          WHERE m.queue_id = q.id AND m.locked_until IS NOT NULL
                          ORDER BY m.locked_until LIMIT %(limit)s) m
      JOIN fairq.channel c ON c.id = m.channel_id
     WHERE %(queue)s::text IS NULL OR q.name = %(queue)s
     ORDER BY m.locked_until, m.id LIMIT %(limit)s"""


def expiring(conn: Connection, queue: str | None, limit: int) -> list[InFlightRow]:
    """Messages in flight, the soonest lock expiry first (expired ones, not yet
    recovered, lead). Each queue's earliest come from message_locked_ix."""
    with conn.cursor(row_factory=class_row(InFlightRow)) as cur:
        cur.execute(EXPIRING_SQL, {"queue": queue, "limit": limit})
        return cur.fetchall()


#: The in-flight page's "Recovered" list; EXPLAINed by the tests.
RECOVERED_SQL = """
    SELECT m.id, q.name AS queue, c.name AS channel, m.num_attempts,
           m.status::text AS status
      FROM fairq.message m
      JOIN fairq.channel c ON c.id = m.channel_id
      JOIN fairq.queue q ON q.id = m.queue_id
     WHERE m.recovered AND (%(queue)s::text IS NULL OR q.name = %(queue)s)
     ORDER BY m.id DESC LIMIT %(limit)s"""


def recovered(conn: Connection, queue: str | None, limit: int) -> list[RecoveredRow]:
    """Messages whose previous lock expired unsettled and that came back, newest first,
    from message_recovered_ix (extension 0.7.39; before, this read fairq.message
    whole)."""
    with conn.cursor(row_factory=class_row(RecoveredRow)) as cur:
        cur.execute(RECOVERED_SQL, {"queue": queue, "limit": limit})
        return cur.fetchall()


def dead_letter_page(conn: Connection, queue: str | None, limit: int,
                     before: str | None = None) -> DeadLetterPage:
    """Dead letters, the latest death first, paged by (died_at, id) along the view's
    died_at indexes. ``before`` is the cursor a previous page returned."""
    died_at: str | None = None
    before_id: int | None = None
    if before:
        stamp, _, ident = before.partition("|")
        died_at, before_id = stamp, int(ident)
    conditions = ["true"]
    if queue is not None:
        conditions.append("queue = %(queue)s")
    if died_at is not None:
        conditions.append("(died_at, id) < (%(died_at)s::timestamptz, %(id)s)")
    query = f"""
        SELECT id, queue, channel, num_attempts,
               -- (A page of fifty 1 MB errors was 50 MB, fetched again at every refresh.)
               CASE WHEN length(error) > {ERROR_CHARS} THEN left(error, {ERROR_CHARS}) || ' …'
                    ELSE error END AS error,
               octet_length(content) AS content_bytes, died_at
          FROM fairq.dead_letters
         WHERE {" AND ".join(conditions)}
         ORDER BY died_at DESC, id DESC LIMIT %(limit)s"""
    with conn.cursor(row_factory=class_row(DeadLetterRow)) as cur:
        cur.execute(query, {"queue": queue, "died_at": died_at, "id": before_id,
                            "limit": limit + 1})
        rows = cur.fetchall()
    if len(rows) <= limit:
        return DeadLetterPage(rows, None)
    last = rows[limit - 1]
    return DeadLetterPage(rows[:limit], f"{last.died_at.isoformat()}|{last.id}")


#: The earliest first delivery settled within its parameter; EXPLAINed by the tests. The
#: bound is a scalar subquery, computed once before the scan: written against
#: clock_timestamp() (volatile) in the condition itself, it could not bound an index
#: scan, and every refresh of the chart read the whole history.
HISTORY_RECENT_SQL = """
    SELECT min(h.first_dequeued_at)
      FROM fairq.message_history h
     CROSS JOIN (SELECT (SELECT clock_timestamp() - %s) AS bound) b
     WHERE h.settled_at >= b.bound AND h.first_dequeued_at >= b.bound"""


def history_recent(conn: Connection, since: timedelta) -> datetime | None:
    """The earliest first delivery among messages settled within ``since`` (None: the
    history holds none, so it is off or idle), read along message_history_settled_at_ix."""
    earliest: datetime | None = _one(conn, HISTORY_RECENT_SQL, (since,))
    return earliest


def history_buckets(conn: Connection, start: datetime, width: timedelta) -> list[HistoryBucket]:
    """Settled messages by queue and by bucket of their first delivery since ``start``:
    how many, and their waits from creation to first delivery. A message is counted once
    settled (still in flight, it is not in the history yet)."""
    query = """
        SELECT queue, date_bin(%(width)s, first_dequeued_at, %(start)s) AS start,
               count(*) AS delivered,
               avg(extract(epoch FROM first_dequeued_at - created_at))::float8 AS wait_avg_s
          FROM fairq.message_history
         WHERE settled_at >= %(start)s AND first_dequeued_at >= %(start)s
         GROUP BY 1, 2 ORDER BY 1, 2"""
    with conn.cursor(row_factory=class_row(HistoryBucket)) as cur:
        cur.execute(query, {"start": start, "width": width})
        return cur.fetchall()


def history_totals(conn: Connection, before: datetime | None) -> list[HistoryTotal]:
    """Settled messages per queue and outcome, of the whole history or settled before
    ``before``."""
    query = """
        SELECT queue, outcome, count(*) AS messages, coalesce(sum(num_attempts), 0) AS deliveries
          FROM fairq.message_history""" + (" WHERE settled_at < %(before)s" if before else "") + """
         GROUP BY 1, 2 ORDER BY 1, 2"""
    with conn.cursor(row_factory=class_row(HistoryTotal)) as cur:
        cur.execute(query, {"before": before})
        return cur.fetchall()


# The actions: each one call of fairq's own functions, as the dashboard's role.

def dead_letter_retry(conn: Connection, message_id: int) -> str:
    return str(_one(conn, "SELECT fairq.dead_letter_retry(%s)", (message_id,)))


def dead_letter_delete(conn: Connection, message_id: int) -> str:
    return str(_one(conn, "SELECT fairq.dead_letter_delete(%s)", (message_id,)))


# A pause of ``seconds`` from the database's clock, or until resumed (None).
_UNTIL = "CASE WHEN %(seconds)s::float8 IS NULL THEN 'infinity'::timestamptz" \
         " ELSE clock_timestamp() + make_interval(secs => %(seconds)s::float8) END"


def pause_channel(conn: Connection, queue: str, channel: str, seconds: float | None) -> None:
    conn.execute(f"SELECT fairq.channel_pause(%(channel)s, {_UNTIL}, %(queue)s)",
                 {"channel": channel, "queue": queue, "seconds": seconds})


def resume_channel(conn: Connection, queue: str, channel: str) -> bool:
    return bool(_one(conn, "SELECT fairq.channel_resume(%s, %s)", (channel, queue)))


def pause_queue(conn: Connection, queue: str, seconds: float | None) -> None:
    conn.execute(f"SELECT fairq.queue_pause(%(queue)s, {_UNTIL})",
                 {"queue": queue, "seconds": seconds})


def resume_queue(conn: Connection, queue: str) -> bool:
    return bool(_one(conn, "SELECT fairq.queue_resume(%s)", (queue,)))
