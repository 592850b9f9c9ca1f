"""The chart of the last hour, per queue, drawn as SVG by the template.

Two sources, and the page says which: ``fairq.message_history`` when it holds
messages settled in the last hour (deliveries per second and the waits from creation
to first delivery), otherwise the dashboard's own samples since it started (ready,
in flight, and the oldest ready message's wait): without the history, fairq records
no deliveries, so none can be counted.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from fairq.dashboard.queries import Connection, history_buckets, history_recent
from fairq.dashboard.sampler import HOUR, Sample

__all__ = ["WIDTH", "Chart", "Panel", "Series", "history_chart", "sampled_chart"]

WIDTH, HEIGHT = 720.0, 130.0  # the plot area of one panel, in SVG units
BUCKETS = 60
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#17becf")


@dataclass(frozen=True)
class Series:
    queue: str
    color: str
    points: str  # SVG polyline points, "x,y x,y ..."
    values: str  # the plotted values, comma-separated (read by the tests)


@dataclass(frozen=True)
class Panel:
    title: str
    top: float  # the value at the top of the plot
    top_label: str
    series: list[Series]


@dataclass(frozen=True)
class Chart:
    source: str  # "history" | "sampled"
    note: str
    start: datetime
    end: datetime
    panels: list[Panel]
    x_ticks: list[tuple[float, str]]

    @property
    def legend(self) -> list[tuple[str, str]]:
        return [(s.queue, s.color) for s in self.panels[0].series] if self.panels else []


def _nice_top(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above value (1 for nothing)."""
    if value <= 0 or math.isnan(value):
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    return float(next(m * power for m in (1, 2, 5, 10) if m * power >= value))


def _label(value: float) -> str:
    return f"{value:g}" if value < 1000 else f"{value:,.0f}"


def _panel(title: str, unit: str, start: datetime, span: float,
           data: dict[str, list[tuple[datetime, float]]]) -> Panel:
    top = _nice_top(max((v for points in data.values() for _, v in points), default=0.0))
    series = []
    for i, (queue, points) in enumerate(sorted(data.items())):
        coords = " ".join(
            f"{(at - start).total_seconds() / span * WIDTH:.1f},{HEIGHT - v / top * HEIGHT:.1f}"
            for at, v in points)
        series.append(Series(queue, PALETTE[i % len(PALETTE)], coords,
                             ",".join(f"{v:g}" for _, v in points)))
    return Panel(title, top, f"{_label(top)} {unit}".strip(), series)


def _ticks(start: datetime, span: float) -> list[tuple[float, str]]:
    fmt = "%H:%M:%S" if span < 600 else "%H:%M"
    return [(WIDTH * i / 4, (start + timedelta(seconds=span * i / 4)).strftime(fmt))
            for i in range(5)]


def history_chart(conn: Connection, now: datetime) -> Chart | None:
    """The last hour from fairq.message_history, or None when it holds nothing recent."""
    earliest = history_recent(conn, HOUR)
    if earliest is None:
        return None
    start = max(earliest, now - HOUR)
    span = max((now - start).total_seconds(), 1.0)
    width = timedelta(seconds=max(1, math.ceil(span / BUCKETS)))
    # Buckets start on whole multiples of the width from `start` (date_bin's origin).
    rate: dict[str, list[tuple[datetime, float]]] = defaultdict(list)
    wait: dict[str, list[tuple[datetime, float]]] = defaultdict(list)
    buckets = history_buckets(conn, start, width)
    by_queue: dict[str, dict[datetime, tuple[int, float]]] = defaultdict(dict)
    for b in buckets:
        by_queue[b.queue][b.start] = (b.delivered, b.wait_avg_s)
    steps = math.ceil(span / width.total_seconds())
    for queue, filled in by_queue.items():
        for i in range(steps):
            at = start + i * width
            delivered, avg = filled.get(at, (0, 0.0))
            # A point at the bucket's middle; an empty bucket delivered nothing.
            middle = at + width / 2
            rate[queue].append((middle, delivered / width.total_seconds()))
            if delivered:
                wait[queue].append((middle, avg))
    seconds = width.total_seconds()
    note = (f"from fairq.message_history: messages settled since {start:%H:%M:%S}, by their "
            f"first delivery, in buckets of {seconds:g} s (a message still in flight is not "
            f"counted yet); wait = creation to first delivery")
    return Chart("history", note, start, now, [
        _panel("deliveries per second", "/s", start, span, rate),
        _panel("average wait", "s", start, span, wait)], _ticks(start, span))


def sampled_chart(samples: Iterable[Sample], started: datetime, now: datetime,
                  interval: timedelta, reads_messages: bool, why: str | None = None) -> Chart:
    """The dashboard's own samples since it started (at most the last hour); ``why``
    the history is not charted, when it holds rows but could not be read."""
    start = max(started, now - HOUR)
    span = max((now - start).total_seconds(), 1.0)
    ready: dict[str, list[tuple[datetime, float]]] = defaultdict(list)
    in_flight: dict[str, list[tuple[datetime, float]]] = defaultdict(list)
    oldest: dict[str, list[tuple[datetime, float]]] = defaultdict(list)
    for s in samples:
        if s.at < start:
            continue
        ready[s.queue].append((s.at, s.ready))
        in_flight[s.queue].append((s.at, s.in_flight))
        oldest[s.queue].append((s.at, s.oldest_ready_s or 0.0))
    note = (f"sampled by this dashboard every {interval.total_seconds():g} s since "
            f"{started:%H:%M:%S}: " + (why or
            "fairq.message_history holds nothing settled in the last "
            "hour, and without it fairq records no deliveries (run the workers with "
            "fairq.history = on to chart deliveries per second)"))
    panels = [_panel("ready (backlog)", "", start, span, ready),
              _panel("in flight", "", start, span, in_flight)]
    if reads_messages:
        panels.append(_panel("oldest ready message's wait", "s", start, span, oldest))
    return Chart("sampled", note, start, now, panels, _ticks(start, span))
