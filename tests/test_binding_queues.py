"""The binding's named queues, weights, pauses, dead-letter delete and purge, and queue
stats (SPEC revision 2), sync and async, against a real database; and how infinite
timestamps (a pause until resumed) load."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import psycopg

from fairq._timestamps import register

UTC = timezone.utc
# What a pause until resumed ('infinity') loads as.
FOREVER = datetime.max.replace(tzinfo=UTC)


# -- infinite timestamps ------------------------------------------------------------


def test_infinite_timestamps_load_as_datetime_max_and_min(conn: psycopg.Connection[Any]) -> None:
    with conn.cursor() as cur:
        register(cur)
        row = cur.execute("SELECT 'infinity'::timestamptz, '-infinity'::timestamptz,"
                          " '2030-01-02 03:04:05.678+00'::timestamptz").fetchone()
    assert row == (FOREVER, datetime.min.replace(tzinfo=UTC),
                   datetime(2030, 1, 2, 3, 4, 5, 678000, tzinfo=UTC))
