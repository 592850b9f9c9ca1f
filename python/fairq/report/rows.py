"""The report's tables as Python rows, for CSV files, charts and the HTML page."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["Collected", "collect", "csv_rows"]


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def csv_rows(df: DataFrame) -> Iterator[list[Any]]:
    """Rows of ``df`` for CSV: timestamps as ISO 8601 UTC (taken as epoch microseconds,
    so neither the session's nor Python's local time zone matters)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    stamps = [f.name for f in df.schema.fields if isinstance(f.dataType, T.TimestampType)]
    plain = df.select(*[F.unix_micros(F.col(c)).alias(c) if c in stamps else F.col(c)
                        for c in df.columns])
    for row in plain.toLocalIterator():
        yield [_iso(v) if c in stamps else v for c, v in zip(df.columns, row, strict=True)]


def _iso(micros: int | None) -> str | None:
    if micros is None:
        return None
    return (_EPOCH + timedelta(microseconds=micros)).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Collected:
    """A table's columns and rows, collected to the driver."""

    columns: list[str]
    rows: list[list[Any]]

    def column(self, name: str) -> list[Any]:
        i = self.columns.index(name)
        return [r[i] for r in self.rows]


def collect(df: DataFrame, limit: int | None = None) -> Collected:
    return Collected(df.columns, list(csv_rows(df if limit is None else df.limit(limit))))
