"""Handlers for worker processes started by the tests (``fairq worker worker_handlers:slow``).

They leave marks as files in $FAIRQ_TEST_MARKS, so a test can see from outside the
process which deliveries started and which finished.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from fairq import Message


def _mark(kind: str, message: Message[bytes]) -> None:
    marks = Path(os.environ["FAIRQ_TEST_MARKS"])
    (marks / f"{kind}-{message.id}-{message.num_attempts}").touch()


def slow(message: Message[bytes]) -> None:
    """Sleeps as many seconds as the content says."""
    _mark("started", message)
    time.sleep(float(message.content.decode()))
    _mark("done", message)
