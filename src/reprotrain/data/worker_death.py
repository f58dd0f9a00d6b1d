"""A DataLoader worker killed from outside (the OOM killer's usual pick) ends the run cleanly.

Closes: a traceback, a run marked ``failed`` although its checkpoints are intact, and a
process that never exits (the surviving workers ignore SIGTERM, and the interpreter's exit
SIGTERMs and joins them). The run is marked ``interrupted`` and exits 75 without a new
checkpoint: the death is reported asynchronously, not at a step boundary.
"""

from __future__ import annotations

import atexit
import multiprocessing
import signal
import threading
import time

#: What the main process may see before torch's SIGCHLD handler when a worker dies while
#: handing over a batch: the socket carrying its shared-memory handles is reset.
TRANSPORT_ERRORS = (ConnectionResetError, BrokenPipeError, EOFError)


def is_worker_death(exc: BaseException) -> bool:
    """Whether ``exc`` reports a dead DataLoader worker (or a reset socket of a killed one)."""
    text = str(exc)
    if isinstance(exc, TRANSPORT_ERRORS):
        return _killed_worker_soon() is not None
    return (
        isinstance(exc, RuntimeError)
        and text.startswith("DataLoader worker")
        and ("killed by signal" in text or "exited unexpectedly" in text)
    )


def killed_worker() -> str | None:
    """A daemonic child (a loader worker) that a signal ended, named as torch names it."""
    # The stdlib keeps finished children only in this set (active_children() drops them).
    for child in list(multiprocessing.process._children):
        code = child.exitcode
        if child.daemon and code is not None and code < 0:
            name = signal.Signals(-code).name
            return f"DataLoader worker (pid {child.pid}) is killed by signal: {name}"
    return None


def _killed_worker_soon(wait_s: float = 10.0) -> str | None:
    """:func:`killed_worker`, waiting up to ``wait_s`` for the exit status: the reset socket
    can come seconds before the worker is reapable (over 2 s on a loaded 2-core host)."""
    deadline = time.monotonic() + wait_s
    while (found := killed_worker()) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


def describe(exc: BaseException) -> str:
    if isinstance(exc, TRANSPORT_ERRORS):
        return _killed_worker_soon() or " ".join(str(exc).split())
    return " ".join(str(exc).split()).rstrip(".")


def stop_workers() -> None:
    """SIGKILL every daemonic child (the loader's workers) so the exit cannot hang on them;
    torch's SIGCHLD handler (it would raise at the first death) is reset first."""
    children = [c for c in multiprocessing.active_children() if c.daemon]
    if not children:
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout=5)


# Before multiprocessing's own exit handler, registered earlier (atexit runs last-in first-out).
atexit.register(stop_workers)
