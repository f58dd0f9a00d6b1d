"""A run directory is written once; so is a sweep directory (docs/run-directory.md).
Closes: a fresh run replacing the records of one already in its directory, and a second
sweep into one ``hydra.sweep.dir``. Checked before Hydra starts (``preflight``) and again by
the trainer once it holds the directory's lock."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from reprotrain.errors import RecordError, ResumeError
from reprotrain.quoting import resume_hint
from reprotrain.run.record import CHECKPOINTS, RUN_FILES, RUN_JSON, parse_json_object
from reprotrain.shown import shown

SWEEP_RECORD = "multirun.yaml"  # Hydra writes it into the sweep dir when a sweep starts


class RunDirUsed(ResumeError):
    """The directory already holds a run (or a sweep); nothing was written."""


def _status(run_dir: Path) -> str:
    try:
        return str(parse_json_object((run_dir / RUN_JSON).read_text(), RUN_JSON).get("status"))
    except (OSError, ValueError, RecordError):
        return "unreadable"


def refuse_reuse(run_dir: Path, resume: str | None) -> None:
    """Refuse a run that would start a new record in a directory that holds one."""
    run_dir = Path(run_dir)
    if not (run_dir / RUN_JSON).is_file():
        refuse_orphan_checkpoints(run_dir)
        refuse_stray_run_files(run_dir)
        return
    if resume == "auto":
        return
    if resume is not None:
        if Path(str(resume)).expanduser().resolve().parent == (run_dir / CHECKPOINTS).resolve():
            return  # its own checkpoint: a resume, not a new record
        raise RunDirUsed(
            f"{run_dir} already holds a run ({RUN_JSON}, status {_status(run_dir)}); a fork "
            f"from resume={resume} goes into a new directory: add hydra.run.dir=<new dir>"
        )
    raise RunDirUsed(
        f"{run_dir} already holds a run ({RUN_JSON}, status {_status(run_dir)}) and a run "
        f"directory is written once: continue it with `{resume_hint(run_dir)}`, fork it with "
        "resume=<its checkpoint> hydra.run.dir=<new dir>, or choose another hydra.run.dir"
    )


def refuse_unmade(path: Path, key: str = "hydra.run.dir") -> None:
    """Refuse a non-empty directory that holds no ``run.json``: another Hydra app's output
    (its ``.hydra/``, a log) or any folder of the user's. Checked before Hydra starts, since
    Hydra's first act is to write there (a used sweep dir is refused before this)."""
    try:
        held = sorted(p.name for p in Path(path).iterdir())
    except OSError:  # absent (made fresh), or no directory: check_creatable names that
        return
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's ranks start Hydra at once: a sibling
        # rank's own .hydra/ and log may already be there (the torchrun agent checked none)
        held = [n for n in held if n != ".hydra" and not n.endswith(".log")]
    if held and RUN_JSON not in held:
        names = ", ".join(shown(n, 40) for n in held[:3]) + (", ..." if len(held) > 3 else "")
        raise RunDirUsed(
            f"{key}={shown(path)} is not empty ({names}) and holds no reprotrain record "
            f"({RUN_JSON}); reprotrain writes only into a directory it made, and touched "
            "nothing there: choose a new or empty directory (a run killed before it recorded "
            "anything leaves only .hydra/ and its log: remove them to start it again)"
        )


def refuse_orphan_checkpoints(run_dir: Path) -> None:
    """Refuse any start where ``checkpoints/`` holds files but there is no ``run.json``."""
    try:
        held = sorted(p.name for p in (Path(run_dir) / CHECKPOINTS).iterdir())
    except OSError:  # no checkpoints/ (or not a directory): nothing to protect
        return
    if held:
        raise RunDirUsed(
            f"{run_dir} holds {len(held)} checkpoint file(s) ({held[0]}, ...) but no {RUN_JSON}; "
            "a run never starts over checkpoints it did not record: choose another "
            "hydra.run.dir (fork one of them there with resume=<path to a checkpoint>)"
        )


def refuse_stray_run_files(run_dir: Path) -> None:
    """Refuse any start where a run's files (``RUN_FILES``) lie but no ``run.json``."""
    if held := [name for name in RUN_FILES if os.path.lexists(Path(run_dir) / name)]:
        raise RunDirUsed(
            f"{run_dir} holds {', '.join(held)} but no {RUN_JSON}; a run never starts over "
            "another run's files: choose another hydra.run.dir (or move those files away)"
        )


def claim_sweep_dir(sweep_dir: Path) -> None:
    """Create ``sweep_dir/multirun.yaml`` exclusively, or refuse: of two sweeps started at
    once only one proceeds. Call after every other check (a later refusal leaves it used)."""
    sweep_dir = Path(sweep_dir)
    refuse_used_sweep_dir(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(sweep_dir / SWEEP_RECORD, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise RunDirUsed(
            f"hydra.sweep.dir={sweep_dir} was just claimed by another sweep started at the "
            "same time; choose another hydra.sweep.dir (or leave it at its default)"
        ) from None
    try:
        who = f"{socket.gethostname()} pid {os.getpid()}"
        note = f"# claimed by {who}; Hydra writes the sweep's config here when it starts\n"
        os.write(fd, note.encode())
    finally:
        os.close(fd)


def sweep_jobs(sweep_dir: Path) -> list[Path]:
    """The run directories of a sweep, sorted: each one below ``sweep_dir`` holding a
    ``run.json``, never one inside a run directory (W&B keeps a copy of the record there).
    The one discovery of a sweep's runs."""
    sweep_dir, jobs = Path(sweep_dir), []
    for root, dirs, files in os.walk(sweep_dir):
        if RUN_JSON in files:
            jobs.append(Path(root))
            dirs.clear()  # nothing below a run directory is another run
    return sorted(jobs)


def refuse_used_sweep_dir(sweep_dir: Path) -> None:
    """Refuse a sweep into a directory that already holds a sweep or any run."""
    sweep_dir = Path(sweep_dir)
    runs = sweep_jobs(sweep_dir)  # none, like the record, where no directory is
    if runs or (sweep_dir / SWEEP_RECORD).exists():
        held = f"{len(runs)} run(s)" if runs else f"a {SWEEP_RECORD}"
        raise RunDirUsed(
            f"hydra.sweep.dir={sweep_dir} already holds a sweep ({held}); a sweep never "
            "overwrites one: choose another hydra.sweep.dir (or leave it at its default), or "
            "continue a single run with make resume RUN=<its dir>"
        )
