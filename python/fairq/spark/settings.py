"""The session settings that a stream's rows' fields depend on, recorded with each
micro-batch's first attempt so that a replay under other settings is refused
(:mod:`fairq.spark.stream`): a row's part is a hash of its fields, and fields computed
under other settings hash into other parts, so such a replay wrote some rows twice and
others never."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: The settings that change what the same expression computes from the same row: the
#: zone naive times (strings, timestamp_ntz, dates) are read in, whether casts and
#: arithmetic fail or give NULL and wrap, what type "timestamp" names in expressions,
#: and how datetime patterns parse. (JSON content and dedup_key_from pin their own
#: options: fairq.spark.messages.JSON_OPTIONS.)
SETTINGS = ("spark.sql.session.timeZone", "spark.sql.ansi.enabled",
            "spark.sql.timestampType", "spark.sql.legacy.timeParserPolicy")


def session_settings(spark: SparkSession) -> dict[str, str | None]:
    """The session's values of :data:`SETTINGS`, Spark's defaults included (every one
    exists since Spark 3.4)."""
    return {key: spark.conf.get(key) for key in SETTINGS}


def settings_changed(first: Mapping[str, str | None], now: Mapping[str, str | None]) -> str | None:
    """What differs between the settings of a batch's first attempt and of this one, as
    ``key: first -> now`` phrases, or None. (A setting that one of them did not record,
    say after an upgrade of Spark, is not compared.)"""
    changes = [f"{key}: {first[key]!r} -> {now[key]!r}" for key in SETTINGS
               if key in first and key in now and first[key] != now[key]]
    return "; ".join(changes) or None
