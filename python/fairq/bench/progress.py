"""Progress lines of a bench run: what ``log`` is, and the default that prints them."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Log", "Progress"]

Log = Callable[[str], None]


class Progress:
    """Progress lines on stderr, stamped with the seconds since the start."""

    def __init__(self, stream: Any = None) -> None:
        self.start = time.monotonic()
        self.stream = stream if stream is not None else sys.stderr

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self.start:7.1f}s] {message}", file=self.stream, flush=True)
