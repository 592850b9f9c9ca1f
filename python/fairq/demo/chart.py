"""The demo's PNG chart: per-tenant throughput and each message's wait."""

from __future__ import annotations

import math
from pathlib import Path

from fairq.demo.queries import Settled
from fairq.demo.scenario import Scenario
from fairq.types import HistoryOutcome

__all__ = ["chart"]


def chart(path: Path, scenario: Scenario, settled: list[Settled], elapsed: float) -> str:
    """Writes the throughput chart; returns a line for the report."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart: skipped (matplotlib is not installed: pip install matplotlib)"
    width = max(0.25, elapsed / 60)
    bins = max(1, math.ceil(elapsed / width))
    edges = [i * width for i in range(bins + 1)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for tenant in scenario.tenants:
        mine = [r for r in settled if r.channel == tenant.name]
        counts = [0] * bins
        for record in mine:
            if record.outcome is HistoryOutcome.COMPLETED:
                counts[min(bins - 1, max(0, int(record.settled / width)))] += 1
        label = f"{tenant.name} ({tenant.policy})" if tenant.policy != "-" else tenant.name
        top.step(edges[:-1], [c / width for c in counts], where="post", label=label)
        bottom.scatter([r.settled for r in mine], [max(r.wait, 1e-3) for r in mine], s=4,
                       label=tenant.name)
    top.set_ylabel("completed messages / s")
    top.set_title("fairq demo: per-tenant throughput, and each message's wait")
    top.legend(fontsize=8, loc="upper right")
    top.axvline(scenario.seconds, color="grey", linestyle=":")
    bottom.set_yscale("log")
    bottom.set_ylabel("wait until first delivery (s)")
    bottom.set_xlabel("seconds since start (dotted: producers stop)")
    bottom.axvline(scenario.seconds, color="grey", linestyle=":")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"chart: {path}"
