"""Callbacks the lightning-hydra-template way (issue 38.2): a ``callbacks`` group of
``_target_``s with four hooks, each inside the RNG guard, its state checkpointed and covered
by the resume's replay."""

from __future__ import annotations

import csv
import json
import random
import signal

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO, TINY, assert_ok, base_env, jsonl, run_json, train
from reprotrain.callbacks import Callback, CallbackContext, Callbacks, rng_guard
from reprotrain.components import ComponentError, build_callbacks, check_node


def test_a_hook_that_draws_leaves_every_global_generator_where_it_was():
    before = random.getstate(), np.random.get_state()[1].copy(), torch.random.get_rng_state()
    with rng_guard(torch.device("cpu")):
        random.random(), np.random.rand(), torch.rand(3)
    after = random.getstate(), np.random.get_state()[1], torch.random.get_rng_state()
    assert before[0] == after[0] and (before[1] == after[1]).all()
    assert torch.equal(before[2], after[2])


def test_only_callbacks_with_state_are_a_part_and_they_round_trip():
    class Plain(Callback):
        pass

    class Counting(Callback):
        def __init__(self) -> None:
            self.n = 0

        def on_epoch_end(self, ctx, row) -> None:
            self.n += 1

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    plain = Callbacks({"plain": Plain()}, torch.device("cpu"))
    assert not plain.has_state() and plain.state_dict() == {}
    counting = Callbacks({"plain": Plain(), "count": Counting()}, torch.device("cpu"))
    ctx = CallbackContext(torch.nn.Linear(1, 1), None, 1, 3, REPO)
    counting.call("on_epoch_end", ctx, {})
    assert counting.has_state() and counting.state_dict() == {"count": {"n": 1}}
    again = Callbacks({"count": Counting()}, torch.device("cpu"))
    again.load_state_dict(counting.state_dict())
    assert again.callbacks["count"].n == 1


def test_the_group_is_built_by_target_and_a_bad_key_is_one_line():
    node = OmegaConf.create(
        {"noise": {"_target_": "callback_user_code.RandomDrawing"}, "off": None}
    )
    built = build_callbacks(node)
    assert list(built) == ["noise"] and built["noise"].epochs_seen == 0
    bad = OmegaConf.create({"_target_": "callback_user_code.RandomDrawing", "seed": 2})
    with pytest.raises(ComponentError, match=r"callbacks\.noise.*seed"):
        check_node(bad, "callbacks.noise")
    with pytest.raises(ComponentError, match=r"callbacks\.x has no _target_"):
        build_callbacks(OmegaConf.create({"x": {"seed": 1}}))


RUN = [
    "experiment=selfcheck",
    *TINY,
    "trainer.epochs=2",
    "trainer.checkpoint_every_steps=1",
    "model.dropout=0.3",
]  # fmt: skip  (dropout draws from the `train` stream)
DRAWING = ["+callbacks.noise._target_=callback_user_code.RandomDrawing",
           "+callbacks.history._target_=callback_user_code.LossHistory",
           "+callbacks.steps._target_=callback_user_code.StepCounter",  # per batch, ctx.log
           "logger=csv",  # metrics.csv, and a user's logger that draws in every hook:
           "+logger.sinks.drawing._target_=logger_user_code.RandomDrawing"]  # fmt: skip


def env():
    return base_env(PYTHONPATH=str(REPO / "tests"))


def test_callbacks_change_no_bits_and_a_callback_with_state_resumes_bitwise(tmp_path):
    """A callback that draws from every global generator in every hook (the per-batch one
    too), and a user's logger (a ``_target_`` under ``logger.sinks``) that draws in every
    hook, killed after the epoch-1 checkpoint and resumed: the callbacks' state is restored
    and replayed (the replay runs on_epoch_end and the per-batch hook), and the run ends
    with the weights of a run without any callback or logger (the guards) and a metric
    history equal to that run's metrics.jsonl. What a callback logs (``ctx.log``) reaches
    the loggers' epoch rows (the user's, metrics.csv), never metrics.jsonl; metrics.csv has
    each epoch once after the resume."""
    none, run = tmp_path / "none", tmp_path / "killed"
    assert_ok(train(none, *RUN, micro=False, env=env()))
    proc = train(run, *RUN, *DRAWING, micro=False, env=env(), fault="step:4")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert_ok(train(run, *RUN, *DRAWING, "resume=auto", micro=False, env=env()))
    (entry,) = run_json(run)["resumes"]
    assert entry["verified"] == "steps 3..3 replayed from step-00000002.pt, identical"
    assert entry["bitwise_guarantee"] is True
    assert run_json(run)["final_weights_sha256"] == run_json(none)["final_weights_sha256"]
    assert run_json(run)["components"]["callbacks"] == {
        "noise": "callback_user_code.RandomDrawing",
        "history": "callback_user_code.LossHistory",
        "steps": "callback_user_code.StepCounter",
    }
    history = json.loads((run / "loss_history.json").read_text())
    assert history == [row["train_loss"] for row in jsonl(none / "metrics.jsonl")]
    assert not any("steps_seen" in row for row in jsonl(run / "metrics.jsonl"))
    with (run / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    assert [float(r["train_loss"]) for r in rows] == history
    # Epoch 2 ran after the resume: its count is the uninterrupted run's (3 steps an epoch).
    # Epoch 1's row was rebuilt from the record, which holds no logged value.
    assert rows[1]["steps_seen"] == "6.0" and rows[0]["steps_seen"] == ""
    seen = jsonl(run / "user_logger.jsonl")
    epochs = [e for e in seen if e["hook"] == "log_epoch"]
    assert [e["epoch"] for e in epochs] == [1, 2] and epochs[-1]["row"]["steps_seen"] == 6
    assert [e["start_step"] for e in seen if e["hook"] == "start"][-1] > 0  # the resumed one
    assert seen[-1] == {"hook": "close", "status": "completed"}


class _Plain(Callback):
    pass


class _PerBatch(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_batch_end(self, ctx, step) -> None:
        self.steps.append(step)
        ctx.log("last_step", step)


def test_the_per_batch_hook_is_found_once_and_only_its_callbacks_are_called():
    """Without a callback that overrides ``on_train_batch_end`` the loop's per-step check is
    an empty mapping (no context, no call); with one, only that callback is called, and what
    it logs waits for the loggers' epoch row (``take_logged``), then is gone."""
    cpu = torch.device("cpu")
    assert not Callbacks({"plain": _Plain()}, cpu).per_batch
    assert not Callbacks({}, cpu).per_batch
    batchy = _PerBatch()
    callbacks = Callbacks({"plain": _Plain(), "batchy": batchy}, cpu)
    assert list(callbacks.per_batch) == ["batchy"]
    plain = callbacks.callbacks["plain"]
    plain.on_train_batch_end = lambda ctx, step: pytest.fail("a no-op hook was called")
    for step in (1, 2):
        callbacks.call("on_train_batch_end", CallbackContext(torch.nn.Linear(1, 1), None, 1,
                                                             step, REPO), step)  # fmt: skip
    assert batchy.steps == [1, 2]
    assert callbacks.take_logged() == {"last_step": 2.0} and callbacks.take_logged() == {}
    callbacks.logged.update(last_step=3.0, train_loss=9.0)  # a name the row has: the row's
    assert callbacks.take_logged({"train_loss": 1.0}) == {"train_loss": 1.0, "last_step": 3.0}


def test_on_checkpoint_runs_before_the_file_is_written(tmp_path):
    """The docstring's promise (issue 46): ``on_checkpoint`` sees ``path`` before the
    checkpoint exists, so what the callback changes is in it."""
    from types import SimpleNamespace

    from reprotrain.loop import Outputs, Trainer

    order: list[str] = []
    path = tmp_path / "step-00000003.pt"

    class Seeing(Callback):
        def on_checkpoint(self, ctx, p) -> None:
            order.append(f"hook exists={p.exists()}")

    trainer = SimpleNamespace(
        loop=SimpleNamespace(global_step=3, epoch=1),
        saver=SimpleNamespace(dir=tmp_path, save=lambda **kw: (path.touch(), order.append("save"))),
        callbacks=Callbacks({"seeing": Seeing()}, torch.device("cpu")), bar=None,
        continuation=SimpleNamespace(flush=list, verdict=lambda s: None, restart=lambda: None),
        runner=SimpleNamespace(state=SimpleNamespace(model=None, optimizer=None)),
        run_dir=tmp_path, dist=SimpleNamespace(is_main=True),
    )  # fmt: skip
    trainer.out = Outputs(trainer)  # the run's outputs: the checkpoint is written
    trainer.callback = lambda hook, *args: Trainer.callback(trainer, hook, *args)
    Trainer.save(trainer)
    assert order == ["hook exists=False", "save"]
    assert "before" in Callback.on_checkpoint.__doc__.lower().split("written")[0]


def test_the_lr_monitor_entry_sends_each_groups_lr_to_the_loggers():
    """``callbacks=lr_monitor`` builds from its YAML entry; at an epoch's end every
    parameter group's lr (and momentum) goes to the loggers' row, nothing to the record."""
    node = OmegaConf.load(REPO / "conf" / "callbacks" / "lr_monitor.yaml")
    node.lr_monitor.log_momentum = True
    callbacks = Callbacks(build_callbacks(node), torch.device("cpu"))
    a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    groups = [{"params": a.parameters()}, {"params": b.parameters(), "lr": 0.5}]
    optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    row = {"epoch": 1, "train_loss": 1.0}
    callbacks.call("on_epoch_end", CallbackContext(a, optimizer, 1, 3, REPO), row)
    assert callbacks.take_logged() == {
        "lr/group0": 0.1, "momentum/group0": 0.9, "lr/group1": 0.5, "momentum/group1": 0.9,
    }  # fmt: skip
    assert row == {"epoch": 1, "train_loss": 1.0}


def test_early_stopping_and_model_checkpoint_entries_set_the_trainers_keys():
    """``callbacks=[default,early_stopping]`` and ``callbacks=model_checkpoint`` are entries
    of the group that set the trainer keys the loop reads (after ``trainer: default``, so not
    reset by it); the command line still wins; they add no callback object."""
    from hydra import compose, initialize_config_dir

    from reprotrain import CONF_DIR
    from reprotrain.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        plain = compose("train", overrides=["experiment=selfcheck"])
        early = compose(
            "train", overrides=["experiment=selfcheck", "callbacks=[default,early_stopping]"]
        )
        ckpt = compose("train", overrides=["experiment=selfcheck", "callbacks=model_checkpoint",
                                           "trainer.keep_checkpoints=5"])  # fmt: skip
    assert plain.trainer.early_stopping_patience == 0
    assert early.trainer.early_stopping_patience == 3
    assert set(early.callbacks) == {"model_summary", "metric_history"}
    assert ckpt.trainer.keep_checkpoints == 5 and ckpt.trainer.checkpoint_every_steps == 0
    assert ckpt.callbacks is None
