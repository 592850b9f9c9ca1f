"""The report printed after a demo: every tenant's waits, and each claim of the README
checked against the database's records (fairness, limits, nothing lost, dead letters,
the crash's recovery, fairq.check())."""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from fairq.demo.queries import Connection, Settled, history
from fairq.demo.scenario import MAX_ATTEMPTS, Observed, Scenario
from fairq.types import HistoryOutcome

__all__ = ["Report", "fmt_s", "percentile", "report"]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def fmt_s(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def add(self, line: str = "") -> None:
        self.lines.append(line)

    def check(self, ok: bool, line: str) -> None:
        self.lines.append(f"  [{'ok' if ok else 'FAILED'}] {line}")
        if not ok:
            self.failures.append(line)


def report(conn: Connection, scenario: Scenario, observed: Observed, since: datetime,
           drained: bool, elapsed: float) -> tuple[Report, list[Settled]]:
    settled = history(conn, since)
    rep = Report()
    by_channel: dict[str, list[Settled]] = defaultdict(list)
    for record in settled:
        by_channel[record.channel].append(record)

    rep.add(f"What happened ({elapsed:.1f} s: {scenario.seconds:g} s of sending, then draining)")
    rep.add()
    rep.add("  Waits from creation to first delivery (p50 / p99):")
    waits: dict[str, list[float]] = defaultdict(list)
    for tenant in scenario.tenants:
        mine = [r.wait for r in by_channel[tenant.name]]
        waits[tenant.kind].extend(mine)
        rep.add(f"    {tenant.name:<14} {tenant.policy:<17} {len(mine):>6} messages  "
                f"{fmt_s(percentile(mine, 50)):>8} / {fmt_s(percentile(mine, 99)):>8}")
    light_p50, light_p99 = percentile(waits["light"], 50), percentile(waits["light"], 99)
    heavy_p50, heavy_p99 = percentile(waits["heavy"], 50), percentile(waits["heavy"], 99)
    rep.add()
    rep.check(bool(waits["light"]) and bool(waits["heavy"]) and light_p50 < heavy_p50,
              f"fairness: light tenants waited {fmt_s(light_p50)} (p50) / {fmt_s(light_p99)} "
              f"(p99) while the heavy tenant's flood waited {fmt_s(heavy_p50)} / "
              f"{fmt_s(heavy_p99)}")
    rep.add("         (the limited and capped tenants queue behind their own limits, by design)")

    for tenant in scenario.tenants:
        if tenant.max_concurrency is not None:
            with observed.lock:
                handlers = observed.max_running[tenant.name]
                sampled = observed.max_in_flight_sampled[tenant.name]
            rep.check(max(handlers, sampled) <= tenant.max_concurrency,
                      f"{tenant.name} max_concurrency {tenant.max_concurrency}: at most "
                      f"{handlers} handlers ran at once (fairq.channels showed at most "
                      f"{sampled} in flight)")
        if tenant.release_interval_ms:
            releases = sorted(r.first_delivery for r in by_channel[tenant.name])
            gaps = [(b - a).total_seconds() * 1000 for a, b in itertools.pairwise(releases)]
            smallest = min(gaps) if gaps else math.nan
            rep.check(bool(gaps) and smallest >= tenant.release_interval_ms,
                      f"{tenant.name} release_interval_ms {tenant.release_interval_ms}: "
                      f"smallest gap between two releases {smallest:.1f} ms "
                      f"({len(releases)} releases, database clock)")

    with observed.lock:
        created = {i: ch for ch, ids in observed.created.items() for i in ids}
        not_created = sum(observed.not_created.values())
        abandoned = dict(observed.abandoned)
        recovered = set(observed.recovered)
        raised, foreign = observed.raised, observed.foreign
    outcome = {r.id: r.outcome for r in settled}
    completed = sum(1 for i in created if outcome.get(i) is HistoryOutcome.COMPLETED)
    dead = sum(1 for i in created if outcome.get(i) is HistoryOutcome.DEAD)
    missing = [i for i in created if i not in outcome]
    twice = len(settled) - len({r.id for r in settled})
    rep.check(not missing and twice == 0 and completed + dead == len(created) and drained,
              f"nothing lost: created {len(created)} = completed {completed} + dead {dead}"
              + (f"; {len(missing)} not settled" if missing else "")
              + (f"; {twice} settled twice" if twice else ""))
    if not_created:
        rep.add(f"         ({not_created} sends were not created: dropped or duplicate)")
    dead_letters = conn.execute("SELECT count(*) FROM fairq.dead_letters"
                                " WHERE channel LIKE 'demo-%'").fetchone()
    dead_rows = int(dead_letters[0]) if dead_letters else 0
    rep.check(dead_rows == dead,
              f"dead letters: the {dead} dead messages are in fairq.dead_letters "
              f"({dead_rows} rows there)")
    came_back = sum(1 for i in abandoned if i in recovered)
    fates = Counter(outcome[i].value if i in outcome else "unsettled" for i in abandoned)
    crashed_at = observed.crashed_at or 0.0
    rep.check(bool(abandoned) and came_back == len(abandoned),
              f"crash: a worker died holding {len(abandoned)} messages at {crashed_at:.1f} s; "
              f"their {scenario.crash_lock.total_seconds():g} s locks expired and {came_back} "
              f"came back with recovered = true ("
              + ", ".join(f"{n} {fate}" for fate, n in sorted(fates.items())) + ")")
    problems = conn.execute("SELECT channel, problem FROM fairq.check()").fetchall()
    rep.check(not problems, "fairq.check(): " + ("consistent" if not problems else
                                                 "; ".join(f"{c}: {p}" for c, p in problems)))
    rep.add(f"  {raised} handler failures: messages failing once were retried with back-off, "
            f"poison ones dead-lettered after {MAX_ATTEMPTS} attempts")
    if foreign:
        rep.add(f"  {foreign} messages of other channels were handed back untouched (deferred)")
    return rep, settled
