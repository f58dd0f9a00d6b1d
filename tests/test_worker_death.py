"""A worker killed while it hands over a batch may surface as a socket reset, not as torch's
"DataLoader worker ... killed by signal": both end the run as interrupted (exit 75)."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import time

from reprotrain.data import worker_death


def _sleep() -> None:
    time.sleep(60)


def test_a_socket_reset_is_a_worker_death_only_when_a_worker_was_killed(monkeypatch):
    # Each "no worker died" answer waits out the wait for an exit status (10 s): 0.5 s here.
    short = functools.partial(worker_death._killed_worker_soon, 0.5)
    monkeypatch.setattr(worker_death, "_killed_worker_soon", short)
    reset = ConnectionResetError(104, "Connection reset by peer")
    assert not worker_death.is_worker_death(reset)  # no worker died: a real I/O error
    child = multiprocessing.get_context("fork").Process(target=_sleep, daemon=True)
    child.start()
    try:
        os.kill(child.pid, signal.SIGKILL)  # what the OOM killer does
        deadline = time.monotonic() + 10
        while child.exitcode is None and time.monotonic() < deadline:  # not join(): the loader
            time.sleep(0.01)  # has not joined its workers when the socket reset arrives
        assert worker_death.is_worker_death(reset)
        assert worker_death.describe(reset) == (
            f"DataLoader worker (pid {child.pid}) is killed by signal: SIGKILL"
        )
    finally:
        child.kill()
        child.join(timeout=5)  # join() also drops it from multiprocessing's children
    assert not worker_death.is_worker_death(reset)


def test_torchs_own_report_is_still_a_worker_death():
    exc = RuntimeError("DataLoader worker (pid 7) is killed by signal: Killed. ")
    assert worker_death.is_worker_death(exc) and not worker_death.is_worker_death(
        RuntimeError("something else")
    )
