"""Running pgbench: finding the binary, starting scripts, reading its summary."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["Pgbench", "pgbench_binary", "pgbench_summary"]


@dataclass
class Pgbench:
    """Runs pgbench scripts against one database."""

    dsn: str
    binary: str
    workdir: Path
    #: Every pgbench started and not yet ended by ``stop_all``: what an interrupted run
    #: must end (see ``start``).
    running: list[subprocess.Popen[str]] = field(default_factory=list)

    def start(self, name: str, script: str, clients: int, seconds: int,
              options: str = "") -> subprocess.Popen[str]:
        path = self.workdir / f"{name}.sql"
        path.write_text(script)
        # --max-tries: a deadlocked or serialization-failed script run is retried (and
        # counted), as a real client would; anything else aborts the client and fails.
        # The password goes in pgbench's environment, not on its command line, which
        # every local user can read (ps, /proc/<pid>/cmdline).
        params = conninfo_to_dict(self.dsn)
        password = params.pop("password", None)
        cmd = [self.binary, "-n", "-M", "prepared", "-c", str(clients), "-j", "1",
               "--max-tries", "10", "-T", str(seconds), "-f", str(path),
               make_conninfo("", **params)]
        env = dict(os.environ)
        if password is not None:
            env["PGPASSWORD"] = str(password)
        if options:
            env["PGOPTIONS"] = (env.get("PGOPTIONS", "") + " " + options).strip()
        # Started and listed with Ctrl-C and SIGTERM held back: an interrupt between
        # Popen's fork and the caller listing the process (or inside Popen, after the
        # fork) left a pgbench nobody ended, still writing to the database (or the
        # throwaway cluster) that the bench was emptying (or removing) on its way out.
        with _interrupts_held():
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env)
            self.running.append(proc)
        return proc

    def stop_all(self) -> None:
        """Ends every pgbench ``start`` started that still runs."""
        try:
            self.stop(self.running)
        finally:
            self.running = [proc for proc in self.running if proc.returncode is None]

    @staticmethod
    def stop(procs: list[subprocess.Popen[str]]) -> None:
        """Ends whichever of ``procs`` still run."""
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

    @staticmethod
    def finish(proc: subprocess.Popen[str], seconds: int) -> str:
        try:
            out, err = proc.communicate(timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"pgbench failed ({proc.returncode}): {err.strip()[-2000:]}")
        return out


#: The signals that end a bench (fairq.bench.cli turns both into KeyboardInterrupt).
_INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Holds Ctrl-C and SIGTERM back for the block; their handlers run when it ends."""
    if threading.current_thread() is not threading.main_thread():
        # Python runs signal handlers in the main thread only: none can run here.
        yield
        return
    caught: list[tuple[int, FrameType | None]] = []
    previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def hold(signum: int, frame: FrameType | None) -> None:
        caught.append((signum, frame))

    try:
        # (An ExitStack: each handler is put back even if putting back another raised.)
        with contextlib.ExitStack() as restore:
            for signum in _INTERRUPTS:
                if signal.getsignal(signum) is None:  # not set from Python: cannot be put back
                    continue
                previous[signum] = signal.signal(signum, hold)
                restore.callback(signal.signal, signum, previous[signum])
            yield
    finally:
        # Also when the block failed: the interrupt is not lost.
        for number, frame in caught:
            handler = previous[number]
            if callable(handler):
                handler(number, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(number)
            # (SIG_IGN: dropped, as it would have been.)


def pgbench_summary(output: str) -> dict[str, float]:
    """tps, average latency (ms), failed and retried script runs from pgbench's output."""
    out: dict[str, float] = {}
    for line in output.splitlines():
        words = line.split()
        if line.startswith("tps ="):
            out["tps"] = float(words[2])
        elif line.startswith("latency average ="):
            out["latency_avg_ms"] = float(words[3])
        elif line.startswith("number of failed transactions:"):
            out["failed"] = float(words[4])
        elif line.startswith("number of transactions retried:"):
            out["retried"] = float(words[4])
    return out


def pgbench_binary() -> str:
    """pgbench on PATH, else the one beside the server that pg_config names."""
    return shutil.which("pgbench") or str(Path(_bindir()) / "pgbench")


def _bindir() -> str:
    from fairq.cluster import pg_bindir
    return str(pg_bindir())
