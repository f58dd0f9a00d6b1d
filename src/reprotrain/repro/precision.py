"""The float math a run uses: ``trainer.precision``, its own choice, apart from determinism.
Closes: the rounding of float32 math chosen behind the run's back. 32-true, tf32, bf16-mixed
and 16-mixed (docs/gpus.md): applied once per process, read back, recorded, and part of the
config's identity and of the comparability rule, through torch's ``fp32_precision`` settings
on every backend. The CPU libraries stay IEEE float32."""

from __future__ import annotations

from typing import Any

from reprotrain.errors import ReprotrainError

PRECISIONS = ("32-true", "tf32", "bf16-mixed", "16-mixed")
DEFAULT = "32-true"
#: The autocast dtype of each mixed precision, by torch's name (none: no autocast). torch is
#: imported where it is used: the config schema reads ``PRECISIONS`` without it.
AUTOCAST = {"bf16-mixed": "bfloat16", "16-mixed": "float16"}


def check(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ReprotrainError(
            f"trainer.precision={precision!r}: choose one of {', '.join(PRECISIONS)}"
        )
    return precision


def recorded(trainer: Any) -> str:
    """The precision a recorded ``trainer`` config ran at (checked)."""
    return check(trainer.get("precision"))


def autocast(precision: str) -> tuple[bool, str]:
    """(autocast on, torch's dtype name): a dict lookup per micro-batch, checked elsewhere."""
    name = AUTOCAST.get(precision)
    return name is not None, name or "float32"


def uses_grad_scaler(precision: str) -> bool:
    """float16 gradients underflow without loss scaling: only 16-mixed scales."""
    return check(precision) == "16-mixed"


#: torch's ``fp32_precision`` settings (the API since torch 2.9), by their ``torch.backends``
#: names ("generic": ``torch.backends.fp32_precision``; "cudnn"/"mkldnn": the backend's own,
#: which its ops inherit when they say "none"). The four that pick a kernel's float32
#: rounding are cuBLAS matmul, cuDNN conv, cuDNN rnn and oneDNN (its matmul, conv and rnn).
SETTINGS = ("generic", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn",
            "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")  # fmt: skip
#: What a fresh torch process holds (read back in a fresh interpreter by tests/test_precision.py):
#: anything else before a run's first ``apply`` was set by other code in the process.
TORCH_DEFAULTS = dict.fromkeys(SETTINGS, "none") | {"cudnn.conv": "tf32", "cudnn.rnn": "tf32"}
_CUDA = ("cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn")
_applied: dict[str, str] | None = None  # what the last ``apply`` of this process set


def wanted(precision: str) -> dict[str, str]:
    """The settings ``precision`` means: TF32 for the CUDA libraries at ``tf32`` only; the
    CPU's oneDNN IEEE at every precision ("mkldnn" itself follows "generic")."""
    cuda = "tf32" if check(precision) == "tf32" else "ieee"
    return dict.fromkeys(SETTINGS, "ieee") | dict.fromkeys(_CUDA, cuda)


def _node(name: str) -> Any:
    import torch

    node = torch.backends
    for part in name.split(".") if name != "generic" else ():
        node = getattr(node, part)
    return node


def settings() -> dict[str, str]:
    """Every fp32_precision setting as torch reports it now (read back, never the legacy
    ``allow_tf32`` flags, which raise once the two APIs disagree)."""
    return {name: _node(name).fp32_precision for name in SETTINGS}


def apply(precision: str) -> dict:
    """Set the fp32_precision settings ``precision`` means; return what torch reports.
    Closes: TF32 rounding of cuBLAS matmuls and cuDNN convolutions and rnns, oneDNN's on the
    CPU, and a setting other code made in this process that the run would silently replace."""
    import torch

    global _applied
    want, now = wanted(precision), settings()
    ours = _applied or TORCH_DEFAULTS
    if changed := [k for k, v in now.items() if v not in (ours[k], want[k])]:
        raise ReprotrainError(_changed_by_others(now, want, changed, "before the run"))
    # torch keeps two legacy records beside the settings (the matmul precision and cuDNN's
    # allow_tf32); code that still reads them (torch.compile's inductor) raises unless they
    # agree with the settings. Their setters also move settings, which the loop sets after.
    tf32 = want["cuda.matmul"] == "tf32"
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = tf32
    for name in SETTINGS:
        if name != "mkldnn":  # its setter sets "generic" (torch 2.14): follows it, read back
            _node(name).fp32_precision = want[name]
    _applied = settings()
    if _applied != want:
        wrong = ", ".join(f"{k}={v}" for k, v in _applied.items() if v != want[k])
        raise ReprotrainError(
            f"trainer.precision={precision}: torch reports {wrong} after setting them; "
            "something overrides torch's fp32_precision settings"
        )
    return effective(precision)


def check_unchanged() -> None:
    """Refuse, in one line, settings other code changed after ``apply`` (a model, a task, a
    callback or a library that sets TF32 itself): the run would not be the recorded one."""
    if _applied is not None and (now := settings()) != _applied:
        changed = [k for k, v in now.items() if v != _applied[k]]
        raise ReprotrainError(_changed_by_others(now, _applied, changed, "during the run"))


def _changed_by_others(now: dict, run: dict, changed: list[str], when: str) -> str:
    shown = ", ".join(f"{k}={now[k]} (the run's: {run[k]})" for k in changed)
    return (
        f"torch's fp32_precision settings were changed {when} by other code in this process: "
        f"{shown}; choose the float math with trainer.precision ({', '.join(PRECISIONS)}) "
        "and remove that setting"
    )


def effective(precision: str) -> dict:
    """The precision and what torch reports is in force now (read back)."""
    return {
        "precision": precision,
        "fp32_precision": settings(),
        "autocast_dtype": AUTOCAST.get(check(precision)),
        "grad_scaler": uses_grad_scaler(precision),
    }
