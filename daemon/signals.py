"""SIGTERM/SIGINT that reach `kafold daemon` before its worker installs its own handlers, kept for the worker.

The worker (Faust's, in daemon.host) installs its signal handlers only once it starts: after the imports, the
configuration and the services' checks, a second or two. A supervisor's SIGTERM in that window would otherwise kill
the process by the signal (exit -15), and Ctrl-C raise KeyboardInterrupt wherever it lands. `catch_early` keeps
such a signal instead; the worker hands it to its own handlers as soon as they are installed, so the daemon stops
the one graceful way (exit 0). Nothing has been consumed by then: no offsets are involved.
"""

from __future__ import annotations

import signal
from typing import Any

from kafold import logs

log = logs.get(__name__)

_received: list[signal.Signals] = []


def catch_early() -> None:
    """Keep SIGTERM/SIGINT from now until the worker's handlers replace these (main thread only)."""
    def keep(signum: int, _frame: Any) -> None:
        if not _received:
            log.info("daemon.stop_requested", signal=signal.Signals(signum).name, phase="starting")
        _received.append(signal.Signals(signum))

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, keep)


def received() -> signal.Signals | None:
    """The first signal kept before the worker's handlers, if any."""
    return _received[0] if _received else None
