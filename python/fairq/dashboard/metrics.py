"""The Prometheus metrics of ``/metrics`` and ``fairq metrics``.

Per queue: gauges of what ``fairq.queues`` shows, the oldest ready message's age and
whether it is paused. Per channel: the same gauges for the ``top`` channels with the
largest ready backlog only, so that the number of series stays bounded however many
tenants there are. Counters of settled messages and deliveries per queue come from
``fairq.message_history`` when it is recorded (fairq keeps no other record of them);
without it they are left out rather than reported as zero; they too keep to
at most SHOWN_QUEUES queues, those that settled the most. Queue and channel names are
label values as the dashboard shows them (format.shown): a control character in a
name, written out raw, reached the terminal of whoever read the exposition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import psycopg
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from fairq.dashboard import sampler as sampling
from fairq.dashboard.format import shown as shown_name
from fairq.dashboard.queries import ChannelRow, Connection, HistoryTotal, QueueRow, history_totals
from fairq.dashboard.queries import top_channels as read_top_channels
from fairq.dashboard.sampler import Sampler, Snapshot, take_snapshot

__all__ = ["Collected", "FairqCollector", "collect_once", "families", "live", "registry"]


@dataclass(frozen=True)
class Collected:
    """Everything one exposition shows."""

    snapshot: Snapshot | None  # None: the database could not be read
    channels: list[ChannelRow]
    settled: list[HistoryTotal] | None  # None: no history recorded
    error: str | None = None


def live(sampler: Sampler, connect: Callable[[], AbstractContextManager[Connection]],
         top: int) -> Callable[[], Collected]:
    """The source of a long-running exposition: the sampler's latest snapshot and
    counters, and the top channels read at each scrape."""
    def source() -> Collected:
        snapshot = sampler.latest()
        if snapshot is None:
            return Collected(None, [], None, sampler.error)
        channels: list[ChannelRow] = []
        error = sampler.error
        if top > 0:
            try:
                with connect() as conn:
                    channels = read_top_channels(conn, top, snapshot.reads_messages)
            except psycopg.Error as exc:
                error = str(exc).strip() or type(exc).__name__
        return Collected(snapshot, channels, sampler.settled(), error)
    return source


def collect_once(conn: Connection, top: int) -> Collected:
    """Reads everything now, for ``fairq metrics --once`` (the counters are the totals
    that fairq.message_history holds)."""
    snapshot = take_snapshot(conn)
    channels = read_top_channels(conn, top, snapshot.reads_messages) if top > 0 else []
    settled = history_totals(conn, None) if snapshot.history else None
    return Collected(snapshot, channels, settled)


# (name, help, value) of the gauges per queue and per channel.
QUEUE_GAUGES: tuple[tuple[str, str, Callable[[QueueRow], float]], ...] = (
    ("channels", "channels shown by fairq.channels", lambda q: q.channels),
    ("size", "messages held (ready, scheduled and in flight)", lambda q: q.size),
    ("ready", "messages due and waiting for a worker", lambda q: q.ready),
    ("scheduled", "messages not yet due", lambda q: q.scheduled),
    ("in_flight", "messages handed out and not settled", lambda q: q.in_flight),
    ("dead_letters", "messages in fairq.dead_letters", lambda q: q.dead),
    ("paused", "1 while the queue is paused", lambda q: q.pause.active),
)
CHANNEL_GAUGES: tuple[tuple[str, str, Callable[[ChannelRow], float]], ...] = (
    ("size", "messages held", lambda c: c.size),
    ("ready", "messages due and waiting", lambda c: c.ready),
    ("in_flight", "messages handed out and not settled", lambda c: c.in_flight),
    ("at_cap", "1 while in flight has reached max_concurrency", lambda c: c.at_cap),
    ("paused", "1 while the channel is paused", lambda c: c.pause.active),
)


def _gauge(name: str, doc: str, labels: list[str],
           samples: Iterable[tuple[list[str], float]]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in samples:
        family.add_metric([shown_name(label) for label in values], value)
    return family


def families(data: Collected) -> Iterator[Metric]:
    """The metric families of one exposition."""
    yield _gauge("fairq_up", "1 when the last read of the database succeeded, and one"
                 " succeeded within the last three intervals", [],
                 [([], 0.0 if data.snapshot is None or data.error else 1.0)])
    snapshot = data.snapshot
    if snapshot is None:
        return
    yield _gauge("fairq_read_duration_seconds",
                 "how long the last read of fairq.queues took (it grows with the channels)",
                 [], [([], snapshot.seconds)])
    yield _gauge("fairq_queues", "queues named so far (the per-queue series show some:"
                 " every paused one, then those holding the most messages)", [],
                 [([], float(len(snapshot.queues)))])
    shown = snapshot.shown_queues()
    for name, doc, value in QUEUE_GAUGES:
        yield _gauge(f"fairq_queue_{name}", f"per queue: {doc}", ["queue"],
                     [([q.queue], float(value(q))) for q in shown])
    if snapshot.reads_messages:
        yield _gauge("fairq_queue_oldest_ready_age_seconds",
                     "per queue: how long its oldest ready message has waited (0: none)",
                     ["queue"], [([q.queue], q.oldest_ready_s or 0.0) for q in shown])
    labels = ["queue", "channel"]
    top = data.channels
    for name, doc, cvalue in CHANNEL_GAUGES:
        yield _gauge(f"fairq_channel_{name}",
                     f"per channel, for the channels with the largest ready backlog: {doc}",
                     labels, [([c.queue, c.channel], float(cvalue(c))) for c in top])
    yield _gauge("fairq_channel_max_concurrency",
                 "per channel (largest backlogs, those with a cap): its max_concurrency",
                 labels, [([c.queue, c.channel], float(c.max_concurrency)) for c in top
                          if c.max_concurrency is not None])
    if snapshot.reads_messages:
        yield _gauge("fairq_channel_oldest_ready_age_seconds",
                     "per channel (largest backlogs): its oldest ready message's wait",
                     labels, [([c.queue, c.channel], c.oldest_ready_s or 0.0) for c in top])
    if data.settled is None:
        return
    settled = CounterMetricFamily(
        "fairq_settled_messages", "messages settled per queue and outcome, as recorded in "
        "fairq.message_history", labels=["queue", "outcome"])
    delivered = CounterMetricFamily(
        "fairq_deliveries", "deliveries of the settled messages per queue (their "
        "num_attempts summed), as recorded in fairq.message_history", labels=["queue"])
    per_queue: dict[str, int] = {}
    counted = _counted_queues(data.settled)
    for total in data.settled:
        if total.queue not in counted:
            continue
        settled.add_metric([shown_name(total.queue), total.outcome], float(total.messages))
        per_queue[total.queue] = per_queue.get(total.queue, 0) + total.deliveries
    for queue, count in sorted(per_queue.items()):
        delivered.add_metric([shown_name(queue)], float(count))
    yield settled
    yield delivered


def _counted_queues(settled: list[HistoryTotal]) -> set[str]:
    """The queues with counters: at most SHOWN_QUEUES, those that settled the most
    (among equals, the first names). Every queue the history recorded had its series,
    and any producer may name a queue. The totals only grow, so the set changes only
    when a queue overtakes another."""
    messages: dict[str, int] = {}
    for total in settled:
        messages[total.queue] = messages.get(total.queue, 0) + total.messages
    ranked = sorted(messages, key=lambda queue: (-messages[queue], queue))
    return set(ranked[:sampling.SHOWN_QUEUES])


class FairqCollector(Collector):
    """Asks ``source`` for the data of each exposition (a scrape, or ``--once``)."""

    def __init__(self, source: Callable[[], Collected]) -> None:
        self.source = source

    def collect(self) -> Iterable[Metric]:
        return list(families(self.source()))


def registry(source: Callable[[], Collected]) -> CollectorRegistry:
    """A registry of fairq's metrics alone (not the process metrics of the default one)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FairqCollector(source))
    return reg
