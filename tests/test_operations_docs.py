"""What an operator copies from the README's Privileges and docs/operations.md's Runbook
works as written: the operator grant block gives a role every owner-only call, and the
runbook's queries say why a tenant's messages wait, who is in flight and whether a
worker serves a queue."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent


def sql_blocks(path: Path, heading: str) -> list[str]:
    """The ```sql blocks of the section under ``heading`` (up to the next heading of
    its level), dedented as written."""
    text = path.read_text()
    level = heading.split(" ", 1)[0]
    assert heading + "\n" in text, f"no section {heading!r} in {path.name}"
    section = text.split(heading + "\n", 1)[1]
    section = re.split(rf"^{level} ", section, maxsplit=1, flags=re.M)[0]
    blocks = re.findall(r"^ *```sql\n(.*?)^ *```", section, re.S | re.M)
    assert blocks, f"no sql block under {heading!r}"
    return [str(b) for b in blocks]


@pytest.fixture
def role(dsn: str) -> Iterator[str]:
    """A role of its own (roles are the cluster's), dropped after the test."""
    name = f"fairq_ops_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def test_the_operator_grant_block_gives_every_owner_only_call(dsn: str, role: str) -> None:
    """The README once said GRANT EXECUTE on queue_pause was enough: without USAGE on
    the schema the call fails, and a role that could pause could not resume. Its
    block is now fairq.grant_operator (with grant_observer to see)."""
    # The README's block, as it concerns the operator role 'ops'.
    [block] = [b for b in sql_blocks(ROOT / "README.md", "## Privileges")
               if "fairq.grant_operator('ops')" in b]
    block = "\n".join(line for line in block.splitlines() if "('ops')" in line)
    assert "grant_operator" in block
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(block.replace("ops", role))
        conn.execute("SELECT * FROM fairq.message_create('acme', 'x')")
        conn.execute("SELECT fairq.message_fail(id, num_attempts, 'boom')"
                     " FROM fairq.message_dequeue(60000)")
        conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
        calls = [
            "SELECT fairq.queue_pause('default')", "SELECT fairq.queue_resume('default')",
            "SELECT fairq.channel_set('acme', p_max_concurrency => 2)",
            "SELECT fairq.channel_pause('acme')", "SELECT fairq.channel_resume('acme')",
            "SELECT fairq.channel_clear('acme')",
            "SELECT fairq.dead_letter_retry(1)", "SELECT fairq.dead_letter_delete(1)", "SELECT fairq.dead_letter_purge(now())",
            "SELECT fairq.history_prune(now())",
            "SELECT * FROM fairq.queues", "SELECT * FROM fairq.channels",
            "SELECT * FROM fairq.dead_letters",
        ]
        for call in calls:  # each raises InsufficientPrivilege if the block missed it
            conn.execute(call)
        assert conn.execute("SELECT count(*) FROM fairq.dead_letters").fetchone() == (0,)


def test_the_runbook_says_why_each_tenant_waits(dsn: str, role: str) -> None:
    why_query, by_id, doorbell, in_flight = sql_blocks(ROOT / "docs" / "operations.md",
                                                       "## Runbook")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("SELECT fairq.grant_observer({})").format(sql.Literal(role)))
        conn.execute("SELECT fairq.channel_set('capped', p_max_concurrency => 1)")
        conn.execute("SELECT fairq.channel_set('slow', p_release_interval_ms => 3600000)")
        for channel in ("capped", "capped", "slow", "slow", "paused"):
            conn.execute("SELECT * FROM fairq.message_create(%s, 'x')", (channel,))
        conn.execute("SELECT * FROM fairq.message_create('held', 'x', p_queue => 'stopped')")
        conn.execute("SELECT fairq.channel_pause('paused')")
        held = conn.execute("SELECT id, channel, num_attempts"
                            " FROM fairq.message_dequeue(600000, 10)").fetchall()
        assert sorted(c for _, c, _ in held) == ["capped", "slow"]
        conn.execute("SELECT * FROM fairq.message_create('waiting', 'x')")
        conn.execute("SELECT * FROM fairq.message_create('held', 'y', p_queue => 'stopped')")
        conn.execute("SELECT fairq.queue_pause('stopped')")
        conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))  # an observer
        reasons = {(q, c): why for q, c, _, _, why in conn.execute(why_query).fetchall()}
        conn.execute("RESET ROLE")
        assert reasons[("default", "capped")].startswith("at max_concurrency")
        assert reasons[("default", "slow")].startswith("release_interval_ms: next release at")
        assert reasons[("default", "paused")] == "channel paused until infinity"
        assert reasons[("stopped", "held")] == "queue paused until infinity"
        assert reasons[("default", "waiting")].startswith("due: waits for its turn")
        assert len(reasons) == 5

        capped_id, _, token = next(m for m in held if m[1] == "capped")
        row = conn.execute(by_id.replace("42", str(capped_id))).fetchone()
        assert row is not None and row[2:4] == ("capped", "locked")
        locks = conn.execute(in_flight).fetchall()
        assert {(q, c) for q, c, *_ in locks} == {("default", "capped"), ("default", "slow")}
        # The runbook's way out of a hung handler: defer with its token.
        assert conn.execute("SELECT fairq.message_defer(%s, %s)",
                            (capped_id, token)).fetchone() == ("deferred",)
        assert conn.execute("SELECT fairq.message_heartbeat(%s, %s, 60000)",
                            (capped_id, token)).fetchone() == ("stale",)

        assert conn.execute(doorbell).fetchall() == []
        with psycopg.connect(dsn, autocommit=True) as worker:
            worker.execute("SELECT fairq.doorbell_hold('default')")
            pid = worker.info.backend_pid
            assert [r[0] for r in conn.execute(doorbell).fetchall()] == [pid]
