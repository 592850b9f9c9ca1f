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


def test_an_uncapped_channel_counting_in_flight_is_reported_as_such(conn: Conn) -> None:
    """Only capped channels count their messages in flight: until 0.7.37 the problem
    read "in_flight is 1 but 1 messages are locked (max_concurrency )"."""
    create(conn, "tenant-a")
    dequeue(conn)
    conn.execute("UPDATE fairq.channel SET in_flight = 1 WHERE name = 'tenant-a'")
    assert problems(conn) == [(
        "tenant-a", "in_flight is 1 but the channel has no max_concurrency: it should be 0")]


def test_a_bounded_channels_count_is_its_row_and_its_changes(conn: Conn) -> None:
    """A bounded channel's count is its channel_size row plus the changes that
    settlements recorded and no producer has folded in yet (0.7.30): check() counts
    both, and reports a change recorded for a channel without max_size, or for none."""
    conn.execute("SELECT fairq.channel_set('tenant-a', p_max_size => 5)")
    for _ in range(3):
        create(conn, "tenant-a")
    (held,) = dequeue(conn)
    assert call(conn, "message_complete", held.id, held.num_attempts) == "completed"
    assert conn.execute("SELECT size FROM fairq.channel_size").fetchone() == (3,)
    assert problems(conn) == []  # 3 - 1 recorded apart: 2, as many as it holds
    conn.execute("INSERT INTO fairq.channel_size_change SELECT channel_id, -1 FROM fairq.channel_size")
    assert problems(conn) == [("tenant-a", "channel_size says 1 but the channel holds 2 messages")]
    conn.execute("DELETE FROM fairq.channel_size_change WHERE delta = -1 AND ctid = "
                 "(SELECT max(ctid) FROM fairq.channel_size_change)")
    create(conn, "tenant-b")
    conn.execute("INSERT INTO fairq.channel_size_change SELECT id, 1 FROM fairq.channel WHERE name = 'tenant-b'")
    conn.execute("INSERT INTO fairq.channel_size_change VALUES (-42, 1)")
    assert sorted(problems(conn), key=str) == sorted([
        ("tenant-b", "channel_size_change rows for a channel without max_size"),
        (None, "1 channel_size_change rows belong to no channel")], key=str)


def test_a_pass_kept_outside_the_rotation_is_only_a_full_or_freed_channels(conn: Conn) -> None:
    """Since 0.7.37 a channel served full with work due keeps its pass outside the
    rotation, and keeps it when a freed slot makes it servable at once (turns.sql):
    check() accepts both, and reports a pass that any other channel outside the
    rotation holds."""
    conn.execute("SELECT fairq.channel_set('tenant-a', p_max_concurrency => 1)")
    for _ in range(2):
        create(conn, "tenant-a")
    (held,) = dequeue(conn)
    assert conn.execute("SELECT turn_at IS NULL, turn_pass IS NOT NULL FROM fairq.channel"
                        " WHERE name = 'tenant-a'").fetchone() == (True, True)
    assert problems(conn) == []
    assert call(conn, "message_complete", held.id, held.num_attempts) == "completed"
    assert conn.execute("SELECT turn_at <= fairq.clock(), turn_pass IS NOT NULL FROM fairq.channel"
                        " WHERE name = 'tenant-a'").fetchone() == (True, True)
    assert problems(conn) == []
    conn.execute("UPDATE fairq.channel SET turn_at = fairq.clock() + interval '1 hour'"
                 " WHERE name = 'tenant-a'")
    (found,) = problems(conn)
    assert found[0] == "tenant-a"
    assert "kept outside the rotation" in found[1] and "keeps its place" in found[1]
