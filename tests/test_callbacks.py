"""Callbacks the lightning-hydra-template way (issue 38.2): a ``callbacks`` group of
``_target_``s with six hooks, each inside the RNG guard, its state checkpointed and covered
by the resume's replay; Lightning's early stopping, model checkpoint and lr monitor under
Lightning's keys, values logged per step at the step's rate and kept across a resume in
every logger, one-line refusals with no run directory (issue 55.1)."""

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
from reprotrain.errors import ReprotrainError


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
           "+logger.drawing._target_=logger_user_code.RandomDrawing"]  # fmt: skip


def env():
    return base_env(PYTHONPATH=str(REPO / "tests"))


def test_callbacks_change_no_bits_and_a_callback_with_state_resumes_bitwise(tmp_path):
    """A callback that draws from every global generator in every hook (the per-batch one
    too), and a user's logger (a ``_target_`` entry of the ``logger`` group) that draws in every
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
    # Logged in the per-batch hook: per step (logged.jsonl), not in the epoch rows.
    assert "steps_seen" not in rows[1]
    steps = {e["global_step"]: e["values"]["steps_seen"] for e in jsonl(run / "logged.jsonl")}
    assert steps == {s: float(s) for s in range(1, 7)}  # the resumed ones counted on
    seen = jsonl(run / "user_logger.jsonl")
    epochs = [e for e in seen if e["hook"] == "log_epoch"]
    assert [e["epoch"] for e in epochs] == [1, 2]
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
    it logs waits for the loggers at its own step (``take_steps``), then is gone."""
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
    assert callbacks.take_logged() == {}  # nothing for the epoch's row
    assert callbacks.take_steps(1) == {1: {"last_step": 1.0}}  # up to the step sent
    assert callbacks.take_steps(2) == {2: {"last_step": 2.0}} and callbacks.take_steps(9) == {}
    # An instance may skip a hook its class defines (LearningRateMonitor at epoch interval).
    batchy.skips = ("on_train_batch_end",)
    assert not Callbacks({"batchy": batchy}, cpu).per_batch


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


def compose_train(*overrides: str):
    from hydra import compose, initialize_config_dir

    from reprotrain import CONF_DIR
    from reprotrain.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=["experiment=selfcheck", *overrides])


def test_lightnings_three_callbacks_are_entries_with_lightnings_keys_and_no_trainer_twin():
    """``callbacks=[early_stopping,model_checkpoint,lr_monitor]`` builds Lightning's three
    callbacks with the keys LHT users type (``callbacks.early_stopping.patience``,
    ``callbacks.model_checkpoint.save_top_k``); their monitor is ``trainer.monitor`` unless
    set; the trainer has no second spelling of them."""
    from reprotrain.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
    from reprotrain.config import TrainerConfig

    cfg = compose_train(
        "callbacks=[early_stopping,model_checkpoint,lr_monitor]",
        "callbacks.early_stopping.patience=5", "callbacks.early_stopping.min_delta=0.01",
        "callbacks.model_checkpoint.save_top_k=2", "callbacks.model_checkpoint.every_n_epochs=3",
        "callbacks.model_checkpoint.save_last=false", "callbacks.lr_monitor.logging_interval=step",
    )  # fmt: skip
    built = build_callbacks(cfg.callbacks)
    early, ckpt, lr = built["early_stopping"], built["model_checkpoint"], built["lr_monitor"]
    assert isinstance(early, EarlyStopping) and isinstance(ckpt, ModelCheckpoint)
    assert isinstance(lr, LearningRateMonitor) and lr.logging_interval == "step"
    assert (early.monitor, early.mode, early.patience, early.min_delta) == (
        "val_acc",
        "max",
        5,
        0.01,
    )
    assert (ckpt.monitor, ckpt.save_top_k, ckpt.every_n_epochs) == ("val_acc", 2, 3)
    assert ckpt.save_last is False
    names = set(TrainerConfig.__dataclass_fields__)
    assert not {n for n in names if "early_stopping" in n or "save_top_k" in n}


def test_model_checkpoint_keeps_the_top_k_and_last_and_its_decision_is_its_state(tmp_path):
    """Decided at the epoch's end (before its checkpoint, so the decision is in it), placed
    once the checkpoint is written; a file a kill kept from being placed is placed at the
    next start; a file no longer among the best is removed."""
    from reprotrain.callbacks import ModelCheckpoint
    from reprotrain.repro.checkpoint import step_path

    ckpt = ModelCheckpoint(monitor="val_acc", mode="max", save_top_k=2)
    for epoch, acc in enumerate([0.5, 0.7, 0.6, 0.4], start=1):
        step = 3 * epoch
        ctx = CallbackContext(torch.nn.Linear(1, 1), None, epoch, step, tmp_path)
        ckpt.on_epoch_end(ctx, {"val_acc": acc, "val_loss": 1.0})
        step_path(tmp_path / "checkpoints", step).parent.mkdir(exist_ok=True)
        step_path(tmp_path / "checkpoints", step).write_bytes(f"epoch {epoch}".encode())
        ckpt.on_checkpoint_written(ctx, step_path(tmp_path / "checkpoints", step))
    files = {p.name: p.read_text() for p in (tmp_path / "checkpoints").glob("[!s]*.pt")}
    assert files == {"epoch_002.pt": "epoch 2", "epoch_003.pt": "epoch 3", "last.pt": "epoch 4"}
    again = ModelCheckpoint(monitor="val_acc", mode="max", save_top_k=2)
    again.load_state_dict(ckpt.state_dict())
    (tmp_path / "checkpoints" / "epoch_003.pt").unlink()  # killed before it was placed
    again.on_start(CallbackContext(torch.nn.Linear(1, 1), None, 5, 12, tmp_path))
    assert (tmp_path / "checkpoints" / "epoch_003.pt").read_text() == "epoch 3"
    with pytest.raises(ReprotrainError, match=r"monitor=val_ac is not a metric of this run"):
        ModelCheckpoint(monitor="val_ac").on_epoch_end(ctx, {"val_acc": 0.1, "train_loss": 1.0})


LIGHTNING = [
    "experiment=selfcheck", *[o for o in TINY if o != "logger=none"], "trainer.epochs=2",
    "logger=[tensorboard,csv]", "logger.log_every_steps=1",
    "callbacks=[model_checkpoint,lr_monitor]", "trainer.monitor=train_loss",
    "trainer.monitor_mode=min", "+callbacks.every_other._target_=callback_user_code.EveryOtherStep",
]  # fmt: skip


def test_a_step_logged_value_reaches_tensorboard_at_its_steps_and_every_value_survives_a_resume(
    tmp_path,
):
    """Killed after epoch 1's checkpoint and resumed: epoch 1's ``lr/group0`` (lr_monitor) is
    in the CSV and in TensorBoard, and a value logged every second step is in TensorBoard at
    steps 2, 4, 6 (it reached it once per epoch before); ``callbacks=model_checkpoint`` wrote
    the ``last.pt`` and the best epoch its YAML promises."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    proc = train(run, *LIGHTNING, micro=False, env=env(), fault="step:4")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert_ok(train(run, *LIGHTNING, "resume=auto", micro=False, env=env()))
    with (run / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["1", "2"] and all(r["lr/group0"] for r in rows)
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("step/every_other")] == [2, 4, 6]
    assert [e.value for e in acc.Scalars("step/every_other")] == [2.0, 4.0, 6.0]
    assert [e.step for e in acc.Scalars("epoch/lr/group0")] == [3, 6]
    checkpoints = run / "checkpoints"
    losses = [r["train_loss"] for r in jsonl(run / "metrics.jsonl")]
    kept = f"epoch_{1 + losses.index(min(losses)):03d}.pt"
    assert {p.name for p in checkpoints.glob("[!s]*.pt")} == {"best.pt", "last.pt", kept}
    assert (checkpoints / "last.pt").read_bytes() == (checkpoints / "step-00000006.pt").read_bytes()


BAD = [
    # Hydra's hint followed without picking the entry: a node with no _target_.
    (["+callbacks.early_stopping.patience=5"], "callbacks.early_stopping has no _target_"),
    # An unknown key of a picked entry, Hydra's "+" hint followed.
    (["callbacks=early_stopping", "+callbacks.early_stopping.patiense=5"],
     "unknown key 'patiense'"),
    # ... and without the "+": Hydra's own refusal, in one line.
    (["callbacks=early_stopping", "callbacks.early_stopping.patiense=5"], "patiense"),
    # The group's own default value, null, on the command line.
    (["callbacks=null"], "callbacks=null"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "said"), BAD)
def test_a_bad_callback_override_is_one_line_exit_2_and_leaves_no_run_directory(
    tmp_path, overrides, said
):
    run = tmp_path / "run"
    proc = train(run, "experiment=selfcheck", *TINY, *overrides, micro=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], proc.stderr
    assert not run.exists()
