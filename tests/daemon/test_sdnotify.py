"""The systemd notify client against a real datagram socket, as systemd would listen on it."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from kafold.sdnotify import Notifier


def _listen(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    return sock


def test_messages_arrive_in_order(tmp_path: Path) -> None:
    """READY, WATCHDOG and STOPPING reach the socket as separate datagrams, in the order sent."""
    path = tmp_path / "notify"
    with _listen(path) as sock:
        notifier = Notifier({"NOTIFY_SOCKET": str(path)})
        assert notifier.ready("3 connectors caught up")
        assert notifier.watchdog()
        assert notifier.stopping()
        got = [sock.recv(4096).decode() for _ in range(3)]
    assert got == ["READY=1\nSTATUS=3 connectors caught up", "WATCHDOG=1", "STOPPING=1"]


def test_abstract_socket_names(tmp_path: Path) -> None:
    """An '@' socket name addresses the abstract namespace."""
    name = f"kafold-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).watchdog()
        assert sock.recv(100) == b"WATCHDOG=1"


def test_outside_systemd_is_a_no_op() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.watchdog_interval_s is None


def test_watchdog_interval_is_half_the_timeout() -> None:
    """WATCHDOG_USEC=10s means pinging every 5 s, unless WATCHDOG_PID names another process."""
    assert Notifier({"WATCHDOG_USEC": "10000000"}).watchdog_interval_s == 5.0
    assert Notifier({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"}).watchdog_interval_s is None
