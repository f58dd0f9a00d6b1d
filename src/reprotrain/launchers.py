"""What a run started by a Hydra launcher (joblib, submitit) needs from the trainer.

Closes three gaps between "one process on my machine" and "a launcher fanned it out":

- **Threads per parallel job.** The intra-op thread count changes reduction order (the
  bits), and N jobs x T threads beyond the cores only slows everything down. The
  ``${cores_per_job:}`` resolver gives each job ``cores // parallel jobs on this node``
  (joblib's ``n_jobs``, or torchrun's ranks per node), decided in the config and therefore
  recorded in ``config.resolved.yaml`` and ``run.json`` like any other thread count.
- **Requeue = same command again.** A submitit job that is preempted or about to time out
  gets SIGUSR2; submitit's own handler re-pickles the job and requeues it, and the requeued
  job reruns the same overrides in the same job directory (the sweep dir's ``${now:}`` is
  cached in the pickled config). ``launched_by_submitit`` lets the trainer default to
  ``resume=auto`` there, and ``submitit_requeue_handler`` lets its own SIGUSR2 handling
  (finish the step, checkpoint) hand over to submitit afterwards.
- **Quiet presets.** ``conf/hydra/launcher/{joblib,submitit_local,submitit_slurm}.yaml`` carry
  the plugins' own names, so ``hydra/launcher=joblib`` selects the preset; Hydra then
  validates each against the plugin's schema of the same name (typos fail) and warns that
  this matching is deprecated. The warning is silenced for those three files only.

Importing this module is cheap (no torch): ``preflight`` registers the resolver before it
composes anything.
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
    """How many training processes share this node's cores right now.

    torchrun's ranks per node (``LOCAL_WORLD_SIZE``) first, since that is the process that
    trains; else joblib's ``n_jobs`` (negative values count back from the cores, as in
    joblib: -1 = all cores); else 1 (basic launcher, or one submitit/SLURM job per
    allocation, whose CPU share the affinity mask already reflects).
    """
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
    """``${run_stamp:}``: ``<date>_<time>-<6 hex>``, the same string in every torchrun rank.

    Hydra makes the run directory in every rank before the trainer runs; built from
    ``${now:}`` and a per-process random suffix, each rank would make its own (and leave
    stray directories). Rank 0's stamp is shared through the torchrun agent's key-value
    store, so all ranks compute one directory. Without torchrun it is just now + random hex.
    """
    global _STAMP
    if _STAMP is None:
        mine = f"{datetime.now():%Y-%m-%d_%H-%M-%S}-{secrets.token_hex(3)}"
        _STAMP = agree_across_ranks("reprotrain/run_stamp", mine)
    return _STAMP


def agree_across_ranks(key: str, value: str) -> str:
    """Rank 0's ``value`` in every rank of a torchrun job, before any process group exists.

    Uses the agent's TCPStore (MASTER_ADDR:MASTER_PORT under torchrun); the first value set
    for this job id wins, so workers restarted by torchrun get the same answer. Outside
    torchrun: ``value`` itself.
    """
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
    """``resume`` as configured, except null becomes ``auto`` inside a submitit job.

    A requeued job reruns the very same command; with ``auto`` it continues from the newest
    checkpoint in its (unchanged) job directory, and a first start finds none and starts
    fresh. Outside submitit nothing changes.
    """
    return "auto" if resume is None and launched_by_submitit() else resume


def submitit_requeue_handler() -> Callable[[int, Any], Any] | None:
    """submitit's SIGUSR2 handler (checkpoint the job pickle, requeue, exit), if installed.

    Read it *before* installing the trainer's own handler. After the trainer has finished
    its step, written its checkpoint, marked the run interrupted and released the run lock,
    calling ``handler(signal.SIGUSR2, None)`` requeues the job (``scontrol requeue`` on
    SLURM, a restart on the local executor) and exits; it returns on ranks other than 0.
    """
    handler = signal.getsignal(signal.SIGUSR2)
    if callable(handler) and getattr(handler, "__module__", "").startswith("submitit"):
        return handler
    return None


def die_with_parent() -> bool:
    """Under torchrun, make this worker die the moment its agent dies (Linux only).

    torchrun starts each worker in a session of its own, so SIGKILL to the torchrun process
    group (a crashed node, a scheduler killing the job, ``kill -9 -PGID``) kills the agent but
    not the workers: they train on as orphans, holding the run lock and writing the run
    directory. ``PR_SET_PDEATHSIG`` has the kernel send them SIGKILL when the agent exits.
    Call it first thing in the entry point; returns whether it was armed.
    """
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
