"""PostgreSQL's ``'infinity'`` and ``'-infinity'`` timestamps as ``datetime.max`` and
``datetime.min`` (in UTC).

A pause until resumed ends at ``'infinity'``: ``paused_until`` of ``fairq.queues``
and ``fairq.channels`` shows it, and so does a paused channel's ``next_dequeue_at``.
psycopg's own loader refuses such a value ("timestamp too large"), which would make
every listing that holds one fail. Python has no infinite datetime, so we load the
largest and smallest there are, as psycopg's documentation suggests for dates.

The loader is registered on the cursors the queues run their calls on, not on the
connections: that reaches every connection a queue uses (its pool, the caller's
connection or pool, a ``conn=`` argument) and leaves how the caller's own queries
load timestamps as it was. Only the text format is covered: the queues fetch text.

No dumper: the binding never sends an infinite timestamp (a pause until resumed
leaves ``p_until`` out, so the SQL's default applies). A caller's ``datetime.max``
goes out as what it is, a finite timestamp in the year 9999.
"""

from __future__ import annotations

from datetime import datetime, timezone

from psycopg.abc import AdaptContext, Buffer
from psycopg.types.datetime import TimestamptzLoader

__all__ = ["MAX", "MIN", "register"]

MAX = datetime.max.replace(tzinfo=timezone.utc)
MIN = datetime.min.replace(tzinfo=timezone.utc)


class _InfinityTimestamptzLoader(TimestamptzLoader):
    def load(self, data: Buffer) -> datetime:
        if data == b"infinity":
            return MAX
        if data == b"-infinity":
            return MIN
        return super().load(data)


def register(context: AdaptContext) -> None:
    """Loads infinite ``timestamptz`` values as :data:`MAX`/:data:`MIN` in ``context``
    (a cursor, a connection, ...)."""
    context.adapters.register_loader("timestamptz", _InfinityTimestamptzLoader)
