"""The demo's traffic: the workers' handler (slow, sometimes failing jobs), the
producer that sends every tenant's messages, and the worker that crashes."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from fairq.demo.scenario import PREFIX, Observed, Scenario, Tenant
from fairq.queue import Queue
from fairq.types import CreateStatus, Message, NewMessage

__all__ = ["HandlerError", "Producer", "make_handler"]


class HandlerError(Exception):
    """What the demo's handler raises to simulate a failing job."""


def make_handler(observed: Observed) -> Callable[[Message[Any]], None]:
    def handle(message: Message[Any]) -> None:
        if not message.channel.startswith(PREFIX):
            # Not ours: hand it straight back (refused at start, but a producer may
            # have sent one since).
            with observed.lock:
                observed.foreign += 1
            message.defer()
            return
        job = message.content
        channel = message.channel
        with observed.lock:
            if message.recovered:
                observed.recovered.add(message.id)
            observed.running[channel] += 1
            observed.max_running[channel] = max(observed.max_running[channel],
                                                observed.running[channel])
        try:
            time.sleep(job["ms"] / 1000)
            if job["fail"] == "always" or (job["fail"] == "once" and message.num_attempts == 1):
                with observed.lock:
                    observed.raised += 1
                raise HandlerError(f"simulated failure ({job['fail']})")
        finally:
            with observed.lock:
                observed.running[channel] -= 1
    return handle


class Producer(threading.Thread):
    """Sends every tenant's messages, and plays the worker that crashes."""

    TICK = 0.05

    def __init__(self, queue: Queue[Any], scenario: Scenario, observed: Observed,
                 started: float, seed: int) -> None:
        super().__init__(name="fairq-demo-producer", daemon=True)
        self.queue = queue
        self.scenario = scenario
        self.observed = observed
        self.started = started
        self.rng = random.Random(seed)
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def job(self, tenant: Tenant) -> dict[str, Any]:
        draw = self.rng.random()
        fail = ("always" if draw < tenant.fail_always
                else "once" if draw < tenant.fail_always + tenant.fail_once else None)
        return {"ms": tenant.work_ms, "fail": fail}

    def send(self, batch: list[NewMessage[Any]]) -> None:
        for start in range(0, len(batch), 500):
            chunk = batch[start:start + 500]
            results = self.queue.send_many(chunk)
            with self.observed.lock:
                for new, result in zip(chunk, results, strict=True):
                    if result.status is CreateStatus.CREATED and result.id is not None:
                        self.observed.created[new.channel].add(result.id)
                    else:
                        self.observed.not_created[new.channel] += 1

    def waiting(self, channel: str) -> int:
        stats = self.queue.channels(channel)
        return stats[0].ready + stats[0].scheduled if stats else 0

    def crash(self) -> None:
        """A worker takes a few messages, then dies: no heartbeat, no settlement."""
        # One call may hand out fewer than asked while other dequeues hold the
        # channels it would serve next; ask again until the worker holds its share.
        taken: list[Message[Any]] = []
        for _ in range(20):
            want = self.scenario.crash_messages - len(taken)
            if want == 0:
                break
            taken += self.queue.dequeue(self.scenario.crash_lock, want)
        with self.observed.lock:
            self.observed.crashed_at = time.monotonic() - self.started
            for message in taken:
                if message.channel.startswith(PREFIX):
                    self.observed.abandoned[message.id] = message.channel
                else:  # not ours: give it back at once
                    self.observed.foreign += 1
                    message.defer()

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    def _run(self) -> None:
        scenario = self.scenario
        self.send([NewMessage(t.name, self.job(t)) for t in scenario.tenants
                   for _ in range(t.burst)])
        next_send = {t.name: self.rng.expovariate(t.rate) for t in scenario.tenants if t.rate}
        crashed = False
        tick = 0
        while not self.stopping.is_set():
            now = time.monotonic() - self.started
            if now >= scenario.seconds:
                return
            batch: list[NewMessage[Any]] = []
            for tenant in scenario.tenants:
                if tenant.rate:
                    while next_send[tenant.name] <= now:
                        batch.append(NewMessage(tenant.name, self.job(tenant)))
                        next_send[tenant.name] += self.rng.expovariate(tenant.rate)
                if tenant.backlog and tick % 4 == 0:
                    missing = tenant.backlog - self.waiting(tenant.name)
                    batch.extend(NewMessage(tenant.name, self.job(tenant))
                                 for _ in range(max(0, missing)))
            if batch:
                self.send(batch)
            if not crashed and now >= scenario.crash_at:
                self.crash()
                crashed = True
            tick += 1
            self.stopping.wait(self.TICK)
