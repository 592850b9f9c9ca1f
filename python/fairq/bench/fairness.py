"""Fairness: light tenants' waits with and without a heavy tenant's backlog, and Jain's
index of service among backlogged tenants."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fairq.bench.database import LOCK_MS, PAYLOAD, connect, load, reset, retrying, settle
from fairq.bench.progress import Log
from fairq.bench.sizes import Sizes
from fairq.bench.stats import jain, quantile, ratio
from fairq.bench.threads import Threads

__all__ = ["UNSERVED_LIGHT_WAITS", "backlogged_tenants", "fairness_scenario", "light_phase"]


DEQUEUE_WAIT = ("SELECT d.id, d.channel, d.num_attempts,"
                " extract(epoch FROM clock_timestamp() - d.dequeue_at)::float8"
                f" FROM fairq.message_dequeue({LOCK_MS}, 1) d")


@dataclass
class Deliveries:
    """What consumers handed out: (seconds since start, channel, wait seconds)."""

    start: float = field(default_factory=time.monotonic)
    rows: list[tuple[float, str, float]] = field(default_factory=list)
    deadlocks: list[int] = field(default_factory=lambda: [0])
    lock: threading.Lock = field(default_factory=threading.Lock)


def _consume(dsn: str, stop: threading.Event, out: Deliveries) -> None:
    with connect(dsn) as conn:
        while not stop.is_set():
            rows = retrying(conn, DEQUEUE_WAIT, (), out.deadlocks, out.lock)
            if not rows:
                time.sleep(0.001)
                continue
            row = rows[0]
            out.rows.append((time.monotonic() - out.start, str(row[1]), float(row[3])))
            retrying(conn, "SELECT fairq.message_complete(%s, %s)", (row[0], row[2]),
                     out.deadlocks, out.lock)


def _light_producer(dsn: str, sizes: Sizes, stop: threading.Event, seconds: float,
                    sent: list[int]) -> None:
    rng = random.Random(7)
    interval = 1.0 / sizes.fair_light_rate
    with connect(dsn) as conn:
        began = time.monotonic()
        n = 0
        while not stop.is_set():
            due = began + n * interval
            if due - began >= seconds:
                break
            # (Asked to stop while it waits: no message after the stop.)
            if stop.wait(max(0.0, due - time.monotonic())):
                break
            channel = f"light-{rng.randrange(sizes.fair_light_tenants)}"
            retrying(conn, "SELECT 1 FROM fairq.message_create(%s, %s)", (channel, PAYLOAD),
                     [0], threading.Lock())
            n += 1
    sent[0] = n


# The light messages still waiting when a phase ends: how long each has waited so far.
UNSERVED_LIGHT_WAITS = ("SELECT extract(epoch FROM clock_timestamp() - m.dequeue_at)::float8"
                        " FROM fairq.message m JOIN fairq.channel c ON c.id = m.channel_id"
                        " WHERE c.name LIKE 'light-%'")


def light_phase(dsn: str, sizes: Sizes) -> tuple[Deliveries, int, list[float]]:
    """Light tenants at a steady rate, consumers polling, for fair_phase_s seconds. Also
    returns how long each light message never handed out had waited when the phase
    ended: a wait at least that long (left out, starving light tenants lowered no
    percentile)."""
    out = Deliveries()
    sent = [0]
    consumers = Threads()
    producer = Threads()
    # (An interrupt stops both: see Threads.__exit__.)
    with consumers, producer:
        for _ in range(sizes.fair_consumers):
            consumers.start(_consume, dsn, consumers.stop, out)
        producer.start(_light_producer, dsn, sizes, producer.stop, sizes.fair_phase_s, sent)
        producer.join(sizes.fair_phase_s + 60)
        # Let the last light messages through, then stop.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if sum(1 for r in out.rows if r[1].startswith("light-")) >= sent[0]:
                break
            time.sleep(0.05)
        consumers.stop.set()
        consumers.join(60)
    with connect(dsn) as conn:
        unserved = [float(w) for (w,) in conn.execute(UNSERVED_LIGHT_WAITS)]
    return out, sent[0], unserved


def backlogged_tenants(remaining: dict[str, int],
                       served: dict[str, int]) -> tuple[dict[str, int], set[str]]:
    """For Jain's index: the loaded tenants (heavy, bulk-*) still holding messages after
    the window, with what each was served, 0 included (counted only when served, a
    starved tenant vanished from the index: the worst unfairness read as fair); and
    the loaded tenants that drained within it (their counts would understate them)."""
    loaded = {c for c in (*remaining, *served) if c == "heavy" or c.startswith("bulk-")}
    backlogged = {c: served.get(c, 0) for c in loaded if remaining.get(c, 0) > 0}
    return backlogged, {c for c in loaded if c in served and c not in backlogged}


def fairness_scenario(dsn: str, sizes: Sizes, log: Log) -> dict[str, Any]:
    reset(dsn)
    base, base_sent, base_unserved = light_phase(dsn, sizes)
    base_served = [r[2] for r in base.rows if r[1].startswith("light-")]
    base_waits = base_served + base_unserved
    log(f"  without heavy tenant: {len(base_waits)} light messages,"
        f" p99 wait {quantile(base_waits, 0.99) * 1e3:.2f} ms")

    reset(dsn)
    load(dsn, lambda i: "heavy", sizes.fair_heavy, sizes, log, "heavy backlog")
    with connect(dsn) as conn:
        settle(conn)
    loaded, loaded_sent, loaded_unserved = light_phase(dsn, sizes)
    light_served = [r[2] for r in loaded.rows if r[1].startswith("light-")]
    light_waits = light_served + loaded_unserved
    heavy_served = sum(1 for r in loaded.rows if r[1] == "heavy")
    log(f"  with heavy backlog {sizes.fair_heavy:,}: {len(light_waits)} light messages,"
        f" p99 wait {quantile(light_waits, 0.99) * 1e3:.2f} ms; heavy served {heavy_served:,}")

    # Jain's index: several tenants backlogged for the whole window (heavy among them).
    # Enough that none drains within the window: four times what the consumers served
    # per second in the phase before (which the heavy backlog's size may have capped).
    phase_rate = len(loaded.rows) / max(sizes.fair_phase_s, 0.1)
    each = int(phase_rate * sizes.jain_window_s * 4 / sizes.jain_tenants) + 200
    # A tenant that drains within the window does not count; if any did, the
    # backlogs were too small for these consumers: load twice as much and measure again.
    for _attempt in range(4):
        load(dsn, lambda i: f"bulk-{i % (sizes.jain_tenants - 1)}",
             each * (sizes.jain_tenants - 1), sizes, log, "backlogged tenants")
        with connect(dsn) as conn:
            settle(conn)
        window = Deliveries()
        with Threads() as consumers:
            for _ in range(sizes.fair_consumers):
                consumers.start(_consume, dsn, consumers.stop, window)
            time.sleep(sizes.jain_window_s)
            consumers.stop.set()
            consumers.join(60)
        with connect(dsn) as conn:
            remaining = {str(name): int(size) for name, size in conn.execute(
                "SELECT channel, size FROM fairq.channels")}
        served: dict[str, int] = {}
        for _, channel, _ in window.rows:
            served[channel] = served.get(channel, 0) + 1
        backlogged, drained = backlogged_tenants(remaining, served)
        if not drained and len(backlogged) >= 2:
            break
        each *= 2
    jain_index = jain(list(backlogged.values()))
    log(f"  {len(backlogged)} backlogged tenants served {sum(backlogged.values()):,} messages"
        f" in {sizes.jain_window_s:g} s: Jain index {jain_index:.4f}")
    return {
        "baseline": {"light_sent": base_sent, "light_served": len(base_served),
                     "p50_wait_ms": quantile(base_waits, 0.5) * 1e3,
                     "p99_wait_ms": quantile(base_waits, 0.99) * 1e3},
        "heavy": {"light_sent": loaded_sent, "light_served": len(light_served),
                  "heavy_served": heavy_served, "heavy_backlog": sizes.fair_heavy,
                  "p50_wait_ms": quantile(light_waits, 0.5) * 1e3,
                  "p99_wait_ms": quantile(light_waits, 0.99) * 1e3},
        "ratio": ratio(quantile(light_waits, 0.99), quantile(base_waits, 0.99)),
        "deadlocks_retried": base.deadlocks[0] + loaded.deadlocks[0] + window.deadlocks[0],
        "jain": {"index": jain_index, "served": backlogged,
                 "tenants_drained": sorted(drained),
                 "window_s": sizes.jain_window_s},
        "series": {"heavy_phase": [(round(t, 4), c, round(w * 1e3, 3)) for t, c, w in loaded.rows],
                   "baseline_phase": [(round(t, 4), c, round(w * 1e3, 3)) for t, c, w in base.rows],
                   "jain_phase": [(round(t, 4), c) for t, c, _ in window.rows]},
    }
