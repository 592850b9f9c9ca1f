"""Threads whose first failure reaches whoever waits for them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Threads"]


class Threads:
    """Runs functions in threads and re-raises the first exception on join."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self.stop = threading.Event()

    def start(self, target: Callable[..., None], *args: Any) -> None:
        def wrapped() -> None:
            try:
                target(*args)
            except BaseException as exc:  # reported by join()
                self.errors.append(exc)
                self.stop.set()

        thread = threading.Thread(target=wrapped, daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self.threads:
            left = None if deadline is None else max(0.1, deadline - time.monotonic())
            thread.join(left)
        if any(t.is_alive() for t in self.threads):
            self.stop.set()
            for thread in self.threads:
                thread.join(30)
        if self.errors:
            raise self.errors[0]
