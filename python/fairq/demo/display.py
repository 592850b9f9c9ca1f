"""The live view of a running demo: a table redrawn in place on a terminal, a line
every few seconds otherwise."""

from __future__ import annotations

import math
from typing import TextIO

from fairq.demo.queries import Row
from fairq.demo.scenario import PREFIX, THREADS, WORKERS, Observed, Scenario

__all__ = ["Display"]


class Display:
    """A table redrawn in place on a terminal; a line every few seconds otherwise."""

    def __init__(self, out: TextIO, scenario: Scenario) -> None:
        self.out = out
        self.scenario = scenario
        self.tty = out.isatty()
        self.drawn = 0
        self.last_line = -math.inf

    def show(self, elapsed: float, phase: str, rows: list[Row], observed: Observed) -> None:
        if self.tty:
            self._table(elapsed, phase, rows, observed)
        elif elapsed - self.last_line >= 2.0 or phase == "done":
            self.last_line = elapsed
            cells = " | ".join(f"{r.channel.removeprefix(PREFIX)} {r.waiting}/{r.in_flight}/"
                               f"{r.done}" for r in rows)
            print(f"[{elapsed:5.1f}s {phase}] waiting/in flight/done: {cells}", file=self.out,
                  flush=True)

    def _table(self, elapsed: float, phase: str, rows: list[Row], observed: Observed) -> None:
        with observed.lock:
            sent = {name: len(ids) for name, ids in observed.created.items()}
            crashed_at, abandoned = observed.crashed_at, len(observed.abandoned)
            recovered, raised = len(observed.recovered), observed.raised
        lines = [f"\x1b[1mfairq demo\x1b[0m  {elapsed:5.1f} s  {phase}   "
                 f"{WORKERS} workers x {THREADS} threads",
                 "",
                 f"  {'tenant':<14}{'policy':<17}{'sent':>7}{'waiting':>9}{'in flight':>11}"
                 f"{'done':>8}{'dead':>6}"]
        for row in rows:
            tenant = self.scenario.tenant(row.channel)
            policy = tenant.policy if tenant else ""
            lines.append(f"  {row.channel:<14}{policy:<17}{sent.get(row.channel, 0):>7}"
                         f"{row.waiting:>9}{row.in_flight:>11}{row.done:>8}{row.dead:>6}")
        crash = ("" if crashed_at is None else
                 f"a worker died holding {abandoned} messages at {crashed_at:.1f} s, "
                 f"{recovered} came back recovered; ")
        lines += ["", f"  {crash}{raised} handler failures so far (retried with back-off)"]
        up = f"\x1b[{self.drawn}F" if self.drawn else ""
        self.out.write(up + "".join(f"{line}\x1b[K\n" for line in lines))
        self.out.flush()
        self.drawn = len(lines)
