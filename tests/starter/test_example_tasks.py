"""The user's example tasks (src/starter/task.py: mixup, a second loss term) run by the
trainer, and the reference experiments' tuned values staying with their optimizer."""

from __future__ import annotations

import math

import torch
from hydra import compose, initialize_config_dir
from torch import nn

from conftest import REPO, TINY, assert_ok, jsonl, run_json, train
from reprotrain import preflight
from reprotrain.config import register_configs
from reprotrain.tasks import StepContext

CPU = torch.device("cpu")


def tiny_train(run_dir, *overrides, env=None):
    return train(run_dir, "experiment=smoke", *TINY, *overrides, env=env, micro=False)


def composed(*overrides: str):
    register_configs()
    preflight.register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_mixup_draws_only_from_the_step_context():
    from starter.task import Mixup

    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    task = Mixup(alpha=0.4)

    def loss_at(step: int, micro: int) -> torch.Tensor:
        ctx = StepContext(CPU, global_step=step, microbatch=micro, train_seed=7)
        return task.training_step(model, (x, y), ctx).loss

    before = torch.get_rng_state()
    first = loss_at(3, 0)
    assert torch.equal(torch.get_rng_state(), before)  # no global draw
    assert torch.equal(first, loss_at(3, 0))
    assert not torch.equal(first, loss_at(3, 1))
    assert not torch.equal(first, loss_at(4, 0))


def test_mixup_task_repeats_bitwise(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert_ok(tiny_train(a, "task=mixup"))
    assert_ok(tiny_train(b, "task=mixup"))
    ra, rb = run_json(a), run_json(b)
    assert ra["components"]["task"] == "starter.task.Mixup"
    assert ra["final_weights_sha256"] == rb["final_weights_sha256"]
    plain = tmp_path / "plain"
    assert_ok(tiny_train(plain))
    assert run_json(plain)["final_weights_sha256"] != ra["final_weights_sha256"]


def test_second_loss_term_is_trained_and_logged_by_name(tmp_path):
    run = tmp_path / "run"
    assert_ok(
        tiny_train(run, "task=aux_loss", "trainer.monitor=val_ce", "trainer.monitor_mode=min")
    )
    row = jsonl(run / "metrics.jsonl")[-1]
    for key in ("train_ce", "train_penalty", "val_ce", "val_penalty", "val_acc"):
        assert math.isfinite(row[key]), key
    final = run_json(run)["final_metrics"]
    assert {"test_ce", "test_penalty", "test_loss", "test_acc"} <= set(final)
    assert row["val_loss"] > row["val_ce"]  # the penalty term is in the loss


def test_experiment_lr_tuned_for_sgd_does_not_leak_into_another_optimizer():
    assert composed("experiment=smoke").optimizer.lr == 0.2
    adamw = composed("experiment=smoke", "optimizer=adamw").optimizer
    assert (
        adamw._target_ == "torch.optim.AdamW"
        and adamw.lr == composed("optimizer=adamw").optimizer.lr
    )
    assert composed("experiment=smoke", "optimizer=adamw", "optimizer.lr=0.01").optimizer.lr == 0.01
    assert composed("experiment=cifar10_resnet18").optimizer.lr == 0.2
    assert composed("experiment=cifar10_resnet18", "optimizer=adamw").optimizer.lr == 1e-3
