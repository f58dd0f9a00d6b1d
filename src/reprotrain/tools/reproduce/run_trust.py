"""The trust decision for a run directory that came from an archive, before it is built.

Closes: ``eval`` and ``bisect`` building an extracted run's ``_target_`` s untrusted. A path
under :data:`MARKER` (or an archive's top folder) is built only under reproduce's rules
(a)/(b)/(c), named on stderr; otherwise one line, nothing built. docs/guarantees.md.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable
from pathlib import Path

from reprotrain.errors import RecordError, SigningError, UntrustedArchive
from reprotrain.shown import shown
from reprotrain.tools.archive.archive_check import (
    ARCHIVE_JSON,
    MANIFEST,
    MARKER,
    SIGNATURE,
    parse_manifest,
)

#: Folders above a path that are searched (a checkpoint in <top>/sweep/<job>/checkpoints/).
_LEVELS = 6
#: Run directories of one sweep looked at, at most (each config is read and checked).
MAX_RUNS = 10_000
HOW = (
    "review the archive and pass TRUST=1 (--trust), or check a signed archive with "
    "TRUSTED_SIGNERS=<allowed signers file> (--trusted-signers)"
)


def archive_folder(path: Path) -> Path | None:
    """The folder that says ``path`` came from an archive, or None for this machine's own run."""
    here = Path(path).resolve()
    for folder in [here, *here.parents][:_LEVELS]:
        if (folder / MARKER).is_file():
            return folder
        if (folder / MANIFEST).is_file() and (folder / ARCHIVE_JSON).is_file():
            return folder
    return None


def _archive_top(folder: Path) -> Path:
    """The archive's top folder (the one with the manifest) at or above ``folder``."""
    for top in [folder, *folder.parents][:_LEVELS]:
        if (top / MANIFEST).is_file():
            return top
    return folder


def run_dirs(path: Path) -> list[Path]:
    """The run directories a path stands for: the run holding it, or every run of a sweep."""
    here = Path(path).resolve()
    for folder in [here, *here.parents][:_LEVELS]:
        if (folder / "run.json").is_file():
            return [folder]
    found = []
    if here.is_dir():
        for record in here.rglob("run.json"):
            found.append(record.parent)
            if len(found) >= MAX_RUNS:
                break
    return sorted(found)


def _config(run: Path) -> dict:
    from omegaconf import OmegaConf

    from reprotrain.run.readers import parse_yaml_config

    path = run / "config.resolved.yaml"
    try:
        cfg = parse_yaml_config(path.read_text(encoding="utf-8"), str(path))
    except (OSError, UnicodeDecodeError) as e:
        raise RecordError(f"{path}: cannot be read ({e})") from None
    raw = OmegaConf.to_container(cfg, resolve=False)
    return raw if isinstance(raw, dict) else {}


def this_checkouts_configs(runs: list[Path]) -> str | None:
    """Rule (a): None when this checkout's conf/ could compose every config; else why not."""
    from reprotrain import REPO_ROOT
    from reprotrain.tools.reproduce import config_trust

    targets = config_trust.conf_targets(*config_trust.trusted_conf_dirs(REPO_ROOT))
    for run in runs:
        found = config_trust.problems(_config(run), targets, "HEAD here")
        if found:
            return f"{shown(run.name, 60)}/config.resolved.yaml: {found[0]}"
    return None


def signed(top: Path, runs: list[Path], trusted_signers: Path) -> str:
    """Rule (b): the signer's line when signature and listed files hold; else SigningError."""
    from reprotrain.tools.archive import signing

    manifest, sig = top / MANIFEST, top / SIGNATURE
    if not sig.is_file():
        raise SigningError(f"{top} is not signed ({sig.name} missing)")
    data = manifest.read_bytes()
    good = signing.verify_bytes(data, sig.read_bytes(), trusted_signers)
    listed = parse_manifest(data.decode("utf-8"))
    for run in runs:
        for name in ("run.json", "config.resolved.yaml"):
            rel = (run / name).relative_to(top).as_posix()
            if rel not in listed:
                raise SigningError(f"{rel} is not in the signed manifest")
    for rel, digest in listed.items():
        path = top / rel
        if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise SigningError(f"{rel} changed since the archive was signed")
    return f"signed by {good.principal}, trusted in {trusted_signers}"


def decide(path: Path, trust: bool = False, trusted_signers: Path | None = None) -> str | None:
    """None for this machine's own run; the trust line for an archive's; else UntrustedArchive."""
    folder = archive_folder(path)
    if folder is None:
        return None
    runs = run_dirs(path)
    problem = this_checkouts_configs(runs)
    if problem is None:
        return f"(a) {len(runs)} run config(s) from an archive name only this checkout's callables"
    notes = [f"(a) no: {problem}"]
    if trusted_signers is not None:
        try:
            return "(b) " + signed(_archive_top(folder), runs, Path(trusted_signers))
        except (SigningError, OSError, UnicodeDecodeError, ValueError) as e:
            notes.append(f"(b) no: {e}")
    if trust:
        return "(c) TRUST=1: built unchecked [" + "; ".join(notes) + "]"
    raise UntrustedArchive(
        f"refusing to build {shown(path, 200)}: it came from an archive ({folder}) and no "
        f"trust rule holds: {'; '.join(notes)}. To proceed: {HOW}"
    )


def require_trust(
    paths: Iterable[Path], trust: bool = False, trusted_signers: Path | None = None
) -> None:
    """:func:`decide` for every path that exists; each trust line on stderr."""
    for path in paths:
        if Path(path).exists():
            line = decide(Path(path), trust, trusted_signers)
            if line is not None:
                print(f"trust    {shown(path, 200)}: {line}", file=sys.stderr, flush=True)


def add_arguments(parser) -> None:
    """``--trust`` and ``--trusted-signers`` for a command that builds from a run directory."""
    anyway = "build a run from an archive even if no other trust rule holds"
    parser.add_argument("--trust", action="store_true", help=anyway)
    signers = "OpenSSH allowed-signers file (a signed archive's runs)"
    parser.add_argument("--trusted-signers", type=Path, metavar="FILE", help=signers)


def pop_arguments(argv: list[str]) -> tuple[bool, Path | None, list[str]]:
    """(``--trust``, ``--trusted-signers`` file, the other arguments) for a foreign parser."""
    trust, signers, rest = False, None, []
    it = iter(argv)
    for arg in it:
        if arg == "--trust":
            trust = True
        elif arg == "--trusted-signers":
            signers = Path(next(it, "")).expanduser()
        elif arg.startswith("--trusted-signers="):
            signers = Path(arg.partition("=")[2]).expanduser()
        else:
            rest.append(arg)
    return trust, signers, rest


def paths_in(argv: list[str]) -> list[Path]:
    """The arguments naming an existing file or folder (``key=<path>`` too): what may be built."""
    out = []
    for arg in argv:
        for text in (arg, arg.partition("=")[2]):
            if text and not text.startswith("-") and Path(text).expanduser().exists():
                out.append(Path(text).expanduser())
                break
    return out
