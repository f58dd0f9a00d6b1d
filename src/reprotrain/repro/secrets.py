"""Config values read from the environment are recorded as the interpolation, not the value.
Closes: ``${oc.env:MIRROR_URL}`` (or a token passed the same way) resolved in clear into
``config.resolved.yaml``, the checkpoints, ``run.json`` and every archive. The run uses the
value; the record keeps the interpolation text and the value's sha256 (docs/guarantees.md).
A leaf depends on the environment when, resolved a second time with ``oc.env`` answering a
random canary, it carries the canary (directly, inside a string or through another key)."""

from __future__ import annotations

import copy
import json
import re
import secrets as _random
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from reprotrain.hashing import text_sha256
from reprotrain.hydra_api import register_resolver

__all__ = ["env_value_differences", "redact"]

_PROBE_RESOLVER = "reprotrain_env_probe"
_CANARY = f"reprotrain-env-canary-{_random.token_hex(8)}"
_OC_ENV = re.compile(r"(?<![\w.])oc\.env:")


def value_sha256(value: Any) -> str:
    """sha256 of a value as text: strings as themselves, anything else as sorted JSON."""
    return text_sha256(value if isinstance(value, str) else json.dumps(value, sort_keys=True))


def _probe_copy(raw: Any) -> Any:
    """The unresolved config with every ``oc.env:`` rewritten to the canary resolver."""
    if isinstance(raw, dict):
        return {k: _probe_copy(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return [_probe_copy(v) for v in raw]
    if isinstance(raw, str) and "${" in raw:
        return _OC_ENV.sub(f"{_PROBE_RESOLVER}:", raw)
    return raw


def _depends_on_env(probe: Any, key: Any) -> bool:
    """Whether ``probe[key]`` resolves to something that carries the canary.
    A leaf whose probe resolution fails (a resolver that rejects the canary) is counted as
    environment-derived when its text mentions the probe: the safe side for a secret."""
    try:
        value = probe[key]
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
    except (OmegaConfBaseException, ValueError, TypeError):
        return True
    return _CANARY in json.dumps(value, default=str)


def _walk(real: Any, raw: Any, probe: Any, path: str, digests: dict[str, dict]) -> Any:
    """``real`` with every environment-derived leaf replaced by its interpolation text."""
    if isinstance(probe, DictConfig):
        return {
            k: _visit(v, raw.get(k), probe, k, f"{path}.{k}" if path else str(k), digests)
            for k, v in real.items()
        }
    if isinstance(probe, ListConfig):
        return [
            _visit(real[i], raw[i], probe, i, f"{path}[{i}]", digests) for i in range(len(real))
        ]
    return real


def _visit(real: Any, raw: Any, parent: Any, key: Any, path: str, digests: dict) -> Any:
    if isinstance(raw, str) and OmegaConf.is_interpolation(parent, key):
        if _depends_on_env(parent, key):
            digests[path] = {"interpolation": raw, "sha256": value_sha256(real)}
            return raw
        return real
    if isinstance(real, (dict, list)):
        return _walk(real, raw, parent[key], path, digests)
    return real


def redact(cfg: DictConfig) -> tuple[dict, dict[str, dict]]:
    """(config as a plain dict with every ``oc.env``-derived leaf replaced by its
    interpolation text, {dotted key: {interpolation, sha256}}). Raises like
    ``OmegaConf.to_container(resolve=True, throw_on_missing=True)`` on a bad config."""
    real = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    raw = OmegaConf.to_container(cfg, resolve=False)
    if "oc.env" not in json.dumps(raw, default=str):
        return real, {}  # the common case: nothing to find
    register_resolver(_PROBE_RESOLVER, lambda key, *default: f"{_CANARY}({key})")
    probe = OmegaConf.create(_probe_copy(copy.deepcopy(raw)))
    digests: dict[str, dict] = {}
    return _walk(real, raw, probe, "", digests), digests


def env_value_differences(recorded: DictConfig | dict, digests: dict[str, dict]) -> list[str]:
    """For a replay: each recorded environment-derived value that is missing here or hashes
    differently (one line each, naming the key and the interpolation, never a value).
    ``recorded``: the recorded config, whose interpolations resolve here."""
    cfg = recorded if isinstance(recorded, DictConfig) else OmegaConf.create(recorded)
    out = []
    for key, entry in sorted((digests or {}).items()):
        interpolation = entry.get("interpolation", "?")
        try:
            value = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
            if isinstance(value, (DictConfig, ListConfig)):
                value = OmegaConf.to_container(value, resolve=True)
        except (OmegaConfBaseException, ValueError, KeyError) as e:
            out.append(f"{key} = {interpolation} cannot be resolved here ({type(e).__name__})")
            continue
        if value is None or value_sha256(value) != entry.get("sha256"):
            out.append(f"{key} = {interpolation} has a different value here (sha256 differs)")
    return out
