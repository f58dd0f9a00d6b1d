"""Loggers as ``_target_`` entries (issue 46.4): the shipped ones named in conf/logger/, a
CSV logger, and a user's logger written in the user's room (a ``reprotrain.api.Logger``)
that the framework builds and guards without being edited, named by a file of its own in
conf/logger/ as in lightning-hydra-template (issue 55.2)."""

from __future__ import annotations

import csv
import random
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from reprotrain.config import register_configs
from reprotrain.errors import ReprotrainError
from reprotrain.loggers import History, LoggerConfig, LoggerSettings, build_loggers
from reprotrain.loggers.shipped import SHIPPED

REPO = Path(__file__).resolve().parents[1]
RECORD = {"name": "smoke", "started_at": "2026-01-01T00:00:00+00:00", "config_sha256": "c" * 64}
USER = {"_target_": "logger_user_code.RandomDrawing"}


def logger_node(**entries):
    """The ``logger`` group as composed: the settings' defaults and ``entries`` beside them."""
    return OmegaConf.create({**asdict(LoggerConfig()), **entries})


@pytest.fixture(autouse=True)
def user_room(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tests"))  # where logger_user_code.py is


def generators():
    return random.getstate(), np.random.get_state()[1].copy(), torch.random.get_rng_state()


def test_a_users_logger_draws_in_every_hook_and_moves_no_generator(tmp_path: Path) -> None:
    """The user's logger draws from python's, NumPy's and torch's generators in every hook;
    after the run's calls every generator is where it was, so the training streams are the
    same with it as without it (the end-to-end twin: test_callbacks.py)."""
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    before = generators()
    cfg = logger_node(drawing=USER)
    with build_loggers(cfg, tmp_path, RECORD) as lg:
        assert lg.names == ["drawing"]
        lg.log_steps([1, 2], {"train_loss": [1.0, 0.5], "lr": [0.1, 0.1]})
        lg.end_batch(2)
        lg.log_epoch(1, 2, {"epoch": 1, "global_step": 2, "train_loss": 0.5})
        lg.log_final({"test_acc": 0.9})
    after = generators()
    assert before[0] == after[0] and (before[1] == after[1]).all()
    assert torch.equal(before[2], after[2])
    hooks = [line.split('"hook": "')[1].split('"')[0]
             for line in (tmp_path / "user_logger.jsonl").read_text().splitlines()]  # fmt: skip
    assert hooks == ["start", "log_steps", "log_epoch", "log_final", "close"]


def test_the_csv_logger_writes_one_row_per_epoch_and_a_resume_rebuilds_it(tmp_path: Path):
    cfg = LoggerConfig(csv={"_target_": "reprotrain.loggers.shipped.CSVLogger"})
    with build_loggers(cfg, tmp_path, RECORD) as lg:
        lg.log_epoch(1, 3, {"epoch": 1, "global_step": 3, "train_loss": 0.5, "note": "x"})
        lg.log_epoch(2, 6, {"epoch": 2, "global_step": 6, "train_loss": 0.25, "val_acc": 0.7})
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert rows == [
        {"epoch": "1", "global_step": "3", "train_loss": "0.5", "val_acc": ""},
        {"epoch": "2", "global_step": "6", "train_loss": "0.25", "val_acc": "0.7"},
    ]
    # Killed after epoch 2 had been logged but before its checkpoint: the resume continues
    # from epoch 1's, and the file holds every epoch once.
    history = History([], {}, [(1, 3, {"epoch": 1, "global_step": 3, "train_loss": 0.5})])
    with build_loggers(LoggerConfig(csv=True), tmp_path, RECORD, 3, history) as lg:
        assert [r["epoch"] for r in csv.DictReader((tmp_path / "metrics.csv").open())] == ["1"]
        lg.log_epoch(2, 6, {"epoch": 2, "global_step": 6, "train_loss": 0.25})
    assert [r["epoch"] for r in csv.DictReader((tmp_path / "metrics.csv").open())] == ["1", "2"]


def test_a_logger_that_is_no_logger_or_no_target_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ReprotrainError, match=r"^logger\.x: not a setting .* and no logger"):
        build_loggers(logger_node(x={"a": 1}), tmp_path, RECORD)
    with pytest.raises(ReprotrainError, match=r"^logger\.x: .*Path lacks start"):
        build_loggers(logger_node(x={"_target_": "pathlib.Path"}), tmp_path, RECORD)
    with pytest.raises(ReprotrainError, match=r"^logger\.x: cannot build nowhere\.Nope"):
        build_loggers(logger_node(x={"_target_": "nowhere.Nope"}), tmp_path, RECORD)
    # The settings keep their types without a schema: a wrong one is one line too.
    with pytest.raises(ReprotrainError, match=r"^logger\.log_every_steps: .*abc"):
        build_loggers(logger_node(log_every_steps="abc"), tmp_path, RECORD)
    assert not (tmp_path / "metrics.csv").exists()


def test_a_logger_that_cannot_start_is_switched_off_and_the_others_go_on(tmp_path, caplog):
    cfg = logger_node(csv=True, down={"_target_": "logger_user_code.Unreachable"})
    before = generators()
    with build_loggers(cfg, tmp_path, RECORD) as lg:
        assert lg.names == ["csv"]
        lg.log_epoch(1, 3, {"epoch": 1, "global_step": 3, "train_loss": 0.5})
    assert torch.equal(before[2], generators()[2])
    assert "logger down failed in start (ConnectionError: tracker.example" in caplog.text
    assert (tmp_path / "metrics.csv").is_file()


def compose_logger(*overrides: str):
    register_configs()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=["experiment=smoke", *overrides]).logger


def test_the_shipped_loggers_are_target_entries_and_a_users_yaml_adds_one(tmp_path: Path):
    """conf/logger/<name>.yaml names each shipped logger's class; ``logger=none`` and
    ``logger=[tensorboard,mlflow,wandb]`` compose as the docs show; a user's logger joins by
    a YAML of the user's own in LHT's shape, ``mine: {_target_: ...}`` (here in a folder on
    Hydra's search path, with the class of tests/logger_user_code.py: before, "Key 'mine'
    not in 'LoggerConfig'"), built by the framework with no framework file edited."""
    for name, cls in SHIPPED.items():
        node = OmegaConf.load(REPO / "conf" / "logger" / f"{name}.yaml")[name]
        assert node["_target_"] == f"{cls.__module__}.{cls.__qualname__}"
    assert LoggerSettings.of(compose_logger("logger=none")).backends == []
    every = compose_logger("logger=[tensorboard,mlflow,wandb]")
    assert LoggerSettings.of(every).backends == ["tensorboard", "mlflow", "wandb"]
    room = tmp_path / "conf"
    (room / "logger").mkdir(parents=True)
    (room / "logger" / "mine.yaml").write_text(
        "mine:\n  _target_: logger_user_code.RandomDrawing\n"
    )
    mine = compose_logger("logger=[csv,mine]", f"hydra.searchpath=[file://{room}]")
    assert LoggerSettings.of(mine).backends == ["csv", "mine"]
    (tmp_path / "run").mkdir()
    with build_loggers(mine, tmp_path / "run", RECORD) as lg:
        assert lg.names == ["csv", "drawing"]
        lg.log_epoch(1, 3, {"epoch": 1, "global_step": 3, "train_loss": 0.5})
    assert (tmp_path / "run" / "metrics.csv").is_file()
    assert (tmp_path / "run" / "user_logger.jsonl").is_file()
