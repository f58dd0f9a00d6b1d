"""The float math a run uses: ``trainer.precision``, its own choice, apart from determinism.
Closes: the rounding of float32 math chosen behind the run's back. 32-true, tf32, bf16-mixed
and 16-mixed (docs/gpus.md): applied once per process, read back, recorded, and part of the
config's identity and of the comparability rule. The CPU libraries stay IEEE float32."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reprotrain.errors import ReprotrainError

if TYPE_CHECKING:
    import torch

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


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype the forward and loss run in under autocast; None at 32-true and tf32."""
    import torch

    name = AUTOCAST.get(check(precision))
    return None if name is None else getattr(torch, name)


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


def apply(precision: str) -> dict:
    """Set the TF32 flags ``precision`` means; return what torch reports is in force.
    Closes: TF32 rounding of CUDA matmuls and cuDNN convolutions, oneDNN's on the CPU."""
    import torch

    tf32 = check(precision) == "tf32"
    # "highest" first: every backend IEEE, the CPU's oneDNN included; then the two CUDA
    # flags, which leave oneDNN as it is.
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    flags = effective(precision)
    if (flags["tf32_matmul"], flags["tf32_cudnn"]) != (tf32, tf32):
        raise ReprotrainError(
            f"trainer.precision={precision}: torch reports TF32 matmul={flags['tf32_matmul']}, "
            f"cuDNN={flags['tf32_cudnn']} after setting them; something overrides torch's flags"
        )
    return flags


def effective(precision: str) -> dict:
    """The precision and what torch reports is in force now (read back)."""
    import torch

    mkldnn = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", None)
    return {
        "precision": precision,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cpu_matmul_fp32_precision": mkldnn,  # oneDNN: "ieee" under every precision
        "autocast_dtype": AUTOCAST.get(check(precision)),
        "grad_scaler": uses_grad_scaler(precision),
    }
