"""The tenant axis: fairq's create → dequeue → complete cycle, one message per call and
``batch`` per call, over each of ``tenant_levels`` channels (producers pick channels
uniformly) and once over the largest level with a Zipf spread, each against the
plain-SQL floor fed by producers of the same shape, interleaved (floor, fairq, floor,
fairq) so that drift hits both. Every run is :func:`fairq.bench.throughput.throughput`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fairq.bench.pgbench import Pgbench
from fairq.bench.progress import Log
from fairq.bench.sizes import Sizes
from fairq.bench.stats import ratio
from fairq.bench.throughput import describe, throughput

__all__ = ["tenants_scenario"]


MODES = (("single", False), ("batched", True))


def tenants_scenario(bench: Pgbench, sizes: Sizes, log: Log,
                     profile: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Returns (summary by level, the throughput runs by level). Levels are the channel
    counts as strings, and "zipf"; each summary has ``single_vs_floor``,
    ``batched_vs_floor``, ``single_msgs_per_s``, ``batched_msgs_per_s``,
    ``floor_single_msgs_per_s``, ``floor_batched_msgs_per_s``, ``channels`` and
    ``spread``."""
    variants = [(str(c), replace(sizes, channels=c, channel_spread="uniform"))
                for c in sizes.tenant_levels]
    variants.append(("zipf", replace(sizes, channels=max(sizes.tenant_levels),
                                     channel_spread="zipf")))
    summary: dict[str, Any] = {}
    details: dict[str, Any] = {}
    for name, scale in variants:
        level: dict[str, Any] = {"channels": scale.channels, "spread": scale.channel_spread}
        runs: dict[str, Any] = {}
        for mode, batched in MODES:
            for kind in ("floor", "fairq"):
                result = throughput(bench, kind, scale, batched, profile=profile)
                runs[f"{kind}_{mode}"] = result
                log(describe(f"tenants {name} {kind} {mode}", result))
                prefix = "floor_" if kind == "floor" else ""
                level[f"{prefix}{mode}_msgs_per_s"] = float(result["msgs_per_s"])
            level[f"{mode}_vs_floor"] = ratio(level[f"{mode}_msgs_per_s"],
                                              level[f"floor_{mode}_msgs_per_s"])
        summary[name] = level
        details[name] = runs
        log(f"  tenants {name}: single {level['single_msgs_per_s']:,.0f} msgs/s"
            f" ({level['single_vs_floor']:.3f} of floor), batched"
            f" {level['batched_msgs_per_s']:,.0f} msgs/s"
            f" ({level['batched_vs_floor']:.3f} of floor)")
    return summary, details
