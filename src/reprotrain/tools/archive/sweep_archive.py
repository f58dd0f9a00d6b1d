"""``make archive RUN=<sweep dir>``: pack a whole sweep (every run, its summary) in one archive.

The single-run layout (``archive.py``) with ``sweep/`` for ``run/``: each run directory
(checkpoints left out), the summary and ``multirun.yaml`` (an Optuna study's ``study.json``
and ``study.journal`` too), one ``source/`` and ``env/`` (all runs must share the commit and
diff), ``archive.json`` (``"kind": "sweep"``, the jobs) and the manifest. ``make reproduce``
replays every job (``reproduce_sweep.py``).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from reprotrain.errors import ArchiveError
from reprotrain.progress import Progress, say
from reprotrain.repro import gitinfo
from reprotrain.run.directory import sweep_jobs
from reprotrain.run.readers import read_run_json
from reprotrain.run.record import RUN_JSON, atomic_write_text, now_iso
from reprotrain.tools.archive import snapshot
from reprotrain.tools.archive.archive_check import ARCHIVE_JSON, CheckedArchive
from reprotrain.tools.archive.pack import (
    FORMAT_VERSION,
    PHASES,
    check_out_dir,
    pip_freeze,
    run_members,
    seal,
    staging_dir,
)

SWEEP = "sweep"
KIND = "sweep"
#: An Optuna study also leaves study.json (tools/sweeps/optuna_study.py), the sweeper's
#: optimization_results.yaml and its storage, study.journal (optuna.load_study opens it);
#: its trials are ordinary run directories.
SWEEP_FILES = (
    "summary.json",
    "summary.md",
    "summary.png",
    "multirun.yaml",
    "study.json",
    "optimization_results.yaml",
    "study.journal",
)


def is_sweep_dir(path: Path) -> bool:
    """A directory without its own run.json that holds run directories below it."""
    path = Path(path)
    return path.is_dir() and not (path / RUN_JSON).exists() and bool(sweep_jobs(path))


def is_sweep_archive(checked: CheckedArchive) -> bool:
    return any(rel.startswith(f"{SWEEP}/") for rel in checked.members)


def job_dirs(sweep_dir: Path) -> list[Path]:
    return sweep_jobs(sweep_dir)


def _shared_code(records: dict[Path, dict], diffs: dict[Path, str]) -> tuple[dict, str]:
    """The one (git, diff) every job ran, or a refusal naming two jobs that differ."""
    first = next(iter(records))
    git, diff = records[first].get("git") or {}, diffs[first]
    for job, record in records.items():
        other = record.get("git") or {}
        if other.get("commit") != git.get("commit") or diffs[job] != diff:
            raise ArchiveError(
                f"{first.name} and {job.name} ran different code (commit or uncommitted "
                "diff); archive them separately"
            )
    return git, diff


def build(
    sweep_dir: Path,
    out_dir: Path,
    repo: Path,
    allow_incomplete: bool = False,
    force: bool = False,
    sign_key: Path | None = None,
) -> tuple[Path, dict]:
    """Write ``<out-dir>/sweep-<name>.tar.gz``; returns (path, archive.json contents)."""
    sweep_dir, out_dir = Path(sweep_dir).resolve(), Path(out_dir).resolve()
    jobs = job_dirs(sweep_dir)
    records = {j: read_run_json(j) for j in jobs}
    unfinished = [j.name for j, r in records.items() if r.get("status") != "completed"]
    if unfinished and not allow_incomplete:
        raise ArchiveError(
            f"{len(unfinished)} run(s) of the sweep are not completed ({', '.join(unfinished)})"
            "; finish them (make resume) or pass --allow-incomplete"
        )
    diffs = {j: (j / "git.diff").read_text() if (j / "git.diff").is_file() else "" for j in jobs}
    git, diff = _shared_code(records, diffs)
    top = "sweep-" + re.sub(r"[^\w.+-]", "_", sweep_dir.name)
    target = out_dir / f"{top}.tar.gz"
    check_out_dir(out_dir)
    if target.exists() and not force:
        raise ArchiveError(f"{target} exists; pass --force to overwrite it")
    if snapshot.is_git_repo(repo) and git.get("commit"):
        snapshot.check_commit(repo, git["commit"])
    out_dir.mkdir(parents=True, exist_ok=True)
    with staging_dir(out_dir, target) as staging:
        root = staging / top
        PHASES("copy the records")
        with Progress("archive", len(jobs), unit="runs copied", emit=say) as copied:
            for job in jobs:
                for path, rel in run_members(job, with_checkpoint=False):
                    dest = root / SWEEP / job.relative_to(sweep_dir) / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, dest)
                copied.update()
        for name in SWEEP_FILES:
            if (sweep_dir / name).is_file():
                shutil.copy2(sweep_dir / name, root / SWEEP / name)
        PHASES("snapshot the source")
        snap = snapshot.build(repo, git.get("commit"), diff, root / "source")
        lock = root / "source" / "requirements.lock"
        if lock.is_file():
            (root / "env").mkdir(parents=True, exist_ok=True)
            shutil.copy2(lock, root / "env" / "requirements.lock")
        PHASES("record the environment")
        now_git, _ = gitinfo.git_info(repo)
        atomic_write_text(root / "env" / "pip-freeze.txt", pip_freeze())
        atomic_write_text(root / "env" / "git.json", json.dumps(now_git, indent=2) + "\n")
        meta = {
            "format": FORMAT_VERSION,
            "kind": KIND,
            "created_at": now_iso(),
            "sweep_name": sweep_dir.name,
            "jobs": [j.relative_to(sweep_dir).as_posix() for j in jobs],
            "source": snap.as_dict(),
        }
        atomic_write_text(root / ARCHIVE_JSON, json.dumps(meta, indent=2, sort_keys=True) + "\n")
        PHASES("seal and pack")
        seal(root, top, target, sign_key)
    return target, meta


def summary(meta: dict, path: Path) -> str:
    src = meta["source"]
    source = f"git {src['commit'][:12]}" if src["kind"] == "git" else "WORKING TREE (not as ran)"
    if src.get("diff_applied"):
        source += " + the runs' git.diff"
    return "\n".join(
        [
            f"archived sweep {meta['sweep_name']} ({len(meta['jobs'])} runs)",
            f"  source   {source}",
            *[f"  note     {n}" for n in src["notes"]],
            f"  archive  {path} ({path.stat().st_size / 1024:.1f} KiB)",
        ]
    )
