"""Loggers are sinks: what they receive, what they write, and what they must never touch."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from reprotrain import loggers
from reprotrain.errors import ReprotrainError
from reprotrain.loggers import (
    EXTRAS_INSTALL,
    LoggerConfig,
    Loggers,
    LoggerSettings,
    build_loggers,
    run_params,
)

REPO = Path(__file__).resolve().parents[1]
RECORD = {
    "experiment_id": "abcd1234-deadbeef-cpu",
    "name": "smoke",
    "started_at": "2026-01-01T00:00:00+00:00",
    "config_sha256": "c" * 64,
    "seeds": {"base": 42, "init": 1, "data": 2, "augment": 3, "train": 4},
    "repro": {"level": "strict"},
    "git": {"commit": "f" * 40, "dirty": False},
    "lock_sha256": "e" * 64,
    "environment": {"env": {"WANDB_API_KEY": "sekrit-from-record"}},
    "command": ["python", "-m", "reprotrain.train", "token=sekrit-from-argv"],
}


def scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_has_one_point_per_step_and_epoch_rows(tmp_path: Path) -> None:
    losses = [2.3 - 0.1 * i for i in range(10)]
    lrs = [0.01 * (i + 1) for i in range(10)]
    with build_loggers(LoggerConfig(tensorboard=True), tmp_path, RECORD) as lg:
        # Handed over in batches, as the loop does at its logging cadence and epoch end.
        lg.log_steps(list(range(1, 7)), {"train_loss": losses[:6], "lr": lrs[:6]})
        lg.log_steps(list(range(7, 11)), {"train_loss": losses[6:], "lr": lrs[6:]})
        row = {"epoch": 1, "global_step": 10, "train_loss": 1.9, "test_acc": 0.5, "x": None}
        lg.log_epoch(1, 10, row)
        lg.log_final({"test_acc": 0.5, "note": "text is not a metric"})

    log_dir = tmp_path / "tensorboard"
    loss = scalars(log_dir, "step/train_loss")
    assert [s for s, _ in loss] == list(range(1, 11))
    assert [v for _, v in loss] == pytest.approx(losses)
    assert [v for _, v in scalars(log_dir, "step/lr")] == pytest.approx(lrs)
    assert scalars(log_dir, "epoch/test_acc") == [(10, pytest.approx(0.5))]
    assert scalars(log_dir, "epoch/epoch") == [(10, 1.0)]


def test_a_diverged_loss_reaches_the_dashboard_as_nan(tmp_path: Path) -> None:
    with build_loggers(LoggerConfig(tensorboard=True), tmp_path, RECORD) as lg:
        lg.log_steps([1, 2, 3], {"train_loss": [2.0, float("nan"), None]})
    points = scalars(tmp_path / "tensorboard", "step/train_loss")
    assert [s for s, _ in points] == [1, 2]  # None: nothing to show; NaN: shown
    assert math.isnan(points[1][1])


def test_resumed_tensorboard_is_rebuilt_from_the_record_up_to_the_checkpoint(
    tmp_path: Path,
) -> None:
    with build_loggers(LoggerConfig(tensorboard=True), tmp_path, RECORD) as lg:
        lg.log_steps(list(range(1, 9)), {"train_loss": [1.0] * 8})  # killed after step 8
        lg.log_steps([3, 3], {"train_loss": [9.0, 9.0]})  # and whatever else it left
    # The checkpoint was at global step 5 (epoch 1 = steps 1-4, epoch 2 resumed at step 5).
    fingerprints = [{"epoch": 1, "global_step": 4, "step_losses": [1.0] * 4,
                     "step_lrs": [0.1] * 4}]  # fmt: skip
    metrics = [{"epoch": 1, "global_step": 4, "val_acc": 0.5}]
    history = loggers.resumed_history(fingerprints, metrics, [1.5], [0.2], global_step=5)
    cfg = LoggerConfig(tensorboard=True)
    with build_loggers(cfg, tmp_path, RECORD, start_step=5, history=history) as lg:
        lg.log_steps([6, 7, 8, 9], {"train_loss": [2.0] * 4})
    points = scalars(tmp_path / "tensorboard", "step/train_loss")
    assert [s for s, _ in points] == list(range(1, 10))
    assert [v for _, v in points] == [1.0] * 4 + [1.5] + [2.0] * 4
    assert [v for _, v in scalars(tmp_path / "tensorboard", "step/lr")] == pytest.approx(
        [0.1] * 4 + [0.2]
    )
    assert scalars(tmp_path / "tensorboard", "epoch/val_acc") == [(4, 0.5)]


class _Greedy(loggers.Logger):
    """A backend that draws from every global RNG, as third-party code may."""

    name = "greedy"

    def _draw(self, *args: object) -> None:
        random.random()
        np.random.rand()
        torch.rand(1)

    log_steps = log_epoch = log_final = close = _draw


def _rng_state() -> tuple:
    return random.getstate(), np.random.get_state()[1].tobytes(), torch.get_rng_state()


def test_logging_leaves_every_global_rng_where_it_was() -> None:
    torch.manual_seed(0)
    before = _rng_state()
    lg = Loggers([_Greedy()])
    lg.log_steps([1], {"train_loss": [1.0]})
    lg.log_epoch(1, 1, {"train_loss": 1.0})
    lg.log_final({"test_acc": 1.0})
    lg.close()
    after = _rng_state()
    assert before[0] == after[0] and before[1] == after[1]
    assert torch.equal(before[2], after[2])


class _Broken(loggers.Logger):
    name = "broken"

    def log_steps(self, *args: object) -> None:
        raise ConnectionError("server went away\nsecond line")


class _Counting(loggers.Logger):
    name = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def log_steps(self, *args: object) -> None:
        self.calls += 1


def test_a_failing_backend_is_switched_off_and_the_others_go_on(caplog) -> None:
    ok = _Counting()
    lg = Loggers([_Broken(), ok])
    lg.log_steps([1], {"train_loss": [1.0]})
    lg.log_steps([2], {"train_loss": [1.0]})
    assert ok.calls == 2 and lg.names == ["counting"]
    assert "logger broken failed in log_steps (ConnectionError: server went away)" in caplog.text


def test_series_of_the_wrong_length_is_a_bug_not_a_silent_shift() -> None:
    with pytest.raises(ValueError, match="2 values, 3 steps"):
        Loggers([]).log_steps([1, 2, 3], {"train_loss": [1.0, 2.0]})


def test_non_zero_ranks_write_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    lg = build_loggers(LoggerConfig(tensorboard=True), tmp_path, RECORD)
    lg.log_steps([1], {"train_loss": [1.0]})
    lg.close()
    assert lg.names == [] and list(tmp_path.iterdir()) == []


def test_missing_optional_extra_is_one_line_naming_the_locked_install(monkeypatch) -> None:
    from reprotrain.loggers import settings

    monkeypatch.setattr(settings, "module_absent", lambda module: module in ("mlflow", "wandb"))
    for backend in ("mlflow", "wandb"):
        with pytest.raises(ReprotrainError) as e:
            loggers.check_extras(LoggerSettings.of(LoggerConfig(**{backend: True})))
        msg = str(e.value)
        assert "\n" not in msg and f"logger={backend}" in msg
        assert f"make install EXTRAS={backend}" in msg


def test_bad_values_fail_in_one_line() -> None:
    with pytest.raises(ReprotrainError, match="log_every_steps=-1 must be >= 0"):
        LoggerSettings.of(LoggerConfig(log_every_steps=-1))
    with pytest.raises(ReprotrainError, match="wandb_mode='cloud' is not one of"):
        LoggerSettings.of(LoggerConfig(wandb_mode="cloud"))


def _compose(*options: str):
    """What Hydra does for ``logger=[a,b]``: merge each option onto the schema, in order."""
    cfg = OmegaConf.structured(LoggerConfig)
    for name in options:
        cfg = OmegaConf.merge(cfg, OmegaConf.load(REPO / "conf" / "logger" / f"{name}.yaml"))
    return cfg


def test_logger_options_combine_as_a_list_and_none_switches_all_off() -> None:
    assert LoggerSettings.of(_compose("tensorboard")).backends == ["tensorboard"]
    assert LoggerSettings.of(_compose("tensorboard", "mlflow")).backends == [
        "tensorboard",
        "mlflow",
    ]
    both = _compose("wandb", "tensorboard", "mlflow")
    assert LoggerSettings.of(both).backends == ["tensorboard", "mlflow", "wandb"]
    assert LoggerSettings.of(_compose("tensorboard", "none")).backends == []
    options = sorted(p.stem for p in (REPO / "conf" / "logger").glob("*.yaml"))
    assert options == ["csv", "mlflow", "none", "tensorboard", "wandb"]


def test_tracker_params_carry_identity_but_no_environment_or_command(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "sekrit-from-env")
    (tmp_path / "config.resolved.yaml").write_text(
        "optimizer:\n  lr: 0.2\nseed:\n  base: 42\n"
        "logger:\n  mlflow_tracking_uri: https://user:sekrit@example.org\n"
    )
    params = run_params(tmp_path, RECORD)
    assert not [k for k in params if k.startswith("config.logger.")]
    assert params["config.optimizer.lr"] == 0.2  # typed (issue 55.2): str()ed before
    assert params["run.experiment_id"] == RECORD["experiment_id"]
    assert params["run.seed.base"] == 42 and params["run.repro.level"] == "strict"
    assert "sekrit" not in json.dumps(params)


def test_wandb_is_offline_unless_a_key_is_configured(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc from `wandb login`
    monkeypatch.delenv("NETRC", raising=False)
    assert loggers.resolve_wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x")
    assert loggers.resolve_wandb_mode("auto") == "online"
    assert loggers.resolve_wandb_mode("disabled") == "disabled"


def test_mlflow_local_store_round_trip(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason=f"optional extra not installed: {EXTRAS_INSTALL}")
    pytest.importorskip("sqlalchemy", reason=f"optional extra not installed: {EXTRAS_INSTALL}")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path.resolve() / 'mlruns.db'}"
    cfg = LoggerConfig(mlflow=True, mlflow_tracking_uri=uri)
    with build_loggers(cfg, tmp_path / "run", RECORD) as lg:
        lg.log_steps([1, 2, 3], {"train_loss": [3.0, 2.0, 1.0]})
        lg.log_epoch(1, 3, {"test_acc": 0.5})
        run_id = lg._backends[0].run_id
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(run_id, "step/train_loss")
    assert [(m.step, m.value) for m in history] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert "sekrit" not in json.dumps(run.data.params)


def test_wandb_offline_run_is_written_into_the_run_dir(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason=f"optional extra not installed: {EXTRAS_INSTALL}")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = LoggerConfig(wandb=True, wandb_mode="offline")
    with build_loggers(cfg, tmp_path, RECORD) as lg:
        lg.log_steps([1, 2], {"train_loss": [2.0, 1.0]})
    assert list((tmp_path / "wandb").glob("offline-run-*"))
