"""What a result was measured on: the machine, the server's settings, fairq's version
and script, pgbench, the sizes."""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fairq.bench.database import connect, scalar
from fairq.bench.sizes import Sizes

__all__ = ["machine"]


SETTINGS = ("server_version", "fsync", "synchronous_commit", "full_page_writes", "wal_level",
            "shared_buffers", "max_connections", "max_wal_size", "checkpoint_timeout",
            "autovacuum", "autovacuum_naptime", "autovacuum_vacuum_cost_limit",
            "autovacuum_vacuum_cost_delay", "wal_sync_method", "jit", "shared_preload_libraries")


def machine(dsn: str, pgbench_binary: str, sizes: Sizes, cluster: str) -> dict[str, Any]:
    with connect(dsn) as conn:
        settings = {name: str(scalar(conn, f"SHOW {name}")) for name in SETTINGS}
        events = scalar(conn, "SELECT current_setting('fairq.events', true)")
        fairq_version = scalar(conn, "SELECT extversion FROM pg_extension WHERE extname = 'fairq'")
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    script = Path(_sharedir()) / "extension" / f"fairq--{fairq_version}.sql"
    digest = None
    with contextlib.suppress(OSError):
        digest = hashlib.sha256(script.read_bytes()).hexdigest()
    pgbench_version = subprocess.run([pgbench_binary, "--version"], capture_output=True,
                                     text=True, check=False).stdout.strip()
    return {
        "cores": os.cpu_count(), "cpu": cpu, "memory_bytes": mem,
        "platform": platform.platform(), "python": platform.python_version(),
        "postgresql": settings.pop("server_version"), "settings": settings,
        "fairq_version": fairq_version, "fairq_script_sha256": digest,
        "fairq_events": events or "wake (default)",
        "cluster": cluster, "pgbench": pgbench_version,
        "load_average_start": list(os.getloadavg()), "sizes": asdict(sizes),
        "clients": (f"throughput: pgbench -M prepared, {sizes.producers} producer +"
                    f" {sizes.consumers} consumer clients (two concurrent processes, -j 1 each)"
                    f" for {sizes.throughput_s} s; latency: one psycopg connection, sequential;"
                    f" fairness and soak: Python threads, one psycopg connection each"),
    }


def _sharedir() -> str:
    try:
        from fairq.cluster import pg_config
        out = subprocess.run([pg_config(), "--sharedir"], capture_output=True, text=True,
                             check=True)
    except (OSError, subprocess.CalledProcessError):
        return "/nonexistent"
    return out.stdout.strip()
