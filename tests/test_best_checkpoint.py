"""best.pt cannot disagree with the record, and pruning only counts the run's own checkpoints.

One real kill (between writing ``step-16.pt`` and ``best.pt``) and resume, compared with the
session's uninterrupted reference run; the rest is in-process on tiny hand-made checkpoints.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from conftest import REPO, assert_ok, base_env, train
from reprotrain.hashing import state_sha256
from reprotrain.repro import checkpoint
from reprotrain.tools.runs import eval as evaluation

SEEDS = {"base": 1, "init": 2}


class Part:
    def __init__(self, sd: dict) -> None:
        self.sd = sd

    def state_dict(self) -> dict:
        return dict(self.sd)


class Loop(Part):
    def __init__(self) -> None:
        super().__init__({})
        self.global_step = 0

    def state_dict(self) -> dict:
        return {"global_step": self.global_step, "epoch": 1, "epoch_step": self.global_step}


def fake_checkpoint(path: Path, global_step: int, seeds: dict = SEEDS, **loop) -> bytes:
    state = {
        "format_version": checkpoint.FORMAT_VERSION,
        "seeds": seeds,
        "model": {"w": torch.tensor([float(global_step)])},
        "loop": {"global_step": global_step, "epoch": 1, "epoch_step": global_step, **loop},
    }
    data = checkpoint.serialise(state)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def test_pruning_counts_and_deletes_only_checkpoints_that_load_and_belong(tmp_path):
    ckpts = tmp_path / "checkpoints"
    fake_checkpoint(checkpoint.step_path(ckpts, 2), 2)
    (ckpts / "step-99999999.pt").write_bytes(b"not a checkpoint")  # newest by name
    fake_checkpoint(checkpoint.step_path(ckpts, 88888888), 88888888, seeds={"base": 9})
    fake_checkpoint(ckpts / "step-77777777.pt", 5)  # renamed: the step inside is 5
    loop = Loop()
    meta = checkpoint.Meta(config={}, config_sha256="", seeds=SEEDS, env={})
    saver = checkpoint.Saver(ckpts, {"model": Part({"w": torch.zeros(1)}), "loop": loop}, meta,
                             keep=2)  # fmt: skip
    assert saver.own == [checkpoint.step_path(ckpts, 2)]
    for step in (3, 4, 6):
        loop.global_step = step
        saver.save()
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["step-00000004.pt", "step-00000006.pt", "step-77777777.pt",
                     "step-88888888.pt", "step-99999999.pt"], names  # fmt: skip


def test_reconcile_best_copies_the_best_epochs_checkpoint_or_removes_a_stale_one(tmp_path):
    ckpts = tmp_path / "checkpoints"
    fake_checkpoint(ckpts / "best.pt", 8, epoch=2, epoch_step=0, best_epoch=1)
    want = fake_checkpoint(checkpoint.step_path(ckpts, 16), 16, epoch=3, epoch_step=0, best_epoch=2)
    loop = checkpoint.load(checkpoint.step_path(ckpts, 16))["loop"]
    note = checkpoint.reconcile_best(ckpts, loop)
    assert "did not hold the recorded best epoch 2; rewritten from step-00000016.pt" in note
    assert (ckpts / "best.pt").read_bytes() == want
    assert checkpoint.reconcile_best(ckpts, loop) is None, "now it agrees"
    assert "no checkpoint of it is left; removed" in checkpoint.reconcile_best(
        ckpts, {**loop, "best_epoch": 7}
    )
    assert not (ckpts / "best.pt").exists()
    rows = [{"epoch": 1, "val_acc": 0.2}, {"epoch": 2, "val_acc": 0.2},
            {"epoch": 3, "val_acc": float("nan")}, {"epoch": 4}]  # fmt: skip
    assert checkpoint.recorded_best_epoch(rows, "val_acc", "max") == 1  # ties keep the first


def _model_sha(path: Path) -> str:
    return state_sha256(checkpoint.load(path)["model"])


def test_kill_between_step_and_best_then_resume_gives_the_uninterrupted_best(
    reference_run, tmp_path
):
    run = tmp_path / "run"
    proc = train(run, "trainer.checkpoint_every_steps=3", fault="before-best:16")
    assert proc.returncode == -9, proc.stderr[-2000:]
    best, ref_best = run / "checkpoints" / "best.pt", reference_run / "checkpoints" / "best.pt"
    assert checkpoint.load(best)["loop"]["epoch"] == 2, "killed: best.pt still holds epoch 1"
    assert checkpoint.load(ref_best)["loop"]["epoch"] == 3, "the reference's best is epoch 2"
    try:  # make eval CKPT=best refuses the disagreement in one line
        evaluation.evaluate_run(run, "best")
        raise AssertionError("a stale best.pt was evaluated")
    except evaluation.EvalError as e:
        assert "holds epoch 1, but metrics.jsonl records val_acc best at epoch 2" in str(e)
    resumed = subprocess.run(
        [sys.executable, "-m", "reprotrain.tools.runs.resume", str(run)],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert_ok(resumed)
    assert "rewritten from step-00000016.pt" in resumed.stderr + resumed.stdout
    assert best.read_bytes() != b"" and _model_sha(best) == _model_sha(ref_best)
    assert _untimed(checkpoint.load(best)["loop"]) == _untimed(checkpoint.load(ref_best)["loop"])
    assert (
        evaluation.evaluate_run(run, "best")["metrics"]
        == evaluation.evaluate_run(_copy(reference_run, tmp_path), "best")["metrics"]
    )


def _untimed(loop: dict) -> dict:
    rows = [{k: v for k, v in r.items() if k not in ("seconds", "images_per_s")}
            for r in loop["metrics"]]  # fmt: skip
    return {**loop, "metrics": rows}


def _copy(run: Path, tmp_path: Path) -> Path:
    """eval writes eval.json: never into the shared reference run."""
    dest = tmp_path / "ref-copy"
    shutil.copytree(run, dest)
    return dest


def test_eval_keeps_one_result_per_checkpoint_evaluated(reference_run, tmp_path):
    """make eval CKPT=best after make eval (last): the first result is still there."""
    run = _copy(reference_run, tmp_path)
    last = evaluation.evaluate_run(run, "last")
    best = evaluation.evaluate_run(run, "best")
    kept = sorted((run / "evals").glob("*.json"))
    assert len(kept) == 2, kept
    results = {json.loads(p.read_text())["checkpoint"]: json.loads(p.read_text()) for p in kept}
    assert results[last["checkpoint"]]["metrics"] == last["metrics"]
    assert results[best["checkpoint"]]["metrics"] == best["metrics"]
    assert json.loads((run / "eval.json").read_text())["checkpoint"] == best["checkpoint"]
