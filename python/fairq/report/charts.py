"""The report's PNG charts (matplotlib, Agg backend)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fairq.report.queries import OUTCOMES, PERCENTILES
from fairq.report.rows import Collected, collect

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["write_charts"]


def write_charts(out: Path, tables: dict[str, DataFrame], top: int) -> list[tuple[str, str]]:
    """Draws the PNG charts; returns (file name, caption) pairs."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from pyspark.sql import functions as F

    charts: list[tuple[str, str]] = []
    hours = collect(tables["hours"])
    busiest = collect(tables["channels"].orderBy(F.desc("settled"), "queue", "channel"), top)
    attempts = collect(tables["attempts"].groupBy("num_attempts")
                        .agg(F.sum("messages").alias("messages")).orderBy("num_attempts"))
    fairness = collect(tables["fairness"])

    def times(data: Collected, name: str) -> list[Any]:  # matplotlib takes datetimes
        return [datetime.fromisoformat(v.replace("Z", "+00:00")) for v in data.column(name)]

    def save(fig: Any, name: str, caption: str) -> None:
        fig.tight_layout()
        fig.savefig(out / "charts" / name, dpi=100)
        plt.close(fig)
        charts.append((f"charts/{name}", caption))

    def label(text: str) -> str:  # as written: matplotlib reads $...$ as maths
        return text.replace("$", r"\$")

    def empty(ax: Any) -> None:
        ax.text(0.5, 0.5, "no history", ha="center", va="center", transform=ax.transAxes)

    fig, ax = plt.subplots(figsize=(9, 4))
    if hours.rows:
        at = times(hours, "hour")
        bottom = [0] * len(at)
        for outcome in OUTCOMES:
            values = hours.column(outcome)
            ax.bar(at, values, width=1 / 24 * 0.9, bottom=bottom, label=outcome, align="edge")
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.legend()
        fig.autofmt_xdate()
    else:
        empty(ax)
    ax.set(title="Throughput per hour (settled messages)", ylabel="messages")
    save(fig, "throughput.png", "Throughput per hour, by outcome")

    for key, title in (("wait", "Wait time (created → first dequeued)"),
                       ("proc", "Processing time (first dequeued → settled)")):
        fig, ax = plt.subplots(figsize=(9, 4))
        if hours.rows:
            at = times(hours, "hour")
            for p in PERCENTILES:
                name = f"{key}_p{round(p * 100)}_ms"
                ax.plot(at, hours.column(name), marker="o", label=name)
            ax.legend()
            fig.autofmt_xdate()
        else:
            empty(ax)
        ax.set(title=f"{title} per hour", ylabel="ms")
        save(fig, f"{key}_time.png", f"{title}: p50, p95, p99 per hour")

    fig, ax = plt.subplots(figsize=(9, 4))
    if attempts.rows:
        ax.bar([str(n) for n in attempts.column("num_attempts")], attempts.column("messages"))
    else:
        empty(ax)
    ax.set(title="Attempts distribution", xlabel="num_attempts at settlement", ylabel="messages")
    save(fig, "attempts.png", "How many attempts messages took")

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, max(3.0, 0.25 * len(busiest.rows) + 1)))
    if busiest.rows:
        queues = busiest.column("queue")
        names = [label(channel if len(set(queues)) == 1 else f"{queue}: {channel}")
                 for queue, channel in zip(queues, busiest.column("channel"), strict=True)][::-1]
        left.barh(names, busiest.column("settled")[::-1])
        right.barh(names, [r or 0 for r in busiest.column("dead_letter_rate")[::-1]])
        right.set_xlim(0, 1)
    else:
        empty(left)
        empty(right)
    left.set(title=f"Throughput of the busiest channels (top {top})",
             xlabel="settled messages")
    right.set(title="Dead-letter rate", xlabel="dead / (completed + dead)")
    save(fig, "channels.png", f"The {top} busiest channels: throughput and dead-letter rate")

    fig, ax = plt.subplots(figsize=(9, 4))
    if fairness.rows:
        at, jains = times(fairness, "window_start"), fairness.column("jain_index")
        queues = fairness.column("queue")
        for queue in sorted(set(queues)):  # each queue is a round-robin of its own
            mine = [i for i, q in enumerate(queues) if q == queue]
            ax.plot([at[i] for i in mine], [jains[i] for i in mine], marker=".", label=label(queue))
        if len(set(queues)) > 1:
            ax.legend()
        ax.set_ylim(0, 1.05)
        fig.autofmt_xdate()
    else:
        empty(ax)
    ax.set(title="Jain's fairness index per window", ylabel="index (1 = fair)")
    save(fig, "fairness.png", "Jain's fairness index over the waiting channels of each window")
    return charts
