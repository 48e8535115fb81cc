"""The daemon of a kafold.toml run in a thread of the test process, as `kafold daemon` runs it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kafold import config
from kafold.daemon.host import DaemonHost


@contextmanager
def daemon_thread(path: Path) -> Iterator[tuple[DaemonHost, threading.Thread]]:
    """The daemon on `path`, run in a thread (as `kafold daemon` does); stopped at the end, exit code 0 checked."""
    loaded = config.load_file(path)
    stop = threading.Event()
    host = DaemonHost(loaded.config, loaded.base, stop)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(host.run()), name="test-daemon")
    thread.start()
    try:
        yield host, thread
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive() and result == [0], f"the daemon did not stop cleanly: {result}"
