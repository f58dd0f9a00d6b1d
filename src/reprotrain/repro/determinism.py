"""Determinism levels: strict, warn, fast, portable (docs/randomness.md, docs/gpus.md).
Closes: cuDNN algorithm choice, nondeterministic CUDA kernels, and the CPU thread count
(reduction order); the float math (``repro/precision.py``) is applied with the level. At
strict, ``fill_uninitialized_memory`` stays on (a read of unwritten memory is a loud NaN);
``portable``'s CPU levers are read back here and a run without them refused."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from reprotrain.errors import ReprotrainError
from reprotrain.repro import levels, machine
from reprotrain.repro import precision as float_math

log = logging.getLogger("reprotrain")

CUBLAS_WORKSPACE = ":4096:8"


def apply(
    level: str,
    num_threads: int,
    fill_uninitialized_memory: bool = True,
    precision: str = float_math.DEFAULT,
) -> dict:
    """Apply a determinism level and a ``trainer.precision``; return the effective flags."""
    chosen = levels.level(level)
    float_math.check(precision)
    if chosen.pins_cpu_dispatch:
        require_portable_dispatch()
    cublas_workspace()
    torch.set_num_threads(num_threads)
    torch.use_deterministic_algorithms(chosen.deterministic, warn_only=chosen.warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = (
        chosen.deterministic and fill_uninitialized_memory
    )
    torch.backends.cudnn.deterministic = chosen.deterministic
    torch.backends.cudnn.benchmark = not chosen.deterministic
    float_math.apply(precision)
    return effective_flags(level, precision)


def require_portable_dispatch() -> None:
    """Refuse repro=portable unless its CPU levers are in force, as the libraries report them."""
    identity = machine.capture_cpu()
    if not machine.portable_in_force(identity):
        seen = ", ".join(
            f"{k}={identity.get(k)}" for k in ("capability", "mkl_cbwr_branch", "onednn_isa")
        )
        raise ReprotrainError(
            f"repro=portable: CPU dispatch is not pinned in this process ({seen}); the "
            "variables only work at interpreter start: run `python -m reprotrain.train` or "
            "make train, which set them"
        )


def cublas_workspace() -> str:
    """Set the project's cuBLAS workspace unless the user chose one (warned: it decides kernels)."""
    value = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if value != CUBLAS_WORKSPACE:
        why = "recorded, but runs with the two values are not comparable bit for bit"
        log.warning(
            "CUBLAS_WORKSPACE_CONFIG=%s replaces the project's %s: %s", value, CUBLAS_WORKSPACE, why
        )
    return value


def effective_flags(level: str, precision: str = float_math.DEFAULT) -> dict:
    """What torch reports is in force now (read back, not what we meant to set)."""
    return {
        "level": level,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "fill_uninitialized_memory": bool(torch.utils.deterministic.fill_uninitialized_memory),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        **float_math.effective(precision),
        "num_threads": torch.get_num_threads(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "pythonhashseed": os.environ.get("PYTHONHASHSEED"),
        "mkldnn_enabled": bool(torch.backends.mkldnn.enabled),
        "cpu_dispatch": cpu_dispatch(),
    }


def cpu_dispatch() -> str:
    """``portable`` when the portable CPU levers are in force (read back), else ``native``."""
    return "portable" if machine.portable_in_force(machine.capture_cpu()) else "native"


ALERT = "does not have a deterministic implementation"


def is_nondeterminism_alert(message: str) -> bool:
    """True for torch's alert, raised at strict and warned at warn."""
    return ALERT in message


@contextmanager
def nondeterminism_alerts(sink: list[str]) -> Iterator[None]:
    """Torch's nondeterminism alerts during a loop: at warn each distinct one appended to
    ``sink`` as it happens; at strict a one-line ``ReprotrainError``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=f".*{ALERT}")
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            text = str(message).splitlines()[0]
            if not is_nondeterminism_alert(text):
                shown(message, category, filename, lineno, file, line)
            elif text not in sink:
                sink.append(text)

        warnings.showwarning = show
        try:
            yield
        except RuntimeError as e:
            if not is_nondeterminism_alert(str(e)):
                raise
            raise ReprotrainError(
                f"nondeterministic op under repro=strict: {str(e).splitlines()[0]} "
                "(use repro=warn to record it instead, or replace the op)"
            ) from None
