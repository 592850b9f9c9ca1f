"""The demo's scenario: its tenants and their policies, the crash, and what the demo's
own threads observe while it runs."""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import timedelta

__all__ = ["MAX_ATTEMPTS", "PREFIX", "THREADS", "WORKERS", "Observed", "Scenario", "Tenant"]


PREFIX = "demo-"
WORKERS = 2
THREADS = 4  # per worker
MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class Tenant:
    name: str  # the channel
    kind: str  # heavy | light | limited | capped
    work_ms: int  # how long its handler "works"
    rate: float = 0.0  # messages per second, sent steadily
    burst: int = 0  # messages sent at the start
    backlog: int = 0  # heavy only: keep this many waiting
    max_concurrency: int | None = None
    release_interval_ms: int = 0
    fail_once: float = 0.0  # share of messages whose first attempt raises
    fail_always: float = 0.0  # share of messages that always raise ("poison")

    @property
    def policy(self) -> str:
        if self.max_concurrency is not None:
            return f"<= {self.max_concurrency} at once"
        if self.release_interval_ms:
            return f"1 per {self.release_interval_ms} ms"
        return "-"


@dataclass(frozen=True)
class Scenario:
    seconds: float  # how long producers produce; then the queue drains
    tenants: tuple[Tenant, ...]
    crash_at: float  # seconds after the start
    crash_messages: int
    crash_lock: timedelta

    @classmethod
    def build(cls, seconds: float) -> Scenario:
        interval_ms = 250
        cap, capped_work_ms = 2, 100
        tenants = (
            Tenant(f"{PREFIX}heavy", "heavy", work_ms=5, backlog=200 if seconds < 10 else 400,
                   fail_once=0.02, fail_always=0.002),
            *(Tenant(f"{PREFIX}light-{i}", "light", work_ms=10, rate=4.0, fail_once=0.05,
                     fail_always=0.02) for i in range(1, 5)),
            # A backlog it needs ~80 % of the run to work through at its pace.
            Tenant(f"{PREFIX}limited", "limited", work_ms=10,
                   burst=max(4, int(0.8 * seconds * 1000 / interval_ms)),
                   release_interval_ms=interval_ms),
            # Enough slow work to sit at its cap for ~70 % of the run.
            Tenant(f"{PREFIX}capped", "capped", work_ms=capped_work_ms,
                   burst=max(4, int(0.7 * seconds * cap * 1000 / capped_work_ms)),
                   max_concurrency=cap),
        )
        return cls(seconds=seconds, tenants=tenants, crash_at=0.3 * seconds, crash_messages=5,
                   crash_lock=timedelta(seconds=1 if seconds < 10 else 2))

    def tenant(self, channel: str) -> Tenant | None:
        return next((t for t in self.tenants if t.name == channel), None)


@dataclass
class Observed:
    """What the demo's own threads saw; the rest comes from the database."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    created: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    not_created: Counter[str] = field(default_factory=Counter)  # dropped | duplicate
    running: Counter[str] = field(default_factory=Counter)
    max_running: Counter[str] = field(default_factory=Counter)
    max_in_flight_sampled: Counter[str] = field(default_factory=Counter)
    raised: int = 0
    recovered: set[int] = field(default_factory=set)
    abandoned: dict[int, str] = field(default_factory=dict)  # id -> channel
    crashed_at: float | None = None
    foreign: int = 0  # messages of other channels that the workers handed back

    def total_created(self) -> int:
        with self.lock:
            return sum(len(ids) for ids in self.created.values())
