"""Optuna inputs from the command line: the documented search-space forms pass preflight
(interval, log, choice, range) and are recorded in study.json; what cannot work (a swept
``hydra.sweeper.params.*``, a searched ``repro``, a bad ``n_trials``, no search space, a
range under the basic sweeper) is one line before anything is written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, base_env
from reprotrain import preflight
from reprotrain.config import register_configs
from reprotrain.errors import ReprotrainError
from reprotrain.tools.sweeps import optuna_study
from test_optuna_sweeps import compose_study

SMOKE = ["experiment=smoke"]
RANGES = ["optimizer.lr=tag(log,interval(0.01,1))", "optimizer.weight_decay=choice(0.0,0.0005)",
          "trainer.epochs=range(1,3)"]  # fmt: skip


def check(*overrides: str) -> list:
    register_configs()
    preflight.register_resolvers()
    return preflight.compose_all(["--multirun", *overrides])


def test_command_line_search_ranges_pass_preflight_with_both_ends_composed():
    composed = check(*SMOKE, "hydra/sweeper=optuna", *RANGES)
    lrs = sorted({float(c.optimizer.lr) for c in composed})
    assert lrs == [0.01, 1.0] and {int(c.trainer.epochs) for c in composed} == {1, 2}


def test_command_line_search_ranges_are_recorded_as_searched_parameters():
    from omegaconf import read_write

    cfg = compose_study(*SMOKE, "hydra/sweeper=optuna")  # what the sweeper sees: the task's
    with read_write(cfg):  # overrides hold the command line's ranges
        cfg.hydra.overrides.task = [*SMOKE, "hydra/sweeper=optuna", *RANGES]
    space = optuna_study._sweeper_settings(optuna_study.StudyView.of(cfg.hydra, cfg.trainer))[
        "search_space"
    ]
    assert space["optimizer.lr"] == "tag(log,interval(0.01,1))"
    assert space["trainer.epochs"] == "range(1,3)"


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["hydra/sweeper=optuna", "hydra.sweeper.params.optimizer.lr=interval(0.01,1)"],
         "'optimizer.lr=interval(0.01,1)'"),
        (["+hparams_search=smoke_optuna", "hydra.sweeper.params.repro=choice(portable,strict)"],
         "repro cannot be searched"),
        (["hydra/sweeper=optuna", "repro=choice(portable,strict)"], "repro cannot be searched"),
        (["+hparams_search=smoke_optuna", "hydra.sweeper.n_trials=0"], "n_trials=0: give a pos"),
        (["+hparams_search=smoke_optuna", "hydra.sweeper.n_trials=-1"], "n_trials=-1: give a"),
        (["optimizer.lr=interval(0.01,1)"], "only Optuna samples"),
        (["hydra/sweeper=optuna"], "no search space"),
    ],
)  # fmt: skip
def test_what_cannot_work_is_one_line_in_preflight(overrides, says):
    with pytest.raises(ReprotrainError, match=None) as refused:
        check(*SMOKE, *overrides)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_the_suggested_form_in_the_no_search_space_refusal_passes_preflight():
    with pytest.raises(ReprotrainError) as refused:
        check(*SMOKE, "hydra/sweeper=optuna")
    suggested = str(refused.value).split("e.g. ")[1].split(" or ")[0].strip("'")
    assert check(*SMOKE, "hydra/sweeper=optuna", suggested)


def test_a_refused_study_leaves_nothing_in_its_explicit_sweep_dir(tmp_path):
    sweep = tmp_path / "study"
    script = Path(sys.executable).with_name("reprotrain")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "reprotrain"]
    proc = subprocess.run([*cmd, "sweep", *SMOKE, "hydra/sweeper=optuna",
                           f"hydra.sweep.dir={sweep}"], cwd=REPO, env=base_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "no search space" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not sweep.exists(), "no claimed multirun.yaml: the corrected command may use it"
