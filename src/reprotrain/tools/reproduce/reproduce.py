"""``make reproduce ARCHIVE=<file>``: replay an archived run from its own source and compare.

Checks the archive, plans the replay, decides trust before anything is extracted or built,
re-runs from the archived source and compares every record. ``--verify-only`` runs nothing.

Last line and exit code: 0 REPRODUCED (bitwise); 1 DIVERGED at epoch E (step S); 2 refused
(one line); 3 NOT COMPARABLE (metrics judged against --tolerance); 4 the re-run failed;
75 INTERRUPTED. Each step and verdict: docs/archive-and-reproduce.md.
"""

from __future__ import annotations

import errno
import math
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from reprotrain import REPO_ROOT, metric_names, safetar
from reprotrain.errors import ReproduceRefused
from reprotrain.repro import comparability, environment, gitinfo, requirements_lock
from reprotrain.repro import device as devices
from reprotrain.repro.secrets import env_value_differences
from reprotrain.shown import say, shown
from reprotrain.tools import cli
from reprotrain.tools.archive import archive_check, sweep_archive
from reprotrain.tools.archive.archive_check import CheckedArchive
from reprotrain.tools.reproduce import replay_plan, reproduce_sweep, rerun, run_trust, study_check
from reprotrain.tools.reproduce.replay_plan import NotReplayable
from reprotrain.tools.runs.run_diff import compare_runs, with_metrics

__all__ = ["CheckedArchive", "ReproduceRefused", "main", "reproduce"]
DEFAULT_TOLERANCE = 0.02
ENV_INTERPOLATIONS = "env_interpolations"  # run.json: values from ${oc.env:...}, hashed


def code_differences(recorded_git: dict, repo: Path = REPO_ROOT) -> list[str]:
    """Recorded commit/dirty vs this checkout (the replay runs the archived source anyway)."""
    now, diff = gitinfo.git_info(repo)
    out = []
    if now.get("commit") is None:
        out.append(f"{repo} is not a git checkout")
    elif now["commit"] != recorded_git.get("commit"):
        out.append(
            f"commit: recorded {str(recorded_git.get('commit'))[:12]}, "
            f"this checkout {now['commit'][:12]}"
        )
    if recorded_git.get("dirty"):
        out.append("the run had uncommitted changes (restored in the archived source)")
    if now.get("dirty"):
        out.append(f"this checkout has uncommitted changes ({len(diff.splitlines())} diff lines)")
    return out


def not_fully_archivable(record: dict) -> str | None:
    git = record.get("git") or {}
    if git.get("fully_archivable", True) is not False:
        return None
    missing = ", ".join(shown(p) for p in (git.get("not_archived") or [])[:5]) or "see run.json"
    return f"the run used untracked files that are not in the archive ({missing})"


def tolerance_report(metric_diffs: dict, tolerance: float) -> tuple[list[str], bool]:
    """Lines per differing metric, and whether every split metric is within ``tolerance``."""
    lines, within = [], True
    for epoch, diffs in sorted(metric_diffs.items()):
        parts = []
        for key, (a, b) in diffs.items():
            judged = metric_names.is_outcome(key)
            if judged and isinstance(a, (int, float)) and isinstance(b, (int, float)):
                delta = abs(a - b)
                ok = math.isfinite(delta) and delta <= tolerance
                within &= ok
                mark = "ok" if ok else "OUT"
                parts.append(f"{shown(key)} {a:.6g} vs {b:.6g} (|d|={delta:.3g}, {mark})")
            else:
                parts.append(f"{shown(key)} {shown(a, 60)} vs {shown(b, 60)}")
        lines.append(f"  epoch {epoch}: " + "; ".join(parts))
    return lines, within


def _current_preview(record: dict, num_threads: int | None, rerun_vars: dict[str, str]) -> dict:
    """What this machine would record, before the re-run (the re-run's run.json decides)."""
    import torch

    spec, _ = devices.replay_spec(devices.recorded_device(record))
    device = devices.resolve(spec) if spec in ("auto", "cuda") else torch.device(spec)
    env = environment.capture(device)
    env["num_threads"] = env["num_threads"] if num_threads is None else num_threads
    env["env"] = {k: rerun_vars[k] for k in environment.ENV_ALLOWLIST if k in rerun_vars}
    env["bits_env"] = environment.bits_env(rerun_vars)
    recorded_env = record.get("environment") or {}
    if comparability.cpu_dispatch(recorded_env) == "portable":
        # repro=portable sets the CPU dispatch again at the re-run's start, which this process
        # cannot show: the preview leaves the CPU out; the re-run's own record is compared.
        env["cpu"] = recorded_env.get("cpu")
        say("env      cpu: repro=portable pins dispatch again in the re-run (checked after it)")
    lock = requirements_lock.lock_sha256(REPO_ROOT)
    return {"environment": env, "lock_sha256": lock, "container": environment.container_image()}


def _check_dirs(args) -> None:
    """Paths the user gave are checked before the (slow) archive checks."""
    if args.extract_dir is not None:
        archive_check.check_extract_dir(Path(args.extract_dir))
    cli.check_dir_arg("--runs-dir", Path(args.runs_dir))
    if args.trusted_signers is not None and not Path(args.trusted_signers).is_file():
        raise ReproduceRefused(
            f"--trusted-signers {args.trusted_signers}: {os.strerror(errno.ENOENT)}"
        )


def reproduce(args) -> int:
    """The replay; a stop signal unwinds it before the re-run and is forwarded once it runs."""
    try:
        with cli.stopping():
            return _reproduce(args)
    except cli.Stopped as e:
        say(f"INTERRUPTED by {e.signal} before the re-run; nothing ran, temp dirs removed")
        return rerun.EXIT_STOPPED


def _reproduce(args) -> int:
    archive = Path(args.archive).resolve()
    _check_dirs(args)
    limits = safetar.Limits(
        max_members=args.max_members, max_member_bytes=args.max_member_bytes,
        max_total_bytes=args.max_total_bytes, max_ratio=args.max_ratio,
    )  # fmt: skip
    if args.verify_only:
        checked = archive_check.verify(archive, limits)
        with rerun.extraction_dir(args, "reprotrain-verify-") as dest:
            archive_check.extract(checked, dest)
            say(f"archive  {archive}: manifest verified, extracted to {dest}")
        return rerun.EXIT_REPRODUCED
    rerun.PHASES("verify the archive")
    checked = archive_check.verify(archive, limits)
    sweep = sweep_archive.is_sweep_archive(checked)  # a sweep: every run, one verdict
    if sweep:
        if args.epochs is not None:
            raise ReproduceRefused("--epochs is for one run; a sweep is replayed in full")
        jobs, epochs, until = reproduce_sweep.archived_jobs(checked), None, None
        # a malformed study record is refused before any run
        study = study_check.archived_study(checked)
    else:
        checked = run_archive(args, archive, checked)
        jobs, (epochs, until) = [("", checked)], replay_span(args, checked)
    rerun.PHASES("build the replay plan")
    try:
        plan = replay_plan.build(jobs, until)
    except NotReplayable as e:
        say(f"NOT COMPARABLE: {e}")
        return rerun.EXIT_NOT_COMPARABLE
    rerun.PHASES("decide trust")  # on the whole plan, before anything of the archive is built
    permit = run_trust.admit_plan(plan, Path(args.repo), args.trusted_signers, args.trust)
    run = rerun.Reproduction(args, archive, plan, permit)
    say(f"trust    {permit.line()}")
    return reproduce_sweep.replay(run, study) if sweep else _replay(run, epochs)


def run_archive(args, archive: Path, checked: CheckedArchive) -> CheckedArchive:
    """A run archive's record, checked; a refusal for what a run archive cannot do."""
    if args.mode == "statistical":
        raise ReproduceRefused(
            "MODE=statistical needs a sweep archive (make archive RUN=<sweep dir>): one run is "
            "one seed, too few to judge"
        )
    checked = archive_check.check_record(checked)
    signed = ", signed" if checked.signature is not None else ""
    say(f"archive  {archive}: manifest verified ({len(checked.manifest)} files{signed})")
    return checked


def replay_span(args, checked: CheckedArchive) -> tuple[int | None, int | None]:
    """(epochs compared, step to stop at), None: all; an interrupted run: its completed epochs."""
    done = len(checked.fingerprints)  # an interrupted run has them too
    if done == 0:
        raise ReproduceRefused("the archived run completed no epoch; there is nothing to compare")
    if args.epochs is not None and not 1 <= args.epochs <= done:
        raise ReproduceRefused(
            f"--epochs {args.epochs}: the archived run has {done} completed epoch(s)"
        )
    complete = checked.record.get("status") == "completed"
    epochs = args.epochs if args.epochs is not None else (None if complete else done)
    until = checked.fingerprints[epochs - 1].get("global_step") if epochs else None
    if until is not None and (not isinstance(until, int) or isinstance(until, bool)):
        where = checked.label("run/fingerprints.jsonl")
        raise ReproduceRefused(f"{where}: epoch {epochs} has no integer global_step")
    return epochs, until


def _replay(run: rerun.Reproduction, epochs: int | None) -> int:
    """One archived run: re-run from its own source, then compared record by record."""
    (job,) = run.plan.jobs
    record, cfg, args = job.record, job.view.config, run.args
    # Values the run read from its environment must be resolvable here (named, not shown).
    env_values = env_value_differences(cfg, record.get(ENV_INTERPOLATIONS) or {})
    unresolved = [d for d in env_values if "cannot be resolved" in d]
    if unresolved:
        raise ReproduceRefused(
            f"{unresolved[0]}; set the variable the archived run read, then retry"
        )
    data_problem = next(iter(run.data_problems()), None)
    partial_archive = _say_archived(record, len(job.view.fingerprints), data_problem, args.repo)
    with run.extracted() as top:
        source, archived, new_run = top / "source", top / "run", cli.stamped_dir(args.runs_dir)
        say(f"code     re-run uses the archived source ({source})")
        num_threads = OmegaConf.select(cfg, "repro.num_threads")
        preview = _current_preview(record, num_threads, rerun.rerun_env(source, job))
        blocking, info = rerun.environment_differences(record, preview)
        base = comparability.container_differences(record, preview)  # a reason if bits differ
        for line in (
            blocking + info + base + ([] if blocking else ["matches the recorded environment"])
        ):
            say(f"env      {line}")
        image = environment.container_line(record.get("container"))
        if image:  # the image the run ran in, to reproduce it inside (docs/container.md)
            say(f"image    {image}")
        say(f"re-run   PYTHONPATH={source / 'src'} (cwd {source})")
        done = rerun.rerun_job(run.trust, job, top, new_run, epochs)
        if isinstance(done, int):
            return done
        reasons = done.reasons + ([data_problem] if data_problem else [])
        reasons += [f"environment-derived value: {d}" for d in env_values]
        rerun.PHASES("compare")
        result = with_metrics(compare_runs(archived, new_run, epochs), archived, new_run, epochs)
        reasons += [] if result.identical else base  # another base: bits not promised
        shown_lines = [f"new run  {new_run}"]
        if partial_archive and result.identical:
            shown_lines.append(f"  note: {partial_archive}; the bits match without them")
        elif partial_archive:
            reasons.append(partial_archive)
        scope = f"epoch(s) 1-{result.epochs_compared}" + ("" if epochs else " + final weights")
        code, verdict, detail = _verdict(result, reasons, args.tolerance, scope)
        report = {
            "archived_experiment_id": record.get("experiment_id"),
            "archived_run": record.get("run_dir"),
            "epochs": epochs,
            "legs": len(job.legs),
            "fully_archivable": partial_archive is None,
            "environment_differences": done.blocking,
            "environment_notes": done.notes,
            "data": data_problem,
            "metric_differences": {str(k): v for k, v in result.metric_diffs.items()},
            "tolerance": args.tolerance,
        }
        return run.finish(new_run, report, code, verdict, *shown_lines, *detail)


def _say_archived(record: dict, done: int, data_problem: str | None, repo: Path) -> str | None:
    """The archived run, its data and code against this checkout; why it is not all archived."""
    seeds, status = record["seeds"], record.get("status")
    run = f"{shown(record.get('experiment_id'))}  seeds base={shown(seeds['base'])}"
    run += f" ({shown(seeds.get('source'))})  repro={shown(record['repro']['level'])}"
    comparing = "" if status == "completed" else f" (run {shown(status)}: comparing those)"
    say(f"run      {run}  epochs={done}{comparing}")
    say(f"data     {'DIFFERS: ' + data_problem if data_problem else 'fingerprint matches'}")
    partial_archive = not_fully_archivable(record)
    if partial_archive:
        say(f"code     NOT FULLY ARCHIVABLE: {partial_archive}")
    same = ["this checkout: same commit, clean"]
    for line in code_differences(record.get("git") or {}, Path(repo)) or same:
        say(f"code     {line}")
    return partial_archive


def _verdict(result, reasons: list[str], tolerance: float, scope: str) -> tuple[int, str, list]:
    """(exit code, verdict line, detail lines) from the comparison and the reasons."""
    lines, within = tolerance_report(result.metric_diffs, tolerance)
    judged = f"{'within' if within else 'OUTSIDE'} tolerance {tolerance}"
    if reasons:
        bits = "bits match anyway" if result.identical else result.verdict()
        metrics = judged if lines else f"identical tolerance {tolerance}"
        detail = [f"  ({bits}); metrics {metrics} on train_/val_/test_ metrics", *lines]
        return rerun.EXIT_NOT_COMPARABLE, "NOT COMPARABLE: " + "; ".join(reasons), detail
    if result.identical:
        return rerun.EXIT_REPRODUCED, f"REPRODUCED (bitwise): {scope} match the archived run", []
    detail = [f"  metric differences ({judged}):", *(lines or ["  (none)"])]
    return rerun.EXIT_DIVERGED, result.verdict(), detail


_byte_size = cli.argtype(safetar.parse_bytes, lambda v: v >= 1, "size (bytes, or with K/M/G/T)")


@cli.entry_point
def main(argv: list[str] | None = None) -> int:
    p = cli.parser("reprotrain.tools.reproduce.reproduce", __doc__)
    p.add_argument("archive", type=cli.user_path)
    p.add_argument("--epochs", type=cli.positive_int, default=None, help="compare only the first N")
    p.add_argument("--tolerance", type=cli.non_negative_float, default=DEFAULT_TOLERANCE)
    p.add_argument("--allow-data-drift", action="store_true")
    p.add_argument("--runs-dir", type=cli.user_path, default=Path("outputs") / "reproduce")
    p.add_argument("--extract-dir", type=cli.user_path, help="keep the extracted archive")
    p.add_argument("--verify-only", action="store_true", help="check and extract, no re-run")
    signers_help = "OpenSSH allowed-signers file to verify a signed archive against"
    p.add_argument("--trusted-signers", type=cli.user_path, metavar="FILE", help=signers_help)
    p.add_argument("--trust", action="store_true", help="run the code even if neither (a) nor (b)")
    p.add_argument("--repo", type=cli.user_path, default=REPO_ROOT, help="checkout for rule (a)")
    d = safetar.Limits()
    for flag, parse, field, what in (
        ("--max-members", cli.positive_int, "max_members", "more"),
        ("--max-member-bytes", _byte_size, "max_member_bytes", "a larger member"),
        ("--max-unpacked-bytes", _byte_size, "max_total_bytes", "a larger total"),
        ("--max-ratio", cli.positive_float, "max_ratio", "a higher unpacked/packed ratio"),
    ):
        most = getattr(d, field)
        limit = safetar.human(most) if parse is _byte_size else f"{most:g}"
        p.add_argument(flag, type=parse, default=most, dest=field, help=f"refuse {what} ({limit})")
    add_sweep_arguments(p)
    return reproduce(p.parse_args(argv))


def add_sweep_arguments(p) -> None:
    """A sweep archive's verdict (tools/reproduce/reproduce_sweep.py): MODE=, MARGIN=, METRIC=."""
    modes, auto = ("auto", "bitwise", "statistical"), "auto: where bits are not promised"
    p.add_argument("--mode", choices=modes, default="auto", help=f"sweep archives ({auto})")
    margin = "equivalence margin (default: archived 95%% CI half-width)"
    p.add_argument("--margin", type=cli.positive_float, default=None, help=margin)
    p.add_argument("--metric", default=None, help="final metric (default: trainer.monitor)")


if __name__ == "__main__":
    sys.exit(main())
