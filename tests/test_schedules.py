"""Metric-driven schedulers and lr-setting callbacks (issue 45, point 8).

- ``scheduler=plateau`` (``ReduceLROnPlateau``) is stepped on ``trainer.monitor`` at each
  epoch end after validation: before, it passed preflight and died at step 1 with a
  traceback (``step() missing 'metrics'``); a metric scheduler whose ``mode`` disagrees with
  ``trainer.monitor_mode``, or a scheduler whose ``step`` needs two values, is refused in
  preflight in one line;
- its state is in every checkpoint: a SIGKILL and resume ends with the uninterrupted run's
  weights and lrs (slow tier);
- the rule for a callback that sets the lr (docs/callbacks.md): under a per-step schedule
  (which sets the lr after every step, and silently overwrote it before) the change is
  refused in one line naming the callback; under ``scheduler=none`` the callback owns the
  lr, and under ``plateau`` its change persists (the plateau scales the lr it finds).
"""

from __future__ import annotations

import signal

import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO, TINY, assert_ok, base_env, jsonl, run_json, train
from reprotrain import optim
from reprotrain.build import callbacks_for
from reprotrain.callbacks import CallbackContext
from reprotrain.errors import ReprotrainError

# Four epochs of three steps. threshold 1.0 (absolute) on val_acc: no epoch after the first
# improves on the best, so with patience 0 every epoch end from the second halves the lr.
PLATEAU = [
    "experiment=selfcheck",
    *TINY,
    "trainer.epochs=4",
    "scheduler=plateau",
    "scheduler.patience=0",
    "scheduler.threshold=1.0",
    "scheduler.threshold_mode=abs",
]


def env() -> dict[str, str]:
    return base_env(PYTHONPATH=str(REPO / "tests"))


@pytest.fixture(scope="module")
def plateau_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("plateau") / "run"
    assert_ok(train(run, *PLATEAU, "trainer.checkpoint_every_steps=1", micro=False))
    return run


def test_plateau_steps_on_the_monitored_metric_at_epoch_end(plateau_run):
    rows = jsonl(plateau_run / "metrics.jsonl")
    lr0 = rows[0]["lr"]
    assert lr0 > 0 and all(row.get("val_acc") is not None for row in rows)
    # Stalled at the end of epochs 2, 3: the next epoch's lr is halved (epoch 1 set the best).
    assert [row["lr"] for row in rows] == [lr0, lr0, lr0 * 0.5, lr0 * 0.25]
    for fp in jsonl(plateau_run / "fingerprints.jsonl"):  # no step moves it within an epoch
        assert len(set(fp["step_lrs"])) == 1, fp["step_lrs"]
    record = run_json(plateau_run)
    assert record["components"]["scheduler"] == "torch.optim.lr_scheduler.ReduceLROnPlateau"
    state = torch.load(plateau_run / "checkpoints" / "step-00000012.pt", weights_only=True)
    plateau = state["scheduler"]  # stepped once per epoch, the last cut after epoch 4
    assert plateau["last_epoch"] == 4 and plateau["mode"] == "max"
    assert plateau["_last_lr"] == [lr0 * 0.125]


@pytest.mark.slow  # three trainings; the default tier keeps the plateau run above
def test_a_killed_plateau_run_resumes_bitwise(plateau_run, tmp_path):
    """Killed in epoch 3, after the plateau cut the lr once and counted a bad epoch: a
    resume that lost its state would see epoch 3 as an improvement and not cut again."""
    run = tmp_path / "killed"
    args = [*PLATEAU, "trainer.checkpoint_every_steps=1"]
    proc = train(run, *args, micro=False, fault="step:8")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert_ok(train(run, *args, "resume=auto", micro=False))
    (entry,) = run_json(run)["resumes"]
    assert entry["bitwise_guarantee"] is True, entry
    assert run_json(run)["final_weights_sha256"] == run_json(plateau_run)["final_weights_sha256"]
    lrs = [row["lr"] for row in jsonl(run / "metrics.jsonl")]
    assert lrs == [row["lr"] for row in jsonl(plateau_run / "metrics.jsonl")]


def _check(*overrides: str) -> None:
    from reprotrain import preflight
    from reprotrain.config import register_configs

    register_configs()
    preflight.register_resolvers()
    preflight.check(["experiment=selfcheck", *overrides])


def test_a_scheduler_the_trainer_cannot_drive_is_refused_in_preflight(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    _check("scheduler=plateau")  # its mode follows trainer.monitor_mode
    _check("scheduler=plateau", "trainer.monitor=val_loss", "trainer.monitor_mode=min")
    with pytest.raises(ReprotrainError, match=r"^scheduler.mode=min but it steps on trainer"):
        _check("scheduler=plateau", "scheduler.mode=min")
    with pytest.raises(ReprotrainError, match=r"its step\(\) needs metrics, other"):
        _check("scheduler=constant", "scheduler._target_=callback_user_code.TwoArgumentScheduler")
    with pytest.raises(ReprotrainError, match=r"its step\(\) needs epoch; the trainer"):
        _check("scheduler=constant", "scheduler._target_=callback_user_code.EpochScheduler")


def _ctx(optimizer) -> CallbackContext:
    return CallbackContext(torch.nn.Linear(1, 1), optimizer, 1, 3, REPO)


def test_a_callbacks_lr_is_refused_under_a_per_step_schedule_and_kept_otherwise(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    node = OmegaConf.create({"decay": {"_target_": "callback_user_code.LrDecay"}})
    model = torch.nn.Linear(1, 1)
    per_step = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = optim.cosine(per_step, total_steps=10)
    with pytest.raises(ReprotrainError, match=r"^callback decay changed the lr in on_epoch_end"):
        callbacks_for(node, torch.device("cpu"), schedule).call("on_epoch_end", _ctx(per_step), {})
    for make in (optim.NoSchedule, torch.optim.lr_scheduler.ReduceLROnPlateau):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        schedule = optim.for_loop(make(optimizer))
        callbacks_for(node, torch.device("cpu"), schedule).call("on_epoch_end", _ctx(optimizer), {})
        for _ in range(3):  # optimizer steps: the schedule leaves the callback's lr
            optimizer.step()
            schedule.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01, rel=1e-12)


def test_under_scheduler_none_a_callback_owns_the_lr(tmp_path):
    run = tmp_path / "run"
    decay = "+callbacks.decay._target_=callback_user_code.LrDecay"
    assert_ok(train(run, "experiment=selfcheck", *TINY, "trainer.epochs=3", "scheduler=none",
                    decay, micro=False, env=env()))  # fmt: skip
    lrs = [row["lr"] for row in jsonl(run / "metrics.jsonl")]
    assert lrs == pytest.approx([lrs[0], lrs[0] * 0.1, lrs[0] * 0.01], rel=1e-12)
    assert run_json(run)["components"]["scheduler"] == "reprotrain.optim.NoSchedule"


def test_the_recorded_lr_is_the_schedules_onecycle_max_lr(tmp_path):
    """With torch's OneCycleLR the run's lr is its ``max_lr``, not the optimizer YAML's lr
    (issue 53): in run.json and in the trackers' params (``run.lr``)."""
    from reprotrain.loggers.params import run_params

    run = tmp_path / "run"
    onecycle = ["scheduler=constant", "scheduler._target_=torch.optim.lr_scheduler.OneCycleLR",
                "+scheduler.max_lr=0.5", "optimizer.lr=0.01"]  # fmt: skip
    assert_ok(train(run, "experiment=selfcheck", *TINY, *onecycle, micro=False))
    record = run_json(run)
    assert record["components"]["lr"] == 0.5
    assert run_params(run, record)["run.lr"] == 0.5
