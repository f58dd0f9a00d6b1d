"""Which environment variables an archive may set for its re-run, and in which form.

Closes: an archive choosing the re-run's environment (an environment variable is code:
``PYTHONPATH``, ``LD_PRELOAD``, ``GIT_TRACE``). Only ``GPU_ENV_VARS`` in their library's form
and ``PYTHONHASHSEED`` (0..4294967295) pass; anything else refuses the replay in one line,
under every trust rule. docs/guarantees.md.
"""

from __future__ import annotations

import re
from typing import Any

from reprotrain.errors import ReproduceRefused
from reprotrain.repro.environment import GPU_ENV_VARS

_SWITCH = re.compile(r"(?i)[01]|on|off|yes|no|true|false|y|n")
_COUNT = re.compile(r"[0-9]{1,12}")
#: The form each variable's library reads; a name of ``GPU_ENV_VARS`` not listed here gets
#: the most restrictive one (a switch), so a new name is never a free-form string.
FORMS: dict[str, re.Pattern[str]] = {
    "CUBLAS_WORKSPACE_CONFIG": re.compile(r"(:[0-9]{1,9}:[0-9]{1,6}){1,8}"),
    "CUBLASLT_WORKSPACE_SIZE": _COUNT,
    "NVIDIA_TF32_OVERRIDE": re.compile(r"[01]"),
}
MAX_HASHSEED = 4294967295
HOW = "an archive may set only " + ", ".join(GPU_ENV_VARS) + " (and PYTHONHASHSEED)"


def checked_value(name: str, value: Any, where: str) -> str | None:
    """``value`` if ``name`` may be set to it (None: unset it); else a refusal."""
    if name not in GPU_ENV_VARS:
        raise ReproduceRefused(
            f"{where} asks to set ${name} in the re-run's environment; {HOW}: refused, "
            "nothing extracted"
        )
    if value is None:
        return None
    form = FORMS.get(name, _SWITCH)
    if not isinstance(value, str) or not form.fullmatch(value):
        raise ReproduceRefused(
            f"{where} sets ${name}={str(value)[:60]!r}, which is not of the form "
            f"{form.pattern!r}: refused, nothing extracted"
        )
    return value


def hashseed(record: dict, where: str) -> str:
    """The re-run's ``PYTHONHASHSEED``: the recorded one (0 when none was recorded)."""
    value = (record.get("repro") or {}).get("pythonhashseed")
    if value is None:
        return "0"
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_HASHSEED:
        raise ReproduceRefused(
            f"{where}: repro.pythonhashseed {str(value)[:40]!r} is not an integer in "
            f"0..{MAX_HASHSEED}: refused, nothing extracted"
        )
    return str(value)


def archive_env(record: dict, where: str) -> dict[str, str | None]:
    """What the archive sets in the re-run's environment, every entry checked; None: unset."""
    environment = record.get("environment") or {}
    recorded = environment.get("env") or {}
    gpu_env = environment.get("gpu_env") or {}
    if not isinstance(recorded, dict) or not isinstance(gpu_env, dict):
        raise ReproduceRefused(f"{where}: environment.env / gpu_env is not an object")
    out: dict[str, str | None] = {}
    if "CUBLAS_WORKSPACE_CONFIG" in recorded:
        name = "CUBLAS_WORKSPACE_CONFIG"
        out[name] = checked_value(name, recorded[name], f"{where} (environment.env)")
    for name, value in gpu_env.items():
        out[str(name)] = checked_value(str(name), value, f"{where} (environment.gpu_env)")
    out["PYTHONHASHSEED"] = hashseed(record, where)
    return out


def apply(base: dict[str, str], archived: dict[str, str | None]) -> dict[str, str]:
    """``base`` (this user's environment) with the archive's checked entries laid over it."""
    env = dict(base)
    for name, value in archived.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env
