"""Handlers for worker processes started by the tests (``fairq worker worker_handlers:gated``).

They leave marks as files in $FAIRQ_TEST_MARKS, so a test can see from outside the
process which deliveries started and which finished.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from fairq import AsyncMessage, Message


def _mark(kind: str, message: Message[bytes] | AsyncMessage[bytes]) -> None:
    marks = Path(os.environ["FAIRQ_TEST_MARKS"])
    (marks / f"{kind}-{message.id}-{message.num_attempts}").touch()


def gated(message: Message[bytes]) -> None:
    """Runs until the test creates the file ``release`` in $FAIRQ_TEST_MARKS, so that a
    test decides by events, not by timing, when a delivery finishes. The content is a
    safety limit in seconds: past it, the handler fails."""
    _mark("started", message)
    release = Path(os.environ["FAIRQ_TEST_MARKS"]) / "release"
    give_up = time.monotonic() + float(message.content.decode())
    while not release.exists():
        if time.monotonic() > give_up:
            raise TimeoutError("never released")
        time.sleep(0.01)
    _mark("done", message)


async def gated_async(message: AsyncMessage[bytes]) -> None:
    """``gated`` as a coroutine: `fairq worker` runs it with an AsyncWorker."""
    _mark("started", message)
    release = Path(os.environ["FAIRQ_TEST_MARKS"]) / "release"
    give_up = time.monotonic() + float(message.content.decode())
    while not release.exists():
        if time.monotonic() > give_up:
            raise TimeoutError("never released")
        await asyncio.sleep(0.01)
    _mark("done", message)


class GatedAsync:
    """``gated_async`` as an object whose ``__call__`` is a coroutine function: `fairq
    worker` runs it with an AsyncWorker too (``inspect.iscoroutinefunction`` is false
    for such an object, and until 0.7.36 a Worker ran it: each call returned a
    coroutine that never ran, and every message failed)."""

    async def __call__(self, message: AsyncMessage[bytes]) -> None:
        await gated_async(message)


gated_async_object = GatedAsync()
