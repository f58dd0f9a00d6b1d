"""``make verify``: run one config twice in fresh processes and demand identical bits.

    python -m reprotrain.tools.runs.verify [--out-dir outputs/verify] [--nproc N] [--nproc-b M]
                                      [--kill] experiment=smoke ...

Exit 0 only when fingerprints, final weights and the newest checkpoints' state match; 1 with
the first divergent epoch and the ``make bisect`` line; 2 when a run was refused or failed.
docs/make-targets.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from reprotrain.errors import ReprotrainError
from reprotrain.quoting import hydra_override
from reprotrain.repro import checkpoint
from reprotrain.resume.replay import first_difference
from reprotrain.run.readers import read_run_json
from reprotrain.run.record import CHECKPOINTS, RUN_JSON
from reprotrain.shown import say
from reprotrain.tools import cli
from reprotrain.tools.debugging.bisect import bisect_command
from reprotrain.tools.runs import run_diff
from reprotrain.tools.runs.resume import trainer_launcher
from reprotrain.tools.runs.run_diff import Comparison, compare_runs, with_metrics

_OWN = ("hydra.run.dir=", "hydra.sweep.dir=", "hydra.mode=")


def check_overrides(overrides: list[str]) -> None:
    for o in overrides:
        if o.lstrip("+~").startswith(_OWN):
            raise ReprotrainError(
                f"verify chooses the run directories itself; drop {o.split('=', 1)[0]} "
                "(use --out-dir to choose where they go)"
            )
        if o in ("-m", "--multirun"):
            raise ReprotrainError("verify runs one config twice; --multirun is not supported")


def run_once(overrides: list[str], run_dir: Path, nproc: int = 1) -> tuple[int, str | None]:
    cmd = [*trainer_launcher(nproc), *overrides, hydra_override("hydra.run.dir", run_dir)]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    return cli.run_forwarding_errors(cmd, env=_env())


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONHASHSEED": "0"}


def run_killed_then_resumed(
    overrides: list[str],
    run_dir: Path,
    nproc: int = 1,
    poll_s: float = 0.02,
    after_steps: tuple[int, ...] = (0,),
) -> tuple[int, str | None]:
    """Run b, SIGKILLed and resumed past each of ``after_steps``; ending before a kill: an error."""
    resume = [sys.executable, "-m", "reprotrain.tools.runs.resume", str(run_dir)]
    resume += ["--nproc", str(nproc)]
    cmd = [*trainer_launcher(nproc), *overrides, hydra_override("hydra.run.dir", run_dir)]
    killed_at = 0
    for step in after_steps:
        past = max(step, killed_at + 1)
        note = f"# SIGKILLed after its first checkpoint at or past step {past}"
        print(f"$ {' '.join(cmd[1:])}   {note}", flush=True)
        rc, killed_at = _killed_after(cmd, run_dir, past, poll_s)
        if rc is not None:
            return rc, None  # the trainer failed on its own: its error line was shown
        cmd = resume
    print(f"$ {' '.join(resume[1:])}", flush=True)
    return cli.run_forwarding_errors(resume, env=_env())


def _killed_after(
    cmd: list[str], run_dir: Path, step: int, poll_s: float
) -> tuple[int | None, int]:
    """SIGKILL ``cmd`` at a checkpoint >= ``step``: (None, its step), or (rc, 0) if it failed."""
    proc = subprocess.Popen(cmd, env=_env(), start_new_session=True)
    ckpts = run_dir / CHECKPOINTS

    def newest() -> int:
        found = checkpoint.list_step_checkpoints(ckpts)
        return (checkpoint.step_of(found[-1]) or 0) if found else 0

    while proc.poll() is None and newest() < step:
        time.sleep(poll_s)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    rc = proc.wait()
    if rc == 0:
        raise ReprotrainError(
            f"run b in {run_dir} completed before the kill after step {step} landed; "
            "checkpoint mid-run (e.g. trainer.checkpoint_every_steps=2), or kill earlier, "
            "so --kill has a run to interrupt"
        )
    if rc != -signal.SIGKILL:
        return rc, 0
    if newest() < step:
        raise ReprotrainError(f"run b in {run_dir} died before writing a checkpoint")
    return None, newest()


def recorded_world_size(run_dir: Path, asked: int) -> int:
    """The world size run.json says ran; an error if it is not the one asked for."""
    size = read_run_json(run_dir).get("world_size", 1)
    if size != asked:
        raise ReprotrainError(
            f"{run_dir / RUN_JSON} says world size {size}, {asked} process(es) were asked for; "
            "nothing was compared"
        )
    return size


def not_invariant(nproc: int, nproc_b: int) -> ReprotrainError:
    return ReprotrainError(
        f"--nproc-b {nproc_b} differs from --nproc {nproc}, but this config is not "
        "world-size-invariant (plain DDP changes the bits with the world size); add "
        "trainer.world_size_invariant=true, or run both at one world size"
    )


def check_world_sizes(run_a: Path, nproc: int, nproc_b: int) -> None:
    """Different world sizes compare only for a world-size-invariant run."""
    if nproc != nproc_b and read_run_json(run_a).get("world_size_invariant") is not True:
        raise not_invariant(nproc, nproc_b)


def check_world_sizes_first(overrides: list[str], nproc: int, nproc_b: int) -> None:
    """:func:`check_world_sizes` from the composed config, before run a trains."""
    if nproc == nproc_b:
        return
    from omegaconf import OmegaConf

    from reprotrain import preflight
    from reprotrain.config import register_configs

    register_configs()
    preflight.register_resolvers()
    composed = preflight.compose_all(list(overrides))
    if composed is False:
        return
    if not all(OmegaConf.select(c, "trainer.world_size_invariant") is True for c in composed):
        raise not_invariant(nproc, nproc_b)


def final_state_difference(a: Path, b: Path) -> str | None:
    """The first entry in which the newest checkpoints differ (the whole state); None: identical."""
    states = []
    for run in (a, b):
        path, state, _ = checkpoint.latest_valid(run / CHECKPOINTS)
        if path is None:
            return f"{run / CHECKPOINTS} holds no checkpoint to compare"
        states.append(state)
    return first_difference(*states)


def with_final_state(result: Comparison, a: Path, b: Path) -> Comparison:
    """Equal fingerprints and metrics with a differing final state: a divergence."""
    if result.identical and (difference := final_state_difference(a, b)) is not None:
        return result.diverged(f"the final checkpoints differ: {difference}")
    return result


def verdict_line(
    result: Comparison, sizes: tuple[int, int], resume: dict | None, configs: dict | None = None
) -> str:
    """The comparison's verdict, naming the world sizes (and the resume) it compared, and
    every setting the two runs differ in (``configs``), even where the bits agree."""
    head, _, rest = result.verdict().partition(": ")
    what = f"world size {sizes[0]} vs {sizes[1]}"
    if resume is not None:
        claim = "bitwise" if resume.get("bitwise_guarantee") else "not bitwise"
        what += (
            f"; b SIGKILLed and resumed from global step {resume.get('global_step')}, "
            f"recorded as {claim} ({resume.get('verified', 'not verified')})"
        )
    if configs:
        what += f"; the runs' configs differ in: {run_diff.differences_text(configs)}"
    return f"{head} ({what}): {rest}"


@cli.entry_point
def main(argv: list[str] | None = None) -> int:
    p = cli.parser("reprotrain.tools.runs.verify", __doc__)
    p.add_argument("--out-dir", type=cli.user_path, default=Path("outputs") / "verify")
    p.add_argument("--nproc", type=cli.positive_int, default=1, help="processes of both runs")
    p.add_argument("--nproc-b", type=cli.positive_int, default=None, help="processes of run b")
    kill = "SIGKILL run b after its first checkpoint, resume it, compare"
    p.add_argument("--kill", action="store_true", help=kill)
    steps = "with --kill: SIGKILL and resume b after its first checkpoint at or past each step"
    p.add_argument("--kill-after-steps", type=_steps, metavar="S1,S2,...", help=steps)
    args, overrides = p.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("--") and o != "--multirun"]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    check_overrides(overrides)
    cli.check_dir_arg("--out-dir", args.out_dir)
    if args.kill_after_steps and not args.kill:
        p.error("--kill-after-steps goes with --kill (make verify KILL=1)")
    nproc_b = args.nproc if args.nproc_b is None else args.nproc_b
    check_world_sizes_first(overrides, args.nproc, nproc_b)
    base = cli.stamped_dir(args.out_dir)
    dirs = [base / "a", base / "b"]
    rc, error_line = run_once(overrides, dirs[0], args.nproc)
    if rc == 0:
        check_world_sizes(dirs[0], args.nproc, nproc_b)
        if args.kill:
            rc, error_line = run_killed_then_resumed(
                overrides, dirs[1], nproc_b, after_steps=args.kill_after_steps or (0,)
            )
        else:
            rc, error_line = run_once(overrides, dirs[1], nproc_b)
    if rc != 0:
        if error_line is None:  # the trainer did not say why: say what we know
            failed = dirs[1] if (dirs[0] / RUN_JSON).is_file() else dirs[0]
            say(f"error: run in {failed} failed (exit {rc}); nothing to compare", file=sys.stderr)
        return 2
    sizes = (recorded_world_size(dirs[0], args.nproc), recorded_world_size(dirs[1], nproc_b))
    resume = (read_run_json(dirs[1]).get("resumes") or [None])[-1] if args.kill else None
    result = with_final_state(with_metrics(compare_runs(*dirs), *dirs), *dirs)
    print(verdict_line(result, sizes, resume, run_diff.config_differences(*dirs)))
    for epoch, diffs in sorted(result.metric_diffs.items()):
        shown = ", ".join(f"{k}: {a} vs {b}" for k, (a, b) in diffs.items())
        print(f"  epoch {epoch}: {shown}")
    print(f"runs: {dirs[0]}  {dirs[1]}")
    if not result.identical:
        print(f"first divergent op: {bisect_command(*dirs)}")
    return 0 if result.identical else 1


def _steps(text: str) -> tuple[int, ...]:
    """``30,70``: global steps in increasing order."""
    try:
        steps = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of steps like 30,70") from None
    if any(s < 1 for s in steps) or list(steps) != sorted(set(steps)):
        raise argparse.ArgumentTypeError(f"{text!r}: steps are positive and increasing")
    return steps


if __name__ == "__main__":
    sys.exit(main())
