"""The task seam: shipped tasks compute exact split metrics, the step's randomness is
counter-based, the README's mixup and second-loss tasks run, monitor typos are refused
before anything is written, and an experiment's tuned lr stays with its optimizer."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from conftest import REPO, TINY, assert_ok, base_env, run_json, train
from reprotrain import preflight
from reprotrain.config import register_configs
from reprotrain.errors import ReprotrainError
from reprotrain.state import MetricSums
from reprotrain.step.runner import evaluate
from reprotrain.tasks import Classification, Regression, StepContext

CPU = torch.device("cpu")


def splits_of(x: torch.Tensor, y: torch.Tensor, sizes: list[int]):
    start = 0
    for size in sizes:
        yield x[start : start + size], y[start : start + size]
        start += size


@pytest.mark.parametrize("outputs", [1, 3])
def test_regression_rmse_and_r2_are_exact_over_the_split(outputs):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(103, 4, generator=g)
    shape = (103,) if outputs == 1 else (103, outputs)
    y = (x[:, :1] * 2.0 + 5.0 + 0.3 * torch.randn(103, outputs, generator=g)).reshape(shape)
    model = nn.Linear(4, outputs)  # [B, 1] predictions of [B] targets are reshaped
    sizes = [40, 40, 23]  # uneven batches: a mean of per-batch R² would be wrong
    got = evaluate(Regression(), model, splits_of(x, y, sizes), prefix="val", device=CPU)
    with torch.no_grad():
        pred = model(x).double().numpy().reshape(shape)
    t = y.double().numpy()
    err = pred - t
    rmse = math.sqrt(float(np.mean(err**2)))
    t2 = t.reshape(len(t), -1)
    e2 = err.reshape(len(t), -1)
    r2 = np.mean(1 - (e2**2).sum(0) / ((t2 - t2.mean(0)) ** 2).sum(0))
    assert set(got) == {"val_loss", "val_rmse", "val_r2"}
    assert got["val_rmse"] == pytest.approx(rmse, rel=1e-9)
    assert got["val_r2"] == pytest.approx(float(r2), rel=1e-9)
    assert got["val_loss"] == pytest.approx(float(np.mean(err**2)), rel=1e-5)
    # ... and not the mean of per-batch R², which differs on these batches
    per_batch = [
        evaluate(Regression(), model, iter([b]), prefix="v", device=CPU)["v_r2"]
        for b in splits_of(x, y, sizes)
    ]
    assert abs(np.mean(per_batch) - got["val_r2"]) > 1e-6


def test_classification_computes_mean_loss_and_accuracy_from_sums():
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    x, y = torch.randn(50, 5), torch.randint(0, 3, (50,))
    got = evaluate(Classification(), model, splits_of(x, y, [32, 18]), prefix="test", device=CPU)
    with torch.no_grad():
        logits = model(x)
    assert got["test_acc"] == int((logits.argmax(1) == y).sum()) / 50
    ce = nn.functional.cross_entropy(logits, y).item()
    assert got["test_loss"] == pytest.approx(ce, rel=1e-6)


def test_metric_sums_keep_int64_counts_and_float64_values_and_resume_exactly():
    sums = MetricSums(CPU)
    sums.add({"loss": torch.tensor(0.1, dtype=torch.float32), "n": torch.tensor(3)}, 4)
    sums.add({"loss": torch.tensor(0.2, dtype=torch.float32), "n": torch.tensor(2)}, 4)
    assert sums.sums["loss"].dtype == torch.float64 and sums.sums["n"].dtype == torch.int64
    again = MetricSums(CPU)
    again.load_state_dict(sums.state_dict())
    assert again.host()["samples"] == 8
    assert torch.equal(again.sums["loss"], sums.sums["loss"])


def test_step_context_generator_is_counter_based_and_lazy():
    ctx = StepContext(CPU, global_step=5, microbatch=1, train_seed=42)
    assert ctx._generator is None and ctx._seed is None  # nothing drawn, nothing made
    a = torch.rand(4, generator=ctx.generator)
    same = StepContext(CPU, global_step=5, microbatch=1, train_seed=42)
    assert torch.equal(a, torch.rand(4, generator=same.generator))
    for other in (
        StepContext(CPU, global_step=5, microbatch=0, train_seed=42),
        StepContext(CPU, global_step=6, microbatch=1, train_seed=42),
        StepContext(CPU, global_step=5, microbatch=1, train_seed=43),
        StepContext(CPU, global_step=5, microbatch=1, train_seed=42, training=False),
    ):
        assert not torch.equal(a, torch.rand(4, generator=other.generator))


def tiny_train(run_dir, *overrides, env=None):
    return train(run_dir, *TINY, *overrides, env=env)


# --- trainer.monitor checked before the run -------------------------------------------------


def preflight_check(*overrides: str) -> None:
    register_configs()
    preflight.register_resolvers()
    preflight.check(["experiment=selfcheck", *overrides])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.monitor=val_rmse"], "trainer.monitor=val_rmse is not a metric of task"),
        (["trainer.monitor=val_acc", "trainer.monitor_mode=min"], "set trainer.monitor_mode=max"),
        (["trainer.monitor=val_loss"], "is better when lower; set trainer.monitor_mode=min"),
        (["task=regression", "loss=mse", "trainer.monitor=val_acc"], "it logs: val_loss, val_rmse"),
    ],
)
def test_monitor_typos_and_wrong_modes_are_refused(overrides, message):
    with pytest.raises(ReprotrainError, match=message.replace("(", r"\(")):
        preflight_check(*overrides)


def test_monitor_that_exists_passes():
    preflight_check(
        "task=regression", "loss=mse", "trainer.monitor=val_rmse", "trainer.monitor_mode=min"
    )
    preflight_check("task=aux_loss", "trainer.monitor=train_penalty", "trainer.monitor_mode=min")


def test_monitor_typo_exits_2_in_one_line_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "reprotrain.train", "experiment=selfcheck"]
    cmd += ["trainer.monitor=val_accc"]
    proc = subprocess.run(
        [*cmd, f"hydra.run.dir={run}"], cwd=REPO, env=base_env(), capture_output=True, text=True
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: trainer.monitor=val_accc is not a metric of task ")
    assert line.endswith("; it logs: val_loss, val_acc, train_loss, train_acc")
    assert not run.exists()


# --- an experiment's tuned lr belongs to its optimizer ------------------------------------


def composed(*overrides: str):
    register_configs()
    preflight.register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_run_json_shows_the_optimizers_own_lr(tmp_path):
    run = tmp_path / "run"
    assert_ok(tiny_train(run, "optimizer=adamw"))
    components = run_json(run)["components"]
    assert components["optimizer"] == "torch.optim.adamw.AdamW" and components["lr"] == 1e-3
