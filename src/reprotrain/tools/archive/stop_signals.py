"""Stop signals unwind the stack like Ctrl-C, so a tool's cleanup runs.

Closes: debris from a stopped tool. SIGTERM, SIGHUP and SIGUSR2 end a Python process at
once by default, skipping every ``finally`` and context manager: ``make archive`` left its
``.archive-*`` staging dir and ``*.tar.gz.tmp``, ``make reproduce`` its temp extraction and
trust dirs. Inside :func:`raising` each of them raises :class:`Stopped` (a
``KeyboardInterrupt``, so no ``except Exception`` swallows it) where the process is, and
the cleanup on the way out runs; the tool's entry point reports it in one line.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2)


class Stopped(KeyboardInterrupt):
    """A stop signal arrived; raised where the process was."""

    def __init__(self, signum: int) -> None:
        self.signal = signal.Signals(signum).name
        super().__init__(f"stopped by {self.signal}")


def _raise(signum: int, frame: object) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def raising(signals: tuple[signal.Signals, ...] = SIGNALS) -> Iterator[None]:
    """Inside: each of ``signals`` raises :class:`Stopped`; the old handlers after."""
    previous = {sig: signal.signal(sig, _raise) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
