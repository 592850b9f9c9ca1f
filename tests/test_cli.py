"""The `fairq` command, end to end, in subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg

from test_install import CURRENT, later, plain_dsn, upgrade_dir  # noqa: F401  (plain_dsn: fixture)

FAIRQ = Path(sys.executable).parent / "fairq"


def fairq(*args: str, dsn: str | None = None, stdin: bytes | None = None,
          module: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    if dsn is not None:
        env["DATABASE_URL"] = dsn
    command = [sys.executable, "-m", "fairq"] if module else [str(FAIRQ)]
    return subprocess.run([*command, *args], env=env, capture_output=True, timeout=60,
                          text=stdin is None, input=stdin)


def test_help_and_usage_errors() -> None:
    shown = fairq("--help")
    assert shown.returncode == 0
    for command in ("install", "upgrade", "channel", "send", "stats", "dead", "worker", "bench",
                    "demo"):
        assert command in shown.stdout
    assert fairq("channel", "--help").returncode == 0
    missing_dsn = fairq("stats")
    assert missing_dsn.returncode == 2 and "DATABASE_URL" in missing_dsn.stderr
    assert fairq("frobnicate", dsn="dbname=x").returncode == 2
    assert fairq("worker", "no_colon", dsn="dbname=x").returncode == 2
    missing_handler = fairq("worker", "no_such_module:run", dsn="dbname=x")
    assert missing_handler.returncode == 2 and "no_such_module" in missing_handler.stderr


def test_bench_demo_and_report_are_handed_their_own_command_line() -> None:
    for command in ("bench", "demo", "report"):
        result = fairq(command, "--help")
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"usage: fairq {command}"), result.stdout
    assert "bench" in fairq("--help").stdout


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
    assert stats[0].split() == ["channel", "size", "ready", "scheduled", "in_flight", "limits",
                                "next_turn"]
    assert stats[1].split()[:5] == ["acme", "2", "1", "1", "0"]

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
    (next_version,) = later(1)
    scripts = upgrade_dir(tmp_path, [next_version])
    upgraded = fairq("upgrade", "--scripts", str(scripts.directory), dsn=plain_dsn)
    assert upgraded.returncode == 0, upgraded.stderr
    assert upgraded.stdout.split() == ["applied", f"fairq--{CURRENT}--{next_version}.sql"]

    refused = fairq("install", dsn=dsn)
    assert refused.returncode == 1 and "extension" in refused.stderr
