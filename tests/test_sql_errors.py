"""SPEC §2, behaviour 8: errors.

Invalid arguments raise SQLSTATE 22023 (a NULL where a value is required: 22004) with
a message that names the parameter, and change nothing. Expected outcomes (nothing
available, not found, stale, locked, dropped) are results, never exceptions.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sqlq import (
    Conn,
    call,
    call_fuzzed,
    complete,
    create,
    create_many,
    dequeue,
    dequeue_one,
    problems,
    travel,
)

NOT_NULL = "22004"  # null_value_not_allowed
INVALID = "22023"  # invalid_parameter_value
OUT_OF_RANGE = "22003"  # numeric_value_out_of_range
NO_SUCH_ROLE = "42704"  # undefined_object
FEATURE_NOT_SUPPORTED = "0A000"

INT4_MIN, INT4_MAX = -(2**31), 2**31 - 1
INT8_MIN, INT8_MAX = -(2**63), 2**63 - 1

# Every table that holds queue state: a rejected call must leave all of them as they were.
STATE_TABLES = ("fairq.channel", "fairq.channel_size", "fairq.channel_size_change", "fairq.message",
                "fairq.dead_letter", "fairq.message_history", "fairq.clock_offset")

# Channel names of exactly 255 bytes (valid) and 256 bytes (invalid), with 1- to 4-byte
# UTF-8 characters, so that the limit is checked in bytes, not characters.
NAMES_OF_255_BYTES = {
    "ascii": "a" * 255,
    "2-byte": "é" * 127 + "a",
    "3-byte": "€" * 85,
    "4-byte": "😀" * 63 + "abc",
}
NAMES_OF_256_BYTES = {
    "ascii": "a" * 256,
    "2-byte": "é" * 128,
    "3-byte": "€" * 85 + "a",
    "4-byte": "😀" * 64,
}


def snapshot(conn: Conn) -> dict[str, list[str]]:
    return {
        table: [row[0] for row in conn.execute(f"SELECT t::text FROM {table} t ORDER BY 1")]
        for table in STATE_TABLES
    }


# -- A database holding every kind of state a wrong call could damage ------------------


@dataclass(frozen=True)
class Populated:
    conn: Conn
    params: dict[str, Any]  # ids of the objects below, for the SQL of the cases


@pytest.fixture(scope="module")
def populated(server: Any) -> Iterator[Populated]:
    """One database for all the error cases (they must change nothing, and we check that).

    It holds a dead letter, an expired but unrecovered lock, a live lock, a bounded
    channel with a policy (so channel_size has a row), ready, scheduled and
    deduplicated messages, and history is on.
    """
    name = server.create_database()
    try:
        with psycopg.connect(server.dsn(name), autocommit=True) as conn:
            conn.execute("SET fairq.history = on")
            create(conn, "dying")
            dying = dequeue_one(conn)
            assert dying is not None
            assert call(conn, "message_fail", dying.id, dying.num_attempts, "boom") == "dead"

            create(conn, "expired")
            expired = dequeue_one(conn)
            assert expired is not None
            conn.execute("UPDATE fairq.message SET locked_until = fairq.clock() - interval '1 min'"
                         " WHERE id = %s", (expired.id,))

            create(conn, "work")
            locked = dequeue_one(conn)
            assert locked is not None and locked.channel == "work"

            call(conn, "channel_set", "bounded", 2, 0, 10, 3)
            ready, _ = create(conn, "bounded", b"r")
            create(conn, "bounded", b"s", dequeue_at=datetime.now(timezone.utc) + timedelta(days=1))
            create(conn, "free", b"d", dedup_key="k")
            assert problems(conn) == []
            yield Populated(conn, {"locked": locked.id, "att": locked.num_attempts,
                                   "dead": dying.id, "ready": ready})
    finally:
        server.drop_database(name)


# -- Every error path of every public function -------------------------------------------


@dataclass(frozen=True)
class Case:
    sql: str
    sqlstate: str
    parameter: str  # the error message must name it
    args: tuple[Any, ...] = ()


def _channel_cases() -> dict[str, Case]:
    """Bad channel names, for each function that takes one."""
    takes_a_name = {
        "channel_set": "SELECT fairq.channel_set({})",
        "channel_clear": "SELECT fairq.channel_clear({})",
        "message_create": "SELECT * FROM fairq.message_create({}, 'x')",
    }
    cases: dict[str, Case] = {}
    for fn, template in takes_a_name.items():
        cases[f"{fn}: NULL channel"] = Case(template.format("NULL"), NOT_NULL, "p_channel")
        cases[f"{fn}: empty channel"] = Case(template.format("''"), INVALID, "p_channel")
        for kind, name in NAMES_OF_256_BYTES.items():
            cases[f"{fn}: 256-byte channel ({kind})"] = Case(
                template.format("%s::text"), INVALID, "p_channel", (name,))
    batch = "SELECT * FROM fairq.message_create_batch(ARRAY['ok', {}], '{{x,y}}')"
    cases["message_create_batch: NULL channel element"] = Case(
        batch.format("NULL"), NOT_NULL, "p_channels")
    cases["message_create_batch: empty channel element"] = Case(
        batch.format("''"), INVALID, "p_channels")
    for kind, name in NAMES_OF_256_BYTES.items():
        cases[f"message_create_batch: 256-byte channel element ({kind})"] = Case(
            batch.format("%s::text"), INVALID, "p_channels", (name,))
    return cases


CASES: dict[str, Case] = {
    **_channel_cases(),
    # channel_set
    "channel_set: max_concurrency 0": Case(
        "SELECT fairq.channel_set('bounded', p_max_concurrency => 0)", INVALID,
        "p_max_concurrency"),
    "channel_set: max_concurrency negative": Case(
        "SELECT fairq.channel_set('bounded', p_max_concurrency => -1)", INVALID,
        "p_max_concurrency"),
    "channel_set: max_concurrency int min": Case(
        "SELECT fairq.channel_set('new', p_max_concurrency => -2147483648)", INVALID,
        "p_max_concurrency"),
    "channel_set: release_interval_ms NULL": Case(
        "SELECT fairq.channel_set('bounded', p_release_interval_ms => NULL)", NOT_NULL,
        "p_release_interval_ms"),
    "channel_set: release_interval_ms negative": Case(
        "SELECT fairq.channel_set('bounded', p_release_interval_ms => -1)", INVALID,
        "p_release_interval_ms"),
    "channel_set: release_interval_ms bigint min": Case(
        "SELECT fairq.channel_set('new', p_release_interval_ms => '-9223372036854775808'::bigint)",
        INVALID, "p_release_interval_ms"),
    "channel_set: max_size 0": Case(
        "SELECT fairq.channel_set('bounded', p_max_size => 0)", INVALID, "p_max_size"),
    "channel_set: max_size negative": Case(
        "SELECT fairq.channel_set('free', p_max_size => -7)", INVALID, "p_max_size"),
    "channel_set: max_attempts 0": Case(
        "SELECT fairq.channel_set('bounded', p_max_attempts => 0)", INVALID, "p_max_attempts"),
    "channel_set: max_attempts negative": Case(
        "SELECT fairq.channel_set('work', p_max_attempts => -1)", INVALID, "p_max_attempts"),
    # message_create
    "message_create: NULL content": Case(
        "SELECT * FROM fairq.message_create('bounded', NULL)", NOT_NULL, "p_content"),
    # message_create_batch
    "message_create_batch: NULL channels": Case(
        "SELECT * FROM fairq.message_create_batch(NULL, '{x}')", NOT_NULL, "p_channels"),
    "message_create_batch: NULL contents": Case(
        "SELECT * FROM fairq.message_create_batch('{bounded}', NULL)", NOT_NULL, "p_contents"),
    "message_create_batch: NULL content element": Case(
        "SELECT * FROM fairq.message_create_batch('{bounded,free}', ARRAY['x', NULL]::bytea[])",
        NOT_NULL, "p_contents"),
    "message_create_batch: contents shorter": Case(
        "SELECT * FROM fairq.message_create_batch('{bounded,free}', '{x}')", INVALID, "p_contents"),
    "message_create_batch: contents longer": Case(
        "SELECT * FROM fairq.message_create_batch('{bounded}', '{x,y}')", INVALID, "p_contents"),
    "message_create_batch: contents empty": Case(
        "SELECT * FROM fairq.message_create_batch('{bounded}', '{}')", INVALID, "p_contents"),
    "message_create_batch: dequeue_ats of other length": Case(
        "SELECT * FROM fairq.message_create_batch('{bounded,free}', '{x,y}',"
        " p_dequeue_ats => ARRAY[now()])", INVALID, "p_dequeue_ats"),
    "message_create_batch: infinite dequeue_at element": Case(
        "SELECT * FROM fairq.message_create_batch('{bounded,free}', '{x,y}',"
        " p_dequeue_ats => ARRAY[now(), '-infinity'])", INVALID, "p_dequeue_ats[2]"),
    "message_create: infinite dequeue_at": Case(
        "SELECT * FROM fairq.message_create('free', 'x', 'infinity')", INVALID, "p_dequeue_at"),
    "message_create: minus infinite dequeue_at": Case(
        "SELECT * FROM fairq.message_create('free', 'x', '-infinity')", INVALID, "p_dequeue_at"),
    "message_create_batch: priorities of other length": Case(
        "SELECT * FROM fairq.message_create_batch('{bounded,free}', '{x,y}',"
        " p_priorities => '{1,2,3}')", INVALID, "p_priorities"),
    "message_create_batch: dedup_keys of other length": Case(
        "SELECT * FROM fairq.message_create_batch('{bounded,free}', '{x,y}',"
        " p_dedup_keys => '{a}')", INVALID, "p_dedup_keys"),
    "message_create_batch: two-dimensional channels": Case(
        "SELECT * FROM fairq.message_create_batch('{{bounded,free},{work,free}}', '{w,x,y,z}')",
        INVALID, "p_channels"),
    # message_dequeue
    "message_dequeue: NULL lock_ms": Case(
        "SELECT * FROM fairq.message_dequeue(NULL)", NOT_NULL, "p_lock_ms"),
    "message_dequeue: lock_ms 0": Case(
        "SELECT * FROM fairq.message_dequeue(0)", INVALID, "p_lock_ms"),
    "message_dequeue: lock_ms negative": Case(
        "SELECT * FROM fairq.message_dequeue(-1000)", INVALID, "p_lock_ms"),
    "message_dequeue: lock_ms bigint min": Case(
        "SELECT * FROM fairq.message_dequeue('-9223372036854775808'::bigint)", INVALID,
        "p_lock_ms"),
    "message_dequeue: NULL max_messages": Case(
        "SELECT * FROM fairq.message_dequeue(1000, NULL)", NOT_NULL, "p_max_messages"),
    "message_dequeue: max_messages 0": Case(
        "SELECT * FROM fairq.message_dequeue(1000, 0)", INVALID, "p_max_messages"),
    "message_dequeue: max_messages negative": Case(
        "SELECT * FROM fairq.message_dequeue(1000, -2147483648)", INVALID, "p_max_messages"),
    # message_complete
    "message_complete: NULL id": Case(
        "SELECT fairq.message_complete(NULL, %(att)s)", NOT_NULL, "p_id"),
    "message_complete: NULL num_attempts": Case(
        "SELECT fairq.message_complete(%(locked)s, NULL)", NOT_NULL, "p_num_attempts"),
    # message_complete_batch
    "message_complete_batch: NULL ids": Case(
        "SELECT * FROM fairq.message_complete_batch(NULL, ARRAY[%(att)s::bigint])", NOT_NULL,
        "p_ids"),
    "message_complete_batch: NULL num_attempts": Case(
        "SELECT * FROM fairq.message_complete_batch(ARRAY[%(locked)s::bigint], NULL)", NOT_NULL,
        "p_num_attempts"),
    "message_complete_batch: NULL id element": Case(
        "SELECT * FROM fairq.message_complete_batch(ARRAY[%(locked)s::bigint, NULL],"
        " ARRAY[%(att)s::bigint, 1])", NOT_NULL, "p_ids"),
    "message_complete_batch: NULL num_attempts element": Case(
        "SELECT * FROM fairq.message_complete_batch(ARRAY[%(locked)s::bigint, -1],"
        " ARRAY[%(att)s::bigint, NULL])", NOT_NULL, "p_num_attempts"),
    "message_complete_batch: num_attempts shorter": Case(
        "SELECT * FROM fairq.message_complete_batch(ARRAY[%(locked)s::bigint, -1],"
        " ARRAY[%(att)s::bigint])", INVALID, "p_num_attempts"),
    "message_complete_batch: num_attempts longer": Case(
        "SELECT * FROM fairq.message_complete_batch(ARRAY[%(locked)s::bigint],"
        " ARRAY[%(att)s::bigint, 1])", INVALID, "p_num_attempts"),
    "message_complete_batch: two-dimensional ids": Case(
        "SELECT * FROM fairq.message_complete_batch(ARRAY[[%(locked)s::bigint, -1], [-2, -3]],"
        " ARRAY[%(att)s::bigint, 1, 1, 1])", INVALID, "p_ids"),
    # message_defer
    "message_defer: infinite dequeue_at": Case(
        "SELECT fairq.message_defer(%(locked)s, %(att)s, 'infinity')", INVALID, "p_dequeue_at"),
    "message_defer: NULL id": Case(
        "SELECT fairq.message_defer(NULL, %(att)s)", NOT_NULL, "p_id"),
    "message_defer: NULL num_attempts": Case(
        "SELECT fairq.message_defer(%(locked)s, NULL)", NOT_NULL, "p_num_attempts"),
    # message_heartbeat
    "message_heartbeat: NULL id": Case(
        "SELECT fairq.message_heartbeat(NULL, %(att)s, 1000)", NOT_NULL, "p_id"),
    "message_heartbeat: NULL num_attempts": Case(
        "SELECT fairq.message_heartbeat(%(locked)s, NULL, 1000)", NOT_NULL, "p_num_attempts"),
    "message_heartbeat: NULL lock_ms": Case(
        "SELECT fairq.message_heartbeat(%(locked)s, %(att)s, NULL)", NOT_NULL, "p_lock_ms"),
    "message_heartbeat: lock_ms 0": Case(
        "SELECT fairq.message_heartbeat(%(locked)s, %(att)s, 0)", INVALID, "p_lock_ms"),
    "message_heartbeat: lock_ms negative": Case(
        "SELECT fairq.message_heartbeat(%(locked)s, %(att)s, -60000)", INVALID, "p_lock_ms"),
    # message_fail
    "message_fail: NULL id": Case(
        "SELECT fairq.message_fail(NULL, %(att)s, 'e')", NOT_NULL, "p_id"),
    "message_fail: NULL num_attempts": Case(
        "SELECT fairq.message_fail(%(locked)s, NULL, 'e')", NOT_NULL, "p_num_attempts"),
    # message_cancel, dead_letter_retry, history_prune
    "message_cancel: NULL id": Case("SELECT fairq.message_cancel(NULL)", NOT_NULL, "p_id"),
    "dead_letter_retry: NULL id": Case("SELECT fairq.dead_letter_retry(NULL)", NOT_NULL, "p_id"),
    "history_prune: NULL before": Case("SELECT fairq.history_prune(NULL)", NOT_NULL, "p_before"),
    # grants
    "grant_producer: NULL role": Case("SELECT fairq.grant_producer(NULL)", NOT_NULL, "p_role"),
    "grant_worker: NULL role": Case("SELECT fairq.grant_worker(NULL)", NOT_NULL, "p_role"),
    "grant_observer: NULL role": Case("SELECT fairq.grant_observer(NULL)", NOT_NULL, "p_role"),
    # (an OID cast to regrole is not checked: a dropped role's, say)
    "grant_producer: no such role": Case("SELECT fairq.grant_producer(99999::regrole)", NO_SUCH_ROLE, "p_role"),
    "grant_worker: no such role": Case("SELECT fairq.grant_worker(0::regrole)", NO_SUCH_ROLE, "p_role"),
    "grant_observer: no such role": Case("SELECT fairq.grant_observer(99999::regrole)", NO_SUCH_ROLE,
                                         "p_role"),
    "revoke_producer: NULL role": Case("SELECT fairq.revoke_producer(NULL)", NOT_NULL, "p_role"),
    "revoke_worker: NULL role": Case("SELECT fairq.revoke_worker(NULL)", NOT_NULL, "p_role"),
    "revoke_observer: NULL role": Case("SELECT fairq.revoke_observer(NULL)", NOT_NULL, "p_role"),
    "revoke_worker: no such role": Case("SELECT fairq.revoke_worker(99999::regrole)", NO_SUCH_ROLE, "p_role"),
    "grant_operator: NULL role": Case("SELECT fairq.grant_operator(NULL)", NOT_NULL, "p_role"),
    "grant_operator: no such role": Case("SELECT fairq.grant_operator(99999::regrole)", NO_SUCH_ROLE,
                                         "p_role"),
    "revoke_operator: NULL role": Case("SELECT fairq.revoke_operator(NULL)", NOT_NULL, "p_role"),
    # clock_travel (owner only): a shift past PostgreSQL's intervals failed with 22015,
    # one past its timestamps with 22008, neither naming the argument
    "clock_travel: NULL shift": Case("SELECT fairq.clock_travel(NULL)", NOT_NULL, "p_shift_ms"),
    "clock_travel: bigint max": Case(
        "SELECT fairq.clock_travel('9223372036854775807'::bigint)", INVALID, "p_shift_ms"),
    "clock_travel: bigint min": Case(
        "SELECT fairq.clock_travel('-9223372036854775808'::bigint)", INVALID, "p_shift_ms"),
    "clock_travel: past the last timestamp": Case(
        "SELECT fairq.clock_travel(9300000000000000)", INVALID, "p_shift_ms"),
    "clock_travel: before the first timestamp": Case(
        "SELECT fairq.clock_travel(-9000000000000000)", INVALID, "p_shift_ms"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_invalid_argument_raises_names_the_parameter_and_changes_nothing(
    populated: Populated, case: Case
) -> None:
    conn = populated.conn
    before = snapshot(conn)
    params: Any = case.args or (populated.params if "%(" in case.sql else None)
    with pytest.raises(psycopg.Error) as excinfo:
        conn.execute(case.sql, params)
    error = excinfo.value
    assert (error.sqlstate, case.parameter in (error.diag.message_primary or "")) == (
        case.sqlstate, True), f"{error.sqlstate}: {error.diag.message_primary}"
    assert snapshot(conn) == before
    assert problems(conn) == []


def test_null_and_invalid_map_to_the_documented_exception_classes(populated: Populated) -> None:
    with pytest.raises(psycopg.errors.NullValueNotAllowed):
        populated.conn.execute("SELECT * FROM fairq.message_dequeue(NULL)")
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        populated.conn.execute("SELECT * FROM fairq.message_dequeue(0)")


# -- Isolation ---------------------------------------------------------------------------

GUARDED_CALLS = {
    "message_create": "SELECT * FROM fairq.message_create('a', 'x')",
    "message_create_batch": "SELECT * FROM fairq.message_create_batch('{a}', '{x}')",
    "message_dequeue": "SELECT * FROM fairq.message_dequeue(30000)",
    "message_complete": "SELECT fairq.message_complete(1, 1)",
    "message_complete_batch": "SELECT * FROM fairq.message_complete_batch('{1}', '{1}')",
    "message_defer": "SELECT fairq.message_defer(1, 1)",
    "message_fail": "SELECT fairq.message_fail(1, 1, 'x')",
    "message_cancel": "SELECT fairq.message_cancel(1)",
    "dead_letter_retry": "SELECT fairq.dead_letter_retry(1)",
    "channel_set": "SELECT fairq.channel_set('a', p_weight => 2)",
    "channel_clear": "SELECT fairq.channel_clear('a')",
    "channel_pause": "SELECT fairq.channel_pause('a')",
    "channel_resume": "SELECT fairq.channel_resume('a')",
}


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
@pytest.mark.parametrize("name", GUARDED_CALLS)
def test_a_call_that_needs_fresh_snapshots_refuses_other_isolation_levels(
        populated: Populated, name: str, level: str) -> None:
    """Under REPEATABLE READ every statement reads in the transaction's first snapshot:
    a worker's dequeue collected another queue's channel that a producer had just
    given a message, and the message was never handed out."""
    conn = populated.conn
    before = snapshot(conn)
    conn.execute(f"BEGIN ISOLATION LEVEL {level}")
    try:
        with pytest.raises(psycopg.Error) as excinfo:
            conn.execute(GUARDED_CALLS[name])
    finally:
        conn.execute("ROLLBACK")
    error = excinfo.value
    assert (error.sqlstate, f"fairq.{name} needs READ COMMITTED" in str(error)) == (
        FEATURE_NOT_SUPPORTED, True), str(error)
    assert snapshot(conn) == before


# -- Settings ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["banana", "-1 s", "1001 years", "300000 years"])
def test_a_bad_idle_channel_ttl_fails_the_collecting_dequeue_naming_the_setting(
        populated: Populated, value: str) -> None:
    conn = populated.conn
    before = snapshot(conn)
    conn.execute("UPDATE fairq.channel_collection SET collected_at = '-infinity'")  # collect now
    conn.execute("SELECT set_config('fairq.idle_channel_ttl', %s, false)", (value,))
    try:
        with pytest.raises(psycopg.Error) as excinfo:
            dequeue(conn)
    finally:
        conn.execute("RESET fairq.idle_channel_ttl")
    error = excinfo.value
    assert (error.sqlstate, "fairq.idle_channel_ttl" in (error.diag.message_primary or "")) == (
        INVALID, True), f"{error.sqlstate}: {error.diag.message_primary}"
    assert snapshot(conn) == before
    assert problems(conn) == []


def test_a_bad_dequeue_busy_wait_fails_the_dequeue_that_would_wait_naming_the_setting(
        conn: Conn, dsn: str) -> None:
    create_many(conn, ["busy"] * 2)
    with psycopg.connect(dsn) as holder:  # its dequeue holds the channel until it rolls back
        assert len(dequeue(holder)) == 1
        conn.execute("SET fairq.dequeue_busy_wait = 'soon'")
        with pytest.raises(psycopg.Error) as excinfo:
            dequeue(conn)
        holder.rollback()
    error = excinfo.value
    assert (error.sqlstate, "fairq.dequeue_busy_wait" in (error.diag.message_primary or "")) == (
        INVALID, True), f"{error.sqlstate}: {error.diag.message_primary}"
    conn.execute("RESET fairq.dequeue_busy_wait")
    assert [d.channel for d in dequeue(conn, n=3)] == ["busy", "busy"]


@pytest.mark.parametrize(("setting", "value"), [("fairq.history", "enabled"),
                                              ("fairq.history", "2"),
                                              ("fairq.events", "banana"),
                                              ("fairq.events", "doorbel")])
def test_a_mistyped_setting_fails_the_call_that_reads_it_naming_the_setting(
        conn: Conn, setting: str, value: str) -> None:
    """A value fairq cannot read is refused, never taken for another: 'enabled' was
    history off, 'doorbel' was every wake event."""
    create(conn, "a")
    d = dequeue_one(conn)
    assert d is not None
    before = snapshot(conn)
    conn.execute("SELECT set_config(%s, %s, false)", (setting, value))
    try:
        with pytest.raises(psycopg.Error) as excinfo:
            if setting == "fairq.history":
                complete(conn, d)
            else:
                create(conn, "b")  # wakes its new channel
    finally:
        conn.execute(f"RESET {setting}")
    error = excinfo.value
    assert (error.sqlstate, setting in (error.diag.message_primary or "")) == (
        INVALID, True), f"{error.sqlstate}: {error.diag.message_primary}"
    assert snapshot(conn) == before
    assert problems(conn) == []


@pytest.mark.parametrize(("value", "recorded"), [
    *[(on, 1) for on in ("on", "ON", "true", "yes", "Y", "1", " t ")],
    *[(off, 0) for off in ("", "off", "OFF", "false", "no", "0")]])
def test_history_reads_every_spelling_of_a_boolean(conn: Conn, value: str, recorded: int) -> None:
    """As PostgreSQL reads its own boolean settings (before 0.7.28, yes was off)."""
    conn.execute("SELECT set_config('fairq.history', %s, false)", (value,))
    try:
        create(conn, "a")
        d = dequeue_one(conn)
        assert d is not None and complete(conn, d) == "completed"
    finally:
        conn.execute("RESET fairq.history")
    assert conn.execute("SELECT count(*) FROM fairq.message_history").fetchone() == (recorded,)


# -- Boundaries and extremes that are valid ---------------------------------------------


def test_a_dequeue_may_ask_for_as_many_messages_as_an_integer_holds(conn: Conn) -> None:
    create(conn, "a")
    first = dequeue_one(conn)
    assert first is not None and complete(conn, first) == "completed"
    create(conn, "a")  # the channel was idle: this queues its wake, read in windows
    assert [d.channel for d in dequeue(conn, n=INT4_MAX)] == ["a"]


@pytest.mark.parametrize("name", NAMES_OF_255_BYTES.values(), ids=NAMES_OF_255_BYTES.keys())
def test_channel_name_of_255_bytes_is_valid(conn: Conn, name: str) -> None:
    assert len(name.encode()) == 255
    call(conn, "channel_set", name, 1)
    assert create(conn, name)[1] == "created"
    rows = conn.execute("SELECT status FROM fairq.message_create_batch(ARRAY[%s::text], '{y}')",
                        (name,)).fetchall()
    assert rows == [("created",)]
    assert conn.execute("SELECT size FROM fairq.channels WHERE channel = %s",
                        (name,)).fetchone() == (2,)
    assert call(conn, "channel_clear", name) is True
    assert [d.channel for d in dequeue(conn, n=2)] == [name, name]
    assert problems(conn) == []


def test_largest_valid_release_interval_keeps_the_channel_usable(conn: Conn) -> None:
    """Any release_interval_ms >= 0 is valid (SPEC). Either it works, or - if the
    implementation must bound it - channel_set refuses it with 22023 naming the
    parameter. What must not happen is a channel_set that succeeds and leaves a channel
    on which every message_create (and fairq.check()) fails."""
    try:
        call(conn, "channel_set", "slow", None, INT8_MAX)
    except psycopg.Error as e:
        assert (e.sqlstate, "p_release_interval_ms" in str(e)) == (INVALID, True), str(e)
        return
    assert create(conn, "slow")[1] == "created"
    assert create(conn, "slow")[1] == "created"
    assert len(dequeue(conn, n=2)) == 1  # the second release waits "forever"
    assert problems(conn) == []


TEN_YEARS_MS = 315_360_000_000  # the longest duration (README, "Limits")


@pytest.mark.parametrize("lock_ms", [TEN_YEARS_MS + 1, 10**16, INT8_MAX],
                         ids=["ten years and 1 ms", "10^16", "bigint max"])
def test_a_lock_beyond_ten_years_is_refused_as_invalid(conn: Conn, lock_ms: int) -> None:
    """Durations are at most ten years: a longer p_lock_ms is an invalid argument
    (22023 naming p_lock_ms), not a datetime overflow, and changes nothing."""
    create(conn, "a")
    create(conn, "b")
    d = dequeue_one(conn)
    assert d is not None
    for sql, args in (("SELECT id FROM fairq.message_dequeue(%s::bigint)", (lock_ms,)),
                      ("SELECT fairq.message_heartbeat(%s, %s, %s::bigint)",
                       (d.id, d.num_attempts, lock_ms))):
        with pytest.raises(psycopg.Error) as refused:
            conn.execute(sql, args)
        assert (refused.value.sqlstate, "p_lock_ms" in str(refused.value)) == (INVALID, True), sql
    assert problems(conn) == []
    assert complete(conn, d) == "completed"  # still held, with its token
    assert [m.channel for m in dequeue(conn)] == ["b"]  # still ready


def test_a_lock_of_ten_years_is_honoured(conn: Conn) -> None:
    create(conn, "a")
    d = dequeue_one(conn, lock_ms=TEN_YEARS_MS)
    assert d is not None
    assert call(conn, "message_heartbeat", d.id, d.num_attempts, TEN_YEARS_MS) == "heartbeated"
    travel(conn, 9 * 365 * 86_400_000)  # nine years on: still held
    assert dequeue(conn) == []
    assert complete(conn, d) == "completed"
    assert problems(conn) == []


def test_long_dedup_key_is_accepted_or_refused_as_invalid(conn: Conn) -> None:
    """No length limit is documented for dedup keys; a long one must either work or be
    refused as an invalid argument, not hit an index row size limit (54000)."""
    key = random.Random(1).randbytes(3000).hex()  # 6000 characters, incompressible
    try:
        first = create(conn, "a", dedup_key=key)
    except psycopg.Error as e:
        assert (e.sqlstate, "p_dedup_key" in str(e)) == (INVALID, True), f"{e.sqlstate}: {e}"
        return
    assert first[1] == "created"
    assert create(conn, "a", dedup_key=key) == (first[0], "duplicate")


def test_null_priority_means_the_same_in_create_and_create_batch(conn: Conn) -> None:
    """message_create_batch has 'the same semantics as message_create' per element
    (SPEC), so a NULL priority is either an error in both (22004 naming the parameter)
    or the default priority in both."""
    def outcome(sql: str) -> str:
        try:
            conn.execute(sql)
        except psycopg.Error as e:
            return f"{e.sqlstate} names priority: {'p_priorit' in str(e)}"
        return str(conn.execute("SELECT priority FROM fairq.message ORDER BY id DESC LIMIT 1")
                   .fetchone())

    single = outcome("SELECT * FROM fairq.message_create('a', 'x', NULL, NULL)")
    batch = outcome("SELECT * FROM fairq.message_create_batch('{b}', '{x}', NULL, '{NULL}')")
    assert single == batch
    assert single in ("(0,)", f"{NOT_NULL} names priority: True")


# -- Expected outcomes are results, never exceptions ------------------------------------


def test_expected_outcomes_are_results(conn: Conn) -> None:
    conn.execute("SET fairq.history = on")
    assert dequeue(conn) == []
    for fn, args in (("message_complete", (424242, 1)), ("message_defer", (424242, 1)),
                     ("message_heartbeat", (424242, 1, 1000)), ("message_fail", (424242, 1)),
                     ("message_cancel", (424242,)), ("dead_letter_retry", (424242,))):
        assert call(conn, fn, *args) == "not_found", fn
    assert conn.execute("SELECT * FROM fairq.message_complete_batch('{424242}', '{1}')"
                        ).fetchall() == [(424242, "not_found")]
    assert call(conn, "channel_clear", "never-seen") is False
    assert call(conn, "history_prune", datetime.now(timezone.utc)) == 0

    call(conn, "channel_set", "tiny", None, 0, 1)
    created, status = create(conn, "tiny")
    assert status == "created"
    assert create(conn, "tiny") == (None, "dropped")
    d = dequeue_one(conn)
    assert d is not None and d.id == created
    assert dequeue(conn, n=5) == []
    assert call(conn, "message_cancel", d.id) == "locked"
    for fn, args in (("message_complete", (d.id, d.num_attempts + 1)),
                     ("message_defer", (d.id, d.num_attempts + 1)),
                     ("message_heartbeat", (d.id, d.num_attempts + 1, 1000)),
                     ("message_fail", (d.id, d.num_attempts + 1))):
        assert call(conn, fn, *args) == "stale", fn
    assert problems(conn) == []


# -- Fuzz: any argument values give a result or a documented error -----------------------

# Text that PostgreSQL can hold: no NUL and no lone surrogates (psycopg refuses those
# before anything reaches the server; they are not values of type text at all).
SAFE_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
INT_EXTREMES = [0, 1, -1, INT4_MIN, INT4_MAX, INT4_MIN - 1, INT4_MAX + 1,
                INT8_MIN, INT8_MAX, INT8_MIN - 1, INT8_MAX + 1]

ints = st.one_of(st.none(), st.integers(-3, 5), st.sampled_from(INT_EXTREMES),
                 st.integers(2**31, 2**64), st.integers(-(2**64), -(2**31)),
                 st.integers(INT8_MIN - 10, INT8_MAX + 10))
texts = st.one_of(
    st.none(),
    st.sampled_from(["a", "b", "c"]),  # so that calls meet on the same channels
    st.text(SAFE_CHARS, max_size=20),
    st.sampled_from(["", *NAMES_OF_255_BYTES.values(), *NAMES_OF_256_BYTES.values()]),
    st.builds(lambda s, n: s * n, st.text(SAFE_CHARS, min_size=1, max_size=4),
              st.integers(1, 1500)),  # up to a few KB, compressible
    st.integers(0, 2**32).map(lambda seed: random.Random(seed).randbytes(2000).hex()),  # 4 KB
)


class Blob(bytes):
    """A large random payload that shows itself briefly in hypothesis' reports."""

    def __repr__(self) -> str:
        return f"<{len(self)} random bytes>"


payloads = st.one_of(
    st.none(), st.binary(max_size=64),
    st.integers(0, 2**32).map(lambda seed: Blob(random.Random(seed).randbytes(2**20))),  # 1 MB
)
timestamps = st.one_of(st.none(), st.datetimes(timezones=st.just(timezone.utc)),
                       st.sampled_from(["infinity", "-infinity"]))

# (SQL, parameter names in order, the range of each integer parameter's type)
INT4, INT8 = (INT4_MIN, INT4_MAX), (INT8_MIN, INT8_MAX)
FUZZED = {
    "message_create": (
        "SELECT * FROM fairq.message_create(%s::text, %s::bytea, %s::timestamptz, %s::int,"
        " %s::text)",
        ("p_channel", "p_content", "p_dequeue_at", "p_priority", "p_dedup_key"),
        (None, None, None, INT4, None),
        st.tuples(texts, payloads, timestamps, ints, texts)),
    "message_dequeue": (
        "SELECT * FROM fairq.message_dequeue(%s::bigint, %s::int)",
        ("p_lock_ms", "p_max_messages"),
        (INT8, INT4),
        st.tuples(ints, ints)),
    "channel_set": (
        "SELECT fairq.channel_set(%s::text, %s::int, %s::bigint, %s::int, %s::int)",
        ("p_channel", "p_max_concurrency", "p_release_interval_ms", "p_max_size", "p_max_attempts"),
        (None, INT4, INT8, INT4, INT4),
        st.tuples(texts, ints, ints, ints, ints)),
}
fuzz_calls = st.one_of(*(st.tuples(st.just(fn), spec[3]) for fn, spec in FUZZED.items()))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large],
          max_examples=60, deadline=None)
@given(calls=st.lists(fuzz_calls, min_size=1, max_size=6))
def test_fuzzed_arguments_give_a_result_or_a_documented_error(
    conn: Conn, calls: list[tuple[str, tuple[Any, ...]]]
) -> None:
    """Legitimate outcomes of a call:
    * success;
    * 22004 / 22023 naming one of the function's parameters (SPEC behaviour 8);
    * 22003, exactly when an integer does not fit the parameter's type (int or
      bigint): the cast in the caller's SQL fails and fairq is never called - this
      is what any client sees when it passes such a value, not an error of fairq's.
    Anything else (22008 datetime overflow, 54000 index row too big, XX000, 42xxx...)
    is a bug. Whatever happened, the queue's invariants still hold."""
    # Each example starts from an empty queue, so that it replays deterministically.
    conn.execute("TRUNCATE fairq.channel, fairq.channel_size, fairq.channel_size_change, fairq.channel_wake,"
                 " fairq.message, fairq.dead_letter,"
                 " fairq.message_history")
    for fn, args in calls:
        sql, names, int_ranges, _ = FUZZED[fn]
        unrepresentable = any(
            r is not None and v is not None and not r[0] <= v <= r[1]
            for v, r in zip(args, int_ranges, strict=True))
        call_fuzzed(conn, fn, sql, args, names, unrepresentable)
    assert problems(conn) == []
