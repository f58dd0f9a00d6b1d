"""Named moments of a run that a test can hook: one registry, read by nobody else.

The training path announces where it is (``events.fire("step", global_step=5)``); a test
registers a handler (in process or through ``tests/faults.py``); with none, ``fire`` is one
dictionary lookup. The moments and their keyword arguments: ``step`` (``global_step``),
``microbatch`` (``global_step``: the step it belongs to), ``after-save`` (``global_step``),
``checkpoint-write`` (``path``, ``data``, ``global_step``), ``before-best`` (``global_step``;
``step-N.pt`` written, ``best.pt`` not yet), ``file-write`` (``path``; temp file open).
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
