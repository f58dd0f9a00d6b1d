"""``make archive RUN=<run dir>``: pack a finished run with everything needed to replay it.

    python -m reprotrain.tools.archive.archive outputs/smoke/<stamp> [--with-checkpoint]
        [--out-dir archives] [--allow-incomplete] [--force] [--repo <checkout>]
        [--sign <ssh key>]

Writes ``<out-dir>/<experiment_id>-<run name>.tar.gz`` (temp file, then renamed: an archive
that exists is complete); ``RUN=<sweep dir>`` packs the whole sweep. Layout:
docs/archive-and-reproduce.md.

Exit codes: 0 written; 2 refused, in one line.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import sys
from pathlib import Path

from reprotrain import REPO_ROOT
from reprotrain.errors import ArchiveError
from reprotrain.run.readers import completion_problem, read_run_json
from reprotrain.run.record import FINGERPRINTS, RUN_JSON, atomic_write_text, read_jsonl
from reprotrain.tools import cli
from reprotrain.tools.archive import sweep_archive
from reprotrain.tools.archive.archive_check import MANIFEST, manifest_text, parse_manifest
from reprotrain.tools.archive.pack import Pack, copy_run, pack, source_and_env, source_line

__all__ = ["MANIFEST", "ArchiveError", "build", "main", "manifest_text", "parse_manifest"]


def _dict(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def archivability(record: dict) -> list[str]:
    """Why the archive cannot hold everything the run ran (empty when it can)."""
    git = _dict(record.get("git"))
    if git.get("fully_archivable", True) is not False:
        return []
    missing = [str(p) for p in git.get("not_archived") or []]
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    return [
        "NOT FULLY ARCHIVABLE: the run had untracked files under src/ or conf/ that were "
        f"recorded by name and sha256 only ({shown or 'see run.json git.untracked'}); a "
        "replay runs without them"
    ]


def check_consistent(run_dir: Path, record: dict) -> None:
    """A record whose status contradicts its own files is refused, not archived."""
    rows = run_dir / FINGERPRINTS
    why = completion_problem(record, len(read_jsonl(rows)) if rows.is_file() else None)
    if why is not None:
        raise ArchiveError(
            f"{run_dir / RUN_JSON} {why}: the record is inconsistent; resume the run "
            "(make resume) instead of archiving it"
        )


def build(
    run_dir: Path,
    out_dir: Path,
    repo: Path = REPO_ROOT,
    with_checkpoint: bool = False,
    allow_incomplete: bool = False,
    force: bool = False,
    sign_key: Path | None = None,
) -> tuple[Path, dict]:
    """Write the archive; returns (path, archive.json contents). Raises ArchiveError."""
    run_dir, out_dir, repo = Path(run_dir).resolve(), Path(out_dir).resolve(), Path(repo)
    if not run_dir.exists():
        raise ArchiveError(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise ArchiveError(f"{run_dir}: not a directory (give the run directory, not a file)")
    if not (run_dir / RUN_JSON).is_file():
        raise ArchiveError(f"{run_dir} is not a reprotrain run directory (no {RUN_JSON})")
    if not repo.is_dir():
        raise ArchiveError(f"--repo {repo}: {os.strerror(errno.ENOENT)}")
    if sign_key is not None and not Path(sign_key).expanduser().is_file():
        raise ArchiveError(f"signing key {sign_key}: {os.strerror(errno.ENOENT)}")
    record = read_run_json(run_dir)
    status = record.get("status")
    if status != "completed" and not allow_incomplete:
        raise ArchiveError(
            f"run {run_dir} is {status!r}, not completed; finish it (make resume) or pass "
            "--allow-incomplete"
        )
    check_consistent(run_dir, record)
    exp_id = re.sub(r"[^\w.+-]", "_", str(record.get("experiment_id") or "unknown"))
    diff_path = run_dir / "git.diff"
    diff = diff_path.read_text(errors="replace") if diff_path.is_file() else ""
    commit = _dict(record.get("git")).get("commit")
    job = Pack(out_dir, f"{exp_id}-{run_dir.name}", repo, commit, diff, force, sign_key)
    return pack(job, functools.partial(_fill, job, run_dir, record, with_checkpoint))


def _fill(job: Pack, run_dir: Path, record: dict, with_checkpoint: bool, root: Path) -> dict:
    """The run's records, source and environment under ``root``; returns archive.json."""
    copy_run(run_dir, root / "run", with_checkpoint)
    snap, lock_sha, now_git, now_diff = source_and_env(root, job)
    if _dict(record.get("git")).get("dirty") and not job.diff:
        snap.notes.append("run.json says the tree was dirty but the run has no git.diff")
    not_archivable = archivability(record)
    snap.notes.extend(not_archivable)
    if lock_sha != record.get("lock_sha256"):
        snap.notes.append(
            f"requirements.lock in the snapshot ({(lock_sha or 'none')[:12]}) is not the "
            f"recorded lock ({str(record.get('lock_sha256') or 'none')[:12]})"
        )
    if now_diff:
        atomic_write_text(root / "env" / "git-archive-time.diff", now_diff)
    return {
        "experiment_id": job.top.removesuffix(f"-{run_dir.name}"),
        "run_name": run_dir.name,
        "run_status": record.get("status"),
        "with_checkpoint": with_checkpoint,
        "fully_archivable": not not_archivable,
        "source": snap.as_dict(),
        "lock_sha256": {"recorded": record.get("lock_sha256"), "snapshot": lock_sha},
        "archived_with": {"python": sys.version.split()[0], "git": now_git.get("commit")},
    }


def summary(record: dict, meta: dict, path: Path) -> str:
    seeds = _dict(record.get("seeds"))
    streams = " ".join(
        f"{k}={seeds[k]}" for k in ("init", "data", "augment", "train") if k in seeds
    )
    final = _dict(record.get("final_metrics"))
    shown = " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in final.items()
        if k not in ("epoch", "global_step", "lr")
    )
    size, source = path.stat().st_size, source_line(meta["source"], "the run's git.diff")
    lines = [
        f"archived {meta['experiment_id']} (run {meta['run_name']}, {meta['run_status']})",
        f"  seeds    base={seeds.get('base')} ({seeds.get('source')})  {streams}",
        f"  repro    {_dict(record.get('repro')).get('level')}",
        f"  metrics  epoch {final.get('epoch')}/{record.get('epochs_completed')}: {shown}",
        f"  source   {source}",
        *[f"  note     {n}" for n in meta["source"]["notes"]],
        f"  archive  {path} ({size / 1024:.1f} KiB, {meta['members']} members, "
        f"checkpoint {'included' if meta['with_checkpoint'] else 'left out'}, "
        f"{'signed' if meta.get('signed') else 'unsigned'})",
    ]
    return "\n".join(lines)


@cli.entry_point
def main(argv: list[str] | None = None) -> int:
    p = cli.parser("reprotrain.tools.archive.archive", __doc__)
    p.add_argument("run_dir", type=cli.user_path, help="a run directory, or a sweep directory")
    p.add_argument("--out-dir", type=cli.user_path, default=Path("archives"))
    p.add_argument("--with-checkpoint", action="store_true", help="add the final checkpoint")
    p.add_argument("--allow-incomplete", action="store_true", help="archive a run not completed")
    p.add_argument("--force", action="store_true", help="overwrite an existing archive")
    p.add_argument(
        "--repo", type=cli.user_path, default=REPO_ROOT, help="checkout to rebuild source from"
    )
    sign = "sign the manifest with this ssh key (ssh-keygen -Y sign)"
    p.add_argument("--sign", type=cli.user_path, default=None, metavar="KEY", help=sign)
    args = p.parse_args(argv)
    try:
        with cli.stopping():  # a stop signal unwinds: staging and temp tar removed
            return _archive(args)
    except cli.Stopped as e:
        why = f"error: interrupted by {e.signal}: no archive written, nothing left behind"
        print(why, file=sys.stderr, flush=True)
        return 130


def _archive(a) -> int:
    if sweep_archive.is_sweep_dir(a.run_dir):  # a sweep: every run and its summary
        path, meta = sweep_archive.build(
            a.run_dir, a.out_dir, a.repo, a.allow_incomplete, a.force, a.sign
        )
        print(sweep_archive.summary(meta, path))
    else:
        path, meta = build(
            a.run_dir, a.out_dir, a.repo, a.with_checkpoint, a.allow_incomplete, a.force, a.sign
        )
        print(summary(read_run_json(a.run_dir), meta, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
