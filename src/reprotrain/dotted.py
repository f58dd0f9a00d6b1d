"""Dotted keys, as in overrides and error messages: ``{"trainer": {"epochs": 30}}`` is
``{"trainer.epochs": 30}``."""

from __future__ import annotations

from typing import Any


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (with ``prefix`` before every key); lists and
    scalars are leaves."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
