"""Running a dashboard with uvicorn: in the foreground (``fairq dashboard``) or on a
thread of its own (``fairq demo``, the tests)."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass

import uvicorn

from fairq.dashboard.app import Dashboard, Settings

__all__ = ["Running", "bind", "serve", "start", "url_of"]


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, bound before uvicorn starts: a port in use fails here, with
    the OS's error, and port 0 picks a free one whose number is known at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def _server(dashboard: Dashboard) -> uvicorn.Server:
    return uvicorn.Server(uvicorn.Config(dashboard.app(), lifespan="on", log_level="warning",
                                         access_log=False))


def serve(dashboard: Dashboard, sock: socket.socket) -> None:
    """Serves until Ctrl-C or SIGTERM (uvicorn's own handlers, on the main thread)."""
    _server(dashboard).run(sockets=[sock])


@dataclass
class Running:
    """A dashboard served on a thread: ``url``, and ``stop()``."""

    url: str
    dashboard: Dashboard
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()


def start(settings: Settings, host: str = "127.0.0.1", port: int = 0) -> Running:
    """Serves a dashboard on a thread; returns once it answers (its sampler has read
    the queues), or raises what kept it from starting."""
    sock = bind(host, port)
    dashboard = Dashboard(settings)
    server = _server(dashboard)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # reported by start()
            failure.append(exc)
        finally:
            sock.close()

    thread = threading.Thread(target=run, name="fairq-dashboard", daemon=True)
    thread.start()
    # Progress, not time: the lifespan sets `ready` once the pool and sampler run;
    # a failed startup ends the thread instead.
    while not dashboard.ready.wait(0.05):
        if not thread.is_alive():
            raise RuntimeError(f"the dashboard did not start: {failure[0] if failure else ''}"
                               "(see the log above)")
    return Running(url_of(sock), dashboard, server, thread)
