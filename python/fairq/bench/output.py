"""A result as the bench hands it out: the table it prints and the JSON it writes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fairq.bench.targets import TARGETS, lookup

__all__ = ["clean", "table", "write_json"]


ROWS = (
    ("floor_msgs_per_s", "plain-SQL floor, 1 msg/call", "{:,.0f}"),
    ("fifo_msgs_per_s", "seed FIFO queue", "{:,.0f}"),
    ("cycle_msgs_per_s", "fairq cycle, 1 msg/call", "{:,.0f}"),
    ("cycle_vs_floor", "  cycle / floor", "{:.3f}"),
    ("batched_floor_msgs_per_s", "plain-SQL floor, batched", "{:,.0f}"),
    ("batched_msgs_per_s", "fairq cycle, batched", "{:,.0f}"),
    ("batched_vs_floor", "  batched / floor", "{:.3f}"),
    ("batched_wide_msgs_per_s", "fairq batched, wide channels (ref.)", "{:,.0f}"),
    ("batched_wide_vs_floor", "  wide batched / floor", "{:.3f}"),
    ("depth_latency_ratio", "dequeue latency, deep / shallow", "{:.3f}"),
    ("channels_latency_ratio", "dequeue latency, many / few channels", "{:.3f}"),
    ("fairness_wait_ratio", "light p99 wait, heavy / none", "{:.3f}"),
    ("jain_index", "Jain index, backlogged tenants", "{:.4f}"),
    ("held_snapshot_ratio", "cycle with held snapshot / without", "{:.3f}"),
    ("floor_held_snapshot_ratio", "  floor with held snapshot (ref.)", "{:.3f}"),
    ("soak_ratio", "soak, last tenth / first tenth", "{:.3f}"),
    ("churn.last_vs_first", "churn, last tenth / first tenth", "{:.3f}"),
    ("weights.max_window_deviation", "weights 1..10: worst window vs weight", "{:d}"),
    ("weights.single.max_share_error", "  share error, 1 msg/call", "{:.4f}"),
    ("weights.batched.max_share_error", "  share error, batched", "{:.4f}"),
    ("queue_isolation_latency_ratio", "small queue latency, beside deep / alone", "{:.3f}"),
    ("spark_enqueue_rows_per_s", "Spark DataFrame enqueue (rows/s)", "{:,.0f}"),
)


def _rows(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """ROWS, with two rows per level of the tenant axis after the churn row."""
    tenant_rows: list[tuple[str, str, str]] = []
    for name, level in results.get("tenants", {}).items():
        where = (f"{level['channels']:,} ch." if name != "zipf"
                 else f"Zipf {level['channels']:,} ch.")
        for mode in ("single", "batched"):
            tenant_rows += [(f"tenants.{name}.{mode}_msgs_per_s", f"{where}, fairq {mode}",
                             "{:,.0f}"),
                            (f"tenants.{name}.{mode}_vs_floor", f"  {where}, {mode} / floor",
                             "{:.3f}")]
    at = next(i for i, row in enumerate(ROWS) if row[0] == "churn.last_vs_first")
    return [*ROWS[:at], *tenant_rows, *ROWS[at:]]


def table(results: dict[str, Any]) -> str:
    declared = {key: (op, limit) for key, op, limit in TARGETS}
    met_by_key = results.get("targets", {})
    lines = [f"{'metric':<38} {'value':>12}  {'target':<14} met",
             f"{'-' * 38} {'-' * 12}  {'-' * 14} ---"]
    for key, label, fmt in _rows(results):
        value = lookup(results, key)
        if value is None and key not in results:
            continue
        shown = "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) \
            else fmt.format(value)
        target = ""
        if key in declared:
            op, limit = declared[key]
            threshold = met_by_key.get(key, {}).get("threshold")
            target = (f"{op} {limit:,g}" if not isinstance(limit, str)
                      else f"{op} ref" if not isinstance(threshold, float)
                      or math.isnan(threshold) else f"{op} {threshold:.3f} ref")
        met = met_by_key.get(key, {}).get("met")
        mark = "" if key not in declared else ("yes" if met else "NO" if met is False else "?")
        lines.append(f"{label:<38} {shown:>12}  {target:<14} {mark}")
    m = results.get("machine", {})
    lines.append(f"machine: {m.get('cores')} cores, {m.get('cpu')}, PostgreSQL"
                 f" {m.get('postgresql')}, fsync={m.get('settings', {}).get('fsync')},"
                 f" synchronous_commit={m.get('settings', {}).get('synchronous_commit')}")
    return "\n".join(lines)


def write_json(results: dict[str, Any], path: Path) -> None:
    """Writes the results (already :func:`clean`) as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


def clean(value: Any) -> Any:
    """NaN is not JSON: write null instead."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value
