"""Vacuum and the queue's traffic (docs/operations.md, "Storage parameters").

A truncation at the end of a vacuum needs its table's exclusive lock, which a queue
under traffic never lets it have: autovacuum's worker waited up to 5 s for it at each
visit, then gave up, while the other tables waited for their turn and their dead rows
piled up (the churn soak's table sizes grew in steps: docs/bench.md). fairq's tables
that traffic rewrites are never truncated by vacuum; their pages are filled again.
"""

from __future__ import annotations

import threading

import psycopg

from sqlq import Conn

# The tables whose rows queue traffic inserts, updates and deletes all the time.
REWRITTEN = ("channel", "channel_size", "channel_size_change", "channel_wake", "message")


def _pages(conn: Conn, table: str) -> int:
    return int(conn.execute("SELECT pg_relation_size(%s) / current_setting('block_size')::int",
                            (table,)).fetchone()[0])  # type: ignore[index]


def test_the_tables_traffic_rewrites_are_never_truncated_by_vacuum(conn: Conn) -> None:
    rows = conn.execute(
        "SELECT c.relname, coalesce(o.option_value, 'true')"
        "  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        "  LEFT JOIN LATERAL pg_options_to_table(c.reloptions) o ON o.option_name = 'vacuum_truncate'"
        " WHERE n.nspname = 'fairq' AND c.relname = ANY (%s)", (list(REWRITTEN),)).fetchall()
    assert dict(rows) == dict.fromkeys(REWRITTEN, "false")


def test_a_vacuum_of_a_drained_queue_never_waits_for_the_queues_readers(dsn: str, conn: Conn) -> None:
    # 3,000 messages go through the queue: every page of the message table is empty.
    conn.execute("SELECT fairq.message_create_batch(array_agg('tenant-' || (i % 50)),"
                 " array_agg(convert_to(repeat('x', 300), 'UTF8')))"
                 "  FROM generate_series(1, 3000) AS i")
    while batch := conn.execute("SELECT id, num_attempts FROM fairq.message_dequeue(60000, 100)").fetchall():
        conn.execute("SELECT count(*) FROM fairq.message_complete_batch(%s, %s)",
                     ([row[0] for row in batch], [row[1] for row in batch]))
    drained_pages = _pages(conn, "fairq.message")
    assert drained_pages > 16

    with psycopg.connect(dsn, autocommit=True) as vacuuming, psycopg.connect(dsn) as reader:
        # An open transaction that has read the table (a worker's, a producer's) holds
        # a lock that a truncation's exclusive lock waits for.
        reader.execute("SELECT count(*) FROM fairq.message")
        pid = vacuuming.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        done = threading.Event()
        failure: list[BaseException] = []

        def vacuum() -> None:
            try:
                vacuuming.execute("VACUUM fairq.message")
            except psycopg.Error as exc:  # failed in this thread: asserted below
                failure.append(exc)
            finally:
                done.set()

        worker = threading.Thread(target=vacuum)
        worker.start()
        waits: set[str] = set()
        while not done.is_set():
            event = conn.execute("SELECT wait_event FROM pg_stat_activity WHERE pid = %s",
                                 (pid,)).fetchone()
            if event is not None and event[0] is not None:
                waits.add(str(event[0]))
            done.wait(0.005)
        worker.join()
        reader.rollback()
    assert not failure, failure
    assert "VacuumTruncate" not in waits, waits
    # The pages stay for the next messages; an operator gives them back on purpose.
    assert _pages(conn, "fairq.message") == drained_pages
    conn.execute("VACUUM (TRUNCATE) fairq.message")
    assert _pages(conn, "fairq.message") < drained_pages
