"""Index lookups only (SPEC §2.6): every statement a dequeue or a settlement runs is
served by index scans, with 100k messages queued in 10k channels.

The plans are the real ones: auto_explain logs each statement nested inside the
fairq functions (as NOTICEs to this session), so the test reads what PostgreSQL
actually executed, not a hand-copied query.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from datetime import timedelta

import psycopg
import pytest

from conftest import Server
from sqlq import Conn, call, create, dequeue, dequeue_one, travel

SCAN = re.compile(r"\b(Seq Scan|Bitmap Heap Scan|Index Scan|Index Only Scan)\b(?: Backward)?(?: using \S+)? on (\S+)")


@pytest.fixture(scope="module")
def loaded_dsn(server: Server) -> Iterator[str]:
    """One database for the module: loading 100k messages takes a while."""
    name = server.create_database()
    with psycopg.connect(server.dsn(name), autocommit=True) as conn:
        conn.execute("SET fairq.events = off")
        for chunk in range(10):
            conn.execute(
                "SELECT fairq.message_create_batch(array_agg('tenant-' || (i %% 10000)),"
                " array_agg('x'::bytea), NULL, array_agg(i %% 3))"
                " FROM generate_series(%s::int, %s::int) AS i", (chunk * 10_000, chunk * 10_000 + 9_999)
            )
        conn.execute("ANALYZE")
    try:
        yield server.dsn(name)
    finally:
        server.drop_database(name)


@pytest.fixture
def loaded(loaded_dsn: str) -> Iterator[Conn]:
    with psycopg.connect(loaded_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM fairq.message").fetchone()[0] >= 99_000  # type: ignore[index]
        yield conn


def plans_of(conn: Conn, sql: str, params: tuple[object, ...] = ()) -> list[str]:
    """Runs sql with auto_explain on and returns the plan of every nested statement."""
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    conn.execute("LOAD 'auto_explain'")
    conn.execute("SET auto_explain.log_min_duration = 0")
    conn.execute("SET auto_explain.log_nested_statements = on")
    conn.execute("SET auto_explain.log_level = notice")
    try:
        conn.execute(sql, params)  # type: ignore[arg-type]
    finally:
        conn.execute("SET auto_explain.log_min_duration = -1")
    return [n for n in notices if "Query Text" in n or "Scan" in n]


def scans(plans: list[str]) -> list[tuple[str, str]]:
    return [(kind, table) for plan in plans for kind, table in SCAN.findall(plan)]


QUEUE_TABLES = ("channel", "message", "channel_size", "dead_letter")


# PostgreSQL 18 prints actual rows with two decimals.
ACTUAL_ROWS = re.compile(r"\(actual time=[\d.]+\.\.[\d.]+ rows=([\d.]+) loops=(\d+)\)")


REMOVED = re.compile(r"Rows Removed by (?:Filter|Index Recheck): (\d+)")


def rows_read(plans: list[str]) -> list[tuple[str, float]]:
    """Each scan of a queue table or of one of its indexes in plans logged with
    log_analyze, with the rows it read over all its loops (those it returned and
    those its filter threw away)."""
    out: list[tuple[str, float]] = []
    for plan in plans:
        node: tuple[str, float, int] | None = None  # the scan being read: line, rows, loops
        for line in [*plan.splitlines(), "(cost=)"]:
            if "(cost=" in line:  # a plan node begins: the scan before it has ended
                if node:
                    out.append((node[0], node[1] * node[2]))
                m, r = SCAN.search(line), ACTUAL_ROWS.search(line)
                node = ((line.strip(), float(r.group(1)), int(r.group(2)))
                        if m and r and m.group(2).split(".")[-1].startswith(QUEUE_TABLES) else None)
            elif node and (removed := REMOVED.search(line)):
                node = (node[0], node[1] + int(removed.group(1)), node[2])
    return out


def full_index_scans(plan: str) -> list[str]:
    """Index scans of a queue table that read the whole index (no Index Cond)."""
    nodes = re.split(r"\n(?=\s*->)", plan)
    return [node.splitlines()[0].strip() for node in nodes
            if (m := SCAN.search(node.splitlines()[0])) and m.group(1).startswith("Index")
            and m.group(2).split(".")[-1] in QUEUE_TABLES and "Index Cond:" not in node]


def assert_index_only(plans: list[str]) -> None:
    found = scans(plans)
    assert found, "auto_explain reported no scans"
    # A bitmap heap scan is fed by a bitmap index scan with its Index Cond: a lookup.
    bad = [(kind, table) for kind, table in found
           if kind == "Seq Scan" and table.split(".")[-1] in QUEUE_TABLES]
    assert not bad, "\n\n".join(p for p in plans if "Seq Scan" in p)
    whole = [p for p in plans if full_index_scans(p)]
    assert not whole, "\n\n".join(whole)


def test_dequeue_uses_index_scans_only(loaded: Conn) -> None:
    plans = plans_of(loaded, "SELECT * FROM fairq.message_dequeue(30000, 10)")
    assert_index_only(plans)
    text = "\n".join(plans)
    assert "channel_turn_ix" in text and "message_ready_ix" in text and "message_locked_ix" in text


def test_settlements_use_index_scans_only(loaded: Conn) -> None:
    got = dequeue(loaded, n=4)
    a, b, c, d = got
    assert_index_only(plans_of(loaded, "SELECT fairq.message_complete(%s, %s)", (a.id, a.num_attempts)))
    assert_index_only(plans_of(loaded, "SELECT fairq.message_defer(%s, %s)", (b.id, b.num_attempts)))
    assert_index_only(plans_of(loaded, "SELECT fairq.message_heartbeat(%s, %s, 1000)", (c.id, c.num_attempts)))
    assert_index_only(plans_of(loaded, "SELECT fairq.message_fail(%s, %s)", (d.id, d.num_attempts)))


def test_create_and_cancel_use_index_scans_only(loaded: Conn) -> None:
    assert_index_only(plans_of(loaded, "SELECT * FROM fairq.message_create('tenant-7', 'y', p_dedup_key => 'k')"))
    assert_index_only(plans_of(loaded, "SELECT * FROM fairq.message_create('brand-new', 'y')"))
    mid, _ = create(loaded, "tenant-8", b"z")
    assert_index_only(plans_of(loaded, "SELECT fairq.message_cancel(%s)", (mid,)))


def test_recovery_and_scheduled_promotion_use_index_scans_only(loaded: Conn) -> None:
    call(loaded, "channel_set", "tenant-1", None, 0, 100000, 5)
    dequeue(loaded, lock_ms=10, n=20)
    loaded.execute("SELECT fairq.message_create('tenant-2', 'later', fairq.clock() + interval '1 second')")
    travel(loaded, 5_000)
    plans = plans_of(loaded, "SELECT * FROM fairq.message_dequeue(30000, 20)")
    assert_index_only(plans)
    assert dequeue_one(loaded) is not None


def test_a_flood_of_due_messages_is_promoted_by_lookups(loaded: Conn) -> None:
    """More of a channel's scheduled messages due than a serve promotes: the best of
    them by priority come from message_scheduled_priority_ix, not from reading every
    due message (which each serve of the flooded channel would do again)."""
    loaded.execute(
        "SELECT fairq.message_create_batch(array_fill('flood'::text, ARRAY[3000]),"
        " array_fill('x'::bytea, ARRAY[3000]),"
        " array_agg(fairq.clock() + interval '1 second' + i * interval '1 ms'),"
        " array_agg(i % 3), NULL, 'flood') FROM generate_series(1, 3000) AS i")
    travel(loaded, 10_000)
    plans = plans_of(loaded, "SELECT * FROM fairq.message_dequeue(30000, 1, 'flood')")
    assert_index_only(plans)
    assert any("message_scheduled_priority_ix" in plan for plan in plans), "\n\n".join(plans)


# The queue the plan checks below plan on (five channels of a message each), and the
# one they then run on (40,000 messages over 2,000 more channels).
SMALL_QUEUE = "SELECT fairq.message_create('t-' || i, 'x') FROM generate_series(100, 104) i"
DEEP_QUEUE = ("SELECT fairq.message_create_batch(array_agg('t-' || (i % 2000)),"
              " array_agg('x'::bytea), NULL, NULL, array_agg('key-' || i))"
              " FROM generate_series(1, 40000) AS i")


@contextlib.contextmanager
def planned_small(server: Server, *tables: str) -> Iterator[tuple[Conn, Conn]]:
    """A new database and two sessions on it: conn, whose plans are generic (as a
    session's are after five calls) and are never made again (autovacuum, whose
    ANALYZE would have them made again, is off for ``tables``), and filler, which
    fills the tables once conn has made its plans on a few rows."""
    name = server.create_database()
    try:
        with psycopg.connect(server.dsn(name), autocommit=True) as conn, \
                psycopg.connect(server.dsn(name), autocommit=True) as filler:
            for table in tables:
                conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
            conn.execute("SET fairq.events = off")
            conn.execute("SET plan_cache_mode = force_generic_plan")
            yield conn, filler
    finally:
        server.drop_database(name)


def analyze_from_now(conn: Conn) -> None:
    """plans_of logs the rows each node read from here on."""
    conn.execute("LOAD 'auto_explain'")
    conn.execute("SET auto_explain.log_analyze = on")


def test_plans_cached_while_the_queue_was_empty_stay_index_lookups(server: Server) -> None:
    """The queue calls plan each statement once per session (plan_cache_mode =
    force_generic_plan). A plan made while the tables were empty must not read a
    whole table or index once the queue is deep."""
    with planned_small(server, "fairq.message", "fairq.channel") as (conn, filler):
        filler.execute(SMALL_QUEUE)

        def every_call() -> list[list[str]]:
            plans = [
                plans_of(conn, "SELECT * FROM fairq.message_create_batch("
                               "ARRAY['t-1', 't-2', 't-1', 't-5', 't-6', 't-7', 't-8', 't-9'],"
                               " array_fill('a'::bytea, ARRAY[8]), NULL, NULL,"
                               " ARRAY['k1', 'k2', 'k3', 'k5', 'k6', 'k7', 'k8', 'k9'])"),
                plans_of(conn, "SELECT * FROM fairq.message_create('t-3', 'd', p_dedup_key => 'k4')"),
                plans_of(conn, "SELECT * FROM fairq.message_dequeue(30000, 3)")]
            got = dequeue(conn, n=6)
            a, b, c, d, e, f = got
            plans += [
                plans_of(conn, "SELECT * FROM fairq.message_complete_batch(%s, %s)",
                         ([a.id, b.id], [a.num_attempts, b.num_attempts])),
                plans_of(conn, "SELECT fairq.message_complete(%s, %s)", (f.id, f.num_attempts)),
                plans_of(conn, "SELECT fairq.message_defer(%s, %s)", (c.id, c.num_attempts)),
                plans_of(conn, "SELECT fairq.message_heartbeat(%s, %s, 1000)", (d.id, d.num_attempts)),
                plans_of(conn, "SELECT fairq.message_fail(%s, %s)", (e.id, e.num_attempts)),
                plans_of(conn, "SELECT fairq.dead_letter_retry(%s)", (e.id,))]
            mid, _ = create(conn, "t-4", b"z")
            plans.append(plans_of(conn, "SELECT fairq.message_cancel(%s)", (mid,)))
            return plans

        every_call()  # plans made on a queue of a few messages
        filler.execute(DEEP_QUEUE)
        analyze_from_now(conn)
        for plans in every_call():  # the same plans, on a deep queue
            assert_index_only(plans)
            # An index scan keyed by the queue alone is a lookup that reads every
            # channel: 0.7.12's producers found missing names so (a merge anti-join
            # planned on the empty table), and one transaction making n new
            # channels took time in n². Each call here touches a few rows.
            read = rows_read(plans)
            assert read, "\n\n".join(plans)
            assert max(n for _, n in read) <= 12, [x for x in read if x[1] > 12]


def test_a_lone_join_finds_its_place_in_a_long_rotation_by_lookups(server: Server) -> None:
    """A dequeue of one that lets one channel join, as in the sparse steady state,
    places it by the rotation's front and back. Planned while 2,000 channels waited
    to join and none was in the rotation (as a worker's session starting on a
    prefilled, analyzed queue plans it), those lookups must still read an entry or two
    once the 2,000 are in the rotation. 0.7.24's read the whole rotation and sorted
    it, through the index of when places were given: at the bench's 10,000-tenant
    level, some 5,000 entries (and as many heap fetches) a dequeue."""
    with planned_small(server, "fairq.message", "fairq.channel") as (conn, filler):
        filler.execute(DEEP_QUEUE)
        filler.execute("ANALYZE fairq.channel")
        names = iter(range(4))

        def lone_joins() -> list[list[str]]:
            # Made after every place was given: it joins at the back.
            create(conn, f"new-{next(names)}")
            plans = [plans_of(conn, "SELECT count(*) FROM fairq.message_dequeue(30000, 1)")]
            # Made before a serve gave a place, seen after it: it joins ahead of that
            # channel, and whether that is the front decides whether it is served first.
            filler.execute("BEGIN")
            create(filler, f"late-{next(names)}")
            assert len(dequeue(conn)) == 1
            filler.execute("COMMIT")
            plans.append(plans_of(conn, "SELECT count(*) FROM fairq.message_dequeue(30000, 1)"))
            return plans

        lone_joins()  # planned with every channel waiting to join
        for _ in range(2):  # the 2,000 join the rotation, and stay: each has more
            dequeue(conn, n=1000)
        assert conn.execute("SELECT count(*) FROM fairq.channel"
                            " WHERE turn_at = '-infinity'").fetchone()[0] > 1900  # type: ignore[index]
        analyze_from_now(conn)
        for plans in lone_joins():
            assert any("after_pass" in p for p in plans), "\n\n".join(plans)
            read = rows_read(plans)
            assert max(n for _, n in read) <= 12, [x for x in read if x[1] > 12]


HEAP_FETCHES = re.compile(r"Heap Fetches: (\d+)")


def test_channels_joining_together_walk_the_places_given_since_once(dsn: str, conn: Conn) -> None:
    """A dequeue that lets many channels join places each just ahead of the first
    channel given its place after its turn. Under load, the places given since are
    mostly dead entries of channels served since (vacuum has not removed them, and
    while older snapshots run no scan may skip them): at the bench's batched
    10,000-tenant level a lookup walked some 100. 0.7.25 looked up every joining
    channel's place on its own, walking the same entries each time (10,000 heap
    fetches for a call of 100); the lookups now go on from each other's places."""
    joiners, rotation = 50, 200
    for i in range(joiners):  # tenants that will come back: idle, kept
        create(conn, f"back-{i}")
    while got := dequeue(conn, n=joiners):
        for d in got:
            call(conn, "message_complete", d.id, d.num_attempts)
    for i in range(rotation):  # busy tenants: they stay in the rotation
        for _ in range(4):
            create(conn, f"busy-{i}")
    assert len(dequeue(conn, n=rotation)) == rotation
    with psycopg.connect(dsn, autocommit=True) as producer, \
            psycopg.connect(dsn, autocommit=True) as reader:
        # The tenants come back in a transaction that commits after two more rounds:
        # each round gives the busy channels new places, after the wakes' time.
        producer.execute("BEGIN")
        for i in range(joiners):
            create(producer, f"back-{i}")
        assert len(dequeue(conn, n=rotation)) == rotation
        # A snapshot older than the next round: its dead places stay in the index.
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT count(*) FROM fairq.channel")
        assert len(dequeue(conn, n=rotation)) == rotation
        producer.execute("COMMIT")
        analyze_from_now(conn)
        conn.execute("SET auto_explain.log_buffers = on")
        plans = plans_of(conn, "SELECT count(*) FROM fairq.message_dequeue(30000, %s)", (joiners,))
        reader.execute("COMMIT")
    joins = [p for p in plans if "back_rank" in p]
    assert len(joins) == 1, "\n\n".join(plans)
    # The dead places (one per busy channel) walked once, not once per joining channel.
    fetches = sum(int(n) for n in HEAP_FETCHES.findall(joins[0]))
    assert fetches <= 2 * rotation + 2 * joiners, joins[0]
    # Their places came before every busy channel's (given after their wakes): the
    # call served them.
    served = conn.execute("SELECT count(*) FROM fairq.message m JOIN fairq.channel c"
                          " ON c.id = m.channel_id WHERE c.name LIKE 'back-%%'"
                          " AND m.status = 'locked'").fetchone()
    assert served == (joiners,)


def test_bulk_policy_and_wide_calls_planned_on_a_small_queue_stay_lookups(server: Server) -> None:
    """The calls the test above leaves out: a bulk producer (500 new channels, 300
    existing ones), policy and pause calls, queue pauses, a dead-letter purge and a
    dequeue of 50 that joins woken channels. Planned on a queue of a few channels and
    run on one of 3,000, no scan reads more than the call's own rows. (0.7.13 read
    every channel of the table to apply the wakes of the channels a dequeue or a
    policy call joined.)"""
    with planned_small(server, "fairq.message", "fairq.channel") as (conn, filler):
        filler.execute(SMALL_QUEUE)
        rounds = iter(range(2))

        def every_call() -> list[list[str]]:
            new = f"bulk{next(rounds)}-"
            return [plans_of(conn, sql, params) for sql, params in [
                ("SELECT count(*) FROM fairq.message_create_batch(%s, %s)",
                 ([f"{new}{i}" for i in range(500)], [b"x"] * 500)),
                ("SELECT count(*) FROM fairq.message_create_batch(%s, %s)",
                 ([f"t-{i}" for i in range(300)], [b"x"] * 300)),
                ("SELECT fairq.channel_set('t-7', p_max_concurrency => 3)", ()),
                ("SELECT fairq.channel_pause('t-8')", ()),
                ("SELECT fairq.channel_resume('t-8')", ()),
                ("SELECT fairq.channel_clear('t-7')", ()),
                ("SELECT fairq.queue_pause('default')", ()),
                ("SELECT fairq.queue_resume('default')", ()),
                ("SELECT fairq.dead_letter_purge(fairq.clock())", ()),
                ("SELECT count(*) FROM fairq.message_dequeue(30000, 50)", ()),
            ]]

        every_call()  # plans made on a queue of a few messages
        filler.execute(DEEP_QUEUE)
        analyze_from_now(conn)
        for plans in every_call():  # the same plans, on 3,000 channels
            read = rows_read(plans)
            assert max((n for _, n in read), default=0) <= 600, [x for x in read if x[1] > 600]
        assert conn.execute("SELECT count(*) FROM fairq.channel").fetchone() == (3000,)


def test_operator_deletes_planned_on_small_tables_stay_lookups(server: Server) -> None:
    """An operator's session that deleted a dead letter, pruned the history and
    purged old dead letters while those tables were small keeps its plans: once they
    hold 40,000 rows each, the same calls still read only the rows they delete.
    (0.7.15's prune and purges kept the sequential scans made on five rows: one that
    deleted nothing read all 40,000.)"""
    dead = ("INSERT INTO fairq.dead_letter (id, channel, priority, content, num_attempts, created_at,"
            " died_at, queue) SELECT i, 'c-' || (i %% 100), 0, 'x', 1, now(),"
            " now() + i * interval '1 ms', 'default' FROM generate_series(%s::bigint, %s::bigint) i")
    history = ("INSERT INTO fairq.message_history (id, queue, channel, priority, created_at, settled_at,"
               " num_attempts, outcome) SELECT i, 'default', 'c-' || (i %% 100), 0, now(),"
               " now() + i * interval '1 ms', 1, 'completed' FROM generate_series(%s::bigint, %s::bigint) i")
    with planned_small(server, "fairq.dead_letter", "fairq.message_history") as (conn, filler):
        filler.execute(dead, (1, 5))
        filler.execute(history, (1, 5))
        ids = iter(range(1, 4))

        def every_call() -> list[list[str]]:
            return [plans_of(conn, sql, params) for sql, params in [
                ("SELECT fairq.dead_letter_delete(%s)", (next(ids),)),
                ("SELECT fairq.history_prune(now() - interval '1 day')", ()),
                ("SELECT fairq.dead_letter_purge(now() - interval '1 day')", ()),
                ("SELECT fairq.dead_letter_purge(now() - interval '1 day', 'default')", ()),
            ]]

        every_call()  # plans made on tables of five rows
        filler.execute(dead, (10, 40_009))
        filler.execute(history, (10, 40_009))
        analyze_from_now(conn)
        for plans in every_call():  # the same plans, on 40,000 rows
            read = rows_read(plans)
            assert read, "\n\n".join(plans)
            assert max(n for _, n in read) <= 12, [x for x in read if x[1] > 12]
        assert conn.execute("SELECT count(*) FROM fairq.dead_letter").fetchone() == (40_003,)


LOCK_INDEX_SCAN = re.compile(
    r"(?:Bitmap Index Scan on|Index (?:Only )?Scan(?: Backward)? using) (message_locked_(?:channel_)?ix)"
    r".*\(actual time=[\d.]+\.\.[\d.]+ rows=([\d.]+) loops=(\d+)\)")


def test_the_collector_reads_the_locks_once_a_call(server: Server) -> None:
    """Before it removes idle channels, the collector makes sure none has a message in
    flight. 0.7.9 looked that up channel by channel, and with its plans made while
    nothing was locked PostgreSQL went through message_locked_ix, by queue: every lock
    of the queue, read again for each channel (16 s a call for 1,000 channels in the
    churn soak, which stalled the queue behind that transaction). Now every read of
    the locks is either one scan that reads each at most once, or a lookup keyed by
    one channel that stops at its first lock (0.7.33 leaves channels with a message
    in flight out before it locks their rows), however it was planned."""
    with planned_small(server, "fairq.message") as (conn, _):
        # As inside message_dequeue, which runs the collector.
        for setting in ("enable_seqscan = off", "fairq.idle_channel_ttl = '0'"):
            conn.execute(f"SET {setting}")
        collect = "SELECT fairq.collect_idle_channels(fairq.clock(), 1000)"
        create(conn, "first")
        for d in dequeue(conn):
            call(conn, "message_complete", d.id, d.num_attempts)
        conn.execute(collect)  # planned with nothing locked
        assert conn.execute("SELECT count(*) FROM fairq.channel").fetchone() == (0,)
        conn.execute("SELECT fairq.message_create_batch(array_agg(c), array_agg('x'::bytea))"
                     " FROM (SELECT 'idle-' || i FROM generate_series(1, 50) i"
                     "       UNION ALL SELECT 'busy-' || (i % 500) FROM generate_series(1, 2000) i) s(c)")
        while got := dequeue(conn, n=500):
            for d in got:
                if d.channel.startswith("idle-"):
                    call(conn, "message_complete", d.id, d.num_attempts)
        analyze_from_now(conn)
        plans = plans_of(conn, collect)
        # The idle channels went; the 500 with all their messages in flight stayed.
        assert conn.execute("SELECT count(*) FILTER (WHERE name LIKE 'idle-%'), count(*)"
                            "  FROM fairq.channel").fetchone() == (0, 500)
        scans = [(m.group(1), float(m.group(2)), int(m.group(3)))
                 for plan in plans for line in plan.splitlines() if (m := LOCK_INDEX_SCAN.search(line))]
        assert scans, "\n\n".join(plans)
        assert all(loops == 1 or rows <= 1 for _, rows, loops in scans), scans
        # (2,000 locks, and the entries the 51 completed messages left behind.)
        assert sum(rows * loops for _, rows, loops in scans) <= 2000 + 51, scans


def test_a_small_queue_beside_a_deep_one_reads_only_its_own_rows(loaded: Conn) -> None:
    """100k messages in 10k channels wait in the default queue (some of them locked and
    expired, some of them woken): a dequeue of another queue with three messages reads
    none of them. Every scan of a queue table is an index lookup keyed by the queue,
    and none returns more rows than the small queue holds."""
    dequeue(loaded, lock_ms=10, n=20)  # expired locks in the deep queue
    loaded.execute("SELECT fairq.message_create('tenant-3', 'woken')")
    for channel in ("a", "b", "a"):
        create(loaded, channel, b"small", queue="small")
    travel(loaded, 1_000)
    loaded.execute("LOAD 'auto_explain'")
    loaded.execute("SET auto_explain.log_analyze = on")
    try:
        plans = plans_of(loaded, "SELECT * FROM fairq.message_dequeue(30000, 10, 'small')")
    finally:
        loaded.execute("SET auto_explain.log_analyze = off")
    assert_index_only(plans)
    read = rows_read(plans)
    assert read, "\n\n".join(plans)
    assert max(n for _, n in read) <= 3, [x for x in read if x[1] > 3]
    assert dequeue(loaded, n=10, queue="small") == []  # all three were handed out above


def message_scans(conn: Conn, sql: str) -> int:
    """How many scans of fairq.message running sql takes (this transaction's counts)."""
    with conn.transaction():
        conn.execute(sql).fetchall()
        row = conn.execute("SELECT seq_scan + coalesce(idx_scan, 0) FROM pg_stat_xact_user_tables"
                           " WHERE relid = 'fairq.message'::regclass").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("sql", ["SELECT * FROM fairq.queues", "SELECT * FROM fairq.check()"])
def test_operators_overviews_read_the_messages_a_fixed_number_of_times(loaded: Conn, sql: str) -> None:
    """An operator looks at fairq.queues (the dashboard's front page) or runs
    fairq.check() on a queue with 10k tenants: each reads the message table a few
    times in all, not once (or, without an index on the channel alone, wholly) per
    channel."""
    assert message_scans(loaded, sql) <= 5


def channel_updates(conn: Conn) -> int:
    """How many channel row versions updates have written in this database so far:
    the session's pending statistics are flushed first (PostgreSQL 15 and later flush
    them when the session goes idle, at most once a second unless forced)."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    row = conn.execute("SELECT n_tup_upd FROM pg_stat_user_tables"
                       " WHERE relid = 'fairq.channel'::regclass").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(("per_call", "writes"), [(1, 10), (10, 20)])
def test_a_sparse_tenants_channel_is_written_once_or_twice_per_message(
        conn: Conn, per_call: int, writes: int) -> None:
    """The realistic load is many tenants with a message now and then: each message
    finds its channel idle, its producer queues a wake, and a dequeue applies the wake,
    puts the channel into the rotation, serves it, and lets it go idle. Every channel
    row version is an update of each channel index. A dequeue of ten writes each row
    twice, no more: once to apply the wake and place the channel in the rotation,
    once to serve it and settle its next turn (0.7.0 wrote it four times). A dequeue
    of one whose woken channel would be first in the rotation writes it once, by the
    serve (0.7.22 wrote it twice)."""
    for i in range(10):
        create(conn, f"tenant-{i}")
    while got := dequeue(conn, n=10):  # drained: every channel idle
        for d in got:
            call(conn, "message_complete", d.id, d.num_attempts)
    conn.execute("SELECT fairq.clock_travel(5000)")  # idle for a while
    row = conn.execute("SELECT fairq.clock()").fetchone()
    assert row is not None
    woken_at = row[0]
    for i in range(10):
        create(conn, f"tenant-{i}")
    assert conn.execute("SELECT count(*) FROM fairq.channel_wake").fetchone() == (10,)
    conn.execute("SET stats_fetch_consistency = none")
    before = channel_updates(conn)
    served = sum(len(dequeue(conn, n=per_call)) for _ in range(10 // per_call))
    assert (served, channel_updates(conn) - before) == (10, writes)
    # Each is idle again, since its serve: its wake spent, not left to act later.
    assert conn.execute("SELECT count(*) FROM fairq.channel_wake").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM fairq.channel WHERE idle_since >= %s",
                        (woken_at,)).fetchone() == (10,)


def test_a_channel_that_joins_first_is_served_with_one_write(conn: Conn) -> None:
    """A channel that waits to join (made due by its producer, or waiting since a
    serve) and would be first in the rotation is served by a dequeue of one straight
    from where it joins: its row is written once, by the serve (0.7.19 wrote it
    twice, joined and then served)."""
    for i in range(3):
        create(conn, f"tenant-{i}")
    conn.execute("SET stats_fetch_consistency = none")
    before = channel_updates(conn)
    served = [d.channel for _ in range(3) for d in dequeue(conn)]
    assert (served, channel_updates(conn) - before) == (["tenant-0", "tenant-1", "tenant-2"], 3)


def test_a_one_message_dequeue_locks_and_hands_out_its_head_in_one_statement(conn: Conn) -> None:
    """Serving one channel, the dequeue finds its best ready message, locks it and
    hands it out in one statement (an update of the head its subquery locks), where a
    call serving several channels runs two: one to lock each channel's head, one to
    mark them locked and return them in pick order. Each statement costs its plan's
    start-up at every call: 0.7.29 ran the two for one channel too, a tenth of a
    one-message dequeue. Both forms hand out the same message (the model test holds
    them to the same answers)."""
    conn.execute("UPDATE fairq.channel_collection SET collected_at = 'infinity'")
    for channel in ("a", "b", "c"):
        create(conn, channel)
        create(conn, channel)
    dequeue(conn)  # planned (the first call lets the channels join)
    heads = re.compile(r"LockRows.*?message_ready_ix", re.S)
    plans = plans_of(conn, "SELECT * FROM fairq.message_dequeue(30000, 1)")
    locking = [p for p in plans if heads.search(p)]
    assert len(locking) == 1 and "Update on message" in locking[0], plans
    plans = plans_of(conn, "SELECT * FROM fairq.message_dequeue(30000, 2)")
    locking = [p for p in plans if heads.search(p)]
    assert len(locking) == 1 and "Update on message" not in locking[0], plans
    assert [p for p in plans if "Update on message" in p and "num_attempts" in p], plans


# A SQL function's body that is a constant, which the planner runs to fold it when it
# plans (again: after an invalidation) a statement that calls it; not a statement of
# the call's own.
FOLDED_CONSTANT = re.compile(r"SELECT (\d+|'[^']*'(::\w+)?)")


def statements_of(conn: Conn, sql: str, params: tuple[object, ...] = ()) -> list[str]:
    """The first line of each statement sql ran inside fairq's functions (the call
    itself left out): what went through the executor, as auto_explain logs it."""
    firsts = [p.split("Query Text:", 1)[1].strip().splitlines()[0].strip()
              for p in plans_of(conn, sql, params) if "Query Text:" in p]
    return [t for t in firsts if not t.startswith(sql.split("(")[0]) and not FOLDED_CONSTANT.fullmatch(t)]


def test_a_busy_channels_cycle_runs_only_the_statements_of_its_work(conn: Conn) -> None:
    """On a busy channel (more ready messages, no wake queued, nothing scheduled) a
    create runs three statements (its queue, its channel, the insert), a dequeue four
    (the queue's questions, the pick, the head handed out, the channel's next turn)
    and a completion two (the fenced delete, the channel). Each statement costs its
    plan's start-up at every call: the argument checks, the locks and the history
    record are assignments that plpgsql evaluates without the executor, and the pick
    asks whether its channels have wakes queued or scheduled messages due instead of
    a statement for each. 0.7.30 ran 18 statements for this cycle, not 9."""
    conn.execute("UPDATE fairq.channel_collection SET collected_at = 'infinity'")
    for _ in range(3):
        create(conn, "a")
        create(conn, "b")
    dequeue_sql = "SELECT id, channel, num_attempts FROM fairq.message_dequeue(30000, 1)"
    complete_sql = "SELECT fairq.message_complete(%s, %s)"
    create_sql = "SELECT fairq.message_create(%s, %s)"

    def cycle(statements: Callable[[str, tuple[object, ...]], list[str]]) -> list[list[str]]:
        handed = statements(dequeue_sql, ())
        row = conn.execute("SELECT m.id, m.num_attempts, c.name FROM fairq.message m"
                           " JOIN fairq.channel c ON c.id = m.channel_id WHERE m.status = 'locked'").fetchone()
        assert row is not None
        return [handed, statements(complete_sql, row[:2]), statements(create_sql, (row[2], b"x"))]

    def run(sql: str, params: tuple[object, ...]) -> list[str]:
        conn.execute(sql, params)
        return []

    # Both channels join the rotation, and every statement of this cycle is planned.
    for _ in range(3):
        cycle(run)
    handed, completed, made = cycle(lambda sql, params: statements_of(conn, sql, params))
    assert len(handed) == 4, handed
    assert len(completed) == 2 and completed[0].startswith("DELETE FROM fairq.message"), completed
    assert len(made) == 3 and made[-1].startswith("INSERT INTO fairq.message"), made


def test_a_join_with_no_wake_queued_starts_up_no_wake_folding(conn: Conn) -> None:
    """Most channels a dequeue lets join carry their turn in their rows (a channel's
    first message, a serve, a completion): nothing in the wake queue concerns them.
    Each node of a statement's plan costs its start-up at every call, rows or not, so
    the join's statement reaches the wake queue only through fairq.folded_wakes, which
    it calls only for woken channels (0.7.17's join statement deleted from the queue
    at every call: some 35 µs of a sparse dequeue)."""
    for i in range(3):
        create(conn, f"tenant-{i}")
    assert conn.execute("SELECT count(*) FROM fairq.channel_wake").fetchone() == (0,)
    # (Three wanted: a call for one serves a lone channel that would be first
    # without a join statement.)
    plans = plans_of(conn, "SELECT * FROM fairq.message_dequeue(30000, 3)")
    joins = [p for p in plans if "back_rank" in p]
    assert len(joins) == 1, plans
    assert "channel_wake" not in joins[0], joins[0]


def test_a_batch_that_makes_its_channels_writes_each_row_once(conn: Conn) -> None:
    """message_create_batch, like message_create, inserts each channel it makes due,
    with its turn, by the earliest of the messages it will hold: a repeated dedup key
    counts by its first element, the one created (0.7.23 inserted the rows idle and
    wrote each again)."""
    create(conn, "old")  # a channel there before: woken, not made
    row = conn.execute("SELECT fairq.clock()").fetchone()
    assert row is not None
    base = row[0]
    conn.execute("SET stats_fetch_consistency = none")
    before = channel_updates(conn)
    statuses = conn.execute(
        "SELECT status FROM fairq.message_create_batch("
        " ARRAY['a', 'b', 'a', 'c', 'c', 'old'], ARRAY['1', '2', '3', '4', '5', '6']::bytea[],"
        " ARRAY[NULL, %(base)s + interval '1 hour', NULL, %(base)s + interval '2 hours', %(base)s, NULL],"
        " NULL, ARRAY[NULL, NULL, NULL, 'k', 'k', NULL]) ORDER BY ord", {"base": base}).fetchall()
    assert [s for (s,) in statuses] == ["created"] * 4 + ["duplicate", "created"]
    assert channel_updates(conn) - before == 0
    due = dict(conn.execute(
        "SELECT name, due_at - %s FROM fairq.channel"
        " WHERE name IN ('b', 'c') AND turn_at = due_at AND idle_since IS NULL", (base,)).fetchall())
    assert due == {"b": timedelta(hours=1), "c": timedelta(hours=2)}
    assert [d.channel for d in dequeue(conn, n=10)] == ["old", "a", "old", "a"]


def test_a_message_that_makes_its_channel_writes_the_row_once(conn: Conn) -> None:
    """With many sparse tenants most messages make their channel. message_create
    knows its message's due time before it makes the row, and nothing can refuse
    a message on a channel just made, so the row is inserted due, with its turn:
    no update follows (0.7.18 inserted it idle and then wrote its turn, two row
    versions and four index entries more per message)."""
    conn.execute("SET stats_fetch_consistency = none")
    before = channel_updates(conn)
    for i in range(5):
        create(conn, f"new-{i}")
    conn.execute("SELECT fairq.message_create('later', 'x', now() + interval '1 hour')")
    assert channel_updates(conn) - before == 0
    assert conn.execute("SELECT count(*) FILTER (WHERE turn_at IS NOT NULL AND idle_since IS NULL)"
                        " FROM fairq.channel").fetchone() == (6,)


def functions_called(conn: Conn, sql: str, params: tuple[object, ...] = ()) -> dict[str, int]:
    """The fairq functions that running sql called, by name, with their calls: those
    PostgreSQL ran as functions (plpgsql, or SQL that was not inlined), not the SQL
    functions inlined into a statement."""
    conn.execute("SET track_functions = 'all'")
    # (The session's counts not yet flushed to the statistics, this call's among them.)
    counts = ("SELECT funcname, calls FROM pg_stat_xact_user_functions"
              " WHERE schemaname = 'fairq'")
    with conn.transaction():
        before = dict(conn.execute(counts).fetchall())
        conn.execute(sql, params)  # type: ignore[arg-type]
        after = dict(conn.execute(counts).fetchall())
    return {str(name): int(calls) - int(before.get(name, 0))  # type: ignore[call-overload]
            for name, calls in after.items() if calls != before.get(name)}


def test_a_busy_channels_cycle_calls_no_helper_function(conn: Conn) -> None:
    """On a busy channel a message's create, dequeue and completion each run as one
    plpgsql call: the argument checks, the lock-count and history settings, the
    queue's lookup, the doorbell and the size of an unbounded channel are SQL
    functions inlined into the statements that ask (a plpgsql call costs more than
    the rest of a completion's checks; 0.7.28 made fourteen such calls a cycle). The
    one helper left is the dequeue's settling of the channels it served. A SQL
    function silently stops being inlined when its body or its arguments change
    shape: this test says so."""
    conn.execute("UPDATE fairq.channel_collection SET collected_at = 'infinity'")  # not its turn
    for _ in range(3):
        create(conn, "busy")
    # The first cycles plan the statements (the first dequeue lets the channel join,
    # the next ones pick it from the rotation), and planning runs what it folds.
    for _ in range(3):
        d = dequeue_one(conn)
        assert d is not None
        call(conn, "message_complete", d.id, d.num_attempts)
        create(conn, "busy")
    # (Called as the cycles above call them: a call that leaves p_queue to its default
    # has no input collation, and PostgreSQL compiles and plans a function anew for it.)
    assert functions_called(conn, "SELECT fairq.message_create(%s, %s)", ("busy", b"x")) == {
        "message_create": 1}
    assert functions_called(conn, "SELECT * FROM fairq.message_dequeue(%s, %s, %s)",
                            (30_000, 1, "default")) == {"message_dequeue": 1, "settled_due_ats": 1}
    d = dequeue_one(conn)
    assert d is not None
    assert functions_called(conn, "SELECT fairq.message_complete(%s, %s)", (d.id, d.num_attempts)) == {
        "message_complete": 1}


def test_a_message_that_wakes_its_channel_queues_the_wake_in_one_statement(conn: Conn) -> None:
    """A sparse tenant's message finds its channel idle and queues a wake. The
    producer's look at the channel comes after its locks, so a wake it finds needed
    is queued at once, in one statement, with no second look (0.7.28 called
    fairq.channels_wake, whose two looks cost more than the rest of the create); a
    second message, while that wake is still queued, finds it and queues none."""
    conn.execute("UPDATE fairq.channel_collection SET collected_at = 'infinity'")
    for _ in range(3):  # planned by a first cycle, as in the test above
        create(conn, "sparse")
        d = dequeue_one(conn)
        assert d is not None
        call(conn, "message_complete", d.id, d.num_attempts)
    assert functions_called(conn, "SELECT fairq.message_create(%s, %s)", ("sparse", b"x")) == {
        "message_create": 1}
    assert conn.execute("SELECT count(*) FROM fairq.channel_wake").fetchone() == (1,)
    assert functions_called(conn, "SELECT fairq.message_create(%s, %s)", ("sparse", b"y")) == {
        "message_create": 1}
    assert conn.execute("SELECT count(*) FROM fairq.channel_wake").fetchone() == (1,)
    assert [d.content for d in dequeue(conn, n=2)] == [b"x", b"y"]
