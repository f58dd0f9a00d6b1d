"""A DataLoader worker killed from outside (the OOM killer's usual pick) ends the run cleanly.

Closes: a SIGKILLed worker turning into a traceback, a run marked ``failed`` although its
checkpoints are intact, and then a process that never exits: the surviving workers ignore
SIGTERM (``pipeline.seed_worker``: stop signals are the main process's business), so the
interpreter's exit, which terminates daemonic children with SIGTERM and joins them, waits
forever.

What happens instead: the run is marked ``interrupted`` (its last checkpoint, written
atomically before the worker died, is where ``make resume`` continues, bitwise as if never
stopped), one ``error:`` line names the worker and says how to resume, the remaining
workers are killed outright, and the process exits 75. No new checkpoint is written: the
worker's death is reported asynchronously (torch's SIGCHLD handler), possibly in the middle
of a step, so the state at that moment is not a step boundary.
"""

from __future__ import annotations

import atexit
import multiprocessing
import signal
import threading

#: What the main process may see first when a worker dies while handing over a batch: the
#: socket that carries the batch's shared-memory handles is reset, before torch's SIGCHLD
#: handler reports the death.
TRANSPORT_ERRORS = (ConnectionResetError, BrokenPipeError, EOFError)


def is_worker_death(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's report of a DataLoader worker that died, or a reset of the
    worker's socket while a worker has in fact been killed by a signal."""
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


def _killed_worker_soon(wait_s: float = 2.0) -> str | None:
    """:func:`killed_worker`, waiting up to ``wait_s`` seconds for the exit status: the
    reset socket can reach the main process a moment before the killed worker is reapable
    (seen on a loaded 2-core host: the run ended as "failed" instead of "interrupted")."""
    import time

    deadline = time.monotonic() + wait_s
    while (found := killed_worker()) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


def describe(exc: BaseException) -> str:
    if isinstance(exc, TRANSPORT_ERRORS):
        return _killed_worker_soon() or " ".join(str(exc).split())
    return " ".join(str(exc).split()).rstrip(".")


def stop_workers() -> None:
    """SIGKILL every daemonic child (the loader's workers) so the exit cannot hang on them.

    torch's SIGCHLD handler would raise "worker killed" at the first death, mid-loop, and
    leave the others alive: it is put back to the default first (main thread only)."""
    children = [c for c in multiprocessing.active_children() if c.daemon]
    if not children:
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout=5)


# Workers ignore SIGTERM, and the interpreter's exit terminates daemonic children with
# SIGTERM and then joins them: kill any still alive first (atexit runs last-in, first-out,
# and multiprocessing registered its own handler before this module was imported).
atexit.register(stop_workers)
