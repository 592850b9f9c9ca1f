"""The `fairq` command, end to end, in subprocesses."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fairq import Queue
from fairq.doctor import Finding, Verdict, diagnose
from test_install import CURRENT, later, plain_dsn, upgrade_dir  # noqa: F401  (plain_dsn: fixture)
from test_worker import _log, _marks, _worker_process, eventually

FAIRQ = Path(sys.executable).parent / "fairq"


def fairq(*args: str, dsn: str | None = None, stdin: bytes | None = None,
          module: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    if dsn is not None:
        env["DATABASE_URL"] = dsn
    command = [sys.executable, "-m", "fairq"] if module else [str(FAIRQ)]
    return subprocess.run([*command, *args], env=env, capture_output=True, timeout=60,
                          text=stdin is None, input=stdin)


@pytest.mark.parametrize("args", [
    ("channel", "set", "x", "--release-interval-ms", "999999999999999999999"),
    ("channel", "set", "x", "--max-concurrency", "99999999999"),
    ("send", "c", "hi", "--priority", "99999999999"),
    ("dead", "retry", "99999999999999999999"),
    ("dead", "delete", "99999999999999999999"),
    ("dead", "list", "--limit", "-1"),
    ("worker", "json:dumps", "--concurrency", "-3"),
    # Past the SQL's longest duration, building the timedelta ended in an OverflowError.
    ("channel", "set", "x", "--release-interval-ms", "86400000000000000"),
    ("channel", "set", "x", "--release-interval-ms", str(2**63 - 1)),
    # A thread each: "can't start new thread", in a traceback.
    ("worker", "json:dumps", "--concurrency", "100000"),
])
def test_a_number_out_of_range_is_a_usage_error_naming_its_option(args: tuple[str, ...]) -> None:
    """Past the SQL's integer or bigint, a number failed in the database naming no
    option (or before it, with a traceback), exit 1; a negative concurrency failed in
    the pool's own words. Nothing is sent: the DSN is never used."""
    done = fairq(*args, dsn="dbname=fairq_never_used host=127.0.0.1 port=1")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "expected" in done.stderr
    assert ("ID" if args[1] in ("retry", "delete") else args[-2]) in done.stderr


def test_help_and_usage_errors() -> None:
    shown = fairq("--help")
    assert shown.returncode == 0
    for command in ("install", "upgrade", "queue", "channel", "send", "stats", "dead", "history",
                    "worker", "bench", "demo"):
        assert command in shown.stdout
    assert fairq("channel", "--help").returncode == 0
    missing_dsn = fairq("stats")
    assert missing_dsn.returncode == 2 and "DATABASE_URL" in missing_dsn.stderr
    assert fairq("frobnicate", dsn="dbname=x").returncode == 2
    assert fairq("worker", "no_colon", dsn="dbname=x").returncode == 2
    missing_handler = fairq("worker", "no_such_module:run", dsn="dbname=x")
    assert missing_handler.returncode == 2 and "no_such_module" in missing_handler.stderr


def test_worker_max_attempts_may_be_none() -> None:
    """Worker(max_attempts=None), which the docs advise for a fresh budget after each
    retry, could not be asked for from the command line."""
    from fairq.cli import _parser

    args = _parser().parse_args(["--dsn", "dbname=x", "worker", "json:loads",
                                 "--max-attempts", "none"])
    assert args.max_attempts is None


@pytest.mark.parametrize("args", [("send", "a", "x", "--delay", "inf"),
                                  ("send", "a", "x", "--delay", "1e20"),
                                  ("send", "a", "x", "--delay", "-1"),
                                  ("worker", "json:loads", "--concurrency", "0"),
                                  ("worker", "json:loads", "--lock", "0"),
                                  ("worker", "json:loads", "--poll", "-1")])
def test_out_of_range_options_are_usage_errors(dsn: str, args: tuple[str, ...]) -> None:
    """They ended in a traceback (OverflowError, or Worker's ValueError) and exit 1."""
    result = fairq("--dsn", dsn, *args)
    assert (result.returncode, "Traceback" in result.stderr) == (2, False), result.stderr


@pytest.mark.parametrize("args", [("dashboard", "--port", "99999"),
                                  ("metrics", "--port", "99999"),
                                  ("demo", "--dashboard-port", "70000"),
                                  ("dashboard", "--interval", "inf"),
                                  ("dashboard", "--interval", "1e300"),
                                  ("metrics", "--interval", "inf"),
                                  ("report", "--out", "d", "--window", "inf"),
                                  ("report", "--out", "d", "--since", "99999999999d"),
                                  ("report", "--out", "d", "--since", "800000d")])
def test_delegated_commands_refuse_out_of_range_options_as_usage_errors(
        args: tuple[str, ...]) -> None:
    """They ended in OverflowError tracebacks (socket.bind, timedelta)."""
    result = fairq("--dsn", "host=127.0.0.1 port=1 dbname=never_used", *args)
    assert (result.returncode, "Traceback" in result.stderr) == (2, False), result.stderr
    option = next(a for a in reversed(args) if a.startswith("--"))
    assert f"argument {option}:" in result.stderr


def test_long_durations_are_refused_with_their_bound() -> None:
    """--delay 1e20 was reported as "expected ... at least 0"."""
    result = fairq("--dsn", "dbname=never_used", "send", "c", "x", "--delay", "1e20")
    assert result.returncode == 2 and "at most 315360000" in result.stderr, result.stderr


@pytest.mark.parametrize("args", [("--ds", "dbname=never_used", "metrics"),
                                  ("--dsn", "dbname=a", "--dsn", "dbname=b", "metrics"),
                                  ("--dsn", "host=127.0.0.1 port=1", "send", "--prio", "1", "c",
                                   "x")])
def test_abbreviations_and_misplaced_options_are_refused(args: tuple[str, ...]) -> None:
    """`fairq --ds URL metrics` took --ds for --dsn and metrics for a command of the main
    parser, which did nothing, exit 0 (so did a --dsn given twice)."""
    result = fairq(*args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "usage:" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [("stats",), ("dashboard",), ("metrics", "--once"),
                                     ("report", "--out", "x")])
def test_a_malformed_database_url_is_named(command: tuple[str, ...]) -> None:
    """It was reported as the malformed "argument --dsn", which was not given."""
    result = fairq(*command, dsn=f"postgresql://app:{SECRET}%zz@127.0.0.1:1/app")
    assert result.returncode == 2 and SECRET not in result.stderr
    assert "error: DATABASE_URL: the connection string is malformed" in result.stderr, (
        result.stderr)


def test_bench_hides_the_password_and_refuses_a_database_in_use_in_one_line(dsn: str) -> None:
    """Its first progress line showed --dsn, password and all; and a database holding
    fairq data was refused with a RuntimeError traceback."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT fairq.queue_pause('billing')")
    # (The test server trusts its connections: the password is not checked.)
    with_password = psycopg.conninfo.make_conninfo(dsn, password=SECRET)
    result = fairq("bench", "--dsn", with_password, "--sizes", "tiny", "--only", "depth")
    assert result.returncode == 1, result.stderr
    assert SECRET not in result.stdout + result.stderr and "Traceback" not in result.stderr
    assert "against" in result.stderr  # the progress line, without the password
    assert result.stderr.splitlines()[-1].startswith(
        "fairq bench: the database already holds fairq data (fairq.queue")


def test_bench_demo_and_report_are_handed_their_own_command_line() -> None:
    for command in ("bench", "demo", "report"):
        result = fairq(command, "--help")
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"usage: fairq {command}"), result.stdout
    assert "bench" in fairq("--help").stdout


SECRET = "Hunter2"
MALFORMED_DSNS = [f"postgresql://app:{SECRET}%zz@127.0.0.1:1/app",
                  f"host=127.0.0.1 port=1 user=app password={SECRET} phrase dbname=app",
                  # libpq reads it, with the password's tail as the host: "could not
                  # translate host name "Hunter2@127.0.0.1"" printed it.
                  f"postgresql://app:s3cr@{SECRET}@127.0.0.1:1/app"]


@pytest.mark.parametrize("command", [("stats",), ("report", "--out", "x"), ("dashboard",),
                                     ("metrics", "--once"), ("bench",), ("demo",)])
@pytest.mark.parametrize("malformed", MALFORMED_DSNS, ids=["url", "keywords", "at-in-password"])
def test_a_malformed_dsn_is_a_usage_error_that_does_not_show_it(
        command: tuple[str, ...], malformed: str) -> None:
    """libpq quotes the text it cannot parse, which may be the password: it was printed
    (in a traceback for the report, and in a log line at each retry of a worker)."""
    for args in ((f"--dsn={malformed}", *command), ("--dsn", malformed, *command)):
        result = fairq(*args)
        assert (result.returncode, SECRET in result.stdout + result.stderr) == (2, False), (
            result.stderr)
        assert "malformed" in result.stderr
    with pytest.raises(ValueError, match="malformed") as excinfo:
        Queue(malformed)
    assert SECRET not in str(excinfo.value)


def test_channel_send_stats_and_dead_letters(dsn: str) -> None:
    assert fairq("--dsn", dsn, "channel", "set", "acme", "--max-concurrency", "2",
                 "--release-interval-ms", "250", "--max-attempts", "3").returncode == 0
    listed = fairq("channel", "list", dsn=dsn)  # DATABASE_URL works as well as --dsn
    assert listed.returncode == 0
    assert "acme" in listed.stdout and "concurrency=2 interval_ms=250 attempts=3" in listed.stdout

    sent = fairq("send", "acme", "hello", "--priority", "3", dsn=dsn)
    assert sent.returncode == 0 and sent.stdout.startswith("created ")
    message_id = int(sent.stdout.split()[1])
    piped = fairq("send", "acme", "-", "--delay", "3600", dsn=dsn, stdin=b"\x00\x01")
    assert piped.returncode == 0

    stats = fairq("stats", dsn=dsn, module=True).stdout.splitlines()
    assert stats[0].split() == ["queue", "channels", "size", "ready", "scheduled", "in_flight",
                                "dead", "paused_until"]
    assert stats[1].split() == ["default", "1", "2", "1", "1", "0", "0", "-"]

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT fairq.message_dequeue(1000)")
        conn.execute("SELECT fairq.message_fail(%s, 1, 'broken')", (message_id,))
    dead = fairq("dead", "list", dsn=dsn)
    assert dead.returncode == 0
    assert dead.stdout.splitlines()[1].split()[:3] == [str(message_id), "acme", "1"]
    assert "broken" in dead.stdout
    assert fairq("dead", "retry", str(message_id), dsn=dsn).stdout.split() == [
        str(message_id), "requeued"]
    again = fairq("dead", "retry", str(message_id), dsn=dsn)
    assert again.returncode == 1 and "no dead letter" in again.stderr

    cleared = fairq("channel", "clear", "acme", dsn=dsn)
    assert cleared.returncode == 0 and "policy cleared" in cleared.stdout


def test_a_send_to_a_full_channel_exits_1(dsn: str) -> None:
    """A dropped message was not stored: a script must see it (0.7.31 exited 0)."""
    assert fairq("channel", "set", "full", "--max-size", "1", dsn=dsn).returncode == 0
    assert fairq("send", "full", "a", dsn=dsn).returncode == 0
    dropped = fairq("send", "full", "b", dsn=dsn)
    assert dropped.returncode == 1
    assert dropped.stdout == "dropped -\n" and "nothing was stored" in dropped.stderr


def fairq_writing_to(stdout: Any, *args: str, dsn: str,
                     env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`fairq ARGS` with its standard output going to ``stdout``."""
    return subprocess.run([str(FAIRQ), *args], env={**os.environ, "DATABASE_URL": dsn, **(env or {})},
                          stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=60)


def closed_pipe() -> int:
    """The write end of a pipe nothing reads any more (`| head -0`)."""
    read, write = os.pipe()
    os.close(read)
    return write


@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_output_nobody_reads_is_no_traceback_and_a_send_done_is_no_failure(
        dsn: str, unbuffered: str) -> None:
    """`fairq stats | head -0` ended in a BrokenPipeError traceback, exit 1; so did
    `fairq send c x | true`, though the message was stored: a script retried it and sent
    it twice. Unbuffered (PYTHONUNBUFFERED, as containers often set), the print itself
    fails, right after the send."""
    env = {"PYTHONUNBUFFERED": unbuffered}
    assert fairq("channel", "set", "full", "--max-size", "1", dsn=dsn).returncode == 0
    pipe = closed_pipe()
    try:
        results = {args: fairq_writing_to(pipe, *args, dsn=dsn, env=env) for args in [
            ("send", "full", "a"), ("send", "full", "b"), ("stats",), ("doctor",),
            ("channel", "list")]}
    finally:
        os.close(pipe)
    assert {args: (r.returncode, "Traceback" in r.stderr) for args, r in results.items()} == {
        ("send", "full", "a"): (0, False),  # stored: its own outcome
        ("send", "full", "b"): (1, False),  # dropped: its own outcome too
        ("stats",): (141, False), ("doctor",): (141, False), ("channel", "list"): (141, False)}
    assert "nothing was stored" in results[("send", "full", "b")].stderr
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM fairq.message").fetchone() == (1,)


def test_output_that_cannot_be_written_is_one_line_and_exit_1(dsn: str) -> None:
    """`fairq stats > /dev/full` ended in an OSError traceback."""
    with open("/dev/full", "w") as full:
        result = fairq_writing_to(full, "stats", dsn=dsn)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr == "fairq stats: cannot write the output: No space left on device\n"


def test_send_without_stdin_is_a_usage_error(dsn: str) -> None:
    """`fairq send c - <&-` ended in an AttributeError traceback (sys.stdin is None)."""
    result = subprocess.run([str(FAIRQ), "--dsn", dsn, "send", "c", "-"], capture_output=True,
                            text=True, timeout=60, preexec_fn=lambda: os.close(0))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "no standard input" in result.stderr


def test_send_takes_content_that_is_not_utf8_byte_exact(dsn: str) -> None:
    """An argument that is not UTF-8 was refused as a usage error (a UnicodeEncodeError
    taken for one), though the content is bytes."""
    sent = fairq("send", "c", os.fsdecode(b"caf\xe9 \xff"), dsn=dsn)
    assert sent.returncode == 0, sent.stderr
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT content FROM fairq.message").fetchone() == (b"caf\xe9 \xff",)


def test_a_name_the_output_encoding_cannot_show_is_escaped(dsn: str) -> None:
    """A UnicodeEncodeError printing it was taken for a usage error (exit 2)."""
    assert fairq("channel", "set", "café", dsn=dsn).returncode == 0
    listed = fairq_writing_to(subprocess.PIPE, "channel", "list", dsn=dsn,
                              env={"PYTHONIOENCODING": "ascii"})
    assert listed.returncode == 0, listed.stderr
    assert "caf\\xe9" in listed.stdout


@pytest.mark.parametrize("source", ["raise ValueError('boom')\ndef run(m): pass\n",
                                    "def run(m:\n"], ids=["ValueError", "SyntaxError"])
def test_a_handler_module_that_fails_to_import_is_named(tmp_path: Path, source: str) -> None:
    """A ValueError it raised was shown as a usage error of its own text ("boom"); a
    SyntaxError as a traceback, exit 1."""
    (tmp_path / "broken_handler.py").write_text(source)
    result = subprocess.run([str(FAIRQ), "--dsn", "dbname=never_used", "worker",
                             "broken_handler:run"], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "cannot load broken_handler:run:" in result.stderr


def _findings(result: subprocess.CompletedProcess[str]) -> dict[str, tuple[str, str]]:
    """`fairq doctor`'s table: check -> (verdict, detail)."""
    rows = [re.split(r"\s{2,}", line, maxsplit=2) for line in result.stdout.splitlines()]
    assert rows[0] == ["check", "verdict", "detail"]
    return {row[0]: (row[1], row[2]) for row in rows[1:]}


def test_doctor_reports_what_keeps_fairq_from_running_well(dsn: str) -> None:
    healthy = fairq("doctor", "--invariants", dsn=dsn)
    assert healthy.returncode == 0, healthy.stderr
    found = _findings(healthy)
    behind = os.environ.get("FAIRQ_TEST_EXTENSION_VERSION", CURRENT) != CURRENT
    assert found["version"][0] == ("warning" if behind else "ok")
    assert {check: found[check][0] for check in
            ("oldest transaction", "tables", "privileges", "periodic schedules", "invariants")
            } == dict.fromkeys(
        ("oldest transaction", "tables", "privileges", "periodic schedules", "invariants"), "ok")
    assert found["autovacuum"][0] in ("ok", "warning")  # warning: a naptime over 10 s

    with psycopg.connect(dsn, autocommit=True) as conn:
        # A table of fairq's that autovacuum never visits, with 20,000 dead rows.
        conn.execute("CREATE TABLE fairq.unvisited WITH (autovacuum_enabled = false)"
                     " AS SELECT i FROM generate_series(1, 20000) i")
        conn.execute("DELETE FROM fairq.unvisited")
        eventually(lambda: conn.execute(
            "SELECT n_dead_tup >= 20000 FROM pg_stat_all_tables"
            " WHERE relid = 'fairq.unvisited'::regclass").fetchone() == (True,))
    with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn) as holder:
        holder_pid = holder.info.backend_pid
        holder.execute("SELECT txid_current()")  # an open transaction, left idle
        conn.execute("GRANT EXECUTE ON FUNCTION fairq.check() TO PUBLIC")
        # (A function made without a REVOKE: its default ACL lets PUBLIC run it.)
        conn.execute("CREATE FUNCTION fairq.added() RETURNS int LANGUAGE sql AS 'SELECT 1'")
        conn.execute("SELECT fairq.channel_set('tenant-a', p_max_concurrency => 2)")
        conn.execute("SELECT fairq.message_create('tenant-a', '\\x00')")
        conn.execute("SELECT fairq.message_dequeue(60000)")
        conn.execute("UPDATE fairq.channel SET in_flight = 2 WHERE name = 'tenant-a'")
        # Each schedule's driver would die after three ticks.
        conn.execute("SELECT fairq.channel_set('fairq.periodic', p_max_attempts => 3)")
        sick = fairq("doctor", "--invariants", "--max-transaction-age", "0", dsn=dsn)
        quick = fairq("doctor", dsn=dsn)
        holder.rollback()
    assert sick.returncode == 1 and "3 problems found" in sick.stderr
    found = _findings(sick)
    assert found["oldest transaction"][0] == "warning"
    assert f"backend {holder_pid} has held a snapshot" in found["oldest transaction"][1]
    assert found["privileges"] == (
        "problem", 'granted to PUBLIC: fairq."check"(), fairq.added(); revoke that, and give'
        " roles what they need with fairq.grant_producer, grant_worker or grant_observer")
    assert found["table fairq.unvisited"] == (
        "warning", "20,000 dead rows and never vacuumed: autovacuum is not keeping up (see"
        " the oldest transaction, and docs/operations.md on table health)")
    assert "tables" not in found
    assert found["periodic schedules, queue default"] == (
        "problem", "channel fairq.periodic has max_attempts 3: each schedule's driver dies"
        " after 3 ticks; set its policy again without p_max_attempts, or SELECT"
        " fairq.channel_clear('fairq.periodic', 'default')")
    assert found["invariant, channel tenant-a"] == (
        "problem", "in_flight is 2 but 1 messages are locked (max_concurrency 2)")
    # Without --invariants fairq.check() is not run; the default age spares a fresh
    # transaction.
    assert quick.returncode == 1 and "2 problems found" in quick.stderr
    assert _findings(quick)["oldest transaction"][0] == "ok"


def test_doctor_as_an_observer_says_what_it_cannot_see(dsn: str, server: Any) -> None:
    """A role given fairq.grant_observer runs every check, and is told that sessions of
    other roles are hidden from it instead of hearing that none holds a snapshot."""
    role = f"fairq_doctor_{uuid.uuid4().hex[:12]}"
    server.admin(f'CREATE ROLE "{role}" LOGIN')
    try:
        with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn) as holder:
            conn.execute("SELECT fairq.grant_observer(%s::regrole)", [role])
            holder.execute("SELECT txid_current()")
            seen = fairq("doctor", "--invariants", "--max-transaction-age", "0",
                         dsn=psycopg.conninfo.make_conninfo(dsn, user=role))
            holder.rollback()
            conn.execute(f'DROP OWNED BY "{role}"')
    finally:
        server.admin(f'DROP ROLE "{role}"')
    assert seen.returncode == 0, seen.stderr
    found = _findings(seen)
    verdict, detail = found["oldest transaction"]  # (holder, conn, any autovacuum)
    assert verdict == "warning" and re.fullmatch(
        r"([2-9]|\d\d+) sessions of this database are hidden from this role: grant it"
        " pg_read_all_stats to see whether one holds back vacuum", detail), detail
    assert found["invariants"][0] == "ok" and found["privileges"][0] == "ok"


@pytest.mark.parametrize("grant", [None, "grant_producer"])
def test_doctor_without_the_observer_grant_says_what_it_could_not_check(
        dsn: str, server: Any, grant: str | None) -> None:
    """fairq.check() is denied to a role without fairq.grant_observer (no USAGE on
    schema fairq, or no EXECUTE on it): the doctor ended on that one error, printing
    none of the findings it had made."""
    role = f"fairq_doctor_{uuid.uuid4().hex[:12]}"
    server.admin(f'CREATE ROLE "{role}" LOGIN')
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            if grant is not None:
                conn.execute(f"SELECT fairq.{grant}(%s::regrole)", [role])  # type: ignore[arg-type]
            seen = fairq("doctor", "--invariants",
                         dsn=psycopg.conninfo.make_conninfo(dsn, user=role))
            conn.execute(f'DROP OWNED BY "{role}"')  # type: ignore[arg-type]
    finally:
        server.admin(f'DROP ROLE "{role}"')
    assert seen.returncode == 1 and "2 problems found" in seen.stderr, seen.stderr
    found = _findings(seen)
    assert found["periodic schedules"] == (
        "problem", f"could not run as {role}: permission denied for"
        f" {'schema fairq' if grant is None else 'view channels'}; reading fairq.channels"
        f" needs fairq.grant_observer (SELECT fairq.grant_observer('{role}') as the owner of"
        " fairq)")
    denied = "schema fairq" if grant is None else "function check"
    assert found["invariants"] == (
        "problem", f"could not run as {role}: permission denied for {denied}; fairq.check()"
        f" needs fairq.grant_observer (SELECT fairq.grant_observer('{role}') as the owner of"
        " fairq)")
    assert {check: found[check][0] for check in ("version", "tables", "privileges")} == (
        dict.fromkeys(("version", "tables", "privileges"), "ok"))


def test_doctor_of_a_plain_install_as_an_observer_runs_the_other_checks(
        plain_dsn: str, server: Any) -> None:  # noqa: F811
    """fairq.installed_version is its owner's alone: the doctor stopped at the version,
    advising fairq.grant_observer, which does not give it."""
    role = f"fairq_doctor_{uuid.uuid4().hex[:12]}"
    server.admin(f'CREATE ROLE "{role}" LOGIN')
    try:
        assert fairq("install", dsn=plain_dsn).returncode == 0
        with psycopg.connect(plain_dsn, autocommit=True) as conn:
            conn.execute("SELECT fairq.grant_observer(%s::regrole)", [role])
            seen = fairq("doctor", "--invariants",
                         dsn=psycopg.conninfo.make_conninfo(plain_dsn, user=role))
            conn.execute(f'DROP OWNED BY "{role}"')  # type: ignore[arg-type]
    finally:
        server.admin(f'DROP ROLE "{role}"')
    assert seen.returncode == 1 and "1 problem found" in seen.stderr, seen.stderr
    found = _findings(seen)
    assert found["version"] == (
        "problem", f"could not run as {role}: permission denied for table installed_version;"
        " a plain install's version is in fairq.installed_version, which only the owner of"
        " schema fairq may read: run the doctor as that owner")
    assert found["invariants"][0] == "ok" and found["privileges"][0] == "ok"


def test_diagnose_goes_on_past_a_check_it_may_not_run(dsn: str, server: Any) -> None:
    """In the caller's transaction: a denied check is rolled back to its savepoint, and
    the next one runs (the aborted transaction failed every check after it)."""
    role = f"fairq_doctor_{uuid.uuid4().hex[:12]}"
    server.admin(f'CREATE ROLE "{role}"')
    try:
        with psycopg.connect(dsn) as conn:
            conn.execute("SELECT fairq.grant_observer(%s::regrole)", [role])
            # (A hardened database: the catalogs in it are this database's own.)
            conn.execute("REVOKE SELECT ON pg_catalog.pg_prepared_xacts FROM PUBLIC")
            conn.execute(f'SET ROLE "{role}"')  # type: ignore[arg-type]
            found = {f.check: f for f in diagnose(conn, invariants=True)}
            assert conn.execute("SELECT current_user").fetchone() == (role,)
            conn.rollback()
    finally:
        server.admin(f'DROP ROLE "{role}"')
    assert found["oldest transaction"] == Finding(
        "oldest transaction", Verdict.PROBLEM,
        f"could not run as {role}: permission denied for view pg_prepared_xacts; the check"
        " reads system catalogs and statistics views: grant the role SELECT on that one")
    assert [found[check].verdict for check in ("version", "tables", "privileges", "invariants")
            ] == [Verdict.OK] * 4


def test_database_errors_exit_1(dsn: str) -> None:
    result = fairq("send", "", "x", dsn=dsn)
    assert result.returncode == 1 and "p_channel" in result.stderr
    unreachable = fairq("stats", dsn="host=127.0.0.1 port=1 dbname=none connect_timeout=2")
    assert unreachable.returncode == 1


def test_install_and_upgrade(plain_dsn: str, dsn: str, tmp_path: Path) -> None:  # noqa: F811
    installed = fairq("install", "--dsn", plain_dsn)
    assert installed.returncode == 0, installed.stderr
    assert "installed" in installed.stdout
    assert fairq("send", "a", "x", dsn=plain_dsn).stdout.startswith("created")
    twice = fairq("install", dsn=plain_dsn)
    assert twice.returncode == 1 and "already installed" in twice.stderr
    upgraded = fairq("upgrade", dsn=plain_dsn)
    assert upgraded.returncode == 0 and "already up to date" in upgraded.stdout
    doctor = fairq("doctor", "--invariants", dsn=plain_dsn)
    assert doctor.returncode == 0, doctor.stderr
    assert _findings(doctor)["version"] == ("ok", f"plain install {CURRENT}")
    assert _findings(doctor)["privileges"][0] == "ok"
    (next_version,) = later(1)
    scripts = upgrade_dir(tmp_path, [next_version])
    upgraded = fairq("upgrade", "--scripts", str(scripts.directory), dsn=plain_dsn)
    assert upgraded.returncode == 0, upgraded.stderr
    assert upgraded.stdout.split() == ["applied", f"fairq--{CURRENT}--{next_version}.sql"]
    downgrade = fairq("upgrade", dsn=plain_dsn)
    assert downgrade.returncode == 1 and f"newer than this package's {CURRENT}" in (
        downgrade.stderr), downgrade.stderr

    refused = fairq("install", dsn=dsn)
    assert refused.returncode == 1 and "extension" in refused.stderr


@pytest.mark.parametrize("command", ["install", "upgrade"])
def test_scripts_that_cannot_be_read_are_refused_in_one_line(
        plain_dsn: str, tmp_path: Path, command: str) -> None:  # noqa: F811
    """--scripts naming no directory, or one without fairq.control, ended in a
    FileNotFoundError traceback."""
    for directory in (tmp_path / "nonexistent", tmp_path):
        result = fairq(command, "--scripts", str(directory), dsn=plain_dsn)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert f"cannot read {directory / 'fairq.control'}" in result.stderr


def table(out: str) -> list[list[str]]:
    """The rows of a table the CLI printed, as cells (header included)."""
    return [line.split() for line in out.splitlines() if line.strip()]


def test_channel_set_says_the_whole_policy_now_in_force(dsn: str) -> None:
    """`channel set` replaces the whole policy: an operator who raised a tenant's weight
    with `--weight 3` silently removed its `--max-concurrency` cap, and the command
    said only "policy set". It prints the policy now in force."""
    def ok(*args: str) -> str:
        done = fairq(*args, dsn=dsn)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert ok("channel", "set", "acme", "--max-concurrency", "2", "--max-attempts", "3") == (
        "channel acme: policy set: weight=1 concurrency=2 attempts=3"
        " (any limit not given is removed)\n")
    assert ok("channel", "set", "acme", "--weight", "3") == (
        "channel acme: policy set: weight=3, no limits (any limit not given is removed)\n")
    assert table(ok("channel", "list"))[1] == ["acme", "3", "-", "-"]


def test_queues_weights_and_pauses(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The commands' local time zone: UTC-5 (POSIX names count westwards).
    monkeypatch.setenv("TZ", "Etc/GMT+5")
    local_zone = timezone(timedelta(hours=-5))

    def ok(*args: str) -> str:
        done = fairq(*args, dsn=dsn)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def paused_until(sql: str) -> object:
        with psycopg.connect(dsn) as conn:
            row = conn.execute(f"SELECT paused_until::text FROM {sql}").fetchone()  # type: ignore[arg-type]
        return row and row[0]

    assert ok("channel", "set", "acme", "--weight", "3", "--max-concurrency", "2",
              "--queue", "emails") == (
        "channel acme: policy set: weight=3 concurrency=2 (any limit not given is removed)\n")
    assert ok("send", "acme", "hello", "--queue", "emails").startswith("created ")
    assert ok("send", "acme", "plain").startswith("created ")  # the default queue
    assert table(ok("channel", "list", "--queue", "emails")) == [
        ["channel", "weight", "limits", "paused_until"], ["acme", "3", "concurrency=2", "-"]]
    assert table(ok("channel", "list"))[1] == ["acme", "1", "-", "-"]

    channel = "fairq.channels WHERE queue = 'emails'"
    assert ok("channel", "pause", "acme", "--queue", "emails") == (
        "channel acme: paused until resumed\n")
    assert paused_until(channel) == "infinity"
    assert table(ok("channel", "list", "--queue", "emails"))[1][-1] == "infinity"
    assert ok("channel", "resume", "acme", "--queue", "emails") == "channel acme: resumed\n"
    assert ok("channel", "resume", "acme", "--queue", "emails") == (
        "channel acme: was not paused\n")
    until = (datetime.now(timezone.utc) + timedelta(hours=1)).replace(microsecond=0)
    ok("channel", "pause", "acme", "--until", until.isoformat(), "--queue", "emails")
    with psycopg.connect(dsn) as conn:
        assert conn.execute(f"SELECT paused_until FROM {channel}").fetchone() == (until,)  # type: ignore[arg-type]

    queue = "fairq.queues WHERE queue = 'emails'"
    assert ok("queue", "pause", "emails") == "queue emails: paused until resumed\n"
    assert paused_until(queue) == "infinity"
    # Without an offset, --until is this machine's local time.
    naive = (datetime.now(timezone.utc) + timedelta(hours=2)).replace(tzinfo=None, microsecond=0)
    local = naive.replace(tzinfo=local_zone)
    ok("queue", "pause", "emails", "--until", naive.isoformat())
    with psycopg.connect(dsn) as conn:
        assert conn.execute(f"SELECT paused_until FROM {queue}").fetchone() == (local,)  # type: ignore[arg-type]

    stats = table(ok("stats"))
    assert stats[0] == ["queue", "channels", "size", "ready", "scheduled", "in_flight", "dead",
                        "paused_until"]
    assert stats[1] == ["default", "1", "1", "1", "0", "0", "0", "-"]
    assert stats[2][:7] == ["emails", "1", "1", "1", "0", "0", "0"]
    assert datetime.fromisoformat(stats[2][7]) == local
    ok("queue", "pause", "emails")
    one = table(ok("stats", "--queue", "emails"))
    assert one[:2] == [stats[0], ["emails", "1", "1", "1", "0", "0", "0", "infinity"]]
    assert one[2] == ["channel", "size", "ready", "scheduled", "in_flight", "weight", "limits",
                      "paused_until", "next_turn"]
    assert one[3][:7] == ["acme", "1", "1", "0", "0", "3", "concurrency=2"]
    assert datetime.fromisoformat(one[3][7]) == until
    assert table(ok("stats", "--queue", "nobody"))[1] == ["nobody", *"000000", "-"]

    assert ok("queue", "resume", "emails") == "queue emails: resumed\n"
    assert ok("queue", "resume", "emails") == "queue emails: was not paused\n"
    assert paused_until(queue) is None


def test_tenant_text_cannot_drive_the_terminal(dsn: str) -> None:
    """A channel name and an error text with an escape sequence and a newline: shown
    escaped, one row each."""
    hostile = "t\x1b]0;owned\x07\x1b[2J\nforged  9  9"
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(2):  # one dies, one stays to be listed
            conn.execute("SELECT fairq.message_create(%s, 'x', p_queue => 'esc')", [hostile])
        [(id_, n)] = conn.execute(
            "SELECT id, num_attempts FROM fairq.message_dequeue(30000, p_queue => 'esc')").fetchall()
        conn.execute("SELECT fairq.message_fail(%s, %s, %s)", [id_, n, hostile])
    # stats: the queue's table and the channels' table, each a header and one row
    for args, lines in ((("stats", "--queue", "esc"), 4), (("dead", "list", "--queue", "esc"), 2)):
        result = fairq("--dsn", dsn, *args)
        assert result.returncode == 0, result.stderr
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout
        assert len(table(result.stdout)) == lines, result.stdout
        assert "\\x1b]0;owned" in result.stdout


def test_one_shot_commands_work_where_the_default_isolation_is_another(dsn: str) -> None:
    """fairq's calls refuse REPEATABLE READ; `send` and `channel set` failed with 0A000
    on a database that defaults to it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{conn.info.dbname}" SET default_transaction_isolation'
                     " = 'repeatable read'")
    for args in (("send", "a", "hello"), ("channel", "set", "a", "--max-concurrency", "2")):
        result = fairq("--dsn", dsn, *args)
        assert result.returncode == 0, result.stderr



    past = fairq("queue", "pause", "emails", "--until", "2001-01-01T00:00:00Z", dsn=dsn)
    assert past.returncode == 1 and "p_until" in past.stderr
    garbage = fairq("channel", "pause", "a", "--until", "tomorrow", dsn=dsn)
    assert garbage.returncode == 2 and "--until" in garbage.stderr
    weight = fairq("channel", "set", "a", "--weight", "0", dsn=dsn)
    assert weight.returncode == 1 and "p_weight" in weight.stderr
    for command in (["send", "a", "x"], ["stats"], ["worker", "worker_handlers:gated"]):
        unnamed = fairq(*command, "--queue", "", dsn=dsn)
        assert unnamed.returncode == 2 and "--queue: must be non-empty" in unnamed.stderr


def test_dead_letters_are_listed_per_queue(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for queue in ("emails", "default"):
            conn.execute("SELECT fairq.message_create('a', %s::bytea, p_queue => %s)",
                         (queue.encode(), queue))
            [(message_id,)] = conn.execute(
                "SELECT id FROM fairq.message_dequeue(1000, p_queue => %s)", (queue,)).fetchall()
            conn.execute("SELECT fairq.message_fail(%s, 1, %s)", (message_id, f"{queue} failed"))
    emails = fairq("dead", "list", "--queue", "emails", dsn=dsn).stdout
    assert "emails failed" in emails and "default failed" not in emails
    assert "default failed" in fairq("dead", "list", dsn=dsn).stdout


def _bury(conn: psycopg.Connection[Any], queue: str, channel: str) -> int:
    conn.execute("SELECT fairq.message_create(%s, 'x'::bytea, p_queue => %s)", (channel, queue))
    [(message_id,)] = conn.execute(
        "SELECT id FROM fairq.message_dequeue(1000, p_queue => %s)", (queue,)).fetchall()
    conn.execute("SELECT fairq.message_fail(%s, 1, 'broken')", (message_id,))
    return int(message_id)


def test_dead_letters_are_deleted_and_purged(dsn: str) -> None:
    """`dead delete` by id (an unknown one named, exit 1, the others deleted);
    `dead purge --before` of --queue's only, or of every queue with --all-queues."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        first, second = _bury(conn, "default", "a"), _bury(conn, "default", "b")
        deleted = fairq("dead", "delete", "424242", str(first), dsn=dsn)
        assert deleted.returncode == 1 and "no dead letter with id 424242" in deleted.stderr
        assert deleted.stdout.split() == ["424242", "not_found", str(first), "deleted"]
        assert conn.execute("SELECT array_agg(id) FROM fairq.dead_letter").fetchone() == (
            [second],)
        _bury(conn, "emails", "a")
        [(between,)] = conn.execute("SELECT clock_timestamp()").fetchall()
        later = _bury(conn, "default", "c")
        before = between.isoformat()
        purged = fairq("dead", "purge", "--before", before, "--queue", "emails", dsn=dsn)
        assert purged.returncode == 0 and purged.stdout == "queue emails: 1 dead letter purged\n"
        everywhere = fairq("dead", "purge", "--before", before, "--all-queues", dsn=dsn)
        assert everywhere.stdout == "every queue: 1 dead letter purged\n"
        assert conn.execute("SELECT array_agg(id) FROM fairq.dead_letter").fetchone() == (
            [later],)
    missing = fairq("dead", "purge", dsn=dsn)
    assert missing.returncode == 2 and "--before" in missing.stderr
    naive = fairq("dead", "purge", "--before", "not a time", dsn=dsn)
    assert naive.returncode == 2 and "--before" in naive.stderr


def test_queue_drain_pauses_and_waits_until_nothing_is_in_flight(dsn: str) -> None:
    """Two messages in flight: the drain pauses the queue at once (a worker's dequeue
    gets nothing), reports the count as it falls, and exits 0 when the last completes;
    the queue stays paused."""
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for channel in ("a", "b", "c"):
            conn.execute("SELECT fairq.message_create(%s, 'x'::bytea)", (channel,))
        held = conn.execute("SELECT id, num_attempts FROM fairq.message_dequeue(600000, 2)"
                            ).fetchall()
        with subprocess.Popen([str(FAIRQ), "--dsn", dsn, "queue", "drain", "default"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as drain:
            assert drain.stdout is not None
            assert drain.stdout.readline() == "queue default: paused until resumed\n"
            assert drain.stdout.readline() == "queue default: 2 in flight\n"
            assert conn.execute("SELECT count(*) FROM fairq.message_dequeue(600000, 5)"
                                ).fetchone() == (0,)
            conn.execute("SELECT fairq.message_complete(%s, %s)", held[0])
            assert drain.stdout.readline() == "queue default: 1 in flight\n"
            conn.execute("SELECT fairq.message_complete(%s, %s)", held[1])
            assert drain.wait(timeout=30) == 0, drain.stderr.read() if drain.stderr else ""
            assert drain.stdout.read().startswith("queue default: drained, nothing in flight")
        assert conn.execute("SELECT paused_until = 'infinity' FROM fairq.queues"
                            " WHERE queue = 'default'").fetchone() == (True,)
        conn.execute("SELECT fairq.queue_resume('default')")
        assert conn.execute("SELECT count(*) FROM fairq.message_dequeue(600000, 5)"
                            ).fetchone() == (1,)


def test_queue_drain_counts_less_often_when_a_count_is_slow(
        dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drain's count reads every message of the database (0.3 s at 10^6 messages):
    counting again every 0.5 s kept over half a core busy for as long as the drain
    waited. It waits four times as long as its last count took, 0.5 s at the least."""
    from fairq import cli
    count_s = 0.3
    really_sleep = time.sleep
    drainer = threading.current_thread()
    waits: list[float] = []
    with psycopg.connect(dsn, autocommit=True) as conn, Queue(dsn) as queue:
        conn.execute("SELECT fairq.message_create('a', 'x'::bytea)")
        held = conn.execute("SELECT id, num_attempts FROM fairq.message_dequeue(600000)").fetchone()
        stats = queue.stats

        def slow_stats() -> Any:  # as on a database of a million messages
            really_sleep(count_s)
            return stats()

        def sleep(seconds: float) -> None:  # (time.sleep: other threads' too)
            if threading.current_thread() is not drainer:
                really_sleep(seconds)
                return
            waits.append(seconds)
            conn.execute("SELECT fairq.message_complete(%s, %s)", held)

        monkeypatch.setattr(queue, "stats", slow_stats)
        monkeypatch.setattr(cli.time, "sleep", sleep)
        cli._drain(queue, None, cli._Output())
    assert len(waits) == 1 and waits[0] >= cli.DRAIN_WAIT_PER_COUNT * count_s


def test_queue_drain_gives_up_after_its_timeout(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT fairq.message_create('a', 'x'::bytea)")
        conn.execute("SELECT fairq.message_dequeue(600000)")
    drained = fairq("queue", "drain", "emails", dsn=dsn)  # nothing in flight there
    assert drained.returncode == 0 and "drained" in drained.stdout
    stuck = fairq("queue", "drain", "default", "--timeout", "0.2", dsn=dsn)
    assert stuck.returncode == 1
    assert "1 still in flight after 0.2 s (queue default stays paused" in stuck.stderr


def test_history_is_pruned_before_a_time(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET fairq.history = on")
        _bury(conn, "default", "a")
        [(between,)] = conn.execute("SELECT clock_timestamp()").fetchall()
        _bury(conn, "emails", "a")
        pruned = fairq("history", "prune", "--before", between.isoformat(), dsn=dsn)
        assert pruned.returncode == 0 and pruned.stdout == "1 history row pruned\n"
        assert conn.execute("SELECT array_agg(queue) FROM fairq.message_history").fetchone() == (
            ["emails"],)


@pytest.mark.parametrize("handler", ["worker_handlers:gated", "worker_handlers:gated_async",
                                     "worker_handlers:gated_async_object"])
def test_send_and_worker_on_a_named_queue(dsn: str, tmp_path: Path, handler: str) -> None:
    """`fairq worker --queue` serves that queue, with a Worker (a function) or an
    AsyncWorker (a coroutine function, or an object whose ``__call__`` is one)."""
    for queue in ("emails", "default"):
        sent = fairq("send", "t", "60", "--queue", queue, dsn=dsn)
        assert sent.returncode == 0, sent.stderr
    (tmp_path / "release").touch()  # the handler finishes at once
    proc = _worker_process(dsn, tmp_path, "--queue", "emails", handler=handler)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            def emails_done() -> bool:
                row = conn.execute("SELECT size FROM fairq.queues WHERE queue = 'emails'"
                                   ).fetchone()
                return row == (0,)
            eventually(emails_done)
        assert len(_marks(tmp_path, "done")) == 1, _log(tmp_path)  # the handler ran, once
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, _log(tmp_path)
    finally:
        proc.kill()
    with psycopg.connect(dsn) as conn:
        left = conn.execute("SELECT c.name, q.name, m.num_attempts FROM fairq.message m"
                            " JOIN fairq.channel c ON c.id = m.channel_id"
                            " JOIN fairq.queue q ON q.id = m.queue_id").fetchall()
    assert left == [("t", "default", 0)]  # the default queue's message was never handed out
