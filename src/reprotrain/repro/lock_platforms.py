"""Which platforms the one lock installs on, checked offline from committed files.
Closes: a lock that only installs where it was compiled. A ``--hash`` names bytes, not a
platform, so ``make lock`` writes ``<lock>.files``; the supported platforms and the checks
are in docs/reproducing-elsewhere.md. Without ``packaging`` the coverage check reports nothing."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from reprotrain.repro.requirements_lock import (
    LockEntry,
    ParsedLock,
    marker_applies,
    normalize_name,
    read_sha256sum,
    sidecar_path,
)

FILES_SUFFIX = ".files"
#: Published only as an sdist and pure Python (hydra-core pins it): built at install time,
#: still hash-checked. The Dockerfile's ``--no-binary`` exception names the same set.
SDIST_ONLY = frozenset({"antlr4-python3-runtime"})
#: The interpreter the locks are compiled for (``uv pip compile --python-version``).
PYTHON = (3, 11)
#: Where ``make lock`` reads file names from (PEP 691 JSON, or PEP 503 HTML).
DEFAULT_INDEX = "https://pypi.org/simple"
_SDIST_EXTS = (".tar.gz", ".zip")
_LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


@dataclass(frozen=True)
class Platform:
    """One platform the locks promise to install on: its marker values and wheel tags."""

    name: str
    sys_platform: str
    platform_system: str
    platform_machine: str
    wheel_platforms: tuple[str, ...]  # most specific first, as pip orders them

    def marker_environment(self) -> dict[str, str]:
        """PEP 508 marker values as pip on this platform sees them (no host value leaks in)."""
        version = f"{PYTHON[0]}.{PYTHON[1]}"
        return {
            "implementation_name": "cpython",
            "implementation_version": f"{version}.4",
            "os_name": "posix",
            "platform_machine": self.platform_machine,
            "platform_python_implementation": "CPython",
            "platform_release": "",
            "platform_system": self.platform_system,
            "platform_version": "",
            "python_full_version": f"{version}.4",
            "python_version": version,
            "sys_platform": self.sys_platform,
        }

    def tags(self) -> frozenset[str]:
        """Every ``python-abi-platform`` tag pip accepts here, as strings."""
        from packaging import tags

        interpreter = f"cp{PYTHON[0]}{PYTHON[1]}"
        found = [
            *tags.cpython_tags(PYTHON, abis=[interpreter], platforms=self.wheel_platforms),
            *tags.compatible_tags(PYTHON, interpreter, self.wheel_platforms),
        ]
        return frozenset(str(t) for t in found)


def _manylinux(arch: str, glibc_minor: int = 28) -> tuple[str, ...]:
    out: list[str] = []
    for minor in range(glibc_minor, 4, -1):
        out.append(f"manylinux_2_{minor}_{arch}")
        if minor in _LEGACY_MANYLINUX:
            out.append(f"{_LEGACY_MANYLINUX[minor]}_{arch}")
    return tuple(out)


def _macos_arm64(major: int = 14) -> tuple[str, ...]:
    out: list[str] = []
    for version in range(major, 10, -1):
        out += [f"macosx_{version}_0_arm64", f"macosx_{version}_0_universal2"]
    out += [f"macosx_10_{minor}_universal2" for minor in range(16, 3, -1)]
    return tuple(out)


PLATFORMS: tuple[Platform, ...] = (
    Platform("linux-x86_64", "linux", "Linux", "x86_64", _manylinux("x86_64")),
    Platform("linux-aarch64", "linux", "Linux", "aarch64", _manylinux("aarch64")),
    Platform("macos-arm64", "darwin", "Darwin", "arm64", _macos_arm64()),
)


def read_files(lock_path: Path) -> dict[str, str] | None:
    """``{sha256: file name}`` from ``<lock>.files``; None when absent."""
    rows = read_sha256sum(sidecar_path(lock_path, FILES_SUFFIX), r"\S+")
    return None if rows is None else dict(rows)


def write_files(lock_path: Path, files: dict[str, str]) -> Path:
    """Write ``<lock>.files``, sorted by file name so a re-lock diffs line by line."""
    path = sidecar_path(lock_path, FILES_SUFFIX)
    lines = sorted(files.items(), key=lambda kv: (kv[1], kv[0]))
    path.write_text("".join(f"{h}  {name}\n" for h, name in lines), encoding="utf-8")
    return path


def _release_of(filename: str) -> tuple[str, str] | None:
    """(normalised name, version) of a wheel or sdist file name; None if it is neither."""
    if filename.endswith(".whl"):
        parts = filename[:-4].split("-")
        return (normalize_name(parts[0]), parts[1]) if len(parts) in (5, 6) else None
    for ext in _SDIST_EXTS:
        if filename.endswith(ext):
            name, _, version = filename[: -len(ext)].rpartition("-")
            return (normalize_name(name), version) if name else None
    return None


def _wheel_tags(filename: str) -> set[str]:
    """The expanded ``python-abi-platform`` tags of a wheel name (compressed sets split)."""
    py, abi, plat = filename[:-4].split("-")[-3:]
    return {f"{p}-{a}-{q}" for p in py.split(".") for a in abi.split(".") for q in plat.split(".")}


def check_files(lock: ParsedLock, files: dict[str, str] | None) -> list[str]:
    """Every hash of the lock names one file of its own release in ``<lock>.files``, which
    lists nothing else (coverage is judged from those names)."""
    name = lock.path.name
    side = sidecar_path(lock.path, FILES_SUFFIX).name
    if files is None:
        return [f"{name}: no {side} (the file behind each hash); run make lock"]
    problems: list[str] = []
    used: set[str] = set()
    for entry in lock.entries.values():
        for digest in entry.hashes:
            used.add(digest)
            if (filename := files.get(digest)) is None:
                problems.append(
                    f"{name}: {entry.name}=={entry.version} has a hash that {side} does not "
                    f"name ({digest[:12]}...); run make lock"
                )
            elif _release_of(filename) != (entry.name, entry.version):
                problems.append(
                    f"{side}: {filename} is not a file of {entry.name}=={entry.version}, "
                    "whose hash it carries; run make lock"
                )
    if extra := sorted(files[h] for h in set(files) - used):
        problems.append(
            f"{side} is stale: {len(extra)} file(s) whose hash {name} no longer holds "
            f"(first: {extra[0]}); run make lock"
        )
    return problems


def check_coverage(
    entries: Iterable[LockEntry], files: dict[str, str], platform: Platform, lock_name: str = "lock"
) -> list[str]:
    """One message per requirement that applies on ``platform`` but could not install there."""
    try:
        environment = platform.marker_environment()
        accepted = platform.tags()
    except ImportError:  # bare python3 before the venv exists
        return []
    where = f"{platform.name} (cp{PYTHON[0]}{PYTHON[1]})"
    problems: list[str] = []
    for entry in entries:
        if not marker_applies(entry.marker, environment):
            continue
        names = [files[h] for h in entry.hashes if h in files]
        if any(n.endswith(".whl") and _wheel_tags(n) & accepted for n in names):
            continue
        if entry.name in SDIST_ONLY and any(n.endswith(_SDIST_EXTS) for n in names):
            continue
        problems.append(
            f"{lock_name}: {entry.name}=={entry.version} applies on {where} but none of its "
            "hashes is a wheel for it"
            + ("" if entry.name in SDIST_ONLY else " (and it is not an allowed sdist-only package)")
        )
    return problems


def check_lock_platforms(lock: ParsedLock) -> list[str]:
    """``check_files`` and, when the sidecar is sound, ``check_coverage`` on every platform."""
    files = read_files(lock.path)
    problems = check_files(lock, files)
    if files is None:
        return problems
    for platform in PLATFORMS:
        problems += check_coverage(lock.entries.values(), files, platform, lock.path.name)
    return problems


def _index_page(url: str, timeout: float) -> dict[str, str]:
    """{sha256: file name} of one project page of a simple index (PEP 691 JSON or PEP 503)."""
    request = urllib.request.Request(
        url, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read().decode("utf-8")
        content_type = response.headers.get("Content-Type", "")
    if "json" in content_type:
        return {
            f["hashes"]["sha256"]: f["filename"]
            for f in json.loads(body)["files"]
            if "sha256" in f.get("hashes", {})
        }
    out = {}
    for href, filename in re.findall(r'href="([^"]+)"[^>]*>([^<]+)</a>', body):
        if m := re.search(r"#sha256=([0-9a-f]{64})", href):
            out[m.group(1)] = filename.strip()
    return out


def fetch_files(
    lock: ParsedLock,
    index_url: str = DEFAULT_INDEX,
    page: Callable[[str, float], dict[str, str]] = _index_page,
) -> dict[str, str]:
    """{sha256: file name} of every hash of ``lock`` from the index (``LookupError``: unlisted)."""
    out: dict[str, str] = {}
    for entry in lock.entries.values():
        listed = page(f"{index_url.rstrip('/')}/{entry.name}/", 60.0)  # timeout, seconds
        for digest in entry.hashes:
            if digest not in listed:
                raise LookupError(
                    f"{entry.name}=={entry.version}: hash {digest[:12]}... is not listed by "
                    f"{index_url}"
                )
            out[digest] = listed[digest]
    return out
