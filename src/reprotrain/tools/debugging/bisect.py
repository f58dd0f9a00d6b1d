"""``make bisect A=<run dir> B=<run dir>``: where two runs part, down to the first op.

    python -m reprotrain.tools.debugging.bisect <run A> <run B> [--max-replay-steps 1000]

Forks each run from its newest checkpoint before the first differing step with per-op
hashing, names the first op whose output differs, and walks back when its inputs already
differed. Report: ``bisect.json`` in the later run. Each step: docs/when-bits-differ.md.

Exit codes: 0 identical; 1 diverged (located as far as records and replays allow); 2 user
error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reprotrain.errors import ReprotrainError
from reprotrain.quoting import hydra_override, make_assignment
from reprotrain.repro import checkpoint, comparability, op_trace
from reprotrain.resume.replay import first_difference as state_difference
from reprotrain.run.mutex import refuse_if_held
from reprotrain.run.readers import read_run_json
from reprotrain.run.record import (
    CHECKPOINTS,
    FINGERPRINTS,
    atomic_write_text,
    now_iso,
    read_jsonl,
)
from reprotrain.shown import say
from reprotrain.tools import cli
from reprotrain.tools.debugging.trace_diff import Finding, first_difference, first_digest_difference
from reprotrain.tools.reproduce import run_trust
from reprotrain.tools.runs import resume
from reprotrain.tools.runs.run_diff import compare_runs, config_differences, differences_text

REPORT = "bisect.json"
EXIT_IDENTICAL, EXIT_DIVERGED, EXIT_USAGE = 0, 1, 2
EXIT_STOPPED = 75  # the trainer stopped at trainer.stop_at_global_step mid-epoch
OUTSIDE_TRACE = "tensors changed between steps, outside any op the trace sees"


@dataclass
class Divergence:
    """The first step the records tell apart; ``what`` is ``loss`` or ``weights``."""

    global_step: int
    epoch: int
    step: int
    what: str
    values: tuple[Any, Any] = (None, None)

    def trace_steps(self) -> list[int]:
        """Steps whose ops can hold the cause: for a loss at s, s-1 and s; else s."""
        if self.what == "loss" and self.global_step > 0:
            return [self.global_step - 1, self.global_step]
        return [self.global_step]


def step_losses(fingerprints: list[dict]) -> dict[int, float]:
    """{global step: loss} from the per-epoch fingerprints."""
    out = {}
    for row in fingerprints:
        first = row["global_step"] - len(row["step_losses"])
        out.update({first + i: v for i, v in enumerate(row["step_losses"])})
    return out


def first_divergence(a: Path, b: Path) -> tuple[Divergence | None, str]:
    """(the divergence or None, the records' one-line verdict)."""
    result = compare_runs(a, b)
    if result.identical:
        return None, result.verdict()
    fa, fb = read_jsonl(a / FINGERPRINTS), read_jsonl(b / FINGERPRINTS)
    if result.divergent_epoch is None:  # epoch counts or final weights only
        n = min(len(fa), len(fb))
        last = fa[n - 1]["global_step"] - 1 if n else 0
        return Divergence(last, n, 0, "weights"), result.verdict()
    i = next(k for k, r in enumerate(fa) if r["epoch"] == result.divergent_epoch)
    ra, rb = fa[i], fb[i]
    first = ra["global_step"] - len(ra["step_losses"])
    if result.divergent_step is not None:
        s = result.divergent_step
        values = (ra["step_losses"][s], rb["step_losses"][s])
        return Divergence(first + s, ra["epoch"], s, "loss", values), result.verdict()
    last = len(ra["step_losses"]) - 1
    values = (ra["weights_sha256"][:12], rb["weights_sha256"][:12])
    return Divergence(first + last, ra["epoch"], last, "weights", values), result.verdict()


def nearest_checkpoint(run_dir: Path, step: int) -> tuple[Path | None, int]:
    """The newest step checkpoint at or before ``step``, or (None, 0): replay from the start."""
    best: tuple[Path | None, int] = (None, 0)
    for path in checkpoint.list_step_checkpoints(run_dir / CHECKPOINTS):
        done = int(path.stem.removeprefix("step-"))
        if done <= step:
            best = (path, done)
    return best


@dataclass
class Replay:
    name: str
    run_dir: Path
    checkpoint: Path | None
    start: int
    trace_dir: Path  # its log beside it: <trace_dir>.log
    mismatched: list[int] = field(default_factory=list)  # traced steps not matching the record

    @property
    def log(self) -> Path:
        return self.trace_dir.with_name(f"{self.trace_dir.name}.log")

    def describe(self) -> str:
        origin = f"checkpoints/{self.checkpoint.name}" if self.checkpoint else "the start"
        return f"{self.name} from {origin} (global step {self.start})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "run": self.name,
            "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            "start_global_step": self.start,
            "traces": str(self.trace_dir),
            "log": str(self.log),
            "losses_match_record": not self.mismatched,
        }


def fork_losses(fork: Path) -> dict[int, float]:
    """{global step: loss} the fork computed, its last checkpoint's partial epoch included."""
    rows = read_jsonl(fork / FINGERPRINTS) if (fork / FINGERPRINTS).is_file() else []
    ckpts = checkpoint.list_step_checkpoints(fork / CHECKPOINTS)
    if ckpts:
        loop = checkpoint.load(ckpts[-1])["loop"]
        partial = loop["progress"].get("step_losses") or []
        rows.append({"global_step": loop["global_step"], "step_losses": partial})
    return step_losses(rows)


def run_replay(replay: Replay, steps: list[int], workdir: Path, digests: range = range(0)) -> None:
    """Fork ``replay.run_dir``, trace ``steps``, digest ``digests``, stop after the last."""
    record = read_run_json(replay.run_dir)
    tag = replay.trace_dir.name
    config_dir, fork = workdir / f"config-{tag}", workdir / f"fork-{tag}"
    config_dir.mkdir()
    (config_dir / resume.PRIMARY).write_text(resume.primary_config_text(replay.run_dir))
    start = hydra_override("resume", replay.checkpoint) if replay.checkpoint else "resume=null"
    overrides = [start, f"trainer.stop_at_global_step={max([*steps, *digests]) + 1}"]
    cmd = resume.resume_command(fork, config_dir, overrides, int(record.get("world_size") or 1))
    env = {**os.environ, op_trace.STEPS_VAR: ",".join(map(str, steps))}
    if digests:
        env[op_trace.DIGEST_VAR] = f"{digests.start}-{digests.stop - 1}"
    env[op_trace.DIR_VAR] = str(replay.trace_dir)
    env["PYTHONHASHSEED"] = str((record.get("repro") or {}).get("pythonhashseed") or "0")
    if replay.trace_dir.exists():
        shutil.rmtree(replay.trace_dir)
    with open(replay.log, "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    missing = [s for s in steps if not op_trace.trace_path(replay.trace_dir, s).is_file()]
    if rc not in (0, EXIT_STOPPED) or missing:
        raise ReprotrainError(
            f"the replay of {replay.name} ({replay.run_dir}) failed (exit {rc}); see {replay.log}"
        )
    losses, recorded = fork_losses(fork), step_losses(read_jsonl(replay.run_dir / FINGERPRINTS))
    replay.mismatched = [s for s in [*digests, *steps] if losses.get(s) != recorded.get(s)]


def later_run(a: Path, b: Path) -> Path:
    ka, kb = (str(read_run_json(r).get("started_at") or "") for r in (a, b))
    return b if kb >= ka else a


def suggest_cadence(max_replay: int) -> str:
    return f"trainer.checkpoint_every_steps={max(1, max_replay)}"


def _check_run(run_dir: Path) -> Path:
    run_dir = run_dir.expanduser().resolve()
    resume.check_run_dir(run_dir)
    if not (run_dir / FINGERPRINTS).is_file():
        raise ReprotrainError(f"{run_dir} has no {FINGERPRINTS}: it completed no epoch")
    refuse_if_held(run_dir)
    return run_dir


def bisect(a: Path, b: Path, max_replay: int) -> tuple[int, dict[str, Any], list[str]]:
    """(exit code, report, screen lines)."""
    lines = [f"runs     A={a}", f"         B={b}"]
    report: dict[str, Any] = {"created_at": now_iso(), "a": str(a), "b": str(b)}
    configs, env = _what_differs(a, b, report, lines)
    div, verdict = first_divergence(a, b)
    report["records"] = verdict
    if div is None:
        lines.append(f"records  {verdict}")
        report["verdict"] = "IDENTICAL"
        if configs:  # the same bits, not the same run twice
            report["verdict"] = (
                f"IDENTICAL bits from two configs: they differ in {', '.join(configs)}"
            )
            lines.append(f"RESULT   {report['verdict']}")
        return EXIT_IDENTICAL, report, lines
    report["divergence"] = {**dataclasses.asdict(div), "values": list(div.values)}
    lines.append(
        f"records  first difference at global step {div.global_step} (epoch {div.epoch} step "
        f"{div.step}): {div.what} {div.values[0]!r} vs {div.values[1]!r}"
    )
    steps = div.trace_steps()
    out_dir = later_run(a, b) / "bisect"
    replays = []
    for name, run_dir in (("A", a), ("B", b)):
        path, start = nearest_checkpoint(run_dir, steps[0])
        replays.append(Replay(name, run_dir, path, start, out_dir / name))
    far = [r for r in replays if steps[0] - r.start > max_replay]
    if far:
        names = ", ".join(f"{r.name} (nearest: global step {r.start})" for r in far)
        report["suggested"] = cadence = suggest_cadence(max_replay)
        lines.append(
            f"replay   not run: no checkpoint within {max_replay} steps of step {steps[0]} in "
            f"{names}; {cadence} would have made it precise (or raise --max-replay-steps)"
        )
        report["verdict"] = f"DIVERGED at global step {div.global_step} (not replayed)"
        lines.append(f"RESULT   {report['verdict']}")
        return EXIT_DIVERGED, report, lines
    out_dir.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="reprotrain-bisect-") as tmp:
        for r in replays:
            run_replay(r, steps, Path(tmp))
        traced = "-".join(str(s) for s in sorted({steps[0], steps[-1]}))
        described = "; ".join(r.describe() for r in replays)
        lines.append(f"replay   {described}; traced step(s) {traced}")
        lines += _replay_notes(replays, steps[0])
        finding, walked = _first_finding(replays, steps), None
        if finding is not None and finding.kind == "output" and not finding.inputs_identical:
            walked = walk_back(a, b, finding, max_replay, out_dir, Path(tmp))
            lines += walked.lines
            report["walk_back"] = walked.as_dict()
    report |= {"replays": [r.as_dict() for r in replays], "traced_steps": steps}
    named, sentence = _conclusion(finding, walked, traced, env)
    report["finding"] = named.as_dict() if named else None
    if configs:
        sentence += f" (the configs differ in: {', '.join(configs)})"
    report["verdict"] = f"DIVERGED at global step {div.global_step}: {sentence}"
    lines.append(f"RESULT   {sentence}")
    return EXIT_DIVERGED, report, lines


def _conclusion(first: Finding | None, walked, traced: str, env: list[str]) -> tuple[Any, str]:
    """(the finding the report names, the sentence that says it) from the trace and walk back."""
    if first is None:
        differ = f" (the recorded environments differ: {env[0]})" if env else ""
        return None, (
            f"the traced step(s) {traced} hash the same in both replays here: the difference "
            f"did not recur on this machine{differ}"
        )
    if walked is None:
        return first, first.sentence()
    if walked.finding is None:
        return first, f"{first.sentence()}; walking back: {walked.why_not}"
    why = f"; {walked.why_not}" if walked.why_not else ""
    return walked.finding, f"{walked.finding.sentence()} (walked back from {first.sentence()}){why}"


@dataclass
class WalkBack:
    """Where a walk back started, what it found, or why it could not."""

    origin: int | None = None
    finding: Finding | None = None
    why_not: str | None = None
    differing_checkpoints: dict[int, list[str]] = field(default_factory=dict)
    digested: list[int] = field(default_factory=list)
    first_digest_step: int | None = None
    lines: list[str] = field(default_factory=list)

    def stopped(self, why: str, head: str = "") -> WalkBack:
        """The walk ends here, for ``why``."""
        self.why_not = why
        self.lines.append(f"walk     {head}{why}")
        return self

    def as_dict(self) -> dict[str, Any]:
        return {
            "origin_global_step": self.origin,
            "differing_checkpoints": {str(k): v for k, v in self.differing_checkpoints.items()},
            "digested_steps": self.digested,
            "first_differing_step": self.first_digest_step,
            "finding": self.finding.as_dict() if self.finding else None,
            "why_not": self.why_not,
        }


def walk_back(
    a: Path, b: Path, first: Finding, max_replay: int, out_dir: Path, workdir: Path
) -> WalkBack:
    """From an op whose inputs already differed back to the op that made the difference."""
    before = first.step
    walk = WalkBack()
    origin, upto, ckpts = _walk_back_origin(a, b, before, max_replay, walk)
    if origin is None:
        return walk.stopped(walk.why_not or "", "not possible: ")
    walk.origin, digests = origin, range(origin, upto)
    where = f"checkpoints/step-{origin:08d}.pt" if ckpts[0] else "the start"
    if not digests:
        held = f"both runs hold the same state at {where}, yet step {before} starts from"
        return walk.stopped(f"{held} different tensors: {OUTSIDE_TRACE}")
    pairs = zip("AB", (a, b), ckpts, strict=True)
    replays = [Replay(n, run, ckpt, origin, out_dir / f"{n}-walk") for n, run, ckpt in pairs]
    for r in replays:
        run_replay(r, [], workdir, digests)
    walk.digested = list(digests)
    k, _ = first_digest_difference(digests, *(op_trace.read_digests(r.trace_dir) for r in replays))
    walk.first_digest_step = k
    span = f"{digests.start}-{digests.stop - 1}" if len(digests) > 1 else f"{digests.start}"
    if k is None:
        later = f"step {before} starts from different tensors"
        if upto < before:
            later = f"their checkpoints at global step {upto} differ"
        same = f"steps {span} (from {where}) digest the same in both replays"
        return walk.stopped(f"{same}, yet {later}: {OUTSIDE_TRACE}")
    traced = [dataclasses.replace(r, trace_dir=out_dir / f"{r.name}-{k}") for r in replays]
    for r in traced:
        run_replay(r, [k], workdir)
    walk.finding = _first_finding(traced, [k])
    walk.lines.append(
        f"walk     from {where}: digested step(s) {span}, first differing step {k}; traced it"
    )
    if walk.finding is None:
        walk.why_not = f"step {k} hashes the same in both traced replays: it did not recur"
    elif walk.finding.kind == "output" and not walk.finding.inputs_identical:
        walk.why_not = (
            f"every step before {k} (from {where}) digests the same, yet its first differing "
            f"op had differing inputs: {OUTSIDE_TRACE}"
        )
    return walk


def _walk_back_origin(
    a: Path, b: Path, before: int, max_replay: int, walk: WalkBack
) -> tuple[int | None, int, tuple[Path | None, Path | None]]:
    """(newest shared state or None with ``walk.why_not``, upto, checkpoints): steps to digest."""
    ka, kb = (
        {checkpoint.step_of(p): p for p in checkpoint.list_step_checkpoints(r / CHECKPOINTS)}
        for r in (a, b)
    )
    upto = before
    for c in sorted((c for c in set(ka) & set(kb) if c <= before), reverse=True):
        parts = state_differences(ka[c], kb[c])
        if not parts:
            return _within(c, upto, max_replay, walk, a), upto, (ka[c], kb[c])
        upto = c
        walk.differing_checkpoints[c] = parts
        walk.lines.append(f"walk     checkpoints/step-{c:08d}.pt differ in: {', '.join(parts)}")
    ia, ib = (read_run_json(r).get("initial_weights_sha256") for r in (a, b))
    if ia and ib and ia != ib:
        walk.why_not = (
            "the initial weights already differ (initial_weights_sha256): the difference is in "
            "building the model (seed.init, the model's code), before any step"
        )
        return None, upto, (None, None)
    return _within(0, upto, max_replay, walk, a), upto, (None, None)


def _within(origin: int, upto: int, max_replay: int, walk: WalkBack, a: Path) -> int | None:
    """``origin`` when within ``max_replay``; else None and why, with the cadence that would do."""
    if upto - origin <= max_replay:
        return origin
    last = max(step_losses(read_jsonl(a / FINGERPRINTS)), default=upto) + 1
    where = f"global step {origin}" if origin else "the start"
    differ = (
        f"the runs' states already differ at their checkpoint at global step {upto}"
        if upto in walk.differing_checkpoints
        else f"the traced step {upto} starts from different tensors"
    )
    walk.why_not = (
        f"no checkpoint early enough: {differ}, and the newest state both runs share is "
        f"{where}, {upto - origin} steps before it (over --max-replay-steps {max_replay}); "
        f"{suggest_cadence(max_replay)} trainer.keep_checkpoints="
        f"{-(-last // max(1, max_replay))} would have made it precise"
    )
    return None


#: Checkpoint keys that describe the run or record its past, not state the next step reads.
NOT_STATE = ("format_version", "config", "config_sha256", "env", "seeds", "loop")


def state_differences(a: Path, b: Path) -> list[str]:
    """The state parts (``model``, ``optimizer``, ...) in which two checkpoints differ bitwise."""
    sa, sb = checkpoint.load(a), checkpoint.load(b)
    parts = sorted((set(sa) | set(sb)) - set(NOT_STATE))
    return [
        k
        for k in parts
        if k not in sa or k not in sb or state_difference({k: sa[k]}, {k: sb[k]}) is not None
    ]


def _what_differs(a: Path, b: Path, report: dict, lines: list[str]) -> tuple[dict, list[str]]:
    """The settings (config, seeds, controls in force) and environment fields that differ,
    into the report and the screen."""
    configs = config_differences(a, b)
    env = comparability.differences(
        read_run_json(a).get("environment") or {}, read_run_json(b).get("environment") or {}
    )
    report["config_differences"] = {k: list(v) for k, v in configs.items()}
    report["environment_differences"] = env
    shown = differences_text(configs)
    lines.append(f"config   {'the configs differ in: ' + shown if configs else 'identical'}")
    same = "same (bits are promised)" if not configs else "same"
    lines.append(f"env      {'; '.join(env) if env else same}")
    return configs, env


def _replay_notes(replays: list[Replay], first: int) -> list[str]:
    """Notes on a long replay from the start or one that missed its own record here."""
    notes = []
    for r in replays:
        if first - r.start > 0 and r.checkpoint is None:
            notes.append(
                f"         {r.name}: no checkpoint before step {first}, replayed "
                f"{first} step(s) from the start ({suggest_cadence(max(1, first))} "
                "would shorten it)"
            )
        if r.mismatched:
            notes.append(
                f"         note: the replay of {r.name} does not reproduce its recorded loss "
                f"at step(s) {', '.join(map(str, r.mismatched))} here: it was recorded in "
                "another environment; the op-level answer describes this machine"
            )
    return notes


def _first_finding(replays: list[Replay], steps: list[int]) -> Finding | None:
    """The first op whose hashes differ between the two replays' traces, step by step."""
    for s in steps:
        ta, tb = (op_trace.read_trace(op_trace.trace_path(r.trace_dir, s)) for r in replays)
        finding = first_difference(s, ta, tb)
        if finding is not None:
            return finding
    return None


def bisect_command(a: Path, b: Path) -> str:
    """The line ``make verify`` prints on DIVERGED."""
    return f"make bisect {make_assignment('A', a)} {make_assignment('B', b)}"


@cli.entry_point
def main(argv: list[str] | None = None) -> int:
    p = cli.parser("reprotrain.tools.debugging.bisect", __doc__)
    p.add_argument("a", type=cli.user_path, help="run directory A")
    p.add_argument("b", type=cli.user_path, help="run directory B")
    p.add_argument("--max-replay-steps", type=int, default=1000)
    run_trust.add_arguments(p)
    args = p.parse_args(argv)
    # A run from an archive is replayed only under a trust rule (its config is code).
    run_trust.require_trust([args.a, args.b], args.trust, args.trusted_signers)
    a, b = _check_run(args.a), _check_run(args.b)
    if a == b:
        raise ReprotrainError("A and B are the same run directory; give two runs")
    code, report, lines = bisect(a, b, args.max_replay_steps)
    report["exit_code"] = code
    path = later_run(a, b) / REPORT
    atomic_write_text(path, json.dumps(report, indent=2, sort_keys=True) + "\n")
    for line in lines:
        say(line)
    say(f"report   {path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
