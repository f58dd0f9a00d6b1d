"""The one trust gate: whether what a directory holds may run here, decided once, as one value.

Closes: each command deciding for itself, and so each new door (a continued sweep re-running
an archive's recorded overrides) deciding on less than what runs. Everything that composes,
instantiates or re-launches a config or overrides read from disk (a run, a sweep, an Optuna
study; extracted, copied or local) gets a :class:`Permit` here, and only here: from
:func:`decide` (a run or sweep directory: each run's config and every override a sweep
recorded) or :func:`admit_plan` (``make reproduce``'s whole replay plan). What launches takes
the Permit (:meth:`Permit.launch`, ``rerun.rerun_job``); nothing else makes one. A directory
from an archive runs only under rule (a) (this checkout's callables, never one that starts a
process), (b) (a trusted signature) or (c) (``TRUST=1``); else one line, nothing built.
docs/guarantees.md.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from reprotrain.errors import RecordError, SigningError, UntrustedArchive
from reprotrain.shown import shown
from reprotrain.tools.archive.archive_check import ARCHIVE_JSON, MANIFEST, MARKER, SIGNATURE
from reprotrain.tools.cli import pop_option

if TYPE_CHECKING:
    from reprotrain.tools.reproduce.replay_plan import ReplayPlan

_GATE = object()  # the key only this module holds: a Permit is made nowhere else
#: The rules, from the one that needs no decision to the one that checks nothing.
RULES = ("own", "a", "b", "c")


@dataclass(frozen=True)
class Permit:
    """The gate's decision on everything a directory (or a replay plan) will run: the rule
    that holds (``own``: this machine's own run; ``a``, ``b``, ``c``) and why."""

    rule: str
    detail: str
    key: InitVar[object] = None

    def __post_init__(self, key: object) -> None:
        if key is not _GATE:
            raise TypeError("a Permit is made only by the trust gate (tools/reproduce/run_trust)")

    def line(self) -> str:
        return f"({self.rule}) {self.detail}"

    def launch(self, cmd: list[str], env: dict[str, str]) -> int:
        """The trainer (``cmd``) run under this decision, stop signals forwarded."""
        from reprotrain.launchers import run_forwarding_signals

        return run_forwarding_signals(cmd, env)


def permitted(permit: Permit) -> Permit:
    """``permit``, checked to be the gate's: what every launcher from a directory calls first."""
    if not isinstance(permit, Permit):
        raise TypeError(f"{type(permit).__name__} is not the trust gate's Permit")
    return permit


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


def sweep_records(path: Path) -> list[Path]:
    """The sweep directories a path stands for: every one at or below it (``multirun.yaml``)."""
    from reprotrain.sweep_checks import SWEEP_RECORD

    here = Path(path).resolve()
    if not here.is_dir():
        return []
    found = [here] if (here / SWEEP_RECORD).is_file() else []
    for record in here.rglob(SWEEP_RECORD):
        if record.parent != here and len(found) < MAX_RUNS:
            found.append(record.parent)
    return sorted(found)


def recorded_overrides(sweep_dir: Path) -> list[str]:
    """Every override a sweep recorded (Hydra's and the task's): what a continuation re-runs.
    Read within bounds (``read_sweep_record``): a hostile record is one line, never a stall."""
    from omegaconf import OmegaConf

    from reprotrain.run.readers import read_sweep_record

    saved = read_sweep_record(sweep_dir)
    if saved is None:
        return []
    found = []
    for part in ("hydra", "task"):
        lines = OmegaConf.select(saved, f"hydra.overrides.{part}", default=None) or []
        found += [str(line) for line in lines]
    params = OmegaConf.select(saved, "hydra.sweeper.params", default=None) or {}
    return found + [f"hydra.sweeper.params.{k}={v}" for k, v in params.items()]


def this_checkouts_configs(runs: list[Path], sweeps: list[Path] = ()) -> str | None:
    """Rule (a): None when this checkout's conf/ could compose every config and every
    recorded override would set no callable, hook, command or search path; else why not."""
    from reprotrain import REPO_ROOT
    from reprotrain.tools.reproduce import config_trust

    for sweep in sweeps:
        found = config_trust.override_problems(recorded_overrides(sweep))
        if found:
            return f"{shown(sweep.name, 60)}/multirun.yaml: {found[0]}"
    rule = config_trust.Rule.of(REPO_ROOT) if runs else None
    for run in runs:
        found = rule.problems(_config(run), "HEAD here")
        if found:
            return f"{shown(run.name, 60)}/config.resolved.yaml: {found[0]}"
    return None


def signed(top: Path, runs: list[Path], trusted_signers: Path) -> str:
    """Rule (b): the signer's line when signature and listed files hold; else SigningError."""
    from reprotrain.tools.archive import archive_check, signing

    manifest, sig = top / MANIFEST, top / SIGNATURE
    if not sig.is_file():
        raise SigningError(f"{top} is not signed ({sig.name} missing)")
    data = manifest.read_bytes()
    good = signing.verify_bytes(data, sig.read_bytes(), trusted_signers)
    listed = archive_check.parse_manifest(data.decode("utf-8"))
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


def decide(path: Path, trust: bool = False, trusted_signers: Path | None = None) -> Permit:
    """The gate for a run or sweep directory: what it holds that will run (each run's config,
    every override a sweep recorded), judged whole; a Permit, or UntrustedArchive."""
    folder = archive_folder(path)
    if folder is None:
        return Permit("own", "this machine's own run, not from an archive", _GATE)
    runs, sweeps = run_dirs(path), sweep_records(path)
    problem = this_checkouts_configs(runs, sweeps)
    if problem is None:
        what = f"{len(runs)} run config(s) and {len(sweeps)} sweep record(s) from an archive"
        return Permit("a", f"{what} name only this checkout's callables", _GATE)
    notes = [f"(a) no: {problem}"]
    if trusted_signers is not None:
        try:
            return Permit("b", signed(_archive_top(folder), runs, Path(trusted_signers)), _GATE)
        except (SigningError, OSError, UnicodeDecodeError, ValueError) as e:
            notes.append(f"(b) no: {e}")
    if trust:
        return Permit("c", "TRUST=1: built unchecked [" + "; ".join(notes) + "]", _GATE)
    raise UntrustedArchive(
        f"refusing to build {shown(path, 200)}: it came from an archive ({folder}) and no "
        f"trust rule holds: {'; '.join(notes)}. To proceed: {HOW}"
    )


def admit_plan(
    plan: ReplayPlan, repo: Path, trusted_signers: Path | None = None, trust: bool = False
) -> Permit:
    """The gate for ``make reproduce``: the first rule that holds for the whole replay plan,
    before anything of the archive is extracted (``trust.py`` gathers the evidence)."""
    from reprotrain.tools.archive import signing
    from reprotrain.tools.reproduce.trust import same_code_here

    ok, why = same_code_here(plan, repo)
    checked = plan.jobs[0].view
    if ok:
        return Permit("a", why.removeprefix("(a) "), _GATE)
    notes = [why]
    if checked.signature is not None and trusted_signers is not None:
        try:
            good = signing.verify_bytes(checked.manifest_bytes, checked.signature, trusted_signers)
            signer = f"signed by {good.principal}, trusted in {trusted_signers}"
            return Permit("b", f"{signer}: {good.message}", _GATE)
        except SigningError as e:
            notes.append(f"(b) no: {e}")
    elif trusted_signers is not None:
        notes.append("(b) no: the archive is not signed")
    elif checked.signature is not None:
        notes.append("(b) not checked: the archive is signed but no TRUSTED_SIGNERS was given")
    else:
        notes.append("(b) no: not signed")
    if trust:
        detail = "TRUST=1: the archive's code runs unchecked [" + "; ".join(notes) + "]"
        return Permit("c", detail, _GATE)
    raise UntrustedArchive(
        "refusing to run the archive's code (nothing extracted): "
        + "; ".join(notes)
        + f". To proceed: {HOW}"
    )


def require_trust(
    paths: Iterable[Path], trust: bool = False, trusted_signers: Path | None = None
) -> Permit:
    """:func:`decide` for every path that exists, each archive's trust line on stderr; the
    Permit for them all (the strictest rule that held)."""
    permits = [Permit("own", "nothing from an archive", _GATE)]
    for path in paths:
        if Path(path).exists():
            permit = decide(Path(path), trust, trusted_signers)
            if permit.rule != "own":
                print(f"trust    {shown(path, 200)}: {permit.line()}", file=sys.stderr, flush=True)
            permits.append(permit)
    return max(permits, key=lambda p: RULES.index(p.rule))


def add_arguments(parser) -> None:
    """``--trust`` and ``--trusted-signers`` for a command that builds from a run directory."""
    anyway = "build a run from an archive even if no other trust rule holds"
    parser.add_argument("--trust", action="store_true", help=anyway)
    signers = "OpenSSH allowed-signers file (a signed archive's runs)"
    parser.add_argument("--trusted-signers", type=Path, metavar="FILE", help=signers)


def pop_arguments(argv: list[str]) -> tuple[bool, Path | None, list[str]]:
    """(``--trust``, ``--trusted-signers`` file, the other arguments) for a foreign parser."""
    signers, rest = pop_option(argv, "--trusted-signers", None)
    trusted = None if signers is None else Path(signers).expanduser()
    return "--trust" in rest, trusted, [arg for arg in rest if arg != "--trust"]


def paths_in(argv: list[str]) -> list[Path]:
    """The arguments naming an existing file or folder (``key=<path>`` too): what may be built."""
    out = []
    for arg in argv:
        for text in (arg, arg.partition("=")[2]):
            if text and not text.startswith("-") and Path(text).expanduser().exists():
                out.append(Path(text).expanduser())
                break
    return out
