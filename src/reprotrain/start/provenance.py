"""What a run is, written into its run.json at the start: identity, code, environment, layout.
Closes: code and environment drift, unrecorded.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import OmegaConf

from reprotrain import REPO_ROOT
from reprotrain.config import config_sha256
from reprotrain.errors import ReprotrainError
from reprotrain.hashing import file_sha256
from reprotrain.repro import device as devices
from reprotrain.repro import environment, gitinfo, requirements_lock
from reprotrain.resume.audit import installed
from reprotrain.run import record as rec

if TYPE_CHECKING:
    from reprotrain.start import Run

log = logging.getLogger("reprotrain")


def open_run(record: rec.RunRecord, container: dict, env_values: dict) -> None:
    """Mark the run running under this config (sha256, labels, ``oc.env`` digests); write it."""
    record.update(status="running", config_sha256=config_sha256(container))
    record.update(tags=list(container.get("tags") or []))  # labels, not identity
    record.update(env_interpolations=env_values)
    rec.atomic_write_text(record.run_dir / rec.RESOLVED_CONFIG, OmegaConf.to_yaml(container))


def identity(run: Run, name: str, require_locked_env: bool, include_untracked: list[str]) -> None:
    """A new run's identity (git, environment, lock) and torch's report, environment.txt."""
    from torch.utils import collect_env

    record, device, run_dir = run.record, run.device, run.run_dir
    drift = requirements_lock.env_drift(REPO_ROOT)
    if drift["status"] == "drift":
        changed = (d["name"] for d in drift["different"])
        summary = ", ".join([*drift["missing"], *drift["extra"], *changed])
        if require_locked_env:
            raise ReprotrainError(f".venv differs from the lock ({summary}); run `make install`")
        log.warning("environment drift against the lock: %s (run `make env-check`)", summary)
    git, diff = gitinfo.git_info(REPO_ROOT, include_untracked=include_untracked)
    if warning := gitinfo.archivability_warning(git):
        log.warning(warning)
    if diff:
        rec.atomic_write_text(run_dir / "git.diff", diff)
    rec.atomic_write_text(run_dir / "environment.txt", torch_report(collect_env))
    record.update(
        run_dir=str(run_dir.resolve()),
        name=name,
        started_at=rec.now_iso(),
        command=["python", "-m", "reprotrain.train", *sys.argv[1:]],
        seeds=run.seeds.as_dict(),
        repro=run.flags,
        device=str(device),
        device_caveat=devices.bitwise_caveat(device),  # mps: kernels promise no determinism
        nondeterministic_ops=[],
        git=git,
        code_sha256=gitinfo.code_sha256(REPO_ROOT),  # compared at every resume
        environment=run.env,
        lock_sha256=requirements_lock.lock_sha256(REPO_ROOT),
        env_drift=drift,
        container=environment.container_image(),
        resumes=[],
    )
    record.update(experiment_id=experiment_id(record.data, device))


def experiment_id(record: dict, device: torch.device) -> str:
    """<config sha[:8]>-<commit>[+dirty]-<device>-<precision>: follows the config that ran."""
    git, slug = record["git"], environment.device_slug(device)
    dirty = "+dirty" if git.get("dirty") else ""
    precision = (record.get("repro") or {}).get("precision")
    tail = f"-{precision}" if precision else ""
    return f"{record['config_sha256'][:8]}-{git.get('short')}{dirty}-{slug}{tail}"


def layout(run: Run) -> None:
    """World size, backend, every rank's device and threads (a collective), the reduction."""
    dist = run.dist
    me = {"rank": dist.rank, "device": str(run.device), "threads": torch.get_num_threads()}
    ranks = dist.all_gather_objects(me | {"host": socket.gethostname()})
    run.record.update(world_size=dist.world_size, backend=dist.backend, ranks=ranks)
    run.record.update(**run.reduction.record(run.microbatches))


def torch_report(collect_env: Any) -> str:
    """torch's ``collect_env`` report, its ``pip list`` answered in this process with the same
    lines (``requirements_lock.pip_list``); any other command it runs is its own."""
    command, run = [sys.executable, "-mpip", "list", "--format=freeze"], collect_env.run
    collect_env.run = lambda cmd: (
        (0, requirements_lock.pip_list(), "") if cmd == command else run(cmd)
    )
    try:
        return collect_env.get_pretty_env_info()
    finally:
        collect_env.run = run


def code_now() -> dict:
    """This process's ``code_sha256`` and ``imported_code`` (compared at a resume)."""
    return {"code_sha256": gitinfo.code_sha256(REPO_ROOT), "imported_code": imported_code()}


def imported_code() -> dict[str, str]:
    """sha256 of each module imported from outside installed packages and the snapshot."""
    found: dict[str, str] = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not file or not os.path.isfile(file) or installed(file):
            continue  # installed packages are the lock's
        real = os.path.realpath(file)
        if any(p.startswith("torchinductor") for p in Path(file).parts + Path(real).parts):
            continue  # torch.compile's generated kernels
        name = os.path.abspath(file)
        if name.startswith(str(REPO_ROOT) + os.sep):
            name = os.path.relpath(name, REPO_ROOT)
            if gitinfo.in_snapshot(Path(name).as_posix()):
                continue  # in code_sha256
        found[name] = file_sha256(Path(real))
    return dict(sorted(found.items()))
