"""Test-only fault injection: kill or signal this process at an exact training event.

``REPROTRAIN_TEST_KILL=in-save:6 | after-save:8 | before-best:16 | step:5 | sigterm:5 |
sigusr2:5 | sigint2:5`` (``before-best``: after ``step-N.pt``, before ``best.pt``)
sends SIGKILL (or SIGTERM, SIGUSR2, or two SIGINTs) at that event of that global step, so
tests interrupt at exact points (mid-epoch, an epoch boundary, mid-write). Read once at
import: ``hook`` is called every training step and costs one string test when unset.

``REPROTRAIN_TEST_KILL=enospc:<file name>``: the first write of that file (``metrics.jsonl``,
``step-00000008.pt``) fails as on a full disk (``OSError(ENOSPC)``); later writes succeed,
so the failure can be recorded.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

_spec = os.environ.get("REPROTRAIN_TEST_KILL", "")


def hook(event: str, global_step: int) -> None:
    """Fire if the spec names this event and step (no-op otherwise)."""
    if not _spec:
        return
    if event == "step" and _spec == f"sigterm:{global_step}":
        os.kill(os.getpid(), signal.SIGTERM)
    elif event == "step" and _spec == f"sigusr2:{global_step}":
        os.kill(os.getpid(), signal.SIGUSR2)
    elif event == "step" and _spec == f"sigint2:{global_step}":  # Ctrl-C pressed twice
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
    elif _spec == f"{event}:{global_step}":
        os.kill(os.getpid(), signal.SIGKILL)


def partial_write(path: Path, data: bytes, global_step: int | None) -> None:
    """``in-save:N``: leave what a kill mid-write leaves (half a temp file), then die."""
    if _spec and _spec == f"in-save:{global_step}":
        tmp = Path(path).with_name(f".{Path(path).name}.partial.tmp")
        tmp.write_bytes(data[: len(data) // 2])
        hook("in-save", global_step)


_disk_full_fired = False


def disk_full(path: Path) -> None:
    """``enospc:<name>``: raise ENOSPC on the first write of a file called ``name``."""
    global _disk_full_fired
    if _spec.startswith("enospc:") and not _disk_full_fired and Path(path).name == _spec[7:]:
        _disk_full_fired = True
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
