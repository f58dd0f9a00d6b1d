"""What every archive is built from, for one run and for a sweep alike: members, source and
environment, the staging folder, and the seal (manifest, signature, atomic tar)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from reprotrain import events
from reprotrain.errors import ArchiveError
from reprotrain.hashing import file_sha256
from reprotrain.progress import Phases, say
from reprotrain.repro import gitinfo
from reprotrain.run.mutex import pid_exists
from reprotrain.run.record import CHECKPOINTS, atomic_write_text, now_iso
from reprotrain.tools import cli
from reprotrain.tools.archive import archive_check, signing, snapshot

FORMAT_VERSION = 1
#: Packing, in order, after the refusals (progress lines on stdout: ``archive [2/4] ...``).
PHASES = Phases(
    "archive",
    ("copy the records", "snapshot the source", "record the environment", "seal and pack"),
    emit=say,
)


def scrub_credentials(text: str) -> str:
    return re.sub(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@", r"\g<scheme>***@", text)


def pip_freeze() -> str:
    """``sys.executable -m pip freeze``: the installed set, beside the lock that should match."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"# pip freeze failed: {type(e).__name__}\n"
    if out.returncode != 0:
        return f"# pip freeze failed (exit {out.returncode})\n"
    return scrub_credentials(out.stdout)


def final_checkpoint(run_dir: Path) -> Path | None:
    steps = sorted((run_dir / CHECKPOINTS).glob("step-*.pt"))
    return steps[-1] if steps else None


def copy_run(run_dir: Path, dest: Path, with_checkpoint: bool) -> None:
    """The run dir's files into ``dest``: no checkpoints unless asked, no temp files."""
    keep = final_checkpoint(run_dir) if with_checkpoint else None
    for path in sorted(run_dir.rglob("*")):
        rel = path.relative_to(run_dir)
        if path.is_symlink() or not path.is_file():
            continue  # archives hold plain files only (reproduce refuses links)
        if rel.parts[0] == CHECKPOINTS and path != keep:
            continue
        if path.name.endswith(".tmp") and path.name.startswith("."):
            continue  # an atomic write in flight
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest / rel)


@dataclass(frozen=True)
class Pack:
    """One archive to write: ``<out_dir>/<top>.tar.gz``, its source from ``repo`` at ``commit``."""

    out_dir: Path
    top: str
    repo: Path
    commit: str | None
    diff: str
    force: bool = False
    sign_key: Path | None = None

    @property
    def target(self) -> Path:
        return self.out_dir / f"{self.top}.tar.gz"


def pack(job: Pack, fill: Callable[[Path], dict]) -> tuple[Path, dict]:
    """``fill(root)`` writes the records and returns archive.json's own keys; sealed, packed.

    Refused before any write: the archive exists, or the repo lacks the recorded commit. A
    refusal leaves nothing, not even the folders made for it."""
    cli.check_dir_arg("--out-dir", job.out_dir)
    if job.target.exists() and not job.force:
        raise ArchiveError(f"{job.target} exists; pass --force to overwrite it")
    if snapshot.is_git_repo(job.repo) and job.commit:
        snapshot.check_commit(job.repo, job.commit)
    created = [p for p in (job.out_dir, *job.out_dir.parents) if not p.exists()]
    job.out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with staging_dir(job.out_dir, job.target) as staging:
            root = staging / job.top
            PHASES("copy the records")
            meta = {"format": FORMAT_VERSION, "created_at": now_iso(), **fill(root)}
            text = json.dumps(meta, indent=2, sort_keys=True) + "\n"
            atomic_write_text(root / archive_check.ARCHIVE_JSON, text)
            PHASES("seal and pack")
            files = seal(root, job.top, job.target, job.sign_key)
    except BaseException:
        for p in created:  # innermost first: leave no empty folders from a refused archive
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
    signed = job.sign_key is not None
    return job.target, {**meta, "members": files + 1 + signed, "signed": signed}


def source_line(src: dict, diff: str) -> str:
    """Where the archived source came from, for the summary printed after packing."""
    if src["kind"] != "git":
        return "WORKING TREE (not as ran)"
    return f"git {src['commit'][:12]}" + (f" + {diff}" if src["diff_applied"] else "")


def source_and_env(root: Path, job: Pack):
    """Write ``source/`` and ``env/``; (the snapshot, lock sha256 or None, git now, diff now)."""
    PHASES("snapshot the source")
    snap = snapshot.build(job.repo, job.commit, job.diff, root / "source")
    lock = root / "source" / "requirements.lock"
    lock_sha = file_sha256(lock) if lock.is_file() else None
    if lock.is_file():
        (root / "env").mkdir(parents=True, exist_ok=True)
        shutil.copy2(lock, root / "env" / "requirements.lock")
    PHASES("record the environment")
    now_git, now_diff = gitinfo.git_info(job.repo)
    atomic_write_text(root / "env" / "pip-freeze.txt", pip_freeze())
    atomic_write_text(root / "env" / "git.json", json.dumps(now_git, indent=2) + "\n")
    return snap, lock_sha, now_git, now_diff


def _normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """No owner names or ids in the archive; plain permissions."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o755 if info.isdir() or info.mode & 0o100 else 0o644
    return info


STAGING_PREFIX = ".archive-"


def remove_stale_staging(out_dir: Path) -> list[Path]:
    """Remove and return killed archivers' ``.archive-<pid>-*``; a live archiver's are kept."""
    removed = []
    for path in Path(out_dir).glob(f"{STAGING_PREFIX}*"):
        pid = path.name[len(STAGING_PREFIX) :].partition("-")[0]
        if path.is_symlink() or not pid.isdigit() or pid_exists(int(pid)):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


#: The reaper: blocks on its stdin, the read end of a pipe whose write end only the
#: archiver holds. The archiver writes one byte when it cleaned up itself; EOF without it
#: means the archiver died (SIGKILL: no ``finally`` ran), and the reaper removes its
#: ``.archive-<pid>-*`` (the staging dir and the temp tar).
_REAPER = (
    "import glob, os, shutil, sys\n"
    "if not os.read(0, 1):\n"
    "    for p in glob.glob(sys.argv[1]):\n"
    "        shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.unlink(p)\n"
)


@contextlib.contextmanager
def _reaper(out_dir: Path) -> Iterator[None]:
    """A process of its own session: removes the staging dir and temp tar if this one is killed."""
    read, write = os.pipe()
    pattern = str(Path(out_dir) / f"{STAGING_PREFIX}{os.getpid()}-*")
    argv, quiet = [sys.executable, "-S", "-c", _REAPER, pattern], subprocess.DEVNULL
    proc = subprocess.Popen(argv, stdin=read, stdout=quiet, stderr=quiet, start_new_session=True)
    os.close(read)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.write(write, b"x")  # cleaned up here: nothing for the reaper to do
        os.close(write)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


@contextlib.contextmanager
def staging_dir(out_dir: Path, target: Path) -> Iterator[Path]:
    """A hidden temp dir in ``out_dir`` removed however the block ends (SIGKILL: the reaper)."""
    staging = None
    try:
        remove_stale_staging(out_dir)
        with _reaper(out_dir):
            prefix = f"{STAGING_PREFIX}{os.getpid()}-"
            staging = Path(tempfile.mkdtemp(prefix=prefix, dir=out_dir))
            try:
                yield staging
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        # a copy names (source, destination): the file that could not be written is the second
        where = e.filename2 or e.filename or (staging or out_dir)
        raise ArchiveError(
            f"writing {target} failed at {where}: {e.strerror or e}; nothing written "
            f"(free space in {out_dir}, or give --out-dir on a larger disk)"
        ) from None


def seal(root: Path, top: str, target: Path, sign_key: str | None) -> int:
    """``MANIFEST.sha256`` over ``root`` (signed given a key), packed atomically; its file count."""
    digests = archive_check.file_digests(root)
    (root / archive_check.MANIFEST).write_text(archive_check.manifest_text(digests))
    if sign_key is not None:
        signing.sign_file(root / archive_check.MANIFEST, Path(sign_key).expanduser())
    tmp = None
    try:
        # named like the staging dir, so the reaper and the next archive know whose it is
        prefix = f"{STAGING_PREFIX}{os.getpid()}-{top}."
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tar.gz.tmp", dir=target.parent)
        os.close(fd)
        events.fire("file-write", path=Path(tmp))  # a moment a test kills the archiver at
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(root, arcname=top, filter=_normalise)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and not e.filename:
            e.filename = tmp  # a full disk names the file it was writing
        raise
    return len(digests)
