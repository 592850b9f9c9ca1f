"""A TCP proxy in front of the test database that a test can cut, to make the database
unreachable without stopping the session's cluster."""

from __future__ import annotations

import contextlib
import socket
import threading

from psycopg.conninfo import conninfo_to_dict, make_conninfo


class Proxy:
    """Forwards connections to the database of ``dsn`` (TCP) until :meth:`cut`: then
    every connection through it is torn down and every new one closed as soon as it is
    accepted (``refused`` counts them), as a database that went away would."""

    def __init__(self, dsn: str) -> None:
        params = conninfo_to_dict(dsn)
        self._target = (str(params["host"]), int(params["port"]))
        self._listener = socket.create_server(("127.0.0.1", 0))
        # (accept() wakes up now and then to see close(): closing a socket does not
        # wake a thread blocked on it.)
        self._listener.settimeout(0.1)
        self.dsn = make_conninfo(dsn, host="127.0.0.1", port=self._listener.getsockname()[1])
        self.refused = 0
        self._cut = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    def cut(self) -> None:
        self._cut.set()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)  # wakes the pump blocked on it, which closes both ends

    def close(self) -> None:
        self._closed.set()
        self.cut()

    def _accept(self) -> None:
        with self._listener:
            while not self._closed.is_set():
                try:
                    client, _ = self._listener.accept()
                except TimeoutError:
                    continue
                if self._cut.is_set():
                    client.close()
                    self.refused += 1
                    continue
                upstream = socket.create_connection(self._target)
                with self._lock:
                    self._sockets.update((client, upstream))
                for source, sink in ((client, upstream), (upstream, client)):
                    threading.Thread(target=self._pump, args=(source, sink),
                                     daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):  # the other end went, or cut() shut this one
            while data := source.recv(65536):
                sink.sendall(data)
        for sock in (source, sink):
            _shut(sock)
        with self._lock:
            self._sockets.discard(source)
        source.close()  # (the other pump closes sink, its own source)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already shut, or closed
        sock.shutdown(socket.SHUT_RDWR)
