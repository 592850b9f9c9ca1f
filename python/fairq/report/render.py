"""Writing the report: one sorted Parquet file and one CSV file per table, the charts,
and index.html, which shows the summary and links everything."""

from __future__ import annotations

import csv
import html
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fairq.report.charts import write_charts
from fairq.report.queries import ORDER, TABLES
from fairq.report.rows import Collected, collect, csv_rows

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["write_report"]


_DESCRIPTIONS = {
    "summary": "the whole period in one row",
    "channels": "per channel: throughput, outcomes, wait and processing percentiles",
    "hours": "per hour (of settled_at): the same figures over all channels",
    "channel_hours": "per channel and hour: throughput by outcome",
    "attempts": "per channel: how many messages settled after n attempts",
    "fairness": "per window and queue: waiting channels, first deliveries, Jain's fairness index",
}


def _html_table(data: Collected) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in data.columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>"
        for row in data.rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_report(tables: dict[str, DataFrame], out: Path, *, title: str = "fairq report",
                 top: int = 20, note: str = "") -> Path:
    """Writes Parquet, CSV, charts and index.html under ``out``; returns index.html.

    Each table is computed once, into one sorted Parquet file; the CSV files and the
    charts are made from those files."""
    (out / "csv").mkdir(parents=True, exist_ok=True)
    (out / "charts").mkdir(parents=True, exist_ok=True)
    written: dict[str, DataFrame] = {}
    for name in TABLES:
        df, path = tables[name], str(out / "parquet" / name)
        one = df.coalesce(1)
        if ORDER[name]:
            one = one.sortWithinPartitions(*ORDER[name])
        one.write.mode("overwrite").parquet(path)
        written[name] = df.sparkSession.read.parquet(path)
        with open(out / "csv" / f"{name}.csv", "w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(df.columns)
            writer.writerows(csv_rows(written[name]))
    tables = written
    charts = write_charts(out, tables, top)
    summary = collect(tables["summary"])
    transposed = Collected(["figure", "value"],
                            [[c, v] for c, v in zip(summary.columns, summary.rows[0], strict=True)]
                            if summary.rows else [])
    links = "".join(
        f'<li><b>{name}</b> — {html.escape(_DESCRIPTIONS[name])}: '
        f'<a href="csv/{name}.csv">CSV</a>, <a href="parquet/{name}/">Parquet</a></li>'
        for name in TABLES)
    figures = "".join(
        f'<figure><img src="{src}" alt="{html.escape(caption)}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        for src, caption in charts)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1000px}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}
figure{{margin:1em 0}}img{{max-width:100%}}</style></head>
<body><h1>{html.escape(title)}</h1>
<p>{html.escape(note)}</p>
<p>Times in milliseconds; hours and windows in UTC. Wait time: created → first dequeued.
Processing time: first dequeued → settled (completed and dead messages). Dead-letter rate:
dead / (completed + dead). Jain's index: (Σx)² / (n·Σx²) over the channels waiting in a
window, x = their first deliveries in it.</p>
<h2>Summary</h2>{_html_table(transposed)}
<h2>Tables</h2><ul>{links}</ul>
<h2>Charts</h2>{figures}
</body></html>
"""
    index = out / "index.html"
    index.write_text(page, encoding="utf-8")
    return index
