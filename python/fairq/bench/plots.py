"""PNG plots of a ``fairq bench`` result (matplotlib, Agg backend)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["write_plots"]


def write_plots(results: dict[str, Any], directory: Path) -> list[Path]:
    """Writes the plots the results allow into ``directory``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    details: dict[str, Any] = results.get("details", {})
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = directory / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    # Throughput bars against floor and FIFO.
    bars = [(label, results.get(key)) for key, label in (
        ("floor_msgs_per_s", "floor\n1/call"), ("fifo_msgs_per_s", "seed FIFO\n1/call"),
        ("cycle_msgs_per_s", "fairq\n1/call"),
        ("held_snapshot_ratio", "fairq 1/call\nheld snapshot"),
        ("batched_floor_msgs_per_s", "floor\n100/call"),
        ("batched_msgs_per_s", "fairq\n100/call"))]
    if "cycle_held_snapshot" in details:
        bars[3] = (bars[3][0], details["cycle_held_snapshot"]["msgs_per_s"])
    shown = [(label, float(value)) for label, value in bars if isinstance(value, (int, float))]
    if shown:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        colours = ["#888888" if "floor" in label else "#bbbbbb" if "FIFO" in label
                   else "#1f77b4" for label, _ in shown]
        rects = ax.bar([b[0] for b in shown], [b[1] for b in shown], color=colours)
        ax.bar_label(rects, labels=[f"{b[1]:,.0f}" for b in shown], fontsize=8)
        ax.set_ylabel("messages per second (create → dequeue → complete)")
        ax.set_title("Throughput: fairq against the plain-SQL floor and the seed FIFO")
        save(fig, "throughput.png")

    # Dequeue latency against depth and against channel count.
    for key, x_key, name, xlabel in (
            ("depth", "depth", "latency_depth.png", "queued messages"),
            ("channels", "channels", "latency_channels.png", "non-empty channels")):
        levels = details.get(key, {}).get("levels")
        if not levels:
            continue
        fig, ax = plt.subplots(figsize=(6.5, 4))
        xs = [lv[x_key] for lv in levels]
        ax.plot(xs, [lv["median_ms"] for lv in levels], "o-", label="median")
        ax.plot(xs, [lv["p90_ms"] for lv in levels], "s--", label="p90", alpha=0.7)
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("dequeue latency (ms)")
        ax.set_title(f"Dequeue latency vs {xlabel}")
        ax.legend()
        save(fig, name)

    # Per-tenant service over time in the fairness scenario.
    fairness = details.get("fairness")
    if fairness:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7))
        heavy = fairness["series"]["heavy_phase"]
        if heavy:
            end = max(row[0] for row in heavy)
            width = max(end / 40, 0.05)
            edges = [i * width for i in range(int(end / width) + 2)]
            for label, prefix in (("heavy tenant", "heavy"), ("all light tenants", "light-")):
                counts = [0] * (len(edges) - 1)
                for t, c, *_ in heavy:
                    if c.startswith(prefix):
                        counts[min(int(t / width), len(counts) - 1)] += 1
                top.plot(edges[:-1], [n / width for n in counts], label=label)
            top.set_title("Heavy backlog + light tenants: deliveries per second")
            top.set_xlabel("seconds")
            top.set_ylabel("msgs/s")
            top.legend()
        window = fairness["series"]["jain_phase"]
        tenants = sorted({c for _, c in window})
        for tenant in tenants:
            times = [t for t, c in window if c == tenant]
            bottom.step(times, range(1, len(times) + 1), where="post", label=tenant)
        jain = fairness["jain"]["index"]  # (None when it could not be computed)
        bottom.set_title("Backlogged tenants: cumulative deliveries"
                         + (f" (Jain index {jain:.4f})" if jain is not None else ""))
        bottom.set_xlabel("seconds")
        bottom.set_ylabel("messages served")
        if tenants:
            bottom.legend(fontsize=7, ncol=2)
        save(fig, "fairness.png")

    # Throughput over time in the soak.
    soak = details.get("soak")
    if soak and soak.get("series"):
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot([p[0] for p in soak["series"]], [p[1] for p in soak["series"]])
        end = soak["producing_seconds"]
        start = soak.get("measured_from_s") or 0.0
        tenth = (end - start) / 10
        ax.axvspan(start, start + tenth, alpha=0.15, color="green", label="first tenth")
        ax.axvspan(end - tenth, end, alpha=0.15, color="red", label="last tenth")
        ax.set_xlabel("seconds")
        ax.set_ylabel("messages completed per second")
        ax.set_title(f"Soak: {soak['messages']:,} messages, ratio last/first"
                     f" {soak['ratio']:.3f}" if soak.get("ratio") else "Soak")
        ax.set_ylim(bottom=0)
        ax.legend()
        save(fig, "soak.png")

    if results.get("tenants"):
        save(_tenants_figure(plt, results["tenants"]), "tenants.png")
    churn = results.get("churn")
    if churn and churn.get("channel_rows"):
        save(_churn_figure(plt, churn), "churn.png")
    return written


def _tenants_figure(plt: Any, tenants: dict[str, Any]) -> Any:
    """msgs/s against channel count (log x): fairq and floor, one panel per mode; the
    Zipf variant as lone markers at its channel count."""
    levels = sorted((v for k, v in tenants.items() if k != "zipf"), key=lambda v: v["channels"])
    zipf = tenants.get("zipf")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, mode in zip(axes, ("single", "batched"), strict=True):
        xs = [v["channels"] for v in levels]
        for prefix, label, style, colour in (("", "fairq", "o-", "#1f77b4"),
                                             ("floor_", "floor", "s--", "#888888")):
            ys = [v.get(f"{prefix}{mode}_msgs_per_s") for v in levels]
            ax.plot(xs, [math.nan if y is None else y for y in ys], style, color=colour,
                    label=f"{label}, uniform")
            if zipf and zipf.get(f"{prefix}{mode}_msgs_per_s") is not None:
                ax.plot([zipf["channels"]], [zipf[f"{prefix}{mode}_msgs_per_s"]], "*",
                        color=colour, markersize=12, label=f"{label}, Zipf")
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("channels (tenants)")
        ax.set_ylabel("messages per second")
        ax.set_title("1 message per call" if mode == "single" else "batched calls")
        ax.legend(fontsize=8)
    fig.suptitle("Throughput against the number of tenants")
    return fig


def _churn_figure(plt: Any, churn: dict[str, Any]) -> Any:
    """Per tenth of the churn soak, against the tenants seen so far: throughput, and
    fairq.channel's bytes (heap, total, each index) and rows."""
    seen = churn["tenants_seen"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    rates = [math.nan if r is None else r for r in churn["tenth_msgs_per_s"]]
    top.plot(seen[:len(rates)], rates, "o-")
    top.set_ylim(bottom=0)
    top.set_ylabel("msgs/s in the tenth")
    ratio = churn.get("last_vs_first")
    top.set_title(f"Churn soak: {churn['messages']:,} messages, {churn['tenants']:,} tenants"
                  f" ({churn['window']:,} at a time)"
                  + (f", last/first tenth {ratio:.3f}" if isinstance(ratio, float) else ""))
    mb = 1 / (1024 * 1024)
    bottom.plot(seen, [b * mb for b in churn["channel_bytes"]], "o-", label="heap")
    bottom.plot(seen, [b * mb for b in churn["channel_total_bytes"]], "s-", label="total")
    for name, sizes in churn["channel_index_bytes"].items():
        bottom.plot(seen, [math.nan if b is None else b * mb for b in sizes], "--",
                    label=name.removeprefix("fairq."))
    bottom.set_ylim(bottom=0)
    bottom.set_xlabel("tenants seen so far")
    bottom.set_ylabel("fairq.channel (MiB)")
    rows = bottom.twinx()
    rows.plot(seen, churn["channel_rows"], "k:", label="rows (right)")
    rows.set_ylim(bottom=0)
    rows.set_ylabel("fairq.channel rows")
    lines, labels = bottom.get_legend_handles_labels()
    more, more_labels = rows.get_legend_handles_labels()
    bottom.legend(lines + more, labels + more_labels, fontsize=7, loc="upper left")
    return fig
