"""The environment record of a run (run.json ``environment``).
Closes (as a record): environment drift (versions, the machine, threads, world size, the
variables that steer the kernels); what must match: ``repro/comparability.py``. Variables
are copied from an allowlist only: no token (WANDB_API_KEY, HF_TOKEN...) reaches a record."""

from __future__ import annotations

import os
import platform
import re
from typing import Any

import numpy as np
import torch

from reprotrain.hashing import text_sha256
from reprotrain.repro import machine

#: Variables that change which cuBLAS/cuBLASLt kernels run (and so the bits), or the TF32
#: choice behind torch's back. Recorded (None when unset) and compared.
_CUBLAS = "CUBLAS_WORKSPACE_CONFIG CUBLASLT_WORKSPACE_SIZE TORCH_BLAS_PREFER_CUBLASLT"
CUBLAS_ENV_VARS = (*_CUBLAS.split(), "NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")
#: Two more that torch 2.14 reads: the shared cuBLAS/cuBLASLt workspace, cuDNN's heuristics.
_TORCH_READS = "TORCH_CUBLASLT_UNIFIED_WORKSPACE TORCH_CUDNN_USE_HEURISTIC_MODE_B"
GPU_ENV_VARS = (*CUBLAS_ENV_VARS, *_TORCH_READS.split())
_ALLOWED = (
    "PYTHONHASHSEED CUBLAS_WORKSPACE_CONFIG CUDA_VISIBLE_DEVICES OMP_NUM_THREADS MKL_NUM_THREADS "
    "NVIDIA_VISIBLE_DEVICES SLURM_JOB_ID SLURM_ARRAY_TASK_ID SLURM_RESTART_COUNT"
)
ENV_ALLOWLIST = tuple(_ALLOWED.split())
#: Families of variables the kernel libraries and torch read, recorded whole: any member may
#: steer the math (``ONEDNN_DEFAULT_FPMATH_MODE=BF16`` did).
_PREFIXES = "ONEDNN_ DNNL_ MKL_ OMP_ KMP_ GOMP_ OPENBLAS_ ATEN_ TORCH_ PYTORCH_ CUBLAS_ CUDNN_"
BITS_ENV_PREFIXES = (*_PREFIXES.split(), "CUDA_", "NCCL_")
BITS_ENV_NAMES = ("NVIDIA_TF32_OVERRIDE",)
#: Members that do not decide the bits (visible GPUs, thread pools: the count that ran is
#: compared; how idle OpenMP threads wait, spinning or asleep: the work is split alike;
#: torchrun's error handling, set in its workers: a world-size-invariant run on 2
#: processes and its replay on 1 differ in them; install and cache paths): notes only.
_NOT_BITS = "CUDA_VISIBLE_DEVICES CUDA_DEVICE_ORDER OMP_NUM_THREADS MKL_NUM_THREADS OMP_WAIT_POLICY"
NOT_BITS_ENV = (*_NOT_BITS.split(), "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
NOT_BITS_SUFFIXES = ("_HOME", "_PATH", "_DIR", "_ROOT", "_CACHE")


#: A family member whose name says it holds a credential is recorded by sha256 only (still
#: compared): no token reaches a run record.
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|_KEY$|^KEY_|_KEY_", re.IGNORECASE)


def bits_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables of ``BITS_ENV_PREFIXES``/``BITS_ENV_NAMES`` that are set, by name."""
    environ = os.environ if environ is None else environ
    return {
        k: _recorded(k, environ[k])
        for k in sorted(environ)
        if k.startswith(BITS_ENV_PREFIXES) or k in BITS_ENV_NAMES
    }


def _recorded(name: str, value: str) -> str:
    return "sha256:" + text_sha256(value) if _SECRET_NAME.search(name) else value


def steers_bits(name: str) -> bool:
    """Whether a variable of the families is compared (False: recorded as a note only)."""
    return name not in NOT_BITS_ENV and not name.endswith(NOT_BITS_SUFFIXES)


def device_slug(device: torch.device) -> str:
    """Short device tag for experiment ids: ``cpu``, ``cuda-nvidia-h200``."""
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device).lower()
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def capture(device: torch.device) -> dict[str, Any]:
    """The environment record of a run on ``device`` (after the level, before training)."""
    device = torch.device(device)
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),  # a TorchVersion would not load under weights_only
        "numpy": np.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": machine.device_info(device),
        "cpu": machine.capture_cpu(),
        "gpu": machine.capture_gpu(device),
        "matmul": machine.reduced_precision_flags(),
        "gpu_env": {k: os.environ.get(k) for k in GPU_ENV_VARS},
        "world_size": world_size(),
        "os": platform.platform(),
        "machine": platform.machine(),
        "num_threads": torch.get_num_threads(),
        "env": {k: os.environ[k] for k in ENV_ALLOWLIST if k in os.environ},
        "bits_env": bits_env(),
    }


def peak_memory(device: torch.device) -> dict[str, int | None]:
    """Peak GPU memory of this process, for run.json (None off CUDA): a peak near the free
    total at start points at cuDNN choosing another algorithm for lack of workspace."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"peak_reserved_bytes": None, "peak_allocated_bytes": None}
    device = machine.indexed(device)
    return {
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
    }


#: Files a container engine puts in every container it starts (the engine, when nothing says).
_ENGINE_MARKERS = (("/run/.containerenv", "podman"), ("/.dockerenv", "docker"))
#: Why a field of the container record can be None (a record says so rather than guess).
_NOT_GIVEN = {
    "image": "not built by `make docker-build` (no REPROTRAIN_IMAGE in the image)",
    "image_id": "not given at start: `make docker-train`/`docker-test` pass REPROTRAIN_IMAGE_ID",
    "engine": "not given at start, and no engine marker file found",
    "base_id": "the base was neither held by the engine nor pinned by digest at build",
}


def container_image() -> dict | None:
    """The container this process runs in, for run.json (docs/container.md); None outside one.
    The Dockerfile builds in the tag, the base (``BASE_REF``) and its ID or digest, and the
    commit; an image learns its own ID only once built, so the Make targets pass it, and the
    engine, at start. A field nothing established is None, its reason in ``not_recorded``."""
    marker = next((name for path, name in _ENGINE_MARKERS if os.path.exists(path)), None)
    if not (image := _env("REPROTRAIN_IMAGE")) and marker is None:
        return None
    out = {
        "image": image,
        "image_id": _image_id(_env("REPROTRAIN_IMAGE_ID")),
        "engine": _env("REPROTRAIN_ENGINE") or marker,
        "base": _env("REPROTRAIN_BASE_IMAGE"),
        "base_id": _image_id(_env("REPROTRAIN_BASE_ID")),
        "git_commit": _env("REPROTRAIN_GIT_COMMIT"),
    }
    out["not_recorded"] = {k: why for k, why in _NOT_GIVEN.items() if out[k] is None}
    return out


def _env(name: str) -> str | None:
    return os.environ.get(name, "").strip() or None


def _image_id(value: str | None) -> str | None:
    """``sha256:<64 hex>``: docker writes IDs so, podman without the prefix."""
    return "sha256:" + value if value and re.fullmatch(r"[0-9a-f]{64}", value) else value


def container_line(container: dict | None) -> str | None:
    """What ``reproduce`` says of a run recorded in a container (run.json ``container``): the
    image to re-run it in, and the base and commit that rebuild one like it; None for a run
    outside any container. The values come from a record: print it with ``shown.say``."""
    if not container:
        return None
    got = {k: container.get(k) or "not recorded" for k in ("image", "image_id", "base", "base_id")}
    commit = f" at commit {container['git_commit']}" if container.get("git_commit") else ""
    return (
        f"the run ran in container image {got['image']} (ID {got['image_id']}, engine "
        f"{container.get('engine') or 'not recorded'}), built on {got['base']} (ID "
        f"{got['base_id']}): reproduce inside that image, or one built{commit} by "
        f"`make docker-build BASE_REF={got['base']}`"
    )
