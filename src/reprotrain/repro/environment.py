"""Environment and code identity for run.json.

Closes (as records): environment drift (python/torch/numpy, CUDA, cuDNN, the GPU and its
driver, the CPU's identity and kernel dispatch, the thread count, the variables that steer
cuBLAS and the CPU libraries) and
code drift (git commit, branch, dirty flag; the diff is saved beside run.json).

Every GPU field is always present: on a CPU host its value is None, so "recorded as absent"
is never confused with "not recorded" (a record older than a field lacks the key). The CPU
block is kept on GPU runs too: data order and augmentation are computed on the CPU.
Which of these fields must match for a bitwise promise is decided in one place,
``repro/comparability.py``.

Environment variables are copied from an allowlist only, so tokens and keys in the
environment (WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, HF_TOKEN...) never reach a run record.
Only torch APIs are used for the GPU, plus one ``nvidia-smi`` query for what torch does not
expose (the driver version, MIG mode) when it is on PATH.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
from typing import Any

import numpy as np
import torch

from reprotrain.repro import cpu_identity

#: Variables that change which cuBLAS/cuBLASLt kernels run (and so the bits), or the TF32
#: choice behind torch's back. Recorded (None when unset) and compared.
CUBLAS_ENV_VARS = (
    "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_WORKSPACE_SIZE",
    "TORCH_BLAS_PREFER_CUBLASLT",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
)
#: Two more that torch 2.14's CUDA library reads and that steer kernel choice: the shared
#: cuBLAS/cuBLASLt workspace, and cuDNN's heuristic mode.
GPU_ENV_VARS = (
    *CUBLAS_ENV_VARS,
    "TORCH_CUBLASLT_UNIFIED_WORKSPACE",
    "TORCH_CUDNN_USE_HEURISTIC_MODE_B",
)

ENV_ALLOWLIST = (
    "PYTHONHASHSEED",
    "CUBLAS_WORKSPACE_CONFIG",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NVIDIA_VISIBLE_DEVICES",
    "SLURM_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_RESTART_COUNT",
    "REPROTRAIN_IMAGE",
    "REPROTRAIN_IMAGE_DIGEST",
)

#: Families of variables the kernel libraries and torch read (issue 34: a user's own
#: ``ONEDNN_DEFAULT_FPMATH_MODE=BF16`` changed a conv run's bits and was recorded nowhere).
#: Recorded whole, by family, not from a fixed list: any member may steer the math.
BITS_ENV_PREFIXES = (
    "ONEDNN_", "DNNL_", "MKL_", "OMP_", "KMP_", "GOMP_", "OPENBLAS_", "ATEN_", "TORCH_",
    "PYTORCH_", "CUBLAS_", "CUDNN_", "CUDA_", "NCCL_",
)  # fmt: skip
BITS_ENV_NAMES = ("NVIDIA_TF32_OVERRIDE",)
#: Members of those families that do not decide the bits: which GPUs are visible, the thread
#: pools' sizes (the thread count that ran is read back from torch and compared; torchrun
#: sets ``OMP_NUM_THREADS=1`` in its workers), torchrun's error handling, and where things
#: are installed or cached.
#: Recorded, shown as notes, never a reason.
NOT_BITS_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    # torchrun sets these in its workers: how a collective's failure is reported, not math
    # (a world-size-invariant run on 2 processes and its replay on 1 differ in them).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_ASYNC_ERROR_HANDLING",
)
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
    if _SECRET_NAME.search(name):
        return "sha256:" + hashlib.sha256(value.encode()).hexdigest()
    return value


def steers_bits(name: str) -> bool:
    """Whether a variable of the families is compared (False: recorded as a note only)."""
    return name not in NOT_BITS_ENV and not name.endswith(NOT_BITS_SUFFIXES)


#: The GPU block's keys; all None on a CPU run.
GPU_FIELDS = (
    "index",
    "name",
    "uuid",
    "compute_capability",
    "sm_count",
    "total_memory_bytes",
    "mig_mode",
    "driver_version",
    "driver_cuda_version",
    "visible_devices",
    "blas_library",
    "cublas_workspace_bytes",
    "cublaslt_workspace_bytes",
    "memory_free_at_start_bytes",
    "memory_total_at_start_bytes",
)


def cpu_info() -> dict[str, Any]:
    """The CPU's identity for bits (``repro/cpu_identity.py``): vendor, family/model, model
    name, the ISA extensions and the code paths torch, oneDNN and MKL chose, their versions
    and the variables that steer them. Two AVX-512 CPUs of two vendors differ in the bits
    of CPU math (data order, augmentation, a CPU run's every step)."""
    return cpu_identity.capture()


def device_info(device: torch.device) -> dict[str, Any]:
    """Short device identity (type, resolved name, model, capability) for ids and reports."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "type": "cuda",
            "resolved": str(_indexed(device)),
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
        }
    return {
        "type": device.type,
        "resolved": device.type,
        "name": _cpu_model() or platform.machine(),
        "capability": torch.backends.cpu.get_cpu_capability(),
    }


def _indexed(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _cpu_model() -> str | None:
    return cpu_identity.cpu_fields()["model_name"] or platform.processor() or None


def device_slug(device: torch.device) -> str:
    """Short device tag for experiment ids: ``cpu``, ``cuda-nvidia-h200``."""
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device).lower()
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def _bare_uuid(uuid: str) -> str:
    return uuid.lower().removeprefix("gpu-").removeprefix("mig-")


def nvidia_smi(*args: str) -> str | None:
    """stdout of ``nvidia-smi args`` or None (not on PATH, failed, or hung)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _smi_row(uuid: str) -> dict[str, str | None]:
    """Driver version and MIG mode of the GPU with this UUID, per nvidia-smi."""
    out = nvidia_smi("--query-gpu=uuid,driver_version,mig.mode.current", "--format=csv,noheader")
    rows = [[c.strip() for c in line.split(",")] for line in (out or "").splitlines()]
    rows = [r for r in rows if len(r) == 3]
    if not rows:
        return {"driver_version": None, "mig_mode": None}
    # The driver is one per host; MIG mode belongs to the physical GPU (a MIG slice's own
    # UUID is not listed here, so no match leaves it unknown unless the env says MIG).
    match = next((r for r in rows if _bare_uuid(r[0]) == _bare_uuid(uuid)), None)
    mig = match[2] if match and match[2] not in ("[N/A]", "N/A") else None
    return {"driver_version": rows[0][1], "mig_mode": mig}


def driver_cuda_version() -> str | None:
    """The CUDA version the driver supports ("13.0"), from torch when it exposes it."""
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    if get is None:
        return None
    try:
        v = int(get())
    except (RuntimeError, TypeError, ValueError):
        return None
    return f"{v // 1000}.{(v % 1000) // 10}" if v > 0 else None


def gpu_info(device: torch.device) -> dict[str, Any]:
    """The training GPU's identity and free memory now; every value None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return dict.fromkeys(GPU_FIELDS)
    device = _indexed(device)
    props = torch.cuda.get_device_properties(device)
    uuid = str(props.uuid)
    smi = _smi_row(uuid)
    mig = smi["mig_mode"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if mig is None and (uuid.startswith("MIG-") or "MIG-" in visible):
        mig = "Enabled"
    free, total = torch.cuda.mem_get_info(device)
    return {
        "index": device.index,
        "name": props.name,
        "uuid": uuid,
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": int(props.multi_processor_count),
        "total_memory_bytes": int(props.total_memory),
        "mig_mode": mig,
        "driver_version": smi["driver_version"],
        "driver_cuda_version": driver_cuda_version(),
        "visible_devices": torch.cuda.device_count(),
        **blas_info(),
        "memory_free_at_start_bytes": int(free),
        "memory_total_at_start_bytes": int(total),
    }


def blas_info() -> dict[str, Any]:
    """The BLAS library and workspace sizes torch will really use (env vars or code can set
    them; the workspace bounds which kernels cuBLAS may pick). CUDA runs only."""
    b = torch.backends.cuda
    out: dict[str, Any] = {}
    for key, get in (
        ("blas_library", lambda: str(b.preferred_blas_library()).rsplit(".", 1)[-1]),
        ("cublas_workspace_bytes", lambda: int(b.cublas_workspace_size())),
        ("cublaslt_workspace_bytes", lambda: int(b.cublaslt_workspace_size())),
    ):
        try:
            out[key] = get()
        except (AttributeError, RuntimeError):
            out[key] = None
    return out


def reduced_precision_flags() -> dict[str, bool]:
    """cuBLAS may reduce fp16/bf16 GEMMs in reduced precision (torch's default: allowed);
    the flag changes the bits of AMP runs on CUDA, so it is part of the identity."""
    m = torch.backends.cuda.matmul
    return {
        "fp16_reduced_precision_reduction": bool(m.allow_fp16_reduced_precision_reduction),
        "bf16_reduced_precision_reduction": bool(m.allow_bf16_reduced_precision_reduction),
    }


def world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def capture(device: torch.device) -> dict[str, Any]:
    """The environment record of a run on ``device`` (call it after the determinism level
    is applied and before training, so the GPU's free memory is that at start)."""
    device = torch.device(device)
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),  # a TorchVersion would not load under weights_only
        "numpy": np.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": device_info(device),
        "cpu": cpu_info(),
        "gpu": gpu_info(device),
        "matmul": reduced_precision_flags(),
        "gpu_env": {k: os.environ.get(k) for k in GPU_ENV_VARS},
        "world_size": world_size(),
        "os": platform.platform(),
        "machine": platform.machine(),
        "num_threads": torch.get_num_threads(),
        "env": {k: os.environ[k] for k in ENV_ALLOWLIST if k in os.environ},
        "bits_env": bits_env(),
    }


def peak_memory(device: torch.device) -> dict[str, int | None]:
    """Peak GPU memory of this process, for run.json at the end (None values off CUDA).

    cuDNN picks another algorithm when its workspace does not fit, which changes the bits;
    a peak close to the total that was free at start points at that.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return {"peak_reserved_bytes": None, "peak_allocated_bytes": None}
    device = _indexed(device)
    return {
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
    }


def container_image() -> dict | None:
    """``{"image", "digest", "base", "git_commit"}`` from the Dockerfile's env; None outside.

    Why: inside the image the environment *is* the image; its tag (``reprotrain:<commit>-
    <lock sha256[:12]>``) and the digest of the base it was built ``FROM`` are what another
    machine needs to rebuild or pull it. ``digest`` is the base image digest (the only digest
    known at build time) and is None when the base was not pinned (``make pin-base`` not run);
    ``base`` is the base reference, ``git_commit`` the commit the image was built from
    (``.git`` is not copied into the image).
    """
    image = os.environ.get("REPROTRAIN_IMAGE", "").strip()
    if not image:
        return None

    def env(name: str) -> str | None:
        return os.environ.get(name, "").strip() or None

    return {
        "image": image,
        "digest": env("REPROTRAIN_IMAGE_DIGEST"),
        "base": env("REPROTRAIN_BASE_IMAGE"),
        "git_commit": env("REPROTRAIN_GIT_COMMIT"),
    }
