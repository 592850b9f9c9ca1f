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

Finite timestamps past what ``datetime`` holds load the same way: a time late in 9999 UTC
(``datetime.max`` itself) is in the year 10000 in a session east of UTC, and psycopg
refuses it too.

No dumper: the binding never sends an infinite timestamp (a pause until resumed
leaves ``p_until`` out, so the SQL's default applies). A caller's ``datetime.max``
goes out as what it is, a finite timestamp in the year 9999.
"""

from __future__ import annotations

from datetime import datetime, timezone

from psycopg import DataError
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
        try:
            return super().load(data)
        except DataError:
            # Finite, but past what datetime holds: the year 10000 (a time late in 9999
            # UTC, such as datetime.max, shown in a zone east of UTC) or before year 1.
            text = bytes(data)
            if text.endswith(b" BC"):
                return MIN
            if len(text.split(b"-", 1)[0]) > 4:
                return MAX
            raise


def register(context: AdaptContext) -> None:
    """Loads infinite ``timestamptz`` values as :data:`MAX`/:data:`MIN` in ``context``
    (a cursor, a connection, ...)."""
    context.adapters.register_loader("timestamptz", _InfinityTimestamptzLoader)
