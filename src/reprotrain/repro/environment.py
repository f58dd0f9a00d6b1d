"""Environment and code identity for run.json.

Closes (as records): environment drift (python/torch/CUDA/cuDNN/device/OS, the thread
count) and code drift (git commit, branch, dirty flag; the diff is saved beside run.json).
Environment variables are copied from an allowlist only, so tokens and keys in the
environment (WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, HF_TOKEN...) never reach a run record.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

import numpy as np
import torch

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


def device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "type": "cuda",
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "count": torch.cuda.device_count(),
        }
    return {
        "type": device.type,
        "name": _cpu_model() or platform.machine(),
        # Which SIMD kernels torch dispatches to (AVX2 vs AVX-512 can change the bits).
        "capability": torch.backends.cpu.get_cpu_capability(),
    }


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def device_slug(device: torch.device) -> str:
    """Short device tag for experiment ids: ``cpu``, ``cuda-nvidia-h200``."""
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device).lower()
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def capture(device: torch.device) -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": device_info(device),
        "os": platform.platform(),
        "machine": platform.machine(),
        "num_threads": torch.get_num_threads(),
        "env": {k: os.environ[k] for k in ENV_ALLOWLIST if k in os.environ},
    }


def _git(repo: Path, *args: str, ok: tuple[int, ...] = (0,)) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode in ok else None


CODE_DIRS = ("src/", "conf/", "scripts/", "tests/")


def _looks_secret(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1].lower()
    return name.startswith(".env") or name.endswith((".pem", ".key")) or "secret" in name


def git_info(repo: Path) -> tuple[dict, str]:
    """({commit, short, branch, dirty}, diff text). Outside git: commit None, no diff.

    The diff covers tracked changes against HEAD plus the contents of untracked code files
    under src/, conf/, scripts/ and tests/ (git's ``--intent-to-add`` trick is avoided: it
    would modify the index).
    """
    commit = _git(repo, "rev-parse", "HEAD")
    if commit is None:
        # The container has no .git; the image records the commit it was built from.
        built = os.environ.get("REPROTRAIN_GIT_COMMIT", "").strip()
        if built:
            short = built.removesuffix("-dirty")[:8]
            return {
                "commit": built,
                "short": short,
                "branch": None,
                "dirty": built.endswith("-dirty"),
                "source": "container image",
            }, ""
        return {"commit": None, "short": "nogit", "branch": None, "dirty": None}, ""
    status = _git(repo, "status", "--porcelain", "--untracked-files=all") or ""
    diff = _git(repo, "diff", "--binary", "HEAD") or ""
    untracked = [line[3:] for line in status.splitlines() if line.startswith("?? ")]
    # Contents only for untracked *code*: an untracked .env or key file elsewhere in the tree
    # must never be copied into a run record (its name is still listed in run.json).
    for rel in [u for u in untracked if u.startswith(CODE_DIRS) and not _looks_secret(u)]:
        patch = _git(repo, "diff", "--binary", "--no-index", "/dev/null", rel, ok=(0, 1))
        diff += patch or ""
    info = {
        "commit": commit.strip(),
        "short": commit.strip()[:8],
        "branch": (_git(repo, "rev-parse", "--abbrev-ref", "HEAD") or "").strip() or None,
        "dirty": bool(status.strip()),
        "untracked": untracked,
    }
    return info, diff
