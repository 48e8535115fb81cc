"""systemd's notify protocol (Type=notify): READY=1, WATCHDOG=1, STOPPING=1 and STATUS= over $NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


class Notifier:
    """Sends notify messages to the socket systemd names in $NOTIFY_SOCKET; a no-op outside systemd."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        # A leading '@' names a socket in the abstract namespace (Linux), spelled with a NUL byte.
        self.address = "\0" + path[1:] if path.startswith("@") else path
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        watched = usec.isdigit() and (not pid or pid == str(os.getpid()))
        self.watchdog_interval_s = int(usec) / 1e6 / 2 if watched else None  # ping at half the timeout

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, *lines: str) -> bool:
        """Send one datagram with the given `KEY=value` lines; False when not under systemd."""
        if not self.address:
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(self.address)
            sock.sendall("\n".join(lines).encode())
        return True

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self, status: str = "") -> bool:
        return self.send("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")
