"""The fingerprint of generated data: sha256 of its generation parameters."""

from __future__ import annotations

import hashlib
import json


def params_fingerprint(kind: str, version: int, **params: object) -> dict:
    """run.json's data identity for data that is a pure function of ``params``.

    Bump ``version`` when the generation code changes: it is part of the hash."""
    text = json.dumps({"kind": kind, "version": version, **params}, sort_keys=True)
    return {"kind": "synthetic-params", "sha256": hashlib.sha256(text.encode()).hexdigest()}
