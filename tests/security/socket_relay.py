"""A TCP listener on 127.0.0.1 relaying each connection to a Unix socket (the embedded PostgreSQL listens only there,
and libpq applies sslmode only over TCP)."""

from __future__ import annotations

import socket
import threading
from contextlib import suppress


class UnixRelay:
    def __init__(self, unix_path: str) -> None:
        self.unix_path = unix_path
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.server.getsockname()[1])
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # closed
                return
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(self.unix_path)
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.server.close()
        for c in self._conns:
            c.close()
