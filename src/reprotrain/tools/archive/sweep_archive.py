"""``make archive RUN=<sweep dir>``: pack a whole sweep (every run, its summary) in one archive.

The single-run layout with ``sweep/`` for ``run/`` (every run, no checkpoints, the sweep's
own files); all runs must share the commit and diff. docs/archive-and-reproduce.md.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from reprotrain.errors import ArchiveError
from reprotrain.progress import Progress, say
from reprotrain.run.directory import sweep_jobs
from reprotrain.run.readers import read_run_json
from reprotrain.run.record import RUN_JSON
from reprotrain.tools.archive.archive_check import CheckedArchive
from reprotrain.tools.archive.pack import Pack, copy_run, pack, source_and_env, source_line

SWEEP = "sweep"
#: The sweep's own files (an Optuna study's record, results and journal among them).
SWEEP_FILES = ("summary.json", "summary.md", "summary.png", "multirun.yaml", "study.json")
SWEEP_FILES += ("optimization_results.yaml", "study.journal")


def is_sweep_dir(path: Path) -> bool:
    """A directory without its own run.json that holds run directories below it."""
    path = Path(path)
    return path.is_dir() and not (path / RUN_JSON).exists() and bool(sweep_jobs(path))


def is_sweep_archive(checked: CheckedArchive) -> bool:
    return any(rel.startswith(f"{SWEEP}/") for rel in checked.members)


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
    jobs = sweep_jobs(sweep_dir)
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
    job = Pack(out_dir, top, repo, git.get("commit"), diff, force, sign_key)

    def fill(root: Path) -> dict:
        with Progress("archive", len(jobs), unit="runs copied", emit=say) as copied:
            for j in jobs:
                copy_run(j, root / SWEEP / j.relative_to(sweep_dir), with_checkpoint=False)
                copied.update()
        for name in SWEEP_FILES:
            if (sweep_dir / name).is_file():
                shutil.copy2(sweep_dir / name, root / SWEEP / name)
        snap = source_and_env(root, job)[0]
        return {
            "kind": SWEEP,
            "sweep_name": sweep_dir.name,
            "jobs": [j.relative_to(sweep_dir).as_posix() for j in jobs],
            "source": snap.as_dict(),
        }

    return pack(job, fill)


def summary(meta: dict, path: Path) -> str:
    src = meta["source"]
    source = source_line(src, "the runs' git.diff")
    return "\n".join(
        [
            f"archived sweep {meta['sweep_name']} ({len(meta['jobs'])} runs)",
            f"  source   {source}",
            *[f"  note     {n}" for n in src["notes"]],
            f"  archive  {path} ({path.stat().st_size / 1024:.1f} KiB)",
        ]
    )
