"""The dashboard's SQL (fairq.dashboard.queries, sampler): paging walks every channel
once in both directions, every order is the order it claims, the counters of the
history miss no late commit and count nothing twice, and the channel page's cost
with 100,000 channels (printed, not asserted: the machine is shared)."""

from __future__ import annotations

import time
import urllib.request
from datetime import timedelta
from typing import Any

import psycopg
import pytest

pytest.importorskip("starlette")
from fairq.dashboard import queries as q
from fairq.dashboard.app import Settings
from fairq.dashboard.sampler import SettledCounters
from fairq.dashboard.server import start as serve


def make_channels(conn: psycopg.Connection[Any], count: int, queue: str = "default",
                  spread: int = 7, batch: int = 1000) -> None:
    """``count`` channels tenant-000001.. with 1, 2, ... ``spread`` messages, in turn."""
    for n, start in enumerate(range(1, count + 1, batch)):
        # Fresh tables keep their empty-table plans until analyzed: each batch would get
        # slower until autovacuum comes by (~20 s here for 50,000 channels).
        if n % 10 == 9:
            conn.execute("ANALYZE fairq.channel, fairq.message, fairq.channel_wake")
        conn.execute(
            "SELECT count(*) FROM fairq.message_create_batch("
            " (SELECT array_agg('tenant-' || lpad(i::text, 6, '0')) FROM generate_series(%s::int, %s::int) i"
            "   CROSS JOIN LATERAL generate_series(0, i %% %s) k),"
            " (SELECT array_agg('x'::bytea) FROM generate_series(%s::int, %s::int) i"
            "   CROSS JOIN LATERAL generate_series(0, i %% %s) k), p_queue => %s)",
            (start, min(count, start + batch - 1), spread, start, min(count, start + batch - 1),
             spread, queue))


def test_name_paging_walks_every_channel_once_both_ways(conn: psycopg.Connection[Any]) -> None:
    make_channels(conn, 123)
    conn.execute("SELECT fairq.channel_set('zz-policy-only')")  # shown: it has a policy
    everything = [r[0] for r in conn.execute(
        "SELECT channel FROM fairq.channels WHERE queue = 'default' ORDER BY channel")]
    assert len(everything) == 124
    seen: list[str] = []
    pages = []
    page = q.channel_page(conn, "default", q.ChannelSort.NAME, 50, True)
    for _ in range(5):  # three pages, and a bound should the cursor not move
        pages.append(page)
        seen += [r.channel for r in page.rows]
        if page.next_after is None:
            break
        page = q.channel_page(conn, "default", q.ChannelSort.NAME, 50, True,
                              after=page.next_after)
    assert seen == everything and [len(p.rows) for p in pages] == [50, 50, 24]
    # Back from the last page: the same pages, in reverse.
    back = q.channel_page(conn, "default", q.ChannelSort.NAME, 50, True,
                          before=pages[-1].prev_before)
    assert [r.channel for r in back.rows] == [r.channel for r in pages[1].rows]
    first = q.channel_page(conn, "default", q.ChannelSort.NAME, 50, True,
                           before=back.prev_before)
    assert [r.channel for r in first.rows] == everything[:50] and first.prev_before is None


@pytest.mark.parametrize("sort", [s for s in q.ChannelSort if s is not q.ChannelSort.NAME])
def test_every_order_is_what_it_says(conn: psycopg.Connection[Any], sort: q.ChannelSort) -> None:
    make_channels(conn, 40)
    conn.execute("SELECT fairq.channel_set('tenant-000003', p_max_concurrency => 1,"
                 " p_release_interval_ms => 500, p_weight => 7)")
    conn.execute("SELECT fairq.channel_set('tenant-000009', p_weight => 3)")
    # Some in flight, until tenant-000003 is at its cap (turns decide when it is served).
    for _ in range(40):
        conn.execute("SELECT fairq.message_dequeue(60000, 1)")
        if conn.execute("SELECT in_flight FROM fairq.channels"
                        " WHERE channel = 'tenant-000003'").fetchone() == (1,):
            break
    conn.execute("SELECT fairq.channel_pause('tenant-000011')")
    conn.execute("SELECT fairq.channel_pause('tenant-000012', clock_timestamp() + interval '1 h')")
    rows = []
    offset = 0
    for _ in range(5):  # three pages, and a bound should the offset not move
        page = q.channel_page(conn, "default", sort, 15, True, offset=offset)
        rows += page.rows
        if not page.has_more:
            break
        offset += 15
    assert sorted(r.channel for r in rows) == [f"tenant-{i:06d}" for i in range(1, 41)]
    key = {
        q.ChannelSort.BACKLOG: lambda r: (-r.ready, r.channel),
        q.ChannelSort.OLDEST: lambda r: (-(r.oldest_ready_s or -1), r.channel),
        q.ChannelSort.IN_FLIGHT: lambda r: (not r.at_cap, -r.in_flight, r.channel),
        q.ChannelSort.RATE: lambda r: (-r.release_interval_ms, r.channel),
        q.ChannelSort.WEIGHT: lambda r: (-r.weight, r.channel),
        # Paused until resumed: the view's next turn is 'infinity', after every time.
        q.ChannelSort.NEXT_TURN: lambda r: (
            (0, r.next_dequeue_at.timestamp()) if r.next_dequeue_at
            else (1, 0.0) if r.pause.forever else (2, 0.0), r.channel),
        q.ChannelSort.PAUSED: lambda r: (not r.pause.forever, r.pause.until is None,
                                         -(r.pause.until.timestamp() if r.pause.until else 0),
                                         r.channel),
    }[sort]
    if sort is q.ChannelSort.OLDEST:
        # Waits are read per page, moments apart: compare each page's own order.
        for start in range(0, len(rows), 15):
            chunk = rows[start:start + 15]
            assert chunk == sorted(chunk, key=key)
    else:
        assert rows == sorted(rows, key=key)
    if sort is q.ChannelSort.IN_FLIGHT:
        assert rows[0].channel == "tenant-000003" and rows[0].at_cap, rows[:3]
    if sort is q.ChannelSort.PAUSED:
        assert [r.channel for r in rows[:2]] == ["tenant-000011", "tenant-000012"]
        assert rows[0].pause.forever and rows[1].pause.until is not None


def test_without_fairq_message_nothing_reads_it(conn: psycopg.Connection[Any]) -> None:
    make_channels(conn, 5)
    page = q.channel_page(conn, "default", q.ChannelSort.OLDEST, 10, False)
    assert [r.oldest_ready_s for r in page.rows] == [None] * 5
    assert [r.ready for r in page.rows] == sorted((r.ready for r in page.rows), reverse=True)
    assert [r.oldest_ready_s for r in q.queues(conn, with_oldest=False)] == [None]


def settle(dsn: str, count: int, fail: bool = False) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET fairq.history = on")
        call = "message_fail" if fail else "message_complete"
        conn.execute(f"SELECT fairq.{call}(id, num_attempts)"  # type: ignore[arg-type]
                     f" FROM fairq.message_dequeue(60000, %s)", (count,))


def truth(conn: psycopg.Connection[Any]) -> dict[tuple[str, str], tuple[int, int]]:
    return {(r[0], r[1]): (int(r[2]), int(r[3])) for r in conn.execute(
        "SELECT queue, outcome, count(*), sum(num_attempts) FROM fairq.message_history"
        " GROUP BY 1, 2")}


def counted(counters: SettledCounters) -> dict[tuple[str, str], tuple[int, int]]:
    return {k: (t.messages, t.deliveries) for k, t in counters.totals.items()}


def now(conn: psycopg.Connection[Any]) -> Any:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]


def test_counters_count_late_commits_once(dsn: str, conn: psycopg.Connection[Any]) -> None:
    make_channels(conn, 30)
    settle(dsn, 10)
    counters = SettledCounters(overlap=timedelta(seconds=60))
    counters.update(conn, now(conn))
    assert counted(counters) == truth(conn)
    # Completions whose transaction commits after a read that came later than their
    # settled_at (30 s earlier, on the clock of that transaction alone): the next read
    # still counts them (the overlap), and only once.
    with psycopg.connect(dsn) as late:
        late.execute("SET fairq.history = on")
        late.execute("SELECT fairq.clock_travel(-30000)")
        late.execute("SELECT fairq.message_complete(id, num_attempts)"
                     " FROM fairq.message_dequeue(60000, 3)")
        late.execute("SELECT fairq.clock_travel(0)")
        settle(dsn, 4, fail=True)
        counters.update(conn, now(conn))
        assert counted(counters) == truth(conn)  # without the late three: not committed
        late.commit()
    counters.update(conn, now(conn))
    counters.update(conn, now(conn))
    assert counted(counters) == truth(conn)
    assert sum(m for m, _ in counted(counters).values()) == 17


def test_counters_start_from_the_whole_history(dsn: str, conn: psycopg.Connection[Any]) -> None:
    make_channels(conn, 20)
    settle(dsn, 12)
    conn.execute("SELECT fairq.clock_travel(3600000)")  # an hour later: all of it is old
    counters = SettledCounters(overlap=timedelta(seconds=60))
    counters.update(conn, now(conn))
    conn.execute("SELECT fairq.clock_travel(0)")
    assert counted(counters) == truth(conn) == {("default", "completed"): (12, 12)}


def test_channel_page_with_100000_channels(dsn: str, conn: psycopg.Connection[Any],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The figure the issue asks for, printed into the test log (-s not needed): the
    page's query, and the whole answer of a running dashboard over HTTP."""
    make_channels(conn, 100_000, queue="big", spread=1)
    conn.execute("ANALYZE")
    conn.execute("SET jit = off")  # as the dashboard's sessions do
    timings = {}
    for label, kwargs in (("first page", {}), ("a page deep in", {"after": "tenant-090000"})):
        started = time.perf_counter()
        page = q.channel_page(conn, "big", q.ChannelSort.NAME, 50, True, **kwargs)
        timings[label] = (time.perf_counter() - started) * 1000
        assert len(page.rows) == 50 and all(r.oldest_ready_s is not None for r in page.rows)
    started = time.perf_counter()
    q.channel_page(conn, "big", q.ChannelSort.BACKLOG, 50, True)
    timings["sorted by backlog (one pass over the view)"] = (time.perf_counter() - started) * 1000
    started = time.perf_counter()
    rows = q.queues(conn, with_oldest=True)
    timings["fairq.queues (the queues page's sample)"] = (time.perf_counter() - started) * 1000
    assert [(r.queue, r.channels) for r in rows] == [("big", 100_000)]
    running = serve(Settings(dsn, interval=timedelta(minutes=5)))
    try:
        for label, path in (("HTTP first page", "/channels?queue=big"),
                            ("HTTP a page deep in", "/channels?queue=big&after=tenant-090000")):
            started = time.perf_counter()
            with urllib.request.urlopen(running.url.rstrip("/") + path) as response:
                body = response.read().decode()
            timings[label] = (time.perf_counter() - started) * 1000
            assert body.count('<tr data-channel="') == 50
    finally:
        running.stop()
    with capsys.disabled():
        print("\n[dashboard] 100,000 channels in one queue: " + "; ".join(
            f"{label} {ms:.0f} ms" for label, ms in timings.items()))


def test_recovered_messages_are_found_without_reading_every_message(
        conn: psycopg.Connection[Any]) -> None:
    """The in-flight page's "Recovered" list read all of fairq.message to find the few
    messages whose lock had expired (no index held the flag; since 0.7.39 one does)."""
    make_channels(conn, 2_000, queue="big", spread=20)
    conn.execute("SELECT fairq.message_dequeue(1, 3, p_queue => 'big')")
    conn.execute("SELECT fairq.clock_travel(1000)")
    conn.execute("SELECT fairq.message_dequeue(1, 3, p_queue => 'big')")  # recovers the 3
    conn.execute("SELECT fairq.clock_travel(0)")
    conn.execute("ANALYZE fairq.message")
    rows = q.recovered(conn, "big", 50)
    assert len(rows) == 3 and [r.id for r in rows] == sorted((r.id for r in rows), reverse=True)
    plan = "\n".join(r[0] for r in conn.execute(
        "EXPLAIN " + q.RECOVERED_SQL, {"queue": "big", "limit": 50}))
    assert "message_recovered_ix" in plan and "Seq Scan" not in plan, plan


def plan_of(conn: psycopg.Connection[Any], query: str,
            params: dict[str, object] | tuple[object, ...]) -> str:
    """The plan of ``query`` with sequential scans priced out: what an index can serve,
    it serves (a small test table would otherwise be read whole, rightly)."""
    conn.execute("SET enable_seqscan = off")
    try:
        return "\n".join(str(r[0]) for r in conn.execute("EXPLAIN " + query, params))
    finally:
        conn.execute("RESET enable_seqscan")


def test_expiring_locks_are_read_in_expiry_order_from_the_index(
        conn: psycopg.Connection[Any]) -> None:
    """The in-flight page's locks: asked by status, the query read every lock of the
    queue (message_locked_channel_ix) and sorted them all for a page of 50 (10,000 in
    flight: 937 buffers a refresh); by locked_until, message_locked_ix hands out the
    soonest first."""
    make_channels(conn, 300, queue="big")
    conn.execute("SELECT count(*) FROM fairq.message_dequeue(60000, 100, p_queue => 'big')")
    conn.execute("SELECT count(*) FROM fairq.message_dequeue(1000, 5, p_queue => 'big')")
    conn.execute("ANALYZE fairq.message")
    rows = q.expiring(conn, "big", 10)
    # (Each row's expires_in_s is taken as it is read: compare which locks, not values.)
    assert [r.expires_in_s < 2 for r in rows] == [True] * 5 + [False] * 5
    plan = plan_of(conn, q.EXPIRING_SQL, {"queue": "big", "limit": 50})
    assert "message_locked_ix" in plan and "message_locked_channel_ix" not in plan, plan


def test_recent_history_is_read_from_the_settled_at_index(conn: psycopg.Connection[Any]) -> None:
    """The chart's first question, whether the last hour holds settled messages, read
    the whole history at every refresh (1,000,000 rows: 49 ms, 13,000 buffers): its
    bound was written against clock_timestamp(), which no index scan can take."""
    start = now(conn)
    conn.execute(
        "INSERT INTO fairq.message_history (id, queue, channel, priority, created_at,"
        " first_dequeued_at, settled_at, num_attempts, outcome)"
        " SELECT g, 'default', 'c', 0, %(start)s - g * interval '1 min' - interval '2 s',"
        "        %(start)s - g * interval '1 min' - interval '1 s',"
        "        %(start)s - g * interval '1 min', 1, 'completed'"
        "   FROM generate_series(1, 2000) g", {"start": start})
    conn.execute("ANALYZE fairq.message_history")
    # Settled 1 to 29 minutes before start: those within the last 30 minutes.
    assert q.history_recent(conn, timedelta(minutes=30)) == start - timedelta(minutes=29, seconds=1)
    plan = plan_of(conn, q.HISTORY_RECENT_SQL, (timedelta(hours=1),))
    assert "message_history_settled_at_ix" in plan and "Index Cond: (settled_at >=" in plan, plan
