"""``fairq report``: a Spark job that turns ``fairq.message_history`` into a report.

    fairq report --dsn URL --out DIR [--since T] [--window SECONDS]
    python -m fairq.report --dsn URL --out DIR

It reads the history through Spark's JDBC source (the JDBC URL is derived from the
libpq DSN) and writes, under DIR:

* ``parquet/<table>/`` and ``csv/<table>.csv`` for each table below;
* ``charts/*.png`` (matplotlib, Agg backend);
* ``index.html``, which shows the summary and links everything.

Definitions (all times in milliseconds, hours and windows in UTC):

* a history row is *settled* at ``settled_at``; ``hours`` buckets rows by the hour
  of ``settled_at``; throughput is settled rows per bucket;
* *wait time* = ``first_dequeued_at - created_at``, over rows that were dequeued;
* *processing time* = ``settled_at - first_dequeued_at``, over completed and dead rows;
* percentiles are exact and interpolate like SQL's ``percentile_cont``;
* *dead-letter rate* = dead / (completed + dead) (cancelled rows were never judged);
* *Jain's fairness index* of a window = (Σx)² / (n·Σx²), where the n channels are
  those with a message waiting during the window (created before its end, and first
  dequeued — or, never dequeued, settled — at or after its start) and x is the
  number of each channel's messages first dequeued in the window. 1 means every
  waiting channel was served equally; 1/n means one channel got everything.
  Messages still queued when the report runs are not in the history, so a channel
  starved up to now does not count yet. A channel is a (queue, channel) pair, and
  the index is computed per queue (each is a round-robin of its own).

History rows exist only while the setting ``fairq.history`` is on (off by default).

Modules: ``queries`` (the tables, in Spark), ``rows`` (tables as Python rows),
``charts``, ``render`` (the files and index.html) and ``cli``.
"""

from fairq.report.cli import main, parse_since
from fairq.report.queries import TABLES, compute
from fairq.report.render import write_report

__all__ = ["TABLES", "compute", "main", "parse_since", "write_report"]
