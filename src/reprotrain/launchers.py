"""What a run started by a Hydra launcher (joblib, submitit) needs from the trainer
(docs/scaling-out.md). Cheap to import (no torch): preflight registers the resolvers."""

from __future__ import annotations

import functools
import os
import secrets
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from omegaconf import OmegaConf

from reprotrain.hydra_api import register_resolver

PRESETS = ("joblib", "submitit_local", "submitit_slurm")
#: Stop signals a parent passes on to the trainer it runs.
FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


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


def parallel_jobs_on_this_node(cores: int) -> int:
    """Training processes sharing this node's cores: torchrun's local ranks, else joblib's
    ``n_jobs`` (-1 = all), else 1 (the affinity mask already reflects the share)."""
    if local_world := os.environ.get("LOCAL_WORLD_SIZE"):
        return max(1, int(local_world))
    launcher = _hydra_launcher()
    n_jobs = None if launcher is None else OmegaConf.select(launcher, "n_jobs", default=None)
    if n_jobs is None:
        return 1
    n_jobs = int(n_jobs)
    return max(1, cores + 1 + n_jobs if n_jobs < 0 else n_jobs)


def cores_per_job(cap: Any = None) -> int:
    """``${cores_per_job:}`` = cores // parallel jobs (>= 1); ``${cores_per_job:2}`` caps it."""
    cores = available_cores()
    n = max(1, cores // parallel_jobs_on_this_node(cores))
    return min(n, int(cap)) if cap not in (None, "") else n


@functools.cache
def run_stamp() -> str:
    """``${run_stamp:}``: ``<date>_<time>-<6 hex>``, rank 0's in every torchrun rank."""
    mine = f"{datetime.now():%Y-%m-%d_%H-%M-%S}-{secrets.token_hex(3)}"
    return agree_across_ranks("reprotrain/run_stamp", mine)


def agree_across_ranks(key: str, value: str) -> str:
    """Rank 0's ``value`` in every torchrun rank, before any process group, through the
    agent's TCPStore (first value per job id wins: restarts agree). Else ``value``."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return value
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return value  # not torchrun (e.g. submitit tasks: their config is already shared)
    from torch.distributed import TCPStore

    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = TCPStore(address, port, is_master=False, timeout=timedelta(minutes=5))
    key = f"{key}/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    if os.environ.get("RANK") == "0":
        return store.compare_set(key, "", value).decode()
    return store.get(key).decode()


def register_resolvers() -> None:
    """Register ``${cores_per_job:}`` and ``${run_stamp:}`` (idempotent, not cached)."""
    register_resolver("cores_per_job", cores_per_job)
    register_resolver("run_stamp", run_stamp)


def quiet_preset_schema_warning() -> None:
    """Hide Hydra's deprecation warning for our presets matching the plugins' schemas."""
    message = rf"\s*'hydra/launcher/({'|'.join(PRESETS)})' is validated against ConfigStore schema"
    warnings.filterwarnings("ignore", message=message, category=UserWarning)


def trainer_launcher(nproc: int = 1) -> list[str]:
    """``python -m reprotrain.train``, under torchrun when ``nproc`` > 1."""
    if nproc <= 1:
        return [sys.executable, "-m", "reprotrain.train"]
    signals = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", signals]
    return [sys.executable, *torchrun, "--shutdown-timeout=120", "-m", "reprotrain.train"]


def run_forwarding_signals(cmd: list[str], env: dict[str, str]) -> int:
    """The trainer as a child, stop signals forwarded; its exit code as a shell's (128 + signal)."""
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, frame) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    # Ctrl-C is delivered by the terminal to the whole process group: the trainer gets it
    # directly (a second copy from here would count as the "second SIGINT" that aborts).
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, lambda s, f: None)
    try:
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - rc if rc < 0 else rc


def launched_by_submitit() -> bool:
    """True inside a submitit job (SLURM or local), which a requeue reruns from scratch."""
    return "SUBMITIT_FOLDER" in os.environ


def default_resume(resume: str | None) -> str | None:
    """``resume``, except null is ``auto`` inside a submitit job (a requeue reruns it)."""
    return "auto" if resume is None and launched_by_submitit() else resume


def submitit_requeue_handler() -> Callable[[int, Any], Any] | None:
    """submitit's SIGUSR2 handler, if installed: called once the checkpoint is written."""
    handler = signal.getsignal(signal.SIGUSR2)
    if callable(handler) and getattr(handler, "__module__", "").startswith("submitit"):
        return handler
    return None


def die_with_parent() -> bool:
    """Under torchrun, die with the agent (``PR_SET_PDEATHSIG``, Linux): an orphan would hold
    the run lock. Returns whether it was armed."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        return False
    if os.getppid() != _PARENT_AT_START:  # the agent died before we armed it
        os.kill(os.getpid(), signal.SIGKILL)
    return True


_PARENT_AT_START = os.getppid()
quiet_preset_schema_warning()
