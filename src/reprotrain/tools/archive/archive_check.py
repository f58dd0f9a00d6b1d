"""Check an archive completely *before* anything is extracted, then extract it safely.

Closes: a member writing outside the target; a changed, missing or extra member; a malformed
record crashing the replay (each one line, exit 2). Records stay in memory from the hashing
pass, so trust and record checks run on verified bytes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import lzma
import os
import re
import shutil
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from omegaconf import DictConfig, OmegaConf

from reprotrain import safetar
from reprotrain.errors import RecordError, ReproduceRefused
from reprotrain.hashing import file_sha256
from reprotrain.run import schema as run_schema
from reprotrain.run.readers import completion_problem, parse_jsonl, parse_record, parse_yaml_config
from reprotrain.run.record import atomic_write_text
from reprotrain.shown import shown

MANIFEST = "MANIFEST.sha256"
SIGNATURE = MANIFEST + ".sig"
ARCHIVE_JSON = "archive.json"
#: Written by :func:`extract` into the top folder and every run directory it extracts: a
#: run from an archive is built only under a trust rule (``tools/reproduce/run_trust.py``).
MARKER = "from-archive.json"
#: Members read into memory during the hashing pass (all small, all data, never code).
RECORD_FILES = (
    "run/run.json",
    "run/config.resolved.yaml",
    "run/fingerprints.jsonl",
    "run/metrics.jsonl",
    "run/git.diff",
    ARCHIVE_JSON,
)
RECORD_LIMIT_BYTES = 64 << 20
DEFAULT_LIMITS = safetar.Limits()


def manifest_text(digests: dict[str, str]) -> str:
    """``sha256sum`` format, sorted by path: ``<sha256>  <path relative to the top dir>``."""
    return "".join(f"{digests[rel]}  {rel}\n" for rel in sorted(digests))


def file_digests(root: Path) -> dict[str, str]:
    """{path relative to ``root``: sha256} of every plain file under ``root`` (no links)."""
    return {
        p.relative_to(root).as_posix(): file_sha256(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def parse_manifest(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        m = re.fullmatch(r"([0-9a-f]{64}) [ *](.+)", line)
        if not m or m.group(2) in out:
            raise ValueError(f"{MANIFEST} line {n} is malformed or repeated: {line[:80]!r}")
        out[m.group(2)] = m.group(1)
    return out


@dataclass
class CheckedArchive:
    """A verified archive: its layout, manifest, signature and parsed record, in memory."""

    path: Path
    prefix: str  # "" for a ./-layout archive, else the top folder name
    top_name: str  # the folder it is extracted into
    members: dict[str, tarfile.TarInfo]  # rel path (under prefix) -> member; dirs included
    manifest: dict[str, str]
    manifest_bytes: bytes
    signature: bytes | None
    files: dict[str, bytes] = field(default_factory=dict)  # RECORD_FILES present
    record: dict[str, Any] = field(default_factory=dict)
    config: DictConfig | None = None
    fingerprints: list[dict] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    limits: safetar.Limits = field(default_factory=safetar.Limits)

    def label(self, rel: str) -> str:
        return f"{self.path.name}:{self.prefix + '/' if self.prefix else ''}{rel}"

    def text(self, rel: str) -> str:
        data = self.files.get(rel)
        if data is None:
            return ""
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RecordError(f"{self.label(rel)}: not UTF-8 text (byte {e.start})") from None

    def member(self, rel: str) -> bytes | None:
        """A member's bytes, checked again against the verified manifest; None if absent."""
        if rel not in self.manifest:
            return None
        member = self.members[rel]
        if member.size > RECORD_LIMIT_BYTES:
            raise ReproduceRefused(
                f"{self.label(rel)}: {member.size} bytes, too large for a record"
            )
        with safetar.open_tar(self.path, self.limits) as tar:
            data = tar.extractfile(tar.getmember(member.name)).read()
        if hashlib.sha256(data).hexdigest() != self.manifest[rel]:
            raise ReproduceRefused(f"manifest check failed: {self.label(rel)} changed on disk")
        return data

    @property
    def diff(self) -> str:
        return self.text("run/git.diff")

    @property
    def source_files(self) -> dict[str, str]:
        """{path under source/: sha256} from the (verified) manifest."""
        return {
            rel.removeprefix("source/"): sha
            for rel, sha in self.manifest.items()
            if rel.startswith("source/")
        }


def check_compression(archive: Path, limits: safetar.Limits = DEFAULT_LIMITS) -> None:
    """Read the stream to its end (checksum checked); refused past the limits as it inflates."""
    method = safetar.compression(archive).replace("none", "tar")
    try:
        with safetar.open_stream(archive, limits) as stream:
            while stream.read(1 << 20):
                pass
    except (OSError, EOFError, zlib.error, lzma.LZMAError) as e:
        raise ReproduceRefused(
            f"{archive}: corrupt {method} stream ({e}); nothing extracted"
        ) from None


def _parts(name: str) -> tuple[str, ...]:
    return PurePosixPath(name).parts  # "./a//b/" -> ("a", "b"); "." -> ()


def layout(members: list[tarfile.TarInfo]) -> tuple[str, dict[str, tarfile.TarInfo]]:
    """(prefix, {rel: member}) after refusing anything unsafe, ambiguous or duplicated."""
    if not members:
        raise ReproduceRefused("the archive is empty")
    for m in members:
        why = safetar.unsafe_reason(m)
        if why is not None:
            raise ReproduceRefused(f"unsafe member {m.name!r} ({why}); nothing extracted")
    manifests = [_parts(m.name) for m in members if _parts(m.name)[-1:] == (MANIFEST,)]
    shallow = [p for p in manifests if len(p) <= 2]
    if not shallow:
        raise ReproduceRefused(f"no {MANIFEST} at the top of the archive; not a reprotrain archive")
    if len(shallow) > 1:
        raise ReproduceRefused(
            f"{len(shallow)} {MANIFEST} files at the top of the archive "
            f"({', '.join('/'.join(p) for p in shallow)}); repack one run per archive"
        )
    prefix = shallow[0][:-1]
    kinds = {"/".join(_parts(m.name)): m.isdir() for m in members if _parts(m.name)}
    both = safetar.clash(kinds)
    if both is not None:
        raise ReproduceRefused(
            f"member {both!r} is a file and also a directory of other members; nothing extracted"
        )
    out: dict[str, tarfile.TarInfo] = {}
    for m in members:
        parts = _parts(m.name)
        if parts == prefix or not parts:
            if not m.isdir():
                why = "not a directory"
                raise ReproduceRefused(f"unsafe member {m.name!r} ({why}); nothing extracted")
            continue
        if parts[: len(prefix)] != prefix:
            top = prefix[0] if prefix else "."
            raise ReproduceRefused(
                f"unsafe member {m.name!r} (outside the top folder {top!r}); nothing extracted"
            )
        rel = "/".join(parts[len(prefix) :])
        if rel in out:
            raise ReproduceRefused(f"member {m.name!r} appears twice; nothing extracted")
        out[rel] = m
    return (prefix[0] if prefix else ""), out


def _top_name(archive: Path, prefix: str) -> str:
    if prefix:
        return prefix
    stem = re.sub(r"\.(tar\.gz|tgz|tar\.bz2|tar\.xz|tar)$", "", archive.name)
    return re.sub(r"[^\w.-]", "_", stem) or "archive"


def verify(archive: Path, limits: safetar.Limits = DEFAULT_LIMITS) -> CheckedArchive:
    """Every member hashes to its manifest line, none missing or extra; writes nothing."""
    archive = Path(archive)
    if not archive.exists():
        raise ReproduceRefused(f"{archive}: no such archive")
    if not archive.is_file():
        raise ReproduceRefused(f"{archive}: not a file (give the .tar.gz that make archive wrote)")
    try:
        check_compression(archive, limits)
        with safetar.open_tar(archive, limits) as tar:
            checked = _verify_open(archive, tar, limits)
    except safetar.ArchiveLimitError as e:
        raise ReproduceRefused(str(e)) from None
    except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError) as e:
        raise ReproduceRefused(f"{archive}: not a readable tar archive ({e})") from None
    checked.limits = limits
    return checked


def _verify_open(archive: Path, tar: tarfile.TarFile, limits: safetar.Limits) -> CheckedArchive:
    headers = safetar.read_members(tar, limits)
    safetar.check_sizes(headers, archive.stat().st_size, limits)
    prefix, members = layout(headers)
    files = {rel: m for rel, m in members.items() if m.isreg()}
    if MANIFEST not in files:
        raise ReproduceRefused(f"no {MANIFEST} in the archive; not a reprotrain archive")
    manifest_bytes = tar.extractfile(files.pop(MANIFEST)).read()
    try:
        expected = parse_manifest(manifest_bytes.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise ReproduceRefused(f"manifest check failed: {e}") from None
    signature = tar.extractfile(files.pop(SIGNATURE)).read() if SIGNATURE in files else None
    where = f"{prefix}/" if prefix else "./"
    missing, extra = sorted(set(expected) - set(files)), sorted(set(files) - set(expected))
    for rel in [*missing, *extra]:
        has, lacks = (MANIFEST, "the archive") if rel in expected else ("the archive", MANIFEST)
        why = f"{where}{rel} is in {has} but not in {lacks}"
        raise ReproduceRefused(f"manifest check failed: {why}")
    kept: dict[str, bytes] = {}
    budget = safetar.Budget(limits)
    for rel in sorted(files):
        h = hashlib.sha256()
        keep = rel in RECORD_FILES and files[rel].size <= RECORD_LIMIT_BYTES
        chunks = []
        for chunk in budget.stream(tar, files[rel]):
            h.update(chunk)
            if keep:
                chunks.append(chunk)
        if h.hexdigest() != expected[rel]:
            raise ReproduceRefused(
                f"manifest check failed: {where}{rel} sha256 {h.hexdigest()[:12]} != "
                f"recorded {expected[rel][:12]} (member changed)"
            )
        if keep:
            kept[rel] = b"".join(chunks)
    top = _top_name(archive, prefix)
    return CheckedArchive(archive, prefix, top, members, expected, manifest_bytes, signature, kept)


def check_record(checked: CheckedArchive) -> CheckedArchive:
    """Parse and sanity-check the run record in memory: exit 2 on anything malformed."""
    for rel in ("run/run.json", "run/config.resolved.yaml", "run/fingerprints.jsonl"):
        if rel not in checked.files:
            raise ReproduceRefused(
                f"{checked.label(rel)} is missing from the archive; not a complete run archive"
            )
    label = checked.label("run/run.json")
    record = parse_record(checked.text("run/run.json"), label, run_schema.REPLAY)
    cfg = parse_yaml_config(
        checked.text("run/config.resolved.yaml"), checked.label("run/config.resolved.yaml")
    )
    fp_label = checked.label("run/fingerprints.jsonl")
    fingerprints = parse_jsonl(checked.text("run/fingerprints.jsonl"), fp_label)
    for n, row in enumerate(fingerprints, start=1):
        if not (
            _is_int(row.get("epoch"))
            and isinstance(row.get("weights_sha256"), str)
            and isinstance(row.get("step_losses"), list)
        ):
            raise ReproduceRefused(
                f"{fp_label} line {n}: expected epoch, weights_sha256 and step_losses"
            )
    why = completion_problem(record, len(fingerprints))
    if why is not None:
        raise ReproduceRefused(f"{label} {why}: an inconsistent record is not replayed")
    check_config_identity(
        record, OmegaConf.to_container(cfg), checked.label("run/config.resolved.yaml")
    )
    metrics = parse_jsonl(checked.text("run/metrics.jsonl"), checked.label("run/metrics.jsonl"))
    if any(not _is_int(row.get("epoch")) for row in metrics):
        raise ReproduceRefused(f"{checked.label('run/metrics.jsonl')}: a row has no epoch")
    if not any(rel.startswith("source/src/") and rel.endswith(".py") for rel in checked.members):
        raise ReproduceRefused("the archive has no source snapshot (source/src/...)")
    checked.record, checked.config = record, cfg
    checked.fingerprints, checked.metrics = fingerprints, metrics
    return checked


def check_config_identity(record: dict, config: dict, label: str) -> None:
    """The archived config must hash to run.json's ``config_sha256`` (with ``extended_from``)."""
    from reprotrain.config import config_sha256

    recorded = record.get("config_sha256")
    if not isinstance(recorded, str):
        why = "run.json records no config_sha256 to check it against"
        raise ReproduceRefused(f"{label}: {why}; the record was edited or damaged; nothing was run")
    here = config_sha256(config, record.get("extended_from") or None)
    if here != recorded:
        raise ReproduceRefused(
            f"{label} hashes to config_sha256 {here[:12]}, but run.json records "
            f"{shown(recorded, 20)}: the archive contradicts itself (the config or the record "
            "was edited); nothing was run"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_extract_dir(dest: Path) -> Path:
    """``dest`` if an extraction may go there: a new or empty directory."""
    if dest.exists() and not dest.is_dir():
        raise ReproduceRefused(f"--extract-dir {dest}: {os.strerror(errno.ENOTDIR)}")
    if dest.exists() and any(dest.iterdir()):
        raise ReproduceRefused(f"--extract-dir {dest} is not empty")
    return dest


def extract(checked: CheckedArchive, dest: Path) -> Path:
    """Verified members under ``dest/<top_name>``, through tarfile's ``data`` filter too."""
    dest = check_extract_dir(Path(dest))
    created = [p for p in (dest, *dest.parents) if not p.exists()]
    dest.mkdir(parents=True, exist_ok=True)
    need = sum(m.size for m in checked.members.values())
    free = shutil.disk_usage(dest).free
    if need > free:
        _remove(dest, created)
        raise ReproduceRefused(
            f"extracting needs {safetar.human(need)} but {dest} has {safetar.human(free)} free; "
            "nothing extracted (free space, or give --extract-dir on a larger disk)"
        )
    root = dest / checked.top_name
    try:
        root.mkdir()
        _write_members(checked, dest, root)
        mark_extracted(root, checked.path)
    except BaseException as e:
        _remove(dest, created)
        if isinstance(e, tarfile.FilterError):
            raise ReproduceRefused(f"unsafe member ({e}); nothing extracted") from None
        if isinstance(e, safetar.ArchiveLimitError):
            raise ReproduceRefused(f"{e}; nothing extracted") from None
        if isinstance(e, OSError):
            where = e.filename or dest
            raise ReproduceRefused(
                f"extraction failed at {where}: {e.strerror}; nothing extracted"
            ) from None
        raise
    return root


def _write_members(checked: CheckedArchive, dest: Path, root: Path) -> None:
    budget = safetar.Budget(checked.limits)
    with safetar.open_tar(checked.path, checked.limits) as tar:
        by_name = {m.name: m for m in safetar.read_members(tar, checked.limits)}
        for rel in sorted(checked.members):
            member = by_name[checked.members[rel].name]
            tarfile.data_filter(member, str(dest))
            target = root / rel
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "xb") as out:
                for chunk in budget.stream(tar, member):
                    out.write(chunk)
            os.chmod(target, 0o755 if member.mode & 0o100 else 0o644)


def mark_extracted(top: Path, archive: Path) -> None:
    """:data:`MARKER` in the top folder and each run directory (replacing any archived one)."""
    text = json.dumps({"archive": str(archive), "built_only_under_a_trust_rule": True}) + "\n"
    for folder in [top, *sorted(r.parent for r in top.rglob("run.json"))]:
        atomic_write_text(folder / MARKER, text)


def _remove(dest: Path, created: list[Path]) -> None:
    """Undo an extraction: everything under ``dest``, and the folders made for it."""
    for child in [dest] if dest in created else dest.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
    for p in created[1:]:
        with contextlib.suppress(OSError):
            p.rmdir()
