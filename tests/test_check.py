"""fairq.check() finds the damage it promises to find.

Each test breaks one invariant behind fairq's back (as a superuser editing the tables
would, or a bug), and check() must name the channel and the problem; on the intact
queue it reports nothing.
"""

from __future__ import annotations

import pytest

from sqlq import Conn, call, create, dequeue, problems


@pytest.mark.parametrize("damage", [
    # Locked, but the lock never expires: recovery finds locks by locked_until.
    "UPDATE fairq.message SET locked_until = NULL WHERE status = 'locked'",
    # Ready, with a lock's expiry: recovery would hand it back while it waits.
    "UPDATE fairq.message SET locked_until = fairq.clock() WHERE status = 'ready'",
])
def test_a_lock_expiry_without_a_lock_or_a_lock_without_one_is_reported(conn: Conn, damage: str) -> None:
    for _ in range(2):
        create(conn, "tenant-a")
    (held,) = dequeue(conn)
    assert problems(conn) == []
    conn.execute(damage)
    assert problems(conn) == [(
        "tenant-a", "1 messages have a locked_until but are not locked, or are locked without one")]
    conn.execute("UPDATE fairq.message SET locked_until = CASE WHEN status = 'locked'"
                 " THEN fairq.clock() + interval '30 s' END")
    assert problems(conn) == []
    assert call(conn, "message_complete", held.id, held.num_attempts) == "completed"


def test_a_capped_channels_slot_count_that_drifts_is_reported(conn: Conn) -> None:
    conn.execute("SELECT fairq.channel_set('tenant-a', p_max_concurrency => 2)")
    create(conn, "tenant-a")
    dequeue(conn)
    assert problems(conn) == []
    conn.execute("UPDATE fairq.channel SET in_flight = 2 WHERE name = 'tenant-a'")
    assert problems(conn) == [(
        "tenant-a", "in_flight is 2 but 1 messages are locked (max_concurrency 2)")]
