"""SPEC behaviour 6 on one hot channel: concurrent dequeues never answer "empty"
while an eligible channel holds work, whatever the number of callers and however
far apart their clocks are.

Each race gives every worker thread a fixed number of dequeue calls against a
backlog larger than all of them together, so every call has work to find: an empty
answer is a broken promise, never a drained queue. The counts are printed (run with
``-s``) and must be zero. The last test makes the clocks differ on purpose: one
call reads the clock, then waits (on an advisory lock the test holds) while another
call serves the channel and commits.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import sql

from sqlq import Conn, call, create, dequeue, problems

BUSY_WAIT = "30s"  # a failure net: no dequeue waits that long for another's commit


@dataclass
class Tally:
    delivered: int = 0
    empty: int = 0
    stale: int = 0


def race(dsn: str, *, threads: int, calls: int, batch: int) -> Tally:
    """`threads` workers each make `calls` dequeue calls of up to `batch` messages and
    complete what they get. Every thread starts once all are connected."""
    tally = Tally()
    mutex = threading.Lock()
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            # The wait for a busy channel is bounded by the server's clock (200 ms by
            # default): widened here, so that a holder slowed by the machine's load
            # does not turn into an empty answer.
            with psycopg.connect(dsn, autocommit=True,
                                 options=f"-c fairq.dequeue_busy_wait={BUSY_WAIT}") as c:
                mine = Tally()
                start.wait()
                for _ in range(calls):
                    got = dequeue(c, 30_000, batch)
                    if not got:
                        mine.empty += 1
                    for d in got:
                        status = call(c, "message_complete", d.id, d.num_attempts)
                        mine.delivered += 1
                        mine.stale += status != "completed"
            with mutex:
                tally.delivered += mine.delivered
                tally.empty += mine.empty
                tally.stale += mine.stale
        except BaseException as exc:  # reported below
            errors.append(exc)
            start.abort()

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return tally


@pytest.mark.parametrize(
    ("policy", "threads", "batch"),
    [
        pytest.param(None, 4, 1, id="uncapped-single"),
        pytest.param(None, 6, 5, id="uncapped-batched"),
        pytest.param({"p_max_concurrency": 64}, 4, 1, id="capped-above-workers-single"),
        pytest.param({"p_max_concurrency": 64}, 6, 5, id="capped-above-workers-batched"),
        pytest.param({"p_release_interval_ms": 0}, 4, 1, id="rate-limit-0-single"),
        pytest.param({"p_release_interval_ms": 0}, 6, 5, id="rate-limit-0-batched"),
    ],
)
def test_concurrent_dequeues_on_one_hot_channel_never_come_back_empty(
    conn: Conn, dsn: str, policy: dict[str, int] | None, threads: int, batch: int
) -> None:
    calls = 150 if batch > 1 else 400
    backlog = threads * calls * batch + 1_000  # more than every call together can take
    if policy is not None:
        args = ", ".join(f"{k} => %({k})s" for k in policy)
        conn.execute(f"SELECT fairq.channel_set('hot', {args})", policy)
    conn.execute("SELECT count(*) FROM fairq.message_create_batch("
                 " array_fill('hot'::text, ARRAY[%(n)s]), array_fill('\\x00'::bytea, ARRAY[%(n)s]))",
                 {"n": backlog})
    tally = race(dsn, threads=threads, calls=calls, batch=batch)
    left = conn.execute("SELECT count(*) FROM fairq.message").fetchone()
    print(f"\n{threads} threads x {calls} calls of {batch}: delivered {tally.delivered},"
          f" empty answers {tally.empty}, stale completions {tally.stale}, left {left}")
    assert (tally.empty, tally.stale) == (0, 0)
    assert left == (backlog - tally.delivered,)
    assert problems(conn) == []


GATE_KEY = 717_001  # the advisory lock the gated clock below waits for


@pytest.fixture
def gated_clock(conn: Conn) -> Conn:
    """fairq.clock(), replaced in this test database by one that, in a session with
    fairq_test.gate = on, reads the time and then waits for the test's advisory lock
    before returning it: the call goes on with a clock older than other calls'."""
    conn.execute(sql.SQL("""
        CREATE OR REPLACE FUNCTION fairq.clock() RETURNS timestamptz
        LANGUAGE plpgsql VOLATILE AS $$
        DECLARE
            v_now timestamptz := clock_timestamp()
                                 + coalesce((SELECT shift FROM fairq.clock_offset), interval '0');
        BEGIN
            IF current_setting('fairq_test.gate', true) = 'on' THEN
                PERFORM pg_advisory_xact_lock_shared({gate});
            END IF;
            RETURN v_now;
        END
        $$""").format(gate=sql.Literal(GATE_KEY)))
    return conn


@pytest.mark.parametrize("policy", [None, {"p_max_concurrency": 8}], ids=["uncapped", "capped"])
def test_a_call_whose_clock_is_older_than_the_last_serve_still_finds_the_work(
    gated_clock: Conn, dsn: str, policy: dict[str, int] | None
) -> None:
    conn = gated_clock
    if policy is not None:
        conn.execute("SELECT fairq.channel_set('hot', p_max_concurrency => %(p_max_concurrency)s)",
                     policy)
    for _ in range(5):
        create(conn, "hot")
    result: list[object] = []
    with psycopg.connect(dsn, autocommit=True) as gate, \
            psycopg.connect(dsn, autocommit=True) as late, \
            psycopg.connect(dsn, autocommit=True) as early:
        gate.execute("BEGIN")
        gate.execute("SELECT pg_advisory_xact_lock(%s)", (GATE_KEY,))
        early.execute("SET fairq_test.gate = on")
        early_pid = early.info.backend_pid

        def run_early() -> None:
            result.extend(dequeue(early))

        thread = threading.Thread(target=run_early)
        thread.start()
        # Progress, not time: the early call has read its clock once it waits for the gate.
        with psycopg.connect(dsn, autocommit=True) as watch:
            while not watch.execute(
                    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted"
                    " AND locktype = 'advisory')", (early_pid,)).fetchone()[0]:  # type: ignore[index]
                assert thread.is_alive()
        served = dequeue(late)  # a later clock: the channel's next turn is at this call's time
        assert len(served) == 1
        gate.execute("COMMIT")
        thread.join(30)
        assert not thread.is_alive()
    assert len(result) == 1, "the earlier call answered empty while four messages waited"
    assert problems(conn) == []
