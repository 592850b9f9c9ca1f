"""The dashboard the demo offers while its scenario runs, when the dashboard extra is
installed: read-only (a pause or a retry would upset the demo's own checks), sampled
every second, on the port asked for or, when that one is taken, on any free one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TextIO

from fairq.dashboard.cli import missing_extra

__all__ = ["offer_dashboard"]


@contextmanager
def offer_dashboard(dsn: str, port: int | None, out: TextIO) -> Iterator[None]:
    """Serves the dashboard of ``dsn`` for the duration of the block (``port`` None:
    not at all)."""
    if port is None or missing_extra("the demo's dashboard"):
        yield
        return
    from fairq.dashboard.app import Settings
    from fairq.dashboard.server import start

    settings = Settings(dsn, read_only=True, interval=timedelta(seconds=1))
    try:
        running = start(settings, port=port)
    except OSError:  # the port is taken: any free one will do
        running = start(settings, port=0)
    print(f"dashboard: {running.url} (read-only, while the demo runs)", file=out, flush=True)
    try:
        yield
    finally:
        running.stop()
