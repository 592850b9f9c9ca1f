"""``fairq demo``: a multi-tenant scenario you can watch, then a report of what happened.

Without ``--dsn`` it starts a throwaway PostgreSQL on 127.0.0.1 (``fairq.cluster``),
runs ``CREATE EXTENSION fairq`` there and removes the cluster at the end (also on
Ctrl-C). With ``--dsn`` it runs in an existing database on channels named
``demo-*`` and cleans them up afterwards. ``DATABASE_URL`` is deliberately ignored:
the demo's workers dequeue from *every* channel (fairq's dequeue has no channel
filter), so it must only ever run where you asked it to, and it refuses to start
while any other channel holds messages.

The scenario (``--quick`` shortens 20 s to 5 s):

- ``demo-heavy`` floods the queue: it keeps hundreds of messages waiting at all times;
- ``demo-light-1..4`` send a few messages a second each;
- ``demo-limited`` has ``release_interval_ms`` 250 and sends a burst up front;
- ``demo-capped`` has ``max_concurrency`` 2, slow messages, and a burst up front;
- two :class:`fairq.Worker` s of four threads process everything; a few messages fail
  once (retried with back-off) and a few always fail (dead-lettered after 3
  attempts); a third "worker" takes five messages and dies holding them, so their
  locks expire and they come back as ``recovered``.

With the dashboard extra installed, the demo serves a read-only ``fairq dashboard`` on
127.0.0.1 (``--dashboard-port``, default 8080) while it runs, and prints its address.

Every figure of the report comes from the database's own records
(``fairq.message_history``, recorded for the demo's sessions only), except the
count of handlers running at once, which the workers measure.

Modules: ``scenario`` (tenants, the crash, what the demo observes), ``workload``
(handler and producer), ``queries`` (what it reads back), ``display`` (the live
table), ``summary`` (the report and its checks), ``chart``, ``database`` (where it
runs, and cleaning up), ``dashboard`` (the one it offers), ``runner`` (one run) and
``cli``.
"""

from fairq.demo.cli import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
