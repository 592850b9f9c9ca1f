"""The README's psql walkthrough runs as written, and says what it claims."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_block(heading: str, language: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {heading}", 1)[1]
    match = re.search(rf"```{language}\n(.*?)```", section, re.S)
    assert match, f"no {language} block under {heading!r}"
    return match.group(1)


def test_psql_walkthrough_runs_and_every_claim_holds(dsn: str) -> None:
    script = readme_block("The lifecycle from psql", "sql")
    out = subprocess.run(
        ["psql", "-X", "-v", "ON_ERROR_STOP=1", "-A", "-t", "-F", "|", dsn],
        input=script, capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    # Each commented expectation appears as the statement's result, in order.
    expected = [
        "1|created", "2|created", "3|created",
        "2|tenant-a|1", "3|tenant-b|1", "1|tenant-a|1",
        "heartbeated", "deferred", "completed", "not_found",
    ]
    # fairq.channels: queue|channel|max_concurrency|release_interval_ms|max_size|max_attempts|
    #                 weight|paused_until|size|ready|scheduled|in_flight|next_dequeue_at
    channels = sorted(line for line in out if line.startswith("default|tenant-"))
    assert channels[0] == "default|tenant-a|2|0||3|1||1|0|0|1|"  # message 1 in flight, nothing waiting
    assert channels[1].startswith("default|tenant-b||0|||1||1|1|0|0|2")  # message 3 waits for its turn
    rest = ["3|2|step 1 done", "stale", "dead", "3|tenant-b|2|gave up", "requeued", "cancelled", "locked"]
    results = [line for line in out if not line.startswith("default|tenant-") and line.strip()]
    assert results == expected + rest, out
