"""The source snapshot of an archive: the package and configs *as the run ran them*.

Closes: code drift between a run and its archive: ``git archive <recorded commit>`` plus the
run's ``git.diff``; without git to ask, the working tree is copied and the note says so. The
repository layout is kept, so ``PYTHONPATH=<snapshot>/src`` runs the archived code as is.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from reprotrain.errors import SnapshotError
from reprotrain.repro import gitinfo


@dataclass
class Snapshot:
    """Where the snapshot came from: ``kind`` is ``git`` or ``working-tree``."""

    kind: str
    commit: str | None = None
    diff_applied: bool = False
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    """Bytes out (a tar stream), two minutes at most."""
    return gitinfo.run_git(repo, *args, text=False, timeout=120)


def is_git_repo(repo: Path) -> bool:
    try:
        out = _git(repo, "rev-parse", "--show-toplevel")
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and Path(out.stdout.decode().strip()).resolve() == repo.resolve()


def check_commit(repo: Path, commit: object) -> None:
    """SnapshotError unless ``repo`` has the full object id ``commit`` (before any write)."""
    if not gitinfo.is_commit_id(commit):
        # Only a full hex id reaches git: a recorded "commit" is data, never an option.
        raise SnapshotError(f"recorded commit {str(commit)[:80]!r} is not a git object id")
    if _git(repo, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        raise SnapshotError(
            f"commit {str(commit)[:12]} is not in {repo} (rebased or not fetched?); "
            "fetch it, or archive from a clone that has it"
        )


def from_git(repo: Path, commit: str, diff: str, dest: Path) -> Snapshot:
    """``git archive <commit>`` of the snapshot paths into ``dest``, their diff hunks applied."""
    repo, dest = Path(repo), Path(dest)
    check_commit(repo, commit)
    listed = _git(repo, "ls-tree", "-r", "--name-only", commit)
    paths = sorted({p.split("/", 1)[0] for p in listed.stdout.decode().splitlines()})
    wanted = [p for p in paths if gitinfo.in_snapshot(p)]
    dest.mkdir(parents=True, exist_ok=True)
    snap = Snapshot(kind="git", commit=commit)
    if wanted:
        out = _git(repo, "archive", "--format=tar", commit, "--", *wanted)
        if out.returncode != 0:
            raise SnapshotError(f"git archive {commit[:12]} failed: {out.stderr.decode().strip()}")
        with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tar:
            tar.extractall(dest, filter="data")
    if diff.strip():
        # What a snapshot holds, as git pathspecs / glob patterns relative to the repo root (one
        # list, shared with the trainer's record of which untracked files an archive would miss).
        includes = [f"--include={q}" for p in gitinfo.SNAPSHOT_PATHS for q in (p, f"{p}/*")]
        # dest must not be mistaken for a subfolder of some enclosing checkout (git apply
        # would then patch relative to that repo's root): stop git's repo discovery at dest.
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(dest.resolve().parent)}
        applied = gitinfo.run_git(
            dest, "apply", "--whitespace=nowarn", "--binary", *includes, "-",
            input=diff.encode(), text=False, timeout=120, env=env,
        )  # fmt: skip
        if applied.returncode != 0:
            first = (applied.stderr.decode().strip().splitlines() or ["?"])[0]
            raise SnapshotError(f"the run's git.diff does not apply to {commit[:12]}: {first}")
        snap.diff_applied = True
    return snap


def from_working_tree(repo: Path, dest: Path, reason: str) -> Snapshot:
    """Copy the snapshot paths from the working tree (no git to rebuild the as-ran state)."""
    repo, dest = Path(repo), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    for entry in sorted(repo.iterdir()):
        if not gitinfo.in_snapshot(entry.name):
            continue
        if entry.is_dir():
            shutil.copytree(entry, dest / entry.name, symlinks=False, ignore=skip)
        elif entry.is_file():
            shutil.copy2(entry, dest / entry.name)
    note = f"source copied from the working tree as it is now, not as it ran: {reason}"
    return Snapshot(kind="working-tree", notes=[note])


def build(repo: Path, commit: str | None, diff: str, dest: Path) -> Snapshot:
    """The as-ran source of a run into ``dest``: from git when possible, else the tree."""
    repo = Path(repo)
    if not is_git_repo(repo):
        return from_working_tree(repo, dest, f"{repo} is not a git checkout")
    if not commit:
        return from_working_tree(repo, dest, "the run recorded no git commit")
    return from_git(repo, commit, diff, dest)
