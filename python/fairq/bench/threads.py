"""Threads whose first failure reaches whoever waits for them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

__all__ = ["Threads"]


#: How long threads still running at join's timeout get, all together, to stop once
#: asked to (each function checks ``stop`` between its calls).
STOP_GRACE_S = 30.0


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
        # Listed before it starts: a Ctrl-C between the two left a running thread that
        # halt() did not wait for, and it created a message after the bench had emptied
        # the database (seen once in CI, on a loaded machine).
        self.threads.append(thread)
        thread.start()

    def __enter__(self) -> Threads:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Leaving the block by an exception (Ctrl-C, SIGTERM, a failed call) stops the
        threads and waits up to a grace for them, so that what the run does next (the
        bench empties the database on its way out) is not followed by their calls."""
        if exc is not None:
            self.halt()

    def halt(self, grace: float = STOP_GRACE_S) -> None:
        """Sets ``stop`` and waits up to ``grace`` for the threads; raises nothing."""
        self.stop.set()
        self._join_by(time.monotonic() + grace)

    def join(self, timeout: float | None = None, grace: float = STOP_GRACE_S) -> None:
        """Waits up to ``timeout`` for the threads to end; then sets ``stop`` and waits
        up to ``grace`` more for all of them together (not for each in turn: n stuck
        threads used to cost n times 30 s). Raises the first thread's exception, or
        RuntimeError if any is still running: a bench must not measure its next
        scenario beside a thread still working on the last.

        Interrupted while waiting (Ctrl-C), it stops the threads first: an interrupted
        run on ``--dsn`` emptied the database while they went on creating messages, and
        the next run refused it as holding fairq data."""
        try:
            self._join_by(None if timeout is None else time.monotonic() + timeout)
        except BaseException:
            self.halt(grace)
            raise
        if any(t.is_alive() for t in self.threads):
            self.stop.set()
            self._join_by(time.monotonic() + grace)
        if self.errors:
            raise self.errors[0]
        stuck = sum(t.is_alive() for t in self.threads)
        if stuck:
            raise RuntimeError(f"{stuck} of {len(self.threads)} threads did not stop"
                               f" within {grace:g} s of being asked to")

    def _join_by(self, deadline: float | None) -> None:
        for thread in self.threads:
            if thread.is_alive():  # (not one listed but never started)
                thread.join(None if deadline is None
                            else max(0.0, deadline - time.monotonic()))
