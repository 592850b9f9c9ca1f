"""What the demo reads from the database: live counts per channel, the history of its
channels, and whether other channels hold messages."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from fairq.demo.scenario import Scenario
from fairq.types import HistoryOutcome

__all__ = ["Connection", "Row", "Settled", "db_now", "demo_backlog", "demo_channels",
           "foreign_channels", "history", "live_rows"]


Connection = psycopg.Connection[Any]


@dataclass(frozen=True)
class Row:
    channel: str
    waiting: int
    in_flight: int
    done: int
    dead: int


def db_now(conn: Connection) -> datetime:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def live_rows(conn: Connection, scenario: Scenario, since: datetime) -> list[Row]:
    queued = {r[0]: (r[1], r[2]) for r in conn.execute(
        "SELECT channel, ready + scheduled, in_flight FROM fairq.channels"
        " WHERE channel LIKE 'demo-%'").fetchall()}
    settled: Counter[tuple[str, HistoryOutcome]] = Counter()
    for channel, outcome, count in conn.execute(
            "SELECT channel, outcome, count(*) FROM fairq.message_history"
            " WHERE settled_at >= %s AND channel LIKE 'demo-%%' GROUP BY 1, 2", (since,)):
        settled[(channel, HistoryOutcome(outcome))] = count
    return [Row(t.name, *queued.get(t.name, (0, 0)), settled[(t.name, HistoryOutcome.COMPLETED)],
                settled[(t.name, HistoryOutcome.DEAD)]) for t in scenario.tenants]


def demo_backlog(conn: Connection) -> int:
    row = conn.execute("SELECT coalesce(sum(size), 0) FROM fairq.channels"
                       " WHERE channel LIKE 'demo-%'").fetchone()
    return int(row[0]) if row else 0


def demo_channels(conn: Connection) -> int:
    row = conn.execute("SELECT count(*) FROM fairq.channels WHERE channel LIKE 'demo-%'").fetchone()
    return int(row[0]) if row else 0


def foreign_channels(conn: Connection) -> list[tuple[str, int]]:
    return [(r[0], int(r[1])) for r in conn.execute(
        "SELECT channel, size FROM fairq.channels WHERE size > 0 AND channel NOT LIKE 'demo-%'"
        " ORDER BY channel")]


@dataclass(frozen=True)
class Settled:
    id: int
    channel: str
    wait: float  # seconds from creation to first delivery
    settled: float  # seconds after the start
    first_delivery: datetime
    outcome: HistoryOutcome


def history(conn: Connection, since: datetime) -> list[Settled]:
    rows = conn.execute(
        "SELECT id, channel, extract(epoch FROM first_dequeued_at - created_at),"
        " extract(epoch FROM settled_at - %s), first_dequeued_at, outcome"
        " FROM fairq.message_history WHERE settled_at >= %s AND channel LIKE 'demo-%%'"
        " ORDER BY settled_at", (since, since)).fetchall()
    return [Settled(r[0], r[1], float(r[2] or 0), float(r[3]), r[4], HistoryOutcome(r[5]))
            for r in rows]
