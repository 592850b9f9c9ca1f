"""Running pgbench: finding the binary, starting scripts, reading its summary."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["Pgbench", "pgbench_binary", "pgbench_summary"]


@dataclass
class Pgbench:
    """Runs pgbench scripts against one database."""

    dsn: str
    binary: str
    workdir: Path

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
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)

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
