"""Run an entry point with one fault registered on ``reprotrain.events`` (tests only).

    python tests/faults.py <fault> -m reprotrain.train <overrides...>
    python -m torch.distributed.run ... tests/faults.py <fault> -m reprotrain.train ...

The fault fires at an exact moment of the run, so a test interrupts where it means to
(mid-epoch, at an epoch boundary, mid-write):

- ``step:N`` / ``after-save:N`` / ``before-best:N`` / ``microbatch:N``: SIGKILL at that
  event of global step N (``before-best``: after ``step-N.pt``, before ``best.pt``);
- ``sigterm:N`` / ``sigusr2:N`` / ``sigint2:N``: SIGTERM, SIGUSR2 or two SIGINTs (Ctrl-C
  twice) after step N;
- ``in-save:N``: leave what a kill mid-write leaves (half a temp file), then SIGKILL;
- ``stop:N``: SIGSTOP after step N: the run holds its lock, alive and still, until the
  test kills it (no race with a run that would otherwise finish first);
- ``enospc:<file name>``: the first write of that file fails as on a full disk
  (``OSError(ENOSPC)``); later writes succeed, so the failure can be recorded.

The trainer reads no variable and no key for any of this: the handler is registered here,
in this process, before the entry point runs (``runpy``, as ``python -m`` would). This file
is then no module of the run (``__main__`` is the entry point's), so nothing of it enters the
run's record.
"""

from __future__ import annotations

import errno
import os
import runpy
import signal
import sys
from pathlib import Path

from reprotrain import events

SIGNALS = {"sigterm": (signal.SIGTERM,), "sigusr2": (signal.SIGUSR2,),
           "sigint2": (signal.SIGINT, signal.SIGINT)}  # fmt: skip
KILLS = ("step", "after-save", "before-best", "microbatch")


def _at(step: int, act):
    def handler(global_step: int, **_: object) -> None:
        if global_step == step:
            act()

    return handler


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def register(fault: str) -> None:
    """Register the handler ``fault`` names; an unknown fault is an error, not a no-op."""
    kind, _, arg = fault.partition(":")
    if kind == "enospc":
        fired = []

        def full(path: Path, **_: object) -> None:
            if not fired and path.name == arg:
                fired.append(path)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        events.on("file-write", full)
    elif kind == "in-save":

        def half(path: Path, data: bytes, global_step: int | None, **_: object) -> None:
            if global_step == int(arg):
                path.with_name(f".{path.name}.partial.tmp").write_bytes(data[: len(data) // 2])
                _kill()

        events.on("checkpoint-write", half)
    elif kind in SIGNALS:
        events.on("step", _at(int(arg), lambda: [os.kill(os.getpid(), s) for s in SIGNALS[kind]]))
    elif kind == "stop":
        events.on("step", _at(int(arg), lambda: os.kill(os.getpid(), signal.SIGSTOP)))
    elif kind in KILLS:
        events.on(kind, _at(int(arg), _kill))
    else:
        raise SystemExit(f"faults.py: unknown fault {fault!r}")


def command(fault: str, module: str, *args: str) -> list[str]:
    """The argv that runs ``python -m module args`` with ``fault`` registered."""
    return [sys.executable, __file__, fault, "-m", module, *args]


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "-m":
        raise SystemExit("usage: faults.py <fault> -m <module> [args...]")
    register(argv[0])
    sys.path[0] = os.getcwd()  # as ``python -m`` has it: not this file's folder (tests/)
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
