"""Run a sweep with one SIGKILL at an exact moment of one of its jobs (tests only).

    python tests/sweep_kills.py job:<J>:step:<S> -m reprotrain.train --multirun ...
    python tests/sweep_kills.py enter:<job dir> -m reprotrain.train --multirun ...

``job:J:step:S``: after step S of the sweep's job J (jobs counted in the order they start:
each fresh job's step 1 opens the next). ``enter:DIR``: at the first file the trainer writes
under DIR, so the job there has Hydra's ``.hydra/`` and nothing of its own: a kill between
two jobs. Registered on ``reprotrain.events`` and run as ``tests/faults.py`` runs its entry point.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

from reprotrain import events


def kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def register(spec: str) -> None:
    kind, _, rest = spec.partition(":")
    if kind == "job":
        job, _, step = rest.partition(":step:")
        started = []

        def at_step(global_step: int, **_: object) -> None:
            started.extend([global_step] if global_step == 1 else [])
            if len(started) == int(job) + 1 and global_step == int(step):
                kill()

        events.on("step", at_step)
    elif kind == "enter":
        where = Path(rest).resolve()

        def at_write(path: Path, **_: object) -> None:
            if where in Path(path).resolve().parents:
                kill()

        events.on("file-write", at_write)
    else:
        raise SystemExit(f"sweep_kills.py: unknown kill {spec!r}")


if __name__ == "__main__":
    register(sys.argv[1])
    sys.path[0] = os.getcwd()  # as ``python -m`` has it
    sys.argv = [sys.argv[3], *sys.argv[4:]]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
