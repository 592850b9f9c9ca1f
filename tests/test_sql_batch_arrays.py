"""The batch functions and their arrays (SPEC §2: "validates each element exactly as
its single-message form does, and never misreads an array").

fairq refuses an array whose lower bound is not 1 (22023, naming the argument): its
elements are then named by the subscripts the caller used, which are positions. Each
batch function is also held to its single form element by element: the same SQLSTATE
for the same bad value, a message naming the element, and nothing changed.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from sqlq import Conn, create, dequeue_one

NOT_NULL, INVALID = "22004", "22023"

STATE_TABLES = ("fairq.channel", "fairq.channel_size", "fairq.channel_size_change", "fairq.channel_wake",
                "fairq.message", "fairq.dead_letter", "fairq.message_history")


def state(conn: Conn) -> dict[str, list[str]]:
    return {t: [r[0] for r in conn.execute(f"SELECT x::text FROM {t} x ORDER BY 1")]
            for t in STATE_TABLES}


def refused(conn: Conn, sql: str, args: Any = None) -> tuple[str | None, str]:
    before = state(conn)
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(sql, args).fetchall()
    assert state(conn) == before, "a refused call changed something"
    return caught.value.sqlstate, caught.value.diag.message_primary or ""


CREATE_BATCH = "SELECT * FROM fairq.message_create_batch({}, {}, {}, {}, {})"


def create_batch_sql(channels: str = "'{a,b}'", contents: str = "'{x,y}'", dequeue_ats: str = "NULL",
                     priorities: str = "NULL", dedup_keys: str = "NULL") -> str:
    return CREATE_BATCH.format(channels, contents, dequeue_ats, priorities, dedup_keys)


@pytest.mark.parametrize("argument", ["p_channels", "p_contents", "p_dequeue_ats", "p_priorities",
                                      "p_dedup_keys"])
@pytest.mark.parametrize("lower", [0, 2, -5])
def test_create_batch_refuses_arrays_that_do_not_start_at_1(conn: Conn, argument: str,
                                                            lower: int) -> None:
    good = {"p_channels": "'{a,b}'::text[]", "p_contents": "'{x,y}'::bytea[]",
            "p_dequeue_ats": "ARRAY[now(), NULL]", "p_priorities": "'{1,2}'::int[]",
            "p_dedup_keys": "'{k1,k2}'::text[]"}
    bounds = f"'[{lower}:{lower + 1}]={{"
    odd = {"p_channels": bounds + "a,b}'::text[]", "p_contents": bounds + "x,y}'::bytea[]",
           "p_dequeue_ats": bounds + "2030-01-01,NULL}'::timestamptz[]",
           "p_priorities": bounds + "1,2}'::int[]", "p_dedup_keys": bounds + "k1,k2}'::text[]"}
    args = {**good, argument: odd[argument]}
    sqlstate, message = refused(conn, create_batch_sql(*args.values()))
    assert sqlstate == INVALID and argument in message and "lower bound" in message, message


def test_create_batch_misreads_nothing_at_subscript_0(conn: Conn) -> None:
    # '[0:1]={"",ok}': the empty name sits at subscript 0. 0.4.0 stored a channel ''.
    sqlstate, message = refused(conn, create_batch_sql("'[0:1]={\"\",ok}'::text[]"))
    assert sqlstate == INVALID and "p_channels" in message
    assert conn.execute("SELECT count(*) FROM fairq.channel").fetchone() == (0,)


@pytest.mark.parametrize("lower", [0, 3])
def test_complete_batch_refuses_arrays_that_do_not_start_at_1(conn: Conn, lower: int) -> None:
    create(conn, "c")
    d = dequeue_one(conn)
    assert d is not None
    for ids, attempts, named in ((f"'[{lower}:{lower}]={{{d.id}}}'", f"'{{{d.num_attempts}}}'", "p_ids"),
                                 (f"'{{{d.id}}}'", f"'[{lower}:{lower}]={{{d.num_attempts}}}'",
                                  "p_num_attempts")):
        sqlstate, message = refused(
            conn, f"SELECT * FROM fairq.message_complete_batch({ids}::bigint[], {attempts}::bigint[])")
        assert sqlstate == INVALID and named in message and "lower bound" in message, message
    # The holder's token still completes it.
    assert conn.execute("SELECT * FROM fairq.message_complete_batch(%s, %s)",
                        ([d.id], [d.num_attempts])).fetchall() == [(d.id, "completed")]


def test_complete_batch_answers_each_element_as_completions_one_after_the_other_would(
        conn: Conn) -> None:
    create(conn, "c")
    d = dequeue_one(conn)
    assert d is not None
    # A wrong token first, then the holder's twice: 0.7.26 settled an id by its first
    # element only, so it answered stale, stale, stale and left the message locked.
    assert conn.execute("SELECT * FROM fairq.message_complete_batch(%s, %s)",
                        ([d.id] * 3, [d.num_attempts + 1, d.num_attempts, d.num_attempts])
                        ).fetchall() == [(d.id, "stale"), (d.id, "completed"), (d.id, "not_found")]
    assert conn.execute("SELECT count(*) FROM fairq.message").fetchone() == (0,)


# Element by element: the single form's SQLSTATE for the same bad value, the element named.
LONG_KEY = "k" * 3000
ELEMENT_CASES: dict[str, tuple[str, str, str, str]] = {
    # case: (batch SQL with the bad value second, single-form SQL, SQLSTATE, element named)
    "NULL channel": (create_batch_sql("ARRAY['a', NULL]"),
                     "SELECT * FROM fairq.message_create(NULL, 'y')", NOT_NULL, "p_channels[2]"),
    "empty channel": (create_batch_sql("ARRAY['a', '']"),
                      "SELECT * FROM fairq.message_create('', 'y')", INVALID, "p_channels[2]"),
    "256-byte channel": (create_batch_sql(f"ARRAY['a', '{'c' * 256}']"),
                         f"SELECT * FROM fairq.message_create('{'c' * 256}', 'y')", INVALID,
                         "p_channels[2]"),
    "NULL content": (create_batch_sql(contents="ARRAY['x', NULL]::bytea[]"),
                     "SELECT * FROM fairq.message_create('b', NULL)", NOT_NULL, "p_contents[2]"),
    "infinite dequeue_at": (create_batch_sql(dequeue_ats="ARRAY[NULL, 'infinity']::timestamptz[]"),
                            "SELECT * FROM fairq.message_create('b', 'y', 'infinity')", INVALID,
                            "p_dequeue_ats[2]"),
    "-infinite dequeue_at": (create_batch_sql(dequeue_ats="ARRAY[NULL, '-infinity']::timestamptz[]"),
                             "SELECT * FROM fairq.message_create('b', 'y', '-infinity')", INVALID,
                             "p_dequeue_ats[2]"),
    "3000-byte dedup key": (create_batch_sql(dedup_keys=f"ARRAY[NULL, '{LONG_KEY}']"),
                            f"SELECT * FROM fairq.message_create('b', 'y', NULL, 0, '{LONG_KEY}')",
                            INVALID, "p_dedup_keys[2]"),
    "NULL id": ("SELECT * FROM fairq.message_complete_batch(ARRAY[1, NULL]::bigint[], '{1,1}')",
                "SELECT fairq.message_complete(NULL, 1)", NOT_NULL, "p_ids[2]"),
    "NULL num_attempts": ("SELECT * FROM fairq.message_complete_batch('{1,2}', ARRAY[1, NULL]::bigint[])",
                          "SELECT fairq.message_complete(2, NULL)", NOT_NULL, "p_num_attempts[2]"),
}


@pytest.mark.parametrize("case", ELEMENT_CASES)
def test_batch_elements_are_validated_as_their_single_form(conn: Conn, case: str) -> None:
    batch_sql, single_sql, expected, element = ELEMENT_CASES[case]
    single_state, _ = refused(conn, single_sql)
    batch_state, message = refused(conn, batch_sql)
    assert single_state == batch_state == expected, (single_state, batch_state, message)
    assert message.startswith(element), message


def test_two_dimensional_arrays_are_refused_for_every_argument(conn: Conn) -> None:
    for argument, two_d in (("p_contents", "'{{x},{y}}'::bytea[]"),
                            ("p_dequeue_ats", "'{{NULL},{NULL}}'::timestamptz[]"),
                            ("p_priorities", "'{{1},{2}}'::int[]"),
                            ("p_dedup_keys", "'{{k},{l}}'::text[]")):
        args = {"p_contents": "'{x,y}'::bytea[]", "p_dequeue_ats": "NULL", "p_priorities": "NULL",
                "p_dedup_keys": "NULL", argument: two_d}
        sqlstate, message = refused(conn, create_batch_sql("'{a,b}'", *args.values()))
        assert sqlstate == INVALID and argument in message, message
