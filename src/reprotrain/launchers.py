"""What a run started by a Hydra launcher (joblib, submitit) needs from the trainer
(docs/scaling-out.md): ``${cores_per_job:}`` threads per parallel job (recorded like any
thread count: they change the bits); a submitit requeue reruns the same command, so
``resume`` defaults to ``auto`` there and the trainer's SIGUSR2 handling hands over to
submitit's afterwards; the presets in ``conf/hydra/launcher/`` carry the plugins' names, and
Hydra's deprecation warning for that match is silenced for those files only. Cheap to import
(no torch): preflight registers the resolvers before it composes anything.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import warnings
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from omegaconf import OmegaConf

PRESETS = ("joblib", "submitit_local", "submitit_slurm")


def available_cores() -> int:
    """CPUs this process may run on (a SLURM/cgroup affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _hydra_launcher() -> Any:
    """The running job's ``hydra.launcher`` node, or None outside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return OmegaConf.select(HydraConfig.get(), "launcher", default=None)


def parallel_jobs_on_this_node(cores: int | None = None) -> int:
    """How many training processes share this node's cores: torchrun's ranks per node, else
    joblib's ``n_jobs`` (negative counts back from the cores, -1 = all), else 1 (one job per
    allocation, whose share the affinity mask already reflects)."""
    cores = available_cores() if cores is None else cores
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    if local_world:
        return max(1, int(local_world))
    launcher = _hydra_launcher()
    n_jobs = None if launcher is None else OmegaConf.select(launcher, "n_jobs", default=None)
    if n_jobs is None:
        return 1
    n_jobs = int(n_jobs)
    if n_jobs < 0:
        n_jobs = cores + 1 + n_jobs
    return max(1, n_jobs)


def cores_per_job(cap: Any = None) -> int:
    """``${cores_per_job:}`` = cores // parallel jobs (>= 1); ``${cores_per_job:2}`` caps it."""
    cores = available_cores()
    n = max(1, cores // parallel_jobs_on_this_node(cores))
    return min(n, int(cap)) if cap not in (None, "") else n


_STAMP: str | None = None


def run_stamp() -> str:
    """``${run_stamp:}``: ``<date>_<time>-<6 hex>``, rank 0's in every torchrun rank, so the
    ranks (each of which makes the run directory before the trainer runs) agree on one."""
    global _STAMP
    if _STAMP is None:
        mine = f"{datetime.now():%Y-%m-%d_%H-%M-%S}-{secrets.token_hex(3)}"
        _STAMP = agree_across_ranks("reprotrain/run_stamp", mine)
    return _STAMP


def agree_across_ranks(key: str, value: str) -> str:
    """Rank 0's ``value`` in every rank of a torchrun job, before any process group exists,
    through the agent's TCPStore (the first value set for this job id wins, so restarted
    workers get the same answer). Outside torchrun: ``value`` itself."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return value
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return value  # not torchrun (e.g. submitit tasks: their config is already shared)
    from torch.distributed import TCPStore

    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(minutes=5),
    )
    key = f"{key}/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    if os.environ.get("RANK") == "0":
        return store.compare_set(key, "", value).decode()
    return store.get(key).decode()


def register_resolvers() -> None:
    """Register ``${cores_per_job:}`` and ``${run_stamp:}`` (idempotent). Not cached by
    OmegaConf: a resume reads the recorded values from config.resolved.yaml."""
    if not OmegaConf.has_resolver("cores_per_job"):
        OmegaConf.register_new_resolver("cores_per_job", cores_per_job)
    if not OmegaConf.has_resolver("run_stamp"):
        OmegaConf.register_new_resolver("run_stamp", run_stamp)


def quiet_preset_schema_warning() -> None:
    """Hide Hydra's deprecation warning for our presets matching the plugins' schemas."""
    names = "|".join(PRESETS)
    warnings.filterwarnings(
        "ignore",
        message=rf"\s*'hydra/launcher/({names})' is validated against ConfigStore schema",
        category=UserWarning,
    )


def launched_by_submitit() -> bool:
    """True inside a submitit job (SLURM or local), which a requeue reruns from scratch."""
    return "SUBMITIT_FOLDER" in os.environ


def default_resume(resume: str | None) -> str | None:
    """``resume`` as configured, except null becomes ``auto`` inside a submitit job: a
    requeued job reruns the same command and continues from its newest checkpoint."""
    return "auto" if resume is None and launched_by_submitit() else resume


def submitit_requeue_handler() -> Callable[[int, Any], Any] | None:
    """submitit's SIGUSR2 handler (requeue, exit), if installed: read it before installing
    the trainer's own, and call ``handler(signal.SIGUSR2, None)`` once the checkpoint is
    written and the run lock released (it returns on ranks other than 0)."""
    handler = signal.getsignal(signal.SIGUSR2)
    if callable(handler) and getattr(handler, "__module__", "").startswith("submitit"):
        return handler
    return None


def die_with_parent() -> bool:
    """Under torchrun, make this worker die the moment its agent dies (Linux only): workers
    run in sessions of their own, so a SIGKILL to torchrun's group would leave them training
    on as orphans holding the run lock. ``PR_SET_PDEATHSIG``; returns whether it was armed."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    import ctypes

    parent = _PARENT_AT_START
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        return False
    if os.getppid() != parent:  # the agent died before we armed it
        os.kill(os.getpid(), signal.SIGKILL)
    return True


_PARENT_AT_START = os.getppid()
quiet_preset_schema_warning()
