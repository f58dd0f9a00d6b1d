"""Named moments of a run that a test can hook: one registry, read by nobody else.

The training path announces where it is (``events.fire("step", global_step=5)``); it never
reads an environment variable or a config key to decide whether to misbehave. A test that
needs a kill, a signal or a full disk at an exact point registers a handler first (in
process, or through ``tests/faults.py``, which registers one and then runs the entry point),
and the handler acts. With nothing registered, ``fire`` is one dictionary lookup.

The moments, with what each handler receives as keyword arguments:

- ``step``: a training step finished (``global_step``), before its checkpoint decision;
- ``microbatch``: a micro-batch's backward finished inside a step (``global_step``: the step
  it belongs to), before the step's last one;
- ``after-save``: the end-of-epoch checkpoint is on disk (``global_step``);
- ``checkpoint-write``: a checkpoint's bytes are about to be written (``path``, ``data``,
  ``global_step``);
- ``before-best``: ``step-N.pt`` is written, ``best.pt`` not yet (``global_step``);
- ``file-write``: an atomic write of ``path`` has its temp file open, before any byte.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Handler = Callable[..., None]
_handlers: dict[str, list[Handler]] = {}


def on(event: str, handler: Handler) -> Callable[[], None]:
    """Call ``handler(**info)`` at every ``event``; returns the function that unregisters it."""
    _handlers.setdefault(event, []).append(handler)
    return lambda: _handlers.get(event, []).remove(handler)


def fire(event: str, **info: Any) -> None:
    """Announce ``event``; a no-op unless a handler is registered for it."""
    for handler in _handlers.get(event, ()):
        handler(**info)


def clear() -> None:
    """Forget every handler (tests that register in process call this when done)."""
    _handlers.clear()
