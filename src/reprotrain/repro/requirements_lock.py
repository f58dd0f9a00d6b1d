"""Hashed lock files and the installed environment: the control for *environment drift*.
Closes: a run whose numerics depend on which build of torch/numpy/... is installed. Answers
offline: is the lock sound, does the interpreter hold exactly it (``env_drift``), which lock
did a run use (``lock_sha256``)? docs/reproducing-elsewhere.md; why not a library:
docs/design.md, "Large rooms". Standard library only (``make check-lock`` runs before any
venv); ``packaging`` is used when importable."""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from reprotrain.extras import EXTRAS
from reprotrain.hashing import file_sha256

RUNTIME_LOCK = "requirements.lock"
DEV_LOCK = "requirements-dev.lock"
#: (lock, .in) pairs of this repository, runtime first: the dev .in is constrained by it.
DEFAULT_PAIRS: tuple[tuple[str, str], ...] = (
    (RUNTIME_LOCK, "requirements.in"),
    (DEV_LOCK, "requirements-dev.in"),
)


def extra_pair(extra: str) -> tuple[str, str]:
    """(lock, .in) of an optional extra."""
    return f"requirements-{extra}.lock", f"requirements-{extra}.in"


#: Every lock ``make lock`` compiles and ``make check-lock`` validates, in compile order.
ALL_PAIRS: tuple[tuple[str, str], ...] = DEFAULT_PAIRS + tuple(extra_pair(e) for e in EXTRAS)
#: The installer: compared when a lock pins it, not drift when none does (the runtime image's
#: venv keeps the pip ``python -m venv`` bootstrapped; pip takes no part in the computation).
INSTALLER = "pip"
SIDECAR_SUFFIX = ".sha256"

_NAME_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")
_PIN_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;=]+)\s*(;.*)?$")
_FILE_URL_RE = re.compile(r"\bfile:/", re.IGNORECASE)
_HASH_RE = re.compile(r"^--hash=(sha256):([0-9a-f]{64})$")
# Options that make a lock depend on where it was compiled (index, local wheel folder).
_MACHINE_OPTIONS = frozenset(
    ["--index-url", "--extra-index-url", "--find-links", "--trusted-host", "--no-index", "-i", "-f"]
)


def normalize_name(name: str) -> str:
    """PEP 503 name, so ``PyYAML``, ``pyyaml`` and ``py_yaml`` compare equal everywhere."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class LockEntry:
    """One pinned distribution of a lock."""

    name: str  # normalised
    version: str
    hashes: list[str] = field(default_factory=list)
    marker: str | None = None


@dataclass
class ParsedLock:
    """A lock read line by line; ``problems`` holds what makes it unusable as a lock."""

    path: Path
    entries: dict[str, LockEntry] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Backslash continuations joined, comments dropped; each with its first line number."""
    out, buf = [], []
    start = 0
    for lineno, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not buf:
            start = lineno
        if stripped.startswith("#") or (not stripped and not buf):
            if buf and stripped.startswith("#"):
                # a comment ends a dangling continuation (pip would do the same)
                out.append((start, " ".join(buf)))
                buf = []
            continue
        # inline comments: pip requires whitespace before '#'
        stripped = re.split(r"\s+#", stripped, maxsplit=1)[0].strip()
        if stripped.endswith("\\"):
            buf.append(stripped[:-1].strip())
            continue
        buf.append(stripped)
        joined = " ".join(p for p in buf if p)
        buf = []
        if joined:
            out.append((start, joined))
    if buf:
        out.append((start, " ".join(p for p in buf if p)))
    return out


def parse_lock(path: Path, text: str | None = None) -> ParsedLock:
    """Parse a hashed lock, collecting every line-level problem (unpinned, unhashed, or
    resolving differently elsewhere: an index, a local folder, a ``file:`` URL, an editable)."""
    path = Path(path)
    if text is None:
        text = path.read_text(encoding="utf-8")
    lock = ParsedLock(path=path)
    name = path.name
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if raw.lstrip().startswith("#") and _FILE_URL_RE.search(raw):
            lock.problems.append(
                f"{name}:{lineno}: names a file: URL ({raw.strip()[:80]}); "
                "a lock must not carry machine paths"
            )
    for lineno, line in _logical_lines(text):
        where = f"{name}:{lineno}"
        tokens = line.split()
        first = tokens[0]
        if first.startswith("-"):
            if first.split("=", 1)[0] in _MACHINE_OPTIONS:
                lock.problems.append(
                    f"{where}: '{line[:80]}' names an index or local path; locks are compiled "
                    "with --no-emit-index-url --no-emit-find-links (run make lock)"
                )
            else:
                lock.problems.append(
                    f"{where}: option '{line[:80]}' does not belong in a lock "
                    "(editables, includes and local paths are not reproducible elsewhere)"
                )
            continue
        hash_tokens = [t for t in tokens if t.startswith("--hash")]
        req = " ".join(t for t in tokens if not t.startswith("--hash"))
        if _FILE_URL_RE.search(req) or " @ " in f" {req} " or req.startswith(("/", ".", "~")):
            lock.problems.append(
                f"{where}: '{req[:80]}' is a direct reference (URL or local path), "
                "not a pinned release from an index"
            )
            continue
        if not (m := _PIN_RE.match(req)):
            nm = _NAME_RE.match(req)
            label = nm.group(1) if nm else req[:40]
            lock.problems.append(f"{where}: {label} is not pinned with == ('{req[:80]}')")
            continue
        pkg = normalize_name(m.group(1))
        marker = (m.group(4) or "")[1:].strip() or None
        entry = LockEntry(name=pkg, version=m.group(3), marker=marker)
        for tok in hash_tokens:
            if not (hm := _HASH_RE.match(tok)):
                lock.problems.append(f"{where}: {pkg}: malformed hash '{tok[:90]}'")
            else:
                entry.hashes.append(hm.group(2))
        if not entry.hashes:
            lock.problems.append(f"{where}: {pkg}=={entry.version} has no --hash=sha256:...")
        if entry.marker is not None and marker_applies(entry.marker) is None:
            lock.problems.append(f"{where}: {pkg}: invalid environment marker '{entry.marker}'")
        if pkg in lock.entries and lock.entries[pkg].version != entry.version:
            lock.problems.append(
                f"{where}: {pkg} is pinned twice ({lock.entries[pkg].version} and {entry.version})"
            )
        lock.entries[pkg] = entry
    return lock


def marker_applies(marker: str | None, environment: dict[str, str] | None = None) -> bool | None:
    """Whether a PEP 508 marker holds here (or in ``environment``); None: it does not parse.
    True without ``packaging`` (pip judges it at install time)."""
    if marker is None:
        return True
    try:
        from packaging.markers import InvalidMarker, Marker
    except ImportError:
        return True
    try:
        parsed = Marker(marker)
    except InvalidMarker:
        return None
    try:
        return bool(parsed.evaluate(environment))
    except Exception:  # a name this environment lacks: cannot be ruled out
        return True


def in_includes(in_path: Path) -> list[Path]:
    """Files an ``.in`` pulls in via ``-r``/``-c``, recursively."""
    seen: list[Path] = []

    def walk(p: Path) -> None:
        try:
            text = p.read_text(encoding="utf-8")
        except OSError:
            return
        for _, line in _logical_lines(text):
            if m := re.match(r"^(-r|-c|--requirement|--constraint)(?:\s+|=)(\S+)$", line):
                ref = (p.parent / m.group(2)).resolve()
                if ref not in seen:
                    seen.append(ref)
                    walk(ref)

    walk(Path(in_path).resolve())
    return seen


def _rel(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def sidecar_path(lock_path: Path, suffix: str = SIDECAR_SUFFIX) -> Path:
    return Path(str(lock_path) + suffix)


def expected_record(lock_path: Path, in_path: Path) -> dict[str, str]:
    """What the sidecar should say now: {relative file name: sha256}, inputs then the lock."""
    lock_path, in_path = Path(lock_path), Path(in_path)
    root = lock_path.parent
    files = [in_path, *[p for p in in_includes(in_path) if p.resolve() != lock_path.resolve()]]
    files.append(lock_path)
    return {_rel(p, root): (file_sha256(p) if p.exists() else "") for p in files}


def write_record(lock_path: Path, in_path: Path) -> Path:
    """Write ``<lock>.sha256`` (``sha256sum`` format). Called by ``make lock`` after compiling."""
    record = expected_record(lock_path, in_path)
    if missing := [name for name, digest in record.items() if not digest]:
        raise FileNotFoundError(f"cannot record: missing {', '.join(missing)}")
    out = sidecar_path(lock_path)
    out.write_text("".join(f"{d}  {n}\n" for n, d in record.items()), encoding="utf-8")
    return out


def read_sha256sum(path: Path, name: str = r".+") -> list[tuple[str, str]] | None:
    """(sha256, name) of each line of a ``sha256sum``-format file; None when it is absent."""
    if not Path(path).exists():
        return None
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    found = (re.match(rf"^([0-9a-f]{{64}})\s+\*?({name})$", line.strip()) for line in lines)
    return [(m.group(1), m.group(2).strip()) for m in found if m]


def read_record(lock_path: Path) -> dict[str, str] | None:
    """Parse a sidecar; None when absent."""
    rows = read_sha256sum(sidecar_path(lock_path))
    return None if rows is None else {name: digest for digest, name in rows}


def check_staleness(lock_path: Path, in_path: Path) -> list[str]:
    """Compare the sidecar with the files on disk (a lock from an older ``.in``, or edited)."""
    lock_path, in_path = Path(lock_path), Path(in_path)
    recorded = read_record(lock_path)
    side = sidecar_path(lock_path).name
    if recorded is None:
        return [
            f"{lock_path.name}: no {side} record of the .in it was compiled from; run make lock"
        ]
    problems: list[str] = []
    expected = expected_record(lock_path, in_path)
    stale = f"{lock_path.name} is stale"
    for fname, digest in expected.items():
        if fname == lock_path.name and recorded.get(fname) != digest:
            edited = f"{lock_path.name} was edited after make lock (sha256 differs from {side})"
            problems.append(f"{edited}; regenerate it with make lock")
        elif fname not in recorded:
            problems.append(f"{stale}: {fname} is not recorded in {side}; run make lock")
        elif recorded[fname] != digest:
            problems.append(f"{stale}: {fname} changed since the lock was compiled; run make lock")
    for fname in [f for f in recorded if f not in expected]:
        gone = f"{side} records {fname}, which {in_path.name} no longer uses"
        problems.append(f"{stale}: {gone}; run make lock")
    return problems


def check_in_satisfied(lock: ParsedLock, in_path: Path) -> list[str]:
    """Every direct requirement of the ``.in`` is locked at a version it allows (a stale lock
    whose sidecar was refreshed by hand). Skipped without ``packaging``."""
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:  # bare python3 before the venv exists
        return []
    problems, source, stale = [], Path(in_path).name, f"{lock.path.name} is stale"
    for lineno, line in _logical_lines(Path(in_path).read_text(encoding="utf-8")):
        if line.startswith("-"):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            problems.append(f"{source}:{lineno}: cannot parse '{line[:80]}'")
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = normalize_name(req.name)
        if (entry := lock.entries.get(name)) is None:
            problems.append(f"{stale}: {name} (from {source}) is not locked; run make lock")
        elif req.specifier and not req.specifier.contains(entry.version, prereleases=True):
            pinned = f"{name}=={entry.version} does not satisfy '{req}' in {source}"
            problems.append(f"{stale}: {pinned}; run make lock")
    return problems


def check_agreement(locks: list[ParsedLock]) -> list[str]:
    """Shared packages carry the same version and hashes in every lock."""
    problems = []
    for i, a in enumerate(locks):
        for b in locks[i + 1 :]:
            for name in sorted(set(a.entries) & set(b.entries)):
                ea, eb = a.entries[name], b.entries[name]
                pair = f"{a.path.name} and {b.path.name} disagree on {name}"
                if ea.version != eb.version:
                    problems.append(f"{pair}: {ea.version} vs {eb.version}")
                elif set(ea.hashes) != set(eb.hashes):
                    problems.append(f"{pair}=={ea.version}: different hash sets")
    return problems


def _applicable(paths: list[Path], environment: dict[str, str] | None) -> dict[str, set[str]]:
    """{name: allowed versions} of locks whose marker holds (here, or in ``environment``)."""
    locked: dict[str, set[str]] = {}
    for path in paths:
        for entry in parse_lock(path).entries.values():
            if marker_applies(entry.marker, environment) is not False:
                locked.setdefault(entry.name, set()).add(entry.version)
    return locked


def locked_versions(
    repo_root: Path, environment: dict[str, str] | None = None
) -> tuple[dict[str, set[str]], list[str]]:
    """{name: allowed versions} from the runtime and dev locks that exist, and their names."""
    used = [name for name, _ in DEFAULT_PAIRS if (Path(repo_root) / name).exists()]
    return _applicable([Path(repo_root) / name for name in used], environment), used


def installed_versions() -> dict[str, str]:
    """{normalised name: version} of what the interpreter would import (first on ``sys.path``)."""
    return {name: version for name, (_, version) in _installed().items()}


def pip_list() -> str:
    """What ``python -m pip list --format=freeze`` prints for this interpreter, without starting
    pip (a second a run): ``<Name>==<version>`` by normalised name. Not ``pip freeze``, which
    the archive runs (``tools/archive/pack.pip_freeze``): it shows editable installs by URL."""
    return "\n".join(f"{raw}=={version}" for _, (raw, version) in sorted(_installed().items()))


def _installed() -> dict[str, tuple[str, str]]:
    """{normalised name: (name as published, version)}, the first of each on ``sys.path``."""
    return dict(_installed_on(tuple(sys.path)))


@functools.lru_cache(maxsize=4)
def _installed_on(path: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """Read once per ``sys.path``: a run's start asks twice (the drift and collect_env's list)."""
    from importlib import metadata

    out: dict[str, tuple[str, str]] = {}
    for dist in metadata.distributions(path=list(path)):
        meta = dist.metadata  # parsed once: each access parses METADATA again
        if meta and meta["Name"]:
            out.setdefault(normalize_name(meta["Name"]), (meta["Name"], meta["Version"]))
    return out


def _same_version(a: str, b: str) -> bool:
    try:
        from packaging.version import Version

        return Version(a) == Version(b)
    except (ImportError, ValueError):  # no packaging, or not a version (InvalidVersion)
        return a == b


def project_name(repo_root: Path) -> str | None:
    """The project's own distribution: ``[project].name`` of its ``pyproject.toml``."""
    import tomllib

    try:
        data = tomllib.loads((Path(repo_root) / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    name = (data.get("project") or {}).get("name")
    return normalize_name(name) if isinstance(name, str) and name else None


def editable_source(name: str) -> str | None:
    """Where ``name`` is installed editable from (PEP 610 ``direct_url.json``), or None."""
    import json
    from importlib import metadata
    from urllib.parse import unquote, urlparse

    try:
        info = json.loads(metadata.distribution(name).read_text("direct_url.json") or "{}")
    except (metadata.PackageNotFoundError, ValueError):
        return None
    url = urlparse(info.get("url") or "")
    if url.scheme != "file" or not (info.get("dir_info") or {}).get("editable"):
        return None
    return unquote(url.path)


def compare_env(
    locked: dict[str, set[str]], installed: dict[str, str], project: str | None = None
) -> dict:
    """Pure comparison behind ``env_drift``; ``project`` (installed editable) is never drift.
    A local version label counts: ``2.14.1+cpu`` is not ``2.14.1``."""
    own = normalize_name(project) if project else None
    locked = {normalize_name(k): v for k, v in locked.items() if normalize_name(k) != own}
    installed = {normalize_name(k): v for k, v in installed.items() if normalize_name(k) != own}
    missing = sorted(set(locked) - set(installed))
    extra = sorted(n for n in set(installed) - set(locked) if n != INSTALLER)
    different = [
        {"name": n, "locked": sorted(locked[n])[0], "installed": installed[n]}
        for n in sorted(set(locked) & set(installed))
        if not any(_same_version(v, installed[n]) for v in locked[n])
    ]
    status = "drift" if (missing or extra or different) else "ok"
    return {"status": status, "missing": missing, "extra": extra, "different": different}


def env_drift(repo_root: Path) -> dict:
    """Installed distributions vs the locks, extras included (docs/reproducing-elsewhere.md)."""
    repo_root = Path(repo_root)
    locked, used = locked_versions(repo_root)
    if not used:
        return {"status": "no-lock", "missing": [], "extra": [], "different": [], "locks": []}
    installed = installed_versions()
    extras = [
        extra
        for extra, head in EXTRAS.items()
        if normalize_name(head) in installed and (repo_root / extra_pair(extra)[0]).is_file()
    ]
    for name, versions in _applicable([repo_root / extra_pair(e)[0] for e in extras], None).items():
        locked.setdefault(name, set()).update(versions)
    project = project_name(repo_root)
    source = editable_source(project) if project else None
    result = compare_env(locked, installed, project if source else None)
    result["locks"] = used + [extra_pair(e)[0] for e in extras]
    result["project"] = {"name": project, "editable_from": source}
    return result


def lock_sha256(repo_root: Path) -> str | None:
    """sha256 of ``requirements.lock`` bytes (the environment's identity in ``run.json``)."""
    path = Path(repo_root) / RUNTIME_LOCK
    return file_sha256(path) if path.is_file() else None
