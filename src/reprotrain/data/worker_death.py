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

import multiprocessing


def is_worker_death(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's report of a DataLoader worker that died."""
    text = str(exc)
    return (
        isinstance(exc, RuntimeError)
        and text.startswith("DataLoader worker")
        and ("killed by signal" in text or "exited unexpectedly" in text)
    )


def describe(exc: BaseException) -> str:
    return " ".join(str(exc).split()).rstrip(".")


def stop_workers() -> None:
    """SIGKILL every daemonic child (the loader's workers) so the exit cannot hang on them."""
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join(timeout=5)
