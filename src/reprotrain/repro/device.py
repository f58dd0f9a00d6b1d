"""Which device a run trains on, decided once, recorded, and reused on resume and reproduce.
Closes: silent device changes (``auto`` falling back to the CPU without a word, or
re-resolved on another host). ``auto`` never picks MPS; a device-type change on resume is
refused unless ``trainer.allow_device_change=true``. The rules: docs/gpus.md."""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path

import torch

from reprotrain.errors import ReprotrainError

log = logging.getLogger("reprotrain")

CHOICES = "auto | cpu | cuda | cuda:N | mps"
#: The override that lets a resume continue on another device type (recorded as not bitwise).
ALLOW_CHANGE_OVERRIDE = "trainer.allow_device_change=true"
MPS_CAVEAT = "mps: PyTorch makes no determinism promise on MPS; no bitwise promise"
_SPEC = re.compile(r"^(auto|cpu|mps|cuda)(?::(\d+))?$")
_NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")


def cuda_unavailable_reason() -> str | None:
    """None when CUDA is usable here, else why not, in words a user can act on."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            return None
    for w in caught:  # torch explains a failed init (e.g. a driver too old) in a warning
        if (text := str(w.message).strip().splitlines()) and "CUDA" in text[0]:
            return f"CUDA initialisation failed: {text[0]}"
    if not _NVIDIA_DRIVER.exists():
        return (
            "no NVIDIA driver is loaded (no /proc/driver/nvidia/version; in a container, "
            "start it with --gpus or the CDI device nvidia.com/gpu)"
        )
    return "the NVIDIA driver is loaded but torch sees no GPU (check CUDA_VISIBLE_DEVICES)"


def _parse(spec: str) -> tuple[str, int | None]:
    m = _SPEC.match(str(spec).strip())
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise ReprotrainError(f"trainer.device={spec!r} is not one of {CHOICES}")
    return m.group(1), None if m.group(2) is None else int(m.group(2))


def _cuda(index: int | None, asked: str) -> torch.device:
    if (why := cuda_unavailable_reason()) is not None:
        raise ReprotrainError(f"trainer.device={asked} but CUDA is not usable: {why}")
    count = torch.cuda.device_count()
    index = 0 if index is None else index
    if index >= count:
        raise ReprotrainError(
            f"trainer.device={asked} but only {count} GPU(s) are visible (cuda:0..{count - 1})"
        )
    return torch.device("cuda", index)


def resolve(requested: str, local_rank: int | None = None) -> torch.device:
    """``trainer.device`` -> this process's device, with a GPU ordinal (DDP: ``local_rank``)."""
    device_type, index = _parse(requested)
    index = local_rank if index is None else index
    if device_type == "cpu":
        return torch.device("cpu")
    if device_type == "mps":
        if not torch.backends.mps.is_available():
            raise ReprotrainError("trainer.device=mps but MPS is not available on this host")
        log.warning(MPS_CAVEAT)
        return torch.device("mps")
    if device_type == "cuda":
        return _cuda(index, requested)
    if (why := cuda_unavailable_reason()) is None:
        return _cuda(index, requested)
    hint = ""
    if torch.backends.mps.is_available():
        hint = f"; MPS is available: trainer.device=mps trains on it ({MPS_CAVEAT})"
    log.warning("trainer.device=auto resolved to cpu: %s%s", why, hint)
    return torch.device("cpu")


def bitwise_caveat(device: torch.device) -> str | None:
    """Text for run.json when the device itself rules out a bitwise promise (MPS)."""
    return MPS_CAVEAT if torch.device(device).type == "mps" else None


def resolve_for_resume(
    recorded: str | None, requested: str, allow_change: bool, local_rank: int | None = None
) -> torch.device:
    """The device a resume or replay trains on: the recorded one (``auto``: as recorded); a
    device-type change only with ``allow_change`` (the caller records it as not bitwise)."""
    if recorded is None:
        return resolve(requested, local_rank)
    old_type, old_index = _parse(recorded)
    device_type, index = _parse(requested)
    if device_type == "auto":
        device_type = old_type
    if device_type == old_type:
        if device_type == "cuda" and index is None and local_rank is None:
            # Same ordinal when this host has it; else the first GPU (ordinal is not identity).
            count = torch.cuda.device_count() if cuda_unavailable_reason() is None else 0
            index = old_index if old_index is not None and old_index < count else 0
        try:
            return resolve(device_type if index is None else f"{device_type}:{index}", local_rank)
        except ReprotrainError as e:
            if not allow_change:
                raise ReprotrainError(
                    f"the run was recorded on {recorded} and must continue there, but {e}; "
                    f"to continue on another device anyway (not bitwise), add "
                    f"{ALLOW_CHANGE_OVERRIDE}"
                ) from None
            requested = "auto"
    elif not allow_change:
        raise ReprotrainError(
            f"the run was recorded on {recorded}; trainer.device={requested} would continue on "
            f"{device_type} (not bitwise): add {ALLOW_CHANGE_OVERRIDE} to do that anyway"
        )
    device = resolve(requested, local_rank)
    log.warning("device changes %s -> %s: bitwise equality is not kept", recorded, device)
    return device


def replay_spec(recorded: str | None) -> tuple[str, str | None]:
    """For reproduce: the ``trainer.device`` that replays on the recorded device type, and a
    NOT COMPARABLE reason when this host cannot (then on the CPU)."""
    if recorded is None:
        return "auto", None
    device_type, _ = _parse(recorded)
    if device_type == "cuda":
        if (why := cuda_unavailable_reason()) is not None:
            return "cpu", f"recorded on {recorded}, replayed on cpu: {why}"
        return "cuda", None
    return device_type, None


def recorded_device(record: dict) -> str | None:
    """The device run.json records (``environment.device.resolved``), or None."""
    return ((record.get("environment") or {}).get("device") or {}).get("resolved")
