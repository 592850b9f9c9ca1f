"""One demo run: the policies set, the workers and the producer started, the live view
until the queue drains, then the report and the chart."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import psycopg

from fairq.codecs import JsonCodec
from fairq.demo.chart import chart
from fairq.demo.database import NO_JIT, check_database, cleanup, purge, with_options
from fairq.demo.display import Display
from fairq.demo.queries import db_now, demo_backlog, live_rows
from fairq.demo.scenario import MAX_ATTEMPTS, THREADS, WORKERS, Observed, Scenario
from fairq.demo.summary import report
from fairq.demo.workload import Producer, make_handler
from fairq.queue import Queue
from fairq.worker import Backoff, Worker

__all__ = ["scenario_run"]


def scenario_run(dsn: str, scenario: Scenario, chart_path: Path | None, out: TextIO,
                 seed: int, existing: bool) -> int:
    observed = Observed()
    dsn = with_options(dsn, NO_JIT)
    with psycopg.connect(dsn, autocommit=True) as conn:
        check_database(conn)
        if existing:
            purge(conn, time.monotonic() + 15, scenario)  # leftovers of an interrupted run
        queue: Queue[Any] = Queue(conn)
        for tenant in scenario.tenants:
            if tenant.policy != "-":
                queue.channel_set(tenant.name, max_concurrency=tenant.max_concurrency,
                                  release_interval=timedelta(
                                      milliseconds=tenant.release_interval_ms))
        since = db_now(conn)

    # The workers' sessions record history (the report's source); nobody else's do.
    work_dsn = with_options(dsn, "fairq.history=on")
    workers: list[Worker[Any]] = []
    threads: list[threading.Thread] = []
    queues: list[Queue[Any]] = []
    producer: Producer | None = None
    try:
        for i in range(WORKERS):
            wqueue = Queue(work_dsn, codec=JsonCodec(), pool_size=THREADS + 2)
            queues.append(wqueue)
            worker = Worker(wqueue, make_handler(observed), concurrency=THREADS,
                            lock=timedelta(seconds=5), max_attempts=MAX_ATTEMPTS,
                            backoff=Backoff(base=timedelta(milliseconds=100),
                                            cap=timedelta(milliseconds=500)),
                            poll_interval=timedelta(milliseconds=500),
                            grace_period=timedelta(seconds=2))
            workers.append(worker)
            threads.append(threading.Thread(target=worker.run, name=f"fairq-demo-worker-{i}",
                                            daemon=True))
        pqueue = Queue(work_dsn, codec=JsonCodec(), pool_size=2)
        queues.append(pqueue)
        started = time.monotonic()
        for thread in threads:
            thread.start()
        producer = Producer(pqueue, scenario, observed, started, seed)
        producer.start()

        display = Display(out, scenario)
        drained = False
        drain_limit = scenario.seconds + max(30.0, 2 * scenario.seconds)
        with psycopg.connect(dsn, autocommit=True) as monitor:
            while True:
                elapsed = time.monotonic() - started
                rows = live_rows(monitor, scenario, since)
                with observed.lock:
                    for row in rows:
                        sampled = observed.max_in_flight_sampled
                        sampled[row.channel] = max(sampled[row.channel], row.in_flight)
                if producer.error is not None:
                    raise producer.error
                producing = producer.is_alive()
                settled_all = sum(r.done + r.dead for r in rows) >= observed.total_created()
                if not producing and settled_all and demo_backlog(monitor) == 0:
                    drained = True
                    display.show(elapsed, "done", rows, observed)
                    break
                if elapsed > drain_limit:
                    display.show(elapsed, "gave up waiting", rows, observed)
                    break
                display.show(elapsed, "sending" if producing else "draining", rows, observed)
                time.sleep(0.5)
            elapsed = time.monotonic() - started
            for worker in workers:
                worker.stop()
            for thread in threads:
                thread.join(10)
            rep, settled = report(monitor, scenario, observed, since, drained, elapsed)
        print(file=out)
        for line in rep.lines:
            print(line, file=out)
        if chart_path is not None:
            print(f"  {chart(chart_path, scenario, settled, elapsed)}", file=out)
        if rep.failures:
            print(f"\n{len(rep.failures)} check(s) FAILED", file=out, flush=True)
            return 1
        print("\nall checks passed", file=out, flush=True)
        return 0
    finally:
        if producer is not None:
            producer.stopping.set()
            producer.join(5)
        for worker in workers:
            worker.stop()
        for thread in threads:
            thread.join(10)
        for q in queues:
            q.close()
        if existing:
            cleanup(dsn, scenario, since, out)
