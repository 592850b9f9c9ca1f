"""A throwaway PostgreSQL cluster on 127.0.0.1, for tests, ``fairq demo`` and ``fairq bench``.

PostgreSQL refuses to run as root; when we are root the cluster belongs to the
``postgres`` system user and its commands run through ``runuser``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Cluster", "pg_bindir"]


def pg_bindir(pg_config: str = "pg_config") -> Path:
    """The server binaries of the PostgreSQL that ``pg_config`` describes."""
    out = subprocess.run([pg_config, "--bindir"], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Cluster:
    """A private cluster: ``start()``, use ``dsn()``, ``stop()``, ``remove()``."""

    settings: dict[str, str] = field(default_factory=dict)
    bindir: Path = field(default_factory=pg_bindir)
    port: int = field(default_factory=_free_port)
    user: str = "postgres"
    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="fairq-pg-")))

    @property
    def datadir(self) -> Path:
        return self.base / "data"

    @property
    def logfile(self) -> Path:
        return self.base / "server.log"

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, check=True, capture_output=True, text=True)

    def init(self) -> Cluster:
        if os.geteuid() == 0:
            shutil.chown(self.base, "postgres")
        self._run("initdb", "-D", str(self.datadir), "-U", self.user, "--auth=trust",
                  "-E", "UTF8", "--locale=C.UTF-8", "-N")
        return self

    def start(self) -> Cluster:
        if not (self.datadir / "PG_VERSION").exists():
            self.init()
        options = {"listen_addresses": "127.0.0.1", "port": str(self.port),
                   "unix_socket_directories": str(self.base), **self.settings}
        opts = " ".join(f"-c {k}={v}" for k, v in options.items())
        self._run("pg_ctl", "-D", str(self.datadir), "-l", str(self.logfile), "-o", opts,
                  "-w", "-t", "120", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        """Stops the server; ``mode="immediate"`` is a crash (no checkpoint)."""
        self._run("pg_ctl", "-D", str(self.datadir), "-m", mode, "-w", "stop")

    def running(self) -> bool:
        try:
            self._run("pg_ctl", "-D", str(self.datadir), "status")
        except subprocess.CalledProcessError:
            return False
        return True

    def remove(self) -> None:
        if self.running():
            self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)

    def dsn(self, dbname: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user={self.user} dbname={dbname}"
