"""Every code block of the README is exercised: here, or by a named suite that CI runs.

- ```python blocks run as written, with DATABASE_URL pointing at the test database;
- ```sql blocks: the psql walkthrough is tests/test_readme.py's; the others run here;
- ```sh blocks: every command is one this file maps to whoever exercises it (this
  file, another suite, or CI itself through `make test`) — a new command fails until
  someone says how it is checked;
- ```text blocks are sample output: the demo's sample lines must match what
  `fairq demo --quick` prints now, check by check.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from conftest import Server

ROOT = Path(__file__).resolve().parent.parent
FAIRQ = Path(sys.executable).parent / "fairq"


def blocks() -> list[tuple[str, str, str]]:
    """(section heading, language, code) of every fenced block, in order."""
    found: list[tuple[str, str, str]] = []
    heading = ""
    for part in re.split(r"^(## .*)$", (ROOT / "README.md").read_text(), flags=re.M):
        if part.startswith("## "):
            heading = part[3:].strip()
            continue
        for language, code in re.findall(r"^```(\w*)\n(.*?)^```", part, flags=re.M | re.S):
            found.append((heading, language, code))
    return found


def block(heading: str, language: str) -> str:
    matches = [code for h, lang, code in blocks() if h == heading and lang == language]
    assert len(matches) == 1, f"expected one {language} block under {heading!r}"
    return matches[0]


def env_with(dsn: str) -> dict[str, str]:
    return {**os.environ, "DATABASE_URL": dsn}


# Who exercises each shell command the README shows. A command not listed here fails
# test_every_shell_command_is_exercised: add it with the test that runs it.
SHELL_COMMANDS = {
    "make demo": "test_demo_runs_and_reports_no_loss (the target's `fairq demo`; its "
                 "`venv` and `install` prerequisites are what `make test` runs)",
    "make test": ".ci/run: CI runs exactly this",
    "make install": "make test (its prerequisite, in CI)",
    "make install PG_CONFIG=": "make test: CI runs `make install` with the default PG_CONFIG; "
                               "PG_CONFIG only picks another pg_config (PGXS's own variable)",
    "psql -c 'CREATE EXTENSION fairq'": "tests/conftest.py creates the extension in every "
                                        "test database's template",
    # (The commands below read $DATABASE_URL when --dsn is not given: tests/test_cli.py::
    # test_channel_send_stats_and_dead_letters and test_readme_spark.py run them so.)
    "fairq install": "tests/test_install.py and tests/test_cli.py",
    "fairq upgrade": "tests/test_install.py and tests/test_cli.py",
    "fairq report": "tests/test_readme_spark.py runs the README's Spark example and this",
    "fairq worker": "tests/test_worker.py runs `fairq worker MODULE:FUNCTION` as a process; "
                    "test_cli_worker_block_parses checks this block's options",
    "pip install 'fairq[dashboard]'": "make venv installs the same extra (`.[test,dashboard]`) "
                                      "for the dashboard's suites",
    "fairq dashboard": "tests/test_dashboard_http.py::test_fairq_dashboard_serves_until_stopped",
    "fairq metrics --once": "tests/test_dashboard_http.py::test_metrics_once_prints_the_same",
}


def shell_commands() -> list[str]:
    commands = []
    for _, language, code in blocks():
        if language == "sh":
            for line in code.splitlines():
                command = line.split("#", 1)[0].strip()
                if command:
                    commands.append(command)
    return commands


# (section, language) of every python and sql block -> the test that runs it.
CODE_BLOCKS = {
    ("The lifecycle from psql", "sql"): "tests/test_readme.py",
    ("Python in ten lines", "python"): "test_python_example_runs_as_written_and_takes_turns",
    ("The worker", "python"): "test_worker_example_processes_messages_and_stops_on_sigterm",
    ("Privileges", "sql"): "test_privileges_block_runs",
    ("Two commands", "text"): "test_demo_runs_and_reports_no_loss (sample output)",
}
OWNED_ELSEWHERE = {"Spark"}  # docs/spark.md's owner exercises what they put there


def test_every_code_block_is_exercised() -> None:
    seen = set()
    for heading, language, _ in blocks():
        assert language in {"sh", "sql", "python", "text"}, (heading, language)
        if language == "sh" or heading in OWNED_ELSEWHERE:
            continue  # sh: test_every_shell_command_is_exercised
        assert (heading, language) in CODE_BLOCKS, f"nobody runs the {language} block under {heading!r}"
        seen.add((heading, language))
    assert seen == CODE_BLOCKS.keys(), f"listed but gone from the README: {CODE_BLOCKS.keys() - seen}"


def test_every_shell_command_is_exercised() -> None:
    commands = shell_commands()
    assert commands
    unknown = [c for c in commands if not any(c.startswith(known) for known in SHELL_COMMANDS)]
    assert not unknown, f"README shell commands nobody exercises: {unknown}"


def test_python_example_runs_as_written_and_takes_turns(dsn: str) -> None:
    code = block("Python in ten lines", "python")
    assert len(code.strip().splitlines()) <= 12
    out = subprocess.run([sys.executable, "-c", code], env=env_with(dsn), capture_output=True,
                         text=True, timeout=60, check=True).stdout.splitlines()
    assert out == ["tenant-a 0", "tenant-b 0", "tenant-c 0", "tenant-a 1", "tenant-b 1",
                   "tenant-a 2", "tenant-b 2", "tenant-c 1"]
    with psycopg.connect(dsn) as conn:
        left = conn.execute("SELECT count(*) FROM fairq.message").fetchone()
    assert left == (0,)


def test_worker_example_processes_messages_and_stops_on_sigterm(dsn: str) -> None:
    code = block("The worker", "python")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(5):
            conn.execute("SELECT fairq.message_create(%s, convert_to(%s, 'UTF8'))",
                         (f"tenant-{i % 2}", f'{{"n": {i}}}'))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env_with(dsn),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120  # a failure net: a loaded machine starts it late
        with psycopg.connect(dsn, autocommit=True) as conn:
            while conn.execute("SELECT count(*) FROM fairq.message").fetchone() != (0,):
                assert time.monotonic() < deadline, "the worker did not complete the messages"
                time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    # Handlers print from several threads: match records, not lines.
    printed = re.findall(r"tenant-\d \{'n': \d\}", out)
    assert sorted(printed) == sorted(f"tenant-{i % 2} {{'n': {i}}}" for i in range(5)), out


def test_cli_worker_block_parses() -> None:
    """The `fairq worker` line uses options that exist (tests/test_worker.py runs the
    command itself against a database)."""
    [line] = [c for c in shell_commands() if c.startswith("fairq worker")]
    args = shlex.split(line)
    options = {a for a in args if a.startswith("--")}
    shown = subprocess.run([str(FAIRQ), "worker", "--help"], capture_output=True, text=True,
                           timeout=30, check=True).stdout
    assert all(option in shown for option in options - {"--dsn"}), (options, shown)


def test_privileges_block_runs(dsn: str, server: Server) -> None:
    code = block("Privileges", "sql")
    # (One role may be given two kinds: the operator also observes.)
    roles = list(dict.fromkeys(re.findall(r"fairq\.grant_\w+\('(\w+)'\)", code)))
    assert len(roles) == 4
    created = []
    with psycopg.connect(server.admin_dsn, autocommit=True) as admin:
        for role in roles:
            if admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone() is None:
                admin.execute(f'CREATE ROLE "{role}"')  # type: ignore[arg-type]
                created.append(role)
    try:
        subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", dsn], input=code, text=True,
                       capture_output=True, check=True, timeout=60)
        with psycopg.connect(dsn) as conn:
            def can(role: str, privilege: str, function: str) -> bool:
                row = conn.execute("SELECT has_function_privilege(%s, %s, %s)",
                                   (role, function, privilege)).fetchone()
                return bool(row and row[0])
            producer, worker, observer, operator = roles
            dequeue = "fairq.message_dequeue(bigint, integer, text)"
            create = "fairq.message_create(text, bytea, timestamptz, integer, text, text)"
            assert can(producer, "EXECUTE", create) and not can(producer, "EXECUTE", dequeue)
            assert can(worker, "EXECUTE", dequeue)
            row = conn.execute("SELECT has_table_privilege(%s, 'fairq.channels', 'SELECT')",
                               (observer,)).fetchone()
            assert row == (True,)
            pause = "fairq.queue_pause(text, timestamptz)"
            assert can(operator, "EXECUTE", pause) and not can(operator, "EXECUTE", dequeue)
            assert not can(observer, "EXECUTE", pause)
    finally:
        for role in created:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f'DROP OWNED BY "{role}"')  # type: ignore[arg-type]
            server.admin(f'DROP ROLE "{role}"')


def test_demo_runs_and_reports_no_loss(dsn: str, tmp_path: Path) -> None:
    chart = tmp_path / "demo.png"
    done = subprocess.run([str(FAIRQ), "demo", "--quick", "--dsn", dsn, "--chart", str(chart)],
                          capture_output=True, text=True, timeout=120)
    if "not implemented yet" in done.stderr:  # the CLI does not dispatch to fairq.demo yet
        done = subprocess.run([sys.executable, "-m", "fairq.demo", "--quick", "--dsn", dsn,
                               "--chart", str(chart)], capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert re.search(r"\[ok\] nothing lost: created (\d+) = completed \d+ \+ dead \d+", out), out
    assert "FAILED" not in out
    assert "all checks passed" in out
    assert chart.stat().st_size > 10_000
    # The README's sample output shows the checks the demo makes, in this order.
    sample = [line.split(":")[0].strip() for line in block("Two commands", "text").splitlines()
              if line.strip()]
    shown = [line.split(":")[0].strip() for line in out.splitlines() if "[ok]" in line]
    assert sample == shown
    # It cleaned up after itself: no demo channel, message, dead letter or history row.
    with psycopg.connect(dsn) as conn:
        for query in ("SELECT count(*) FROM fairq.channels WHERE channel LIKE 'demo-%'",
                      "SELECT count(*) FROM fairq.message",
                      "SELECT count(*) FROM fairq.dead_letters",
                      "SELECT count(*) FROM fairq.message_history"):
            assert conn.execute(query).fetchone() == (0,), query  # type: ignore[arg-type]


def test_demo_refuses_a_database_whose_other_channels_hold_messages(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT fairq.message_create('someone-else', 'x')")
    done = subprocess.run([sys.executable, "-m", "fairq.demo", "--quick", "--no-chart",
                           "--dsn", dsn], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "someone-else" in done.stderr
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT num_attempts FROM fairq.message").fetchall() == [(0,)]


@pytest.mark.parametrize("heading", ["Spark"])
def test_blocks_owned_by_other_pages_at_least_compile(heading: str) -> None:
    """Code the Spark page's owner adds to its README section runs in their suite; here
    it must at least be valid Python."""
    for h, language, code in blocks():
        if h == heading and language == "python":
            compile(code, f"README {heading}", "exec")


@pytest.mark.parametrize("seconds", ["nan", "inf", "-1", "0", "1e300"])
def test_demo_refuses_seconds_it_cannot_run_for(seconds: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """NaN and huge values ended in a traceback (or in a burst too large to build)
    before anything started; infinity would never end."""
    from fairq import demo

    assert demo.main(["--seconds", seconds, "--no-chart", "--no-dashboard",
                      "--dsn", "host=127.0.0.1 port=1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--seconds" in err
