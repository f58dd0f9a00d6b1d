"""Strict JSON for every record the project writes.

Python's ``json`` writes ``NaN``, ``Infinity`` and ``-Infinity`` for non-finite floats by
default. Those are not JSON: ``jq``, JavaScript, Go and most strict parsers reject the whole
file, so one diverged loss would make ``run.json`` or ``summary.json`` unreadable to them.
Here a non-finite number becomes ``null`` and its path is returned, so the writer can keep
a flag (e.g. ``"nonfinite": ["final_metrics.train_loss"]``) instead of silently losing the
fact that the value was NaN rather than missing.

    clean, paths = to_strict_json(row)
    if paths:
        clean["nonfinite"] = paths
    text = strict_dumps(clean)          # raises if anything non-finite is left
    data = strict_loads(text)           # rejects NaN / Infinity literals on the way in
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any


def to_strict_json(obj: Any, path: str = "") -> tuple[Any, list[str]]:
    """A copy of ``obj`` with every non-finite float replaced by ``None``, and their paths.

    Paths are dotted for mapping keys and ``[i]`` for sequence items, as in
    ``metrics[3].train_loss``. Integers and booleans pass through untouched (``bool`` is an
    ``int``; ``True`` must not become ``1.0``). Non-``float`` reals (NumPy scalars, 0-d
    tensors converted by the caller) are turned into ``float`` so ``json`` can write them.
    """
    bad: list[str] = []
    return _walk(obj, path, bad), bad


def _walk(obj: Any, path: str, bad: list[str]) -> Any:
    if isinstance(obj, bool | int | str) or obj is None:
        return obj
    if isinstance(obj, float | numbers.Real) and not isinstance(obj, numbers.Integral):
        value = float(obj)
        if math.isfinite(value):
            return value
        bad.append(path or "$")
        return None
    if isinstance(obj, numbers.Integral):  # NumPy integers
        return int(obj)
    if isinstance(obj, dict):
        return {k: _walk(v, f"{path}.{k}" if path else str(k), bad) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_walk(v, f"{path}[{i}]", bad) for i, v in enumerate(obj)]
    return obj  # anything else: json.dumps decides (and raises on what it cannot write)


def strict_dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that refuses non-finite numbers instead of writing ``NaN``."""
    return json.dumps(obj, allow_nan=False, **kwargs)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite JSON constant {name} (strict JSON has no NaN/Infinity)")


def strict_loads(text: str | bytes) -> Any:
    """``json.loads`` that rejects ``NaN``, ``Infinity`` and ``-Infinity`` literals."""
    return json.loads(text, parse_constant=_reject_constant)
