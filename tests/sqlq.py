"""Small helpers for the SQL contract tests: call fairq's functions through psycopg.

The tests speak SQL directly (not through the Python binding) so that they check
the extension's contract exactly as a psql user sees it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

Conn = psycopg.Connection[Any]


@dataclass(frozen=True)
class Delivery:
    id: int
    channel: str
    content: bytes
    state: bytes | None
    num_attempts: int
    priority: int
    dequeue_at: datetime
    recovered: bool


def create(conn: Conn, channel: str, content: bytes = b"x", **kw: Any) -> tuple[int | None, str]:
    args = ", ".join(f"p_{k} => %({k})s" for k in kw)
    row = conn.execute(
        f"SELECT id, status FROM fairq.message_create(%(channel)s, %(content)s{', ' + args if args else ''})",
        {"channel": channel, "content": content, **kw},
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def create_many(conn: Conn, channels: list[str], **kw: Any) -> list[tuple[int, int | None, str]]:
    args = ", ".join(f"p_{k} => %({k})s" for k in kw)
    return conn.execute(
        f"SELECT ord, id, status FROM fairq.message_create_batch(%(channels)s, %(contents)s"
        f"{', ' + args if args else ''})",
        {"channels": channels, "contents": [c.encode() for c in channels], **kw},
    ).fetchall()


def dequeue(conn: Conn, lock_ms: int = 30_000, n: int = 1, queue: str = "default") -> list[Delivery]:
    rows = conn.execute(
        "SELECT id, channel, content, state, num_attempts, priority, dequeue_at, recovered"
        " FROM fairq.message_dequeue(%s, %s, %s)",
        (lock_ms, n, queue),
    ).fetchall()
    return [Delivery(*row) for row in rows]


def dequeue_one(conn: Conn, lock_ms: int = 30_000, queue: str = "default") -> Delivery | None:
    got = dequeue(conn, lock_ms, queue=queue)
    return got[0] if got else None


def call(conn: Conn, function: str, *args: Any) -> Any:
    placeholders = ", ".join(["%s"] * len(args))
    row = conn.execute(f"SELECT fairq.{function}({placeholders})", args).fetchone()
    assert row is not None
    return row[0]


def complete(conn: Conn, d: Delivery) -> str:
    return str(call(conn, "message_complete", d.id, d.num_attempts))


def travel(conn: Conn, shift_ms: int) -> None:
    """Moves the queue's clock to real time + shift_ms (superuser only)."""
    call(conn, "clock_travel", shift_ms)


def channel_row(conn: Conn, name: str) -> dict[str, Any] | None:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute("SELECT * FROM fairq.channels WHERE channel = %s", (name,)).fetchone()


def problems(conn: Conn) -> list[tuple[str | None, str]]:
    return conn.execute("SELECT channel, problem FROM fairq.check()").fetchall()


def drain(conn: Conn, limit: int = 100_000, queue: str = "default") -> list[Delivery]:
    """Dequeues and completes everything available now, one at a time, in order."""
    out: list[Delivery] = []
    while len(out) < limit:
        d = dequeue_one(conn, queue=queue)
        if d is None:
            break
        assert complete(conn, d) == "completed"
        out.append(d)
    return out


def channels_of(deliveries: list[Delivery]) -> list[str]:
    return [d.channel for d in deliveries]


def counts(deliveries: list[Delivery]) -> Counter[str]:
    return Counter(channels_of(deliveries))


def call_fuzzed(conn: Conn, label: str, sql: str, args: Any, names: Any,
                unrepresentable: bool) -> None:
    """One fuzzed call: it succeeds, or it fails with 22004/22023 and a message naming
    one of ``names``, or (exactly when an argument does not fit its SQL type, so the
    cast fails before fairq runs) with 22003."""
    try:
        conn.execute(sql, args).fetchall()
    except psycopg.Error as e:
        summary = f"{label}{args!r:.300}: {e.sqlstate} {e.diag.message_primary}"
        if unrepresentable:
            assert e.sqlstate == "22003", summary
        else:
            assert e.sqlstate in ("22004", "22023"), summary
            assert any(n in (e.diag.message_primary or "") for n in names), summary
    else:
        assert not unrepresentable, f"{label}{args!r:.300} accepted an out-of-range value"
