"""``make resume RUN=<run dir>``: continue an interrupted run in place, with its own config.

    python -m reprotrain.tools.runs.resume <run dir> [overrides...]

A sweep directory continues the sweep instead (its killed jobs resume, those never started
start: ``tools/sweeps/continuation.py``; an Optuna study continues its study). Either runs
only under the trust gate's Permit for everything it will run. docs/resume.md.

Exit codes: the trainer's (0 completed, 2 refused, 75 interrupted again, ...); 2 when the
run directory is missing or its record unreadable.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from reprotrain.errors import RecordError, ReprotrainError
from reprotrain.launchers import run_forwarding_signals, trainer_launcher  # noqa: F401 (verify, bisect)
from reprotrain.quoting import hydra_override
from reprotrain.run.directory import sweep_jobs
from reprotrain.run.mutex import refuse_if_held
from reprotrain.run.readers import read_config, read_run_json, read_text
from reprotrain.run.record import RESOLVED_CONFIG, RUN_JSON
from reprotrain.tools import cli
from reprotrain.tools.reproduce import run_trust
from reprotrain.tools.sweeps import continuation

PRIMARY = "resume.yaml"


def check_run_dir(run_dir: Path) -> None:
    """One line for every way a run directory can be unusable, before anything runs."""
    if not run_dir.exists():
        raise RecordError(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise RecordError(f"{run_dir}: not a directory (give the run directory, not a file)")
    if not (run_dir / RUN_JSON).is_file() or not (run_dir / RESOLVED_CONFIG).is_file():
        raise RecordError(
            f"{run_dir} is not a reprotrain run directory (no {RUN_JSON} or {RESOLVED_CONFIG})"
        )
    read_run_json(run_dir)
    read_config(run_dir / RESOLVED_CONFIG)


def recorded_world_size(record: dict, run_dir: Path) -> int:
    """run.json's world size, checked against its own list of ranks (one line if edited)."""
    size = record.get("world_size", 1)
    if size is None:
        return 1
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise RecordError(
            f"{run_dir / RUN_JSON}: world_size {size!r} is not a positive integer; the record "
            "is damaged (restore it, or give --nproc N)"
        )
    ranks = record.get("ranks")
    if isinstance(ranks, list) and ranks and len(ranks) != size:
        raise RecordError(
            f"{run_dir / RUN_JSON}: world_size {size} but {len(ranks)} rank(s) recorded under "
            "ranks; the record is inconsistent (restore it, or give --nproc N)"
        )
    return size


def check_nproc(nproc: int, recorded: int, overrides: list[str], record: dict) -> None:
    """Refuse in one line what every rank would refuse under torchrun."""
    if nproc < 1:
        raise RecordError(f"--nproc {nproc}: give at least 1 process")
    if record.get("world_size_invariant") is True:
        k = record.get("microbatches_per_step")
        if isinstance(k, int) and k % nproc:
            raise RecordError(
                f"--nproc {nproc} does not divide the run's {k} micro-batches per step; an "
                f"invariant run resumes on a world size dividing {k}"
            )
        return
    allowed = any(o.replace(" ", "") == "trainer.allow_world_size_change=true" for o in overrides)
    if nproc != recorded and not allowed:
        raise RecordError(
            f"the run was recorded with world size {recorded}, this resume has {nproc}; resume "
            f"with NPROC={recorded}, or pass trainer.allow_world_size_change=true (recorded as "
            "not bitwise)"
        )


def wired(config_text: str, tool: str = "make resume") -> str:
    """A recorded config under the wiring conf/train.yaml adds (same ``imported_code``)."""
    head = f"# Written by `{tool}`: the recorded config under the reprotrain wiring.\n"
    return head + "defaults:\n  - reprotrain\n  - _self_\n\n" + config_text


def primary_config_text(run_dir: Path) -> str:
    """The run's own recorded config, wired: what ``make resume`` and ``make bisect`` run."""
    return wired(read_text(run_dir / RESOLVED_CONFIG))


def resume_command(
    run_dir: Path, config_dir: Path, overrides: list[str], nproc: int = 1
) -> list[str]:
    """The trainer's command; under torchrun with ``nproc`` ranks when the run was DDP."""
    return [
        *trainer_launcher(nproc),
        f"--config-path={config_dir}",
        f"--config-name={PRIMARY.removesuffix('.yaml')}",
        hydra_override("hydra.run.dir", run_dir),
        "hydra.output_subdir=null",  # keep the original .hydra/ record untouched
        *([] if any(o.startswith("resume=") for o in overrides) else ["resume=auto"]),
        *overrides,
    ]


def refuse_group_choices(overrides: list[str]) -> None:
    """A config group choice (``model=<name>``) has no group to choose in a resume: one line."""
    from reprotrain import CONF_DIR

    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    for o in overrides:
        key, eq, value = o.lstrip("+~").partition("=")
        if eq and key in groups:
            raise ReprotrainError(
                f"{o}: a resume continues the recorded config and cannot choose another "
                f"{key} group; override a value instead ({key}.<key>=...), or start a new run "
                f"with {key}={value}"
            )


@cli.entry_point
def main(argv: list[str] | None = None) -> int:
    p = cli.parser("reprotrain.tools.runs.resume", __doc__)
    p.add_argument("run_dir", type=cli.user_path, help="the run directory to continue")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides (e.g. trainer.epochs=5)")
    nproc = "processes (default: the recorded world size)"
    p.add_argument("--nproc", type=int, default=None, help=nproc)
    run_trust.add_arguments(p)
    args = p.parse_intermixed_args(argv)  # --nproc may come after the overrides
    refuse_group_choices(args.overrides)
    run_dir = args.run_dir.expanduser().resolve()
    # The resume composes the run's own config (a sweep: its recorded overrides): a directory
    # from an archive runs only under the gate's Permit, decided before anything of it is
    # read, imported or launched.
    permit = run_trust.require_trust([run_dir], args.trust, args.trusted_signers)
    env = {"PYTHONHASHSEED": "0", **os.environ}
    if continuation.is_sweep_dir(run_dir):  # a killed sweep or Optuna study: continue it
        for job in sweep_jobs(run_dir):
            refuse_if_held(job)  # a live job owns its run: start nothing
        return permit.launch(continuation.continue_command(run_dir, args.overrides), env)
    check_run_dir(run_dir)
    refuse_if_held(run_dir)  # a live run owns it: touch nothing
    record = read_run_json(run_dir)
    recorded = recorded_world_size(record, run_dir)
    nproc = recorded if args.nproc is None else args.nproc
    check_nproc(nproc, recorded, args.overrides, record)
    with tempfile.TemporaryDirectory(
        prefix="reprotrain-resume-", ignore_cleanup_errors=True
    ) as tmp:
        (Path(tmp) / PRIMARY).write_text(primary_config_text(run_dir))
        return permit.launch(resume_command(run_dir, Path(tmp), args.overrides, nproc), env)


if __name__ == "__main__":
    sys.exit(main())
