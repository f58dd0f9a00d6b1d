"""Controls that only work at interpreter start: PYTHONHASHSEED and CPU kernel dispatch.
Closes: str/bytes hash randomisation (set iteration order between processes) and, for
``repro=portable``, CPU kernel dispatch, which the libraries read once, when they load: the
current command is re-executed with the variables set. Imports nothing heavy."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Iterable

from reprotrain.repro.levels import level
from reprotrain.repro.machine import PORTABLE_CONFLICTS, PORTABLE_ENV, cpu_flags

FIXED_VALUE = "0"

X86_64 = ("x86_64", "amd64")


def ensure() -> None:
    """Re-exec with PYTHONHASHSEED fixed (a user's number kept; unset or ``random``:
    ``FIXED_VALUE``); set CUBLAS_WORKSPACE_CONFIG before torch is imported."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if os.environ.get("PYTHONHASHSEED", "random").isdigit():
        return
    os.environ["PYTHONHASHSEED"] = FIXED_VALUE
    _reexec()


def portable_problem(
    env: dict[str, str] | None = None, machine: str | None = None, cpu_flags: set | None = None
) -> str | None:
    """Why repro=portable cannot run here (one line), or None (``cpu_flags`` None: unknown)."""
    env = os.environ if env is None else env
    machine = (machine or platform.machine()).lower()
    if machine not in X86_64:
        return (
            f"repro=portable covers x86-64 CPUs with AVX2; this host is {machine} "
            "(use repro=strict: identical bits on this CPU model)"
        )
    if cpu_flags is not None and "avx2" not in cpu_flags:
        return "repro=portable needs a CPU with AVX2; this one has none (use repro=strict)"
    for name, value in PORTABLE_ENV.items():
        if name in env and env[name] != value:
            mine = f"{name}={_visible(env[name])}"
            return f"repro=portable sets {name}={value}; your environment has {mine}: unset it"
    for name in PORTABLE_CONFLICTS:
        if name in env:
            mine = f"{name}={_visible(env[name])}"
            return f"repro=portable pins CPU dispatch; {mine} would steer it: unset it"
    return None


def refuse_portable_here() -> None:
    """One-line ``ReprotrainError`` where repro=portable cannot hold; imports nothing heavy."""
    from reprotrain.errors import ReprotrainError

    if problem := portable_problem(cpu_flags=cpu_flags()):
        raise ReprotrainError(problem)


def _visible(value: str) -> str:
    """An environment value as typed, or ``repr`` when not printable (one line)."""
    return value if value.isprintable() else repr(value)


def ensure_cpu_dispatch(levels: Iterable[str]) -> None:
    """For repro=portable, re-exec with ``PORTABLE_ENV`` before torch loads again (one-line
    ``ReprotrainError`` where it cannot hold); ``levels``: of every run this command starts."""
    from reprotrain.errors import ReprotrainError

    pins = {level(name).pins_cpu_dispatch for name in levels}
    if True not in pins:
        return
    if len(pins) > 1:
        raise ReprotrainError(
            "a --multirun cannot mix repro=portable with other levels (CPU kernel dispatch is "
            "fixed when the interpreter starts); run them as separate sweeps"
        )
    refuse_portable_here()
    if all(os.environ.get(k) == v for k, v in PORTABLE_ENV.items()):
        return
    os.environ.update(PORTABLE_ENV)
    if "torch" not in sys.modules:  # nothing has read them yet: no re-exec needed
        return
    if sys.argv[:1] == ["-c"]:
        raise ReprotrainError(
            "repro=portable sets CPU dispatch variables at interpreter start; run "
            "`python -m reprotrain.train` (or make train), not `python -c`"
        )
    _reexec()


def _reexec() -> None:
    args = sys.argv
    sys.stdout.flush()
    sys.stderr.flush()
    if args and args[0] == "-c":  # `python -c`: nothing to re-exec; children inherit the value
        return
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:  # ``python -m pkg.mod args`` keeps its ``-m`` form
        args = ["-m", spec.name.removesuffix(".__main__"), *args[1:]]
    os.execv(sys.executable, [sys.executable, *args])
