"""Fuzzing that tests/test_sql_errors.py does not already do.

test_sql_errors.py fuzzes message_create, message_dequeue and channel_set, and lists
the error cases of every function (including unequal batch arrays). Missing there,
and added here:

* the settlement and operator functions (defer with any timestamp including
  +/-infinity, heartbeat with any lock, fail with any error text, complete and
  complete_batch with any ids and attempts, cancel, dead_letter_retry,
  history_prune) called on a queue that holds live locks, with fairq.check() empty
  afterwards;
* empty batch arrays;
* huge payloads, states and error texts, which must come back intact.
"""

from __future__ import annotations

import random
from datetime import timezone
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sqlq import Conn, call_fuzzed, problems

NOT_NULL, INVALID, OUT_OF_RANGE = "22004", "22023", "22003"
INT8_MIN, INT8_MAX = -(2**63), 2**63 - 1


class Blob(bytes):
    def __repr__(self) -> str:
        return f"<{len(self)} random bytes>"


def blob(seed: int, size: int) -> Blob:
    return Blob(random.Random(seed).randbytes(size))


def test_empty_batches_give_no_rows_and_change_nothing(conn: Conn) -> None:
    assert conn.execute("SELECT * FROM fairq.message_create_batch('{}', '{}')").fetchall() == []
    assert conn.execute("SELECT * FROM fairq.message_create_batch('{}', '{}', '{}', '{}', '{}')"
                        ).fetchall() == []
    assert conn.execute("SELECT * FROM fairq.message_complete_batch('{}', '{}')").fetchall() == []
    assert conn.execute("SELECT count(*) FROM fairq.channel").fetchone() == (0,)
    assert problems(conn) == []


def test_huge_payloads_states_and_errors_come_back_intact(conn: Conn) -> None:
    big = [blob(i, 6 * 2**20) for i in range(2)]  # 6 MB each, incompressible
    rows = conn.execute("SELECT ord, id, status FROM fairq.message_create_batch("
                        "'{huge,huge}', %s::bytea[])", (big,)).fetchall()
    assert [r[2] for r in rows] == ["created", "created"]
    got = conn.execute("SELECT id, content, num_attempts FROM fairq.message_dequeue(60000, 2)"
                       ).fetchall()
    assert [bytes(g[1]) for g in got] == big
    state = blob(7, 8 * 2**20)
    error = random.Random(8).randbytes(2**20).hex()  # 2 MB of text
    (first, _, att1), (second, _, att2) = got
    assert conn.execute("SELECT fairq.message_defer(%s, %s, NULL, %s)",
                        (first, att1, state)).fetchone() == ("deferred",)
    assert conn.execute("SELECT fairq.message_fail(%s, %s, %s)",
                        (second, att2, error)).fetchone() == ("dead",)
    dead = conn.execute("SELECT content, error FROM fairq.dead_letters").fetchone()
    assert dead is not None and bytes(dead[0]) == big[1] and dead[1] == error
    assert conn.execute("SELECT fairq.dead_letter_retry(%s)", (second,)).fetchone() == ("requeued",)
    again = conn.execute("SELECT id, content, state FROM fairq.message_dequeue(60000, 2)"
                         ).fetchall()
    assert {(r[0], bytes(r[1]), None if r[2] is None else bytes(r[2])) for r in again} == {
        (first, big[0], state), (second, big[1], None)}
    assert problems(conn) == []


# -- Fuzz of the settlement and operator functions ------------------------------------

ids = st.one_of(st.none(), st.sampled_from([1, 2, 3, 4, 5, 6]), st.integers(-3, 10),
                st.sampled_from([0, -1, INT8_MIN, INT8_MAX, INT8_MAX + 1, INT8_MIN - 1]))
attempts = st.one_of(st.none(), st.integers(-1, 3),
                     st.sampled_from([INT8_MIN, INT8_MAX, INT8_MAX + 1]))
lock_ms = st.one_of(st.none(), st.integers(-2, 3), st.sampled_from(
    [1000, 315360000000, 315360000001, INT8_MAX, INT8_MIN, INT8_MAX + 1]))
timestamps = st.one_of(st.none(), st.datetimes(timezones=st.just(timezone.utc)),
                       st.sampled_from(["infinity", "-infinity"]))
texts = st.one_of(st.none(), st.text(max_size=10).filter(lambda s: "\x00" not in s),
                  st.integers(0, 99).map(lambda n: "e" * (n * 10_000)))
payloads = st.one_of(st.none(), st.binary(max_size=16),
                     st.integers(0, 9).map(lambda seed: blob(seed, 2**20)))

# (SQL, names of the parameters, whether each is a bigint that may not fit)
FUZZED: dict[str, tuple[str, tuple[str, ...], tuple[bool, ...], Any]] = {
    "message_defer": ("SELECT fairq.message_defer(%s::bigint, %s::bigint, %s::timestamptz,"
                      " %s::bytea)", ("p_id", "p_num_attempts", "p_dequeue_at", "p_state"),
                      (True, True, False, False), st.tuples(ids, attempts, timestamps, payloads)),
    "message_heartbeat": ("SELECT fairq.message_heartbeat(%s::bigint, %s::bigint, %s::bigint)",
                          ("p_id", "p_num_attempts", "p_lock_ms"), (True, True, True),
                          st.tuples(ids, attempts, lock_ms)),
    "message_fail": ("SELECT fairq.message_fail(%s::bigint, %s::bigint, %s::text)",
                     ("p_id", "p_num_attempts", "p_error"), (True, True, False),
                     st.tuples(ids, attempts, texts)),
    "message_complete": ("SELECT fairq.message_complete(%s::bigint, %s::bigint)",
                         ("p_id", "p_num_attempts"), (True, True), st.tuples(ids, attempts)),
    "message_complete_batch": (
        "SELECT id, status FROM fairq.message_complete_batch(%s::bigint[], %s::bigint[])",
        ("p_ids", "p_num_attempts"), (False, False),
        st.tuples(st.lists(st.integers(-1, 7), max_size=4), st.lists(st.integers(-1, 3),
                                                                        max_size=4))),
    "message_cancel": ("SELECT fairq.message_cancel(%s::bigint)", ("p_id",), (True,),
                       st.tuples(ids)),
    "dead_letter_retry": ("SELECT fairq.dead_letter_retry(%s::bigint)", ("p_id",), (True,),
                          st.tuples(ids)),
    "history_prune": ("SELECT fairq.history_prune(%s::timestamptz)", ("p_before",), (False,),
                      st.tuples(timestamps)),
    "message_dequeue": ("SELECT id, channel, dequeue_at::text, num_attempts"
                        " FROM fairq.message_dequeue(%s::bigint, %s::int)",
                        ("p_lock_ms", "p_max_messages"), (True, False),
                        st.tuples(lock_ms, st.integers(1, 3))),
}
calls = st.one_of(*(st.tuples(st.just(fn), spec[3]) for fn, spec in FUZZED.items()))


def fits(value: Any) -> bool:
    return not isinstance(value, int) or INT8_MIN <= value <= INT8_MAX


@settings(suppress_health_check=list(HealthCheck), max_examples=30, deadline=None)
@given(sequence=st.lists(calls, min_size=1, max_size=8))
def test_fuzzed_settlement_gives_a_result_or_a_documented_error(
    conn: Conn, sequence: list[tuple[str, tuple[Any, ...]]]
) -> None:
    """On a queue with live locks (ids 1-3 on two channels, one of them bounded and
    limited in attempts), ready and scheduled messages: any arguments give a result,
    22004/22023 naming a parameter, or 22003 when a value does not fit bigint (the
    cast fails before fairq is called). Afterwards fairq.check() is empty."""
    conn.execute("TRUNCATE fairq.channel, fairq.channel_size, fairq.channel_size_change, fairq.channel_wake,"
                 " fairq.message, fairq.dead_letter,"
                 " fairq.message_history;"
                 " SELECT setval('fairq.message_id_seq', 1, false); SET fairq.history = on")
    conn.execute("SELECT fairq.channel_set('b', 1, 0, 3, 2)")
    conn.execute("SELECT * FROM fairq.message_create_batch('{a,b,a,b,a}', '{1,2,3,4,5}',"
                 " ARRAY[NULL, NULL, NULL, NULL, now() + interval '1 day']::timestamptz[])")
    conn.execute("SELECT * FROM fairq.message_dequeue(60000, 3)")
    for fn, args in sequence:
        sql, names, bigints, _ = FUZZED[fn]
        unrepresentable = any(b and v is not None and not fits(v)
                              for v, b in zip(args, bigints, strict=True))
        call_fuzzed(conn, fn, sql, args, names, unrepresentable)
    assert problems(conn) == []
