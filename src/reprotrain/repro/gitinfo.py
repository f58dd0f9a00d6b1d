"""Code identity for run.json without copying anything that was never committed.
Closes (as records): code drift, keeping secrets out (docs/guarantees.md): untracked files
by name, size and sha256 only, remote URLs without credentials; in the container (no
``.git``) the commit the image was built from (``REPROTRAIN_GIT_COMMIT``)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from collections.abc import Sequence
from fnmatch import fnmatchcase
from pathlib import Path

from reprotrain.errors import ReprotrainError
from reprotrain.run.bounded import load_json

#: What an archive's source snapshot holds (top-level names / globs).
_LOCKS = "requirements*.lock requirements*.lock.sha256 requirements*.in"
SNAPSHOT_PATHS: tuple[str, ...] = ("src", "conf", "pyproject.toml", "Makefile", *_LOCKS.split())
_SKIP_PARTS = ("__pycache__", ".egg-info")
#: Untracked files larger than this are listed by size, not hashed (an un-ignored dataset).
HASH_LIMIT_BYTES = 64 << 20
_COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_URL_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#@]*@)")


def run_git(
    repo: Path,
    *args: str,
    input: str | bytes | None = None,
    text: bool = True,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """``git -C <repo> <args>``, output captured: the one git runner (standard library only,
    for ``make new-project``). Failure is a return code; a missing git raises ``OSError``."""
    argv = ["git", "-C", str(repo), *args]
    return subprocess.run(
        argv, input=input, capture_output=True, text=text, timeout=timeout, env=env
    )


def _git(repo: Path, *args: str, ok: tuple[int, ...] = (0,)) -> str | None:
    try:
        out = run_git(repo, *args, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode in ok else None


def is_commit_id(text: object) -> bool:
    """A full hex object id: the only form passed on to git (never an option or a ref)."""
    return isinstance(text, str) and _COMMIT.fullmatch(text) is not None


def in_snapshot(rel: str) -> bool:
    """Whether the repo-relative path ``rel`` belongs to an archive's source snapshot."""
    if any(part in rel for part in _SKIP_PARTS):
        return False
    return any(fnmatchcase(rel.split("/", 1)[0], pat) for pat in SNAPSHOT_PATHS)


def scrub_url(url: str) -> str:
    """A remote URL without user, password, token or query (scp-style ``git@host:path`` kept)."""
    url = url.strip()
    if m := _URL_USERINFO.match(url):
        url = m.group("scheme") + url[m.end() :]
    if "://" in url:
        url = re.split(r"[?#]", url, maxsplit=1)[0]
    return url


def remotes(repo: Path) -> dict[str, str]:
    out = {}
    for name in (_git(repo, "remote") or "").split():
        if url := _git(repo, "remote", "get-url", name):
            out[name] = scrub_url(url)
    return out


def _sha256(path: Path) -> tuple[str | None, int]:
    size = path.lstat().st_size
    if path.is_symlink():
        return hashlib.sha256(os.readlink(path).encode()).hexdigest(), size
    if size > HASH_LIMIT_BYTES:
        return None, size
    # Imported here: make new-project imports this module (for run_git) with whatever
    # python3 is on the PATH, before any venv; the hashing module needs Python 3.11.
    from reprotrain.hashing import file_sha256

    return file_sha256(path), size


def _opted_in(rel: str, patterns: Sequence[str]) -> bool:
    pats = [p for p in (str(p).strip().removeprefix("./") for p in patterns) if p]
    dirs = [p for p in pats if p.endswith("/")]
    return rel in pats or rel.startswith(tuple(dirs)) or any(fnmatchcase(rel, p) for p in pats)


def git_info(repo: Path, include_untracked: Sequence[str] = ()) -> tuple[dict, str]:
    """(record, diff text): tracked changes against HEAD, plus the untracked files matched
    by ``include_untracked``; ``not_archived``: untracked snapshot paths left out."""
    repo = Path(repo)
    if (commit := _git(repo, "rev-parse", "HEAD")) is None:
        if built := os.environ.get("REPROTRAIN_GIT_COMMIT", "").strip():
            return {
                "commit": built,
                "short": built.removesuffix("-dirty")[:8],
                "branch": None,
                "dirty": built.endswith("-dirty"),
                "source": "container image",
                "fully_archivable": True,
            }, ""
        return {
            "commit": None,
            "short": "nogit",
            "branch": None,
            "dirty": None,
            "fully_archivable": False,
            "not_archived": ["(not a git checkout: the code that ran is not recorded)"],
        }, ""
    commit = commit.strip()
    status = _git(repo, "status", "--porcelain=v1", "-z", "--untracked-files=all") or ""
    entries = [e for e in status.split("\0") if e]
    listed = [e[3:] for e in entries if e.startswith("?? ")]
    outputs = framework_outputs(repo, listed)  # a run dir in the project is no code change
    untracked_paths = [p for p in listed if not any(_in([p], d) for d in outputs)]
    changed = [e for e in entries if not e.startswith("?? ")]
    diff = _git(repo, "diff", "--binary", "HEAD") or ""
    untracked, not_archived = [], []
    for rel in sorted(untracked_paths):
        try:
            digest, size = _sha256(repo / rel)
        except OSError:
            digest, size = None, None
        if included := _opted_in(rel, include_untracked):
            diff += _git(repo, "diff", "--binary", "--no-index", "/dev/null", rel, ok=(0, 1)) or ""
        elif in_snapshot(rel):
            not_archived.append(rel)
        untracked.append({"path": rel, "size": size, "sha256": digest, "included": included})
    return {
        "commit": commit,
        "short": commit[:8],
        "branch": (_git(repo, "rev-parse", "--abbrev-ref", "HEAD") or "").strip() or None,
        "dirty": bool(changed or untracked_paths),
        "remotes": remotes(repo),
        "untracked": untracked,
        "outputs_not_counted": outputs,
        "fully_archivable": not not_archived,
        "not_archived": not_archived,
    }, diff


#: A run's record and a sweep's (Hydra's): what marks a directory as the framework's output.
RUN_RECORD, SWEEP_RECORD = "run.json", "multirun.yaml"
_STATUSES = ("running", "completed", "failed", "interrupted")  # run.record.STATUSES


def framework_outputs(repo: Path, untracked: Sequence[str]) -> list[str]:
    """The folders, among the untracked paths' parents, that the framework wrote: each run
    directory (one holding a reprotrain ``run.json``, wherever it lies in the project, its
    ``.hydra/`` and log included) and each sweep directory (a ``multirun.yaml`` above a run
    directory). Recognised by their record, never by name: a folder of the user's named
    ``outputs`` still counts as a change."""
    parents = {
        "/".join(rel.split("/")[:i]) for rel in untracked for i in range(1, rel.count("/") + 1)
    }
    runs = [p for p in parents if _is_run_dir(repo / p)]
    sweeps = [p for p in parents if (repo / p / SWEEP_RECORD).is_file() and _in(runs, p)]
    found = {*runs, *sweeps}
    return sorted(p for p in found if not any(_in([p], q) for q in found))  # the outermost


def _in(paths: Sequence[str], folder: str) -> bool:
    """Whether one of ``paths`` lies in ``folder``."""
    return any(p.startswith(folder + "/") for p in paths)


def _is_run_dir(path: Path) -> bool:
    """Whether ``path`` holds a reprotrain record: a ``run.json`` with one of its statuses."""
    if not (path / RUN_RECORD).is_file():  # never a FIFO or a device
        return False
    try:
        with open(path / RUN_RECORD, "rb") as f:
            data = load_json(f.read(HASH_LIMIT_BYTES), str(path / RUN_RECORD))  # bounded
    except (OSError, ValueError, ReprotrainError):
        return False
    return isinstance(data, dict) and data.get("status") in _STATUSES


def code_sha256(repo: Path) -> str:
    """One digest of every file under the snapshot paths (tracked or not, through symlinks),
    by relative path and content (over ``HASH_LIMIT_BYTES``: size). Needs no git."""
    repo = Path(repo)
    digest = hashlib.sha256()
    tops = sorted(p for p in repo.iterdir() if in_snapshot(p.name)) if repo.is_dir() else []
    files = []
    for top in tops:
        walked = [top] if top.is_file() else _files_through_links(top)
        files += [p for p in walked if in_snapshot(p.relative_to(repo).as_posix())]
    for path in sorted(files, key=lambda p: p.relative_to(repo).as_posix()):
        real = Path(os.path.realpath(path))  # a symlink: what an import reads through it
        content, size = _sha256(real) if real.is_file() else (None, 0)  # None over the limit
        digest.update(f"{path.relative_to(repo).as_posix()}\0{content or size}\n".encode())
    return digest.hexdigest()


def _files_through_links(top: Path) -> list[Path]:
    """Every file under ``top``, through symlinked directories (each real one once)."""
    out, seen = [], set()
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        if (real := os.path.realpath(dirpath)) in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        out += [Path(dirpath) / f for f in filenames if (Path(dirpath) / f).is_file()]
    return out


def archivability_warning(info: dict) -> str | None:
    """The line the trainer logs at start when the run cannot be archived as it ran."""
    missing = info.get("not_archived") or []
    if info.get("fully_archivable", True) or not missing:
        return None
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    if info.get("commit") is None:
        return f"this run is not fully archivable: {missing[0]}"
    return (
        f"this run is not fully archivable: {len(missing)} untracked file(s) under the code "
        f"paths are recorded by name and sha256 only ({shown}); commit them, or opt them in "
        "with record.include_untracked=[<path>,...]"
    )
