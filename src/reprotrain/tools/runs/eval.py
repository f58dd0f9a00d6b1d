"""``make eval RUN=dir [CKPT=last|best|path] [ARGS=...]``: a checkpoint on the test split.

Rebuilds the run from its recorded config and evaluates as the trainer's final evaluation
does (``last`` reproduces ``final_metrics`` bit for bit); writes ``evals/<ckpt>-step<N>.json``
and ``eval.json``. ``ARGS``: dotted overrides (may change the bits), written to a file of their
own, ``evals/<ckpt>-step<N>+<sha>.json``: never over the recorded settings'. docs/make-targets.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import sys
from pathlib import Path

from omegaconf import OmegaConf

from reprotrain.errors import ReprotrainError
from reprotrain.repro import checkpoint
from reprotrain.run import record as rec
from reprotrain.run.paths import inside
from reprotrain.run.readers import read_config, read_run_json
from reprotrain.shown import say, shown
from reprotrain.tools import cli
from reprotrain.tools.reproduce import run_trust


class EvalError(ReprotrainError):
    """The run directory or checkpoint cannot be evaluated."""


def pick_checkpoint(run_dir: Path, which: str, seeds: dict | None) -> Path:
    """``last``: the newest step checkpoint of this run; ``best``: best.pt; else the path given."""
    if which == "last":
        found = checkpoint.list_step_checkpoints(run_dir / rec.CHECKPOINTS)
        for path in reversed(found):
            if checkpoint.belongs(path, seeds):
                return path
        if found:
            raise EvalError(
                f"none of the {len(found)} step checkpoint(s) in {run_dir / rec.CHECKPOINTS} "
                "belongs to this run (another run's seeds, a step that is not its name, or "
                "unreadable); give CKPT=<path>"
            )
        raise EvalError(f"{run_dir} has no step checkpoints; give CKPT=<path>")
    if which == "best":
        path = run_dir / rec.CHECKPOINTS / "best.pt"
        if not path.is_file():
            raise EvalError(f"{path} does not exist (no validation split?); use CKPT=last")
        return path
    return Path(which).expanduser()


def check_belongs(state: dict, path: Path, seeds: dict | None) -> None:
    """A checkpoint is evaluated into this run's eval.json only if it holds the run's seeds."""
    if seeds is not None and state.get("seeds") != seeds:
        raise EvalError(
            f"{path} is not a checkpoint of this run (its seeds differ from run.json's); "
            "evaluate it from its own run directory"
        )


def load_weights(model, state: dict, path: Path) -> None:
    """The checkpoint's weights into the run's model; one line when they do not fit."""
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, KeyError, TypeError) as e:
        detail = " ".join(str(e).split())[:200]
        raise EvalError(
            f"{path} does not fit the run's model ({detail}); give a checkpoint of this run"
        ) from None


def check_best(state: dict, path: Path, run_dir: Path, monitor: str, mode: str) -> None:
    """best.pt must be the epoch-end checkpoint of the best epoch metrics.jsonl records."""
    rows = rec.read_jsonl(run_dir / rec.METRICS)
    want = checkpoint.recorded_best_epoch(rows, monitor, mode)
    if want is None or not checkpoint.is_best_of(state, want):
        held = (state.get("loop") or {}).get("epoch", 1) - 1
        raise EvalError(
            f"{path} holds epoch {held}, but {rec.METRICS} records {monitor} best at epoch "
            f"{want}: the record and best.pt disagree (`make resume` re-derives best.pt)"
        )


def evaluation_weights(step_node, model, state: dict, path: Path):
    """(a context with the weights the trainer evaluated with, their name): EMA or the model's."""
    from reprotrain.components import build_step
    from reprotrain.step import Step

    user_step = build_step(step_node, model) if step_node is not None else None
    swap = getattr(user_step, "evaluation_weights", None)
    own = getattr(type(user_step), "evaluation_weights", None) is not Step.evaluation_weights
    if swap is None or not own:  # the base's hook: the model's own weights
        return contextlib.nullcontext(), "model weights"
    saved = state.get("user_step")
    if saved is None:
        what = f"no state of the run's step ({step_node['_target_']})"
        raise EvalError(f"{path} holds {what}; give a checkpoint this run wrote")
    user_step.load_state_dict(saved)
    return swap(model), getattr(user_step, "evaluated_with", "the step's evaluation weights")


def evaluate_run(run_dir: Path, which: str = "last", overrides: list[str] | None = None) -> dict:
    from reprotrain.build import build_data, build_model
    from reprotrain.components import build_task
    from reprotrain.config import PipelineSettings, from_trainer
    from reprotrain.repro import determinism
    from reprotrain.repro import device as devices
    from reprotrain.repro import precision as float_math
    from reprotrain.repro.seeding import Seeds
    from reprotrain.step.runner import evaluate

    config_file = run_dir / rec.RESOLVED_CONFIG
    if not (run_dir / rec.RUN_JSON).is_file() or not config_file.is_file():
        raise EvalError(f"{run_dir} is not a reprotrain run directory (no run.json)")
    record = read_run_json(run_dir)  # one line for [], "environment": "cpu", bad JSON
    try:
        cfg = read_config(config_file)  # bounded: an archive's alias bomb is one line
    except ReprotrainError as e:
        raise EvalError(f"cannot read {run_dir}'s record: {str(e).splitlines()[0]}") from None
    if overrides:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    own_seeds = record.get("seeds") if isinstance(record.get("seeds"), dict) else None
    path = pick_checkpoint(run_dir, which, own_seeds)
    state = checkpoint.load(path)
    check_belongs(state, path, own_seeds)
    if which == "best":
        check_best(state, path, run_dir, cfg.trainer.monitor, cfg.trainer.monitor_mode)
    precision = float_math.check(cfg.trainer.precision)
    repro = cfg.repro
    determinism.apply(repro.level, repro.num_threads, repro.fill_uninitialized_memory, precision)
    device = devices.resolve_for_resume(devices.recorded_device(record), cfg.trainer.device, False)
    seeds = Seeds(**state["seeds"])
    data, channels_last = from_trainer(PipelineSettings, cfg.trainer), cfg.trainer.channels_last
    classes = cfg.model.get("num_classes")
    _, pipeline = build_data(cfg.dataset, classes, data, seeds, device, channels_last=channels_last)
    try:
        model = build_model(cfg.model, device, channels_last)
    except AttributeError:  # the build itself succeeded (its failures are ComponentError):
        # what it built has no ``.to``: not a torch.nn.Module
        raise EvalError(
            f"model._target_ {shown(cfg.model.get('_target_'), 120)} does not build a "
            "torch.nn.Module; evaluate a run whose model is one"
        ) from None
    load_weights(model, state, path)
    task = build_task(cfg.task, cfg.get("loss"))
    weights, evaluated_with = evaluation_weights(cfg.get("step"), model, state, path)
    step = state["loop"]["global_step"]
    amp = float_math.autocast(precision)
    with weights:
        batches = pipeline.eval_batches("test")
        metrics = evaluate(
            task, model, batches, prefix="test", device=device, amp=amp,
            train_seed=seeds.train, global_step=step,
        )  # fmt: skip
    result = {
        "checkpoint": str(path),
        "global_step": step,
        "metrics": metrics,
        "evaluated_with": evaluated_with,
        "device": str(device),
        "evaluated_at": rec.now_iso(),
        "overrides": overrides or [],
    }
    text = rec.strict_json(result, indent=2) + "\n"
    rec.atomic_write_text(result_path(run_dir, path, step, overrides), text)
    if not overrides:  # the latest at the recorded settings; overrides never replace it
        rec.atomic_write_text(inside(run_dir, EVAL_JSON, "eval"), text)
    return result


EVAL_JSON = "eval.json"
#: One result per checkpoint and set of overrides: ``evals/<checkpoint>-step<N>[+<sha>].json``.
EVALS = "evals"


def result_path(
    run_dir: Path, checkpoint_path: Path, global_step: int, overrides: list[str] | None = None
) -> Path:
    """Where this evaluation is kept: one file per checkpoint at the recorded settings, and
    one per set of ``overrides`` beside it (named by their sha256), so that no evaluation
    under other settings (``trainer.precision=32-true`` of a bf16 run) replaces it."""
    stem = re.sub(r"[^\w.+-]", "_", Path(checkpoint_path).stem) or "checkpoint"
    name = f"{stem}-step{int(global_step)}"
    if overrides:
        name += "+" + hashlib.sha256("\n".join(overrides).encode()).hexdigest()[:12]
    return inside(run_dir, f"{EVALS}/{name}.json", "eval")


@cli.entry_point
def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("reprotrain.tools.runs.eval", __doc__)
    parser.add_argument("run_dir", type=Path, help="the run directory")
    parser.add_argument("--checkpoint", default="last", help="last (default) | best | <path>")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the recorded config")
    run_trust.add_arguments(parser)
    args = parser.parse_intermixed_args(argv)  # overrides after --checkpoint (make eval ARGS=)
    # A run from an archive is built only under a trust rule (nothing imported before).
    run_trust.require_trust([args.run_dir.expanduser()], args.trust, args.trusted_signers)
    result = evaluate_run(args.run_dir.expanduser(), args.checkpoint, args.overrides)
    metrics = " ".join(f"{shown(k, 80)}={shown(repr(v), 80)}" for k, v in result["metrics"].items())
    say(f"{metrics} ({result['checkpoint']})")  # names and paths escaped: the run's own text
    step, ckpt = result["global_step"], Path(result["checkpoint"])
    kept = result_path(args.run_dir.expanduser(), ckpt, step, args.overrides)
    latest = "" if args.overrides else f" (and {args.run_dir / EVAL_JSON}, the latest)"
    say(f"wrote {kept}{latest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
