"""The bench's targets, and which of them a result meets."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["TARGETS", "lookup", "targets"]


# (key, comparison, threshold) for the full run on the project's 2-core machine. A key
# with dots names a nested value ("tenants.1000.single_vs_floor" is
# results["tenants"]["1000"]["single_vs_floor"]); a threshold that is a string is the
# key of another result of the same run (a relative target). The batched cycle over
# 100 channels (batched_msgs_per_s, batched_vs_floor), where one batch takes every
# channel, is reported without a target.
TARGETS: tuple[tuple[str, str, float | str], ...] = (
    ("cycle_vs_floor", ">=", 0.65),
    ("tenants.1000.single_vs_floor", ">=", 0.5),
    ("tenants.1000.batched_vs_floor", ">=", 0.5),
    ("tenants.10000.single_vs_floor", ">=", 0.5),
    ("tenants.10000.batched_vs_floor", ">=", 0.5),
    ("tenants.100000.single_vs_floor", ">=", 0.4),
    ("tenants.100000.batched_vs_floor", ">=", 0.4),
    ("depth_latency_ratio", "<=", 1.3),
    ("channels_latency_ratio", "<=", 1.3),
    ("fairness_wait_ratio", "<=", 1.5),
    ("jain_index", ">=", 0.99),
    ("held_snapshot_ratio", ">=", "floor_held_snapshot_ratio"),
    ("soak_ratio", ">=", 0.9),
    ("churn.last_vs_first", ">=", 0.9),
    ("weights.max_window_deviation", "<=", 1),
    ("queue_isolation_latency_ratio", "<=", 1.3),
    ("spark_enqueue_rows_per_s", ">=", 20_000),
)


def lookup(results: dict[str, Any], key: str) -> Any:
    """The result a key names; dots walk nested objects ("tenants.1000.single_vs_floor")."""
    value: Any = results
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def targets(results: dict[str, Any], only: str | None = None) -> dict[str, dict[str, Any]]:
    """Each target of TARGETS whose key the results hold: the target, the value and
    whether it is met (None when the value, or the reference it is compared with, is
    missing or NaN). A relative target also gives the ``threshold`` it resolved to."""
    out: dict[str, dict[str, Any]] = {}
    for key, op, limit in TARGETS:
        value = lookup(results, key)
        if value is None or (only is not None and key != only):
            continue
        entry: dict[str, Any] = {"target": _target_text(op, limit), "value": value}
        if isinstance(limit, str):
            resolved = lookup(results, limit)
            threshold = float(resolved) if isinstance(resolved, (int, float)) else math.nan
            entry["threshold"] = threshold
        else:
            threshold = limit
        entry["met"] = _met(value, op, threshold)
        out[key] = entry
    return out


def _target_text(op: str, limit: float | str) -> str:
    return f"{op} {limit}" if isinstance(limit, str) else f"{op} {limit:g}"


def _met(value: Any, op: str, limit: float) -> bool | None:
    if not isinstance(value, (int, float)) or math.isnan(value) or math.isnan(limit):
        return None
    return value >= limit if op == ">=" else value <= limit
