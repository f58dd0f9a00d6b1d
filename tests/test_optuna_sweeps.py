"""hydra/sweeper=optuna: a seeded study runs the same trials twice and finds the same best;
what cannot work is refused in one line; study.json records the study; it archives like a
sweep."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from conftest import MICRO, REPO, TINY, base_env
from reprotrain import preflight
from reprotrain.config import register_configs
from reprotrain.paths import CONF_DIR
from reprotrain.tools.sweeps import optuna_study

SEARCH = ["experiment=smoke", "+hparams_search=smoke_optuna"]


def compose_study(*overrides: str):
    """The config a ``--multirun`` with these overrides hands the sweeper (hydra node too)."""
    register_configs()
    preflight.register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose("train", overrides=list(overrides), return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def ask_and_tell(cfg, n_trials: int = 12) -> tuple[list[dict], dict]:
    """What hydra-optuna-sweeper does with this config (its own search-space parser, one
    trial asked and told at a time), on a synthetic objective: (trials' params, best)."""
    import optuna
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space, _ = create_params_from_overrides(
        [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()]
    )
    study = optuna.create_study(
        sampler=instantiate(cfg.hydra.sweeper.sampler), direction=cfg.hydra.sweeper.direction
    )
    for _ in range(n_trials):  # past the 10 random start-up trials: TPE proper at the end
        trial = study.ask(fixed_distributions=space)
        p = trial.params
        study.tell(trial, -((math.log10(p["optimizer.lr"]) + 1) ** 2) - p["optimizer.weight_decay"])
    return [t.params for t in study.trials], study.best_params


def test_the_example_study_is_seeded_from_seed_base_and_repeats_its_trials():
    cfg = compose_study(*SEARCH)
    assert cfg.hydra.sweeper.sampler.seed is None, "the plugin's sampler has no seed"
    assert cfg.hydra.sweeper.direction.name == "minimize", "the plugin's default direction"
    optuna_study.prepare(cfg)
    assert cfg.hydra.sweeper.sampler.seed == cfg.seed.base
    assert cfg.hydra.sweeper.direction == "maximize", "smoke monitors val_acc, max"
    first, second = ask_and_tell(cfg), ask_and_tell(cfg)
    assert first == second, "the same study twice: the same trials, the same best"
    other = compose_study(*SEARCH, "seed.base=1")
    optuna_study.prepare(other)
    assert ask_and_tell(other)[0] != first[0], "control: the seed decides the trials"


def test_an_explicit_sampler_seed_is_kept():
    cfg = compose_study(*SEARCH, "hydra.sweeper.sampler.seed=7")
    optuna_study.prepare(cfg)
    assert cfg.hydra.sweeper.sampler.seed == 7


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ([*SEARCH, "hydra.sweeper.direction=minimize"], "hydra.sweeper.direction=maximize"),
        (
            [
                *SEARCH,
                "trainer.monitor=val_loss",
                "trainer.monitor_mode=min",
                "hydra.sweeper.direction=maximize",
            ],
            "set hydra.sweeper.direction=minimize",
        ),
        ([*SEARCH, "hydra.sweeper.storage=sqlite:///study.db"], "SQLAlchemy<2"),
        (["experiment=smoke", "hydra/sweeper=optuna"], "no search space"),
    ],
)
def test_a_study_that_cannot_work_is_refused_in_one_line_before_any_trial(overrides, says, capsys):
    with pytest.raises(SystemExit) as stop:
        optuna_study.prepare(compose_study(*overrides))
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and says in line


def test_a_basic_sweep_is_left_alone():
    cfg = compose_study("experiment=smoke")
    optuna_study.prepare(cfg)  # no refusal, nothing set
    assert not optuna_study.is_optuna(cfg)


def fake_trial(sweep: Path, number: int, params: dict, val_accs: list[float], status: str):
    job = sweep / str(number)
    (job / ".hydra").mkdir(parents=True)
    overrides = ["experiment=smoke", *(f"{k}={v}" for k, v in params.items())]
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    rows = [{"epoch": i, "val_acc": v} for i, v in enumerate(val_accs)]
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (job / "run.json").write_text(json.dumps({"status": status}))


def settings(**sampler) -> dict:
    return {
        "sweeper": optuna_study.OPTUNA_SWEEPER, "study_name": "smoke", "direction": "maximize",
        "metric": "val_acc", "metric_mode": "max", "n_trials": 3, "n_jobs": 1,
        "storage": None, "sampler": {"class": "optuna.samplers.TPESampler", **sampler},
        "seed_from": None, "search_space": {"optimizer.lr": "interval(0.01, 1)"},
    }  # fmt: skip


def test_study_json_names_each_trials_params_and_value_and_the_best(tmp_path):
    fake_trial(tmp_path, 0, {"optimizer.lr": 0.5}, [0.2, 0.4], "completed")
    fake_trial(tmp_path, 1, {"optimizer.lr": 0.05}, [0.6, 0.5], "completed")
    fake_trial(tmp_path, 2, {"optimizer.lr": 0.9}, [float("nan")], "completed")
    (tmp_path / "optimization_results.yaml").write_text(
        yaml.safe_dump({"best_params": {"optimizer.lr": 0.05}, "best_value": 0.6})
    )
    study = optuna_study.write_study(tmp_path, settings(seed=3))
    assert [t["value"] for t in study["trials"]] == [0.4, 0.6, None]
    assert study["best"]["number"] == 1 and study["best"]["params"] == {"optimizer.lr": 0.05}
    assert study["optuna_best_agrees"] is True and study["repeatable"] is True
    assert json.loads((tmp_path / "study.json").read_text()) == study


def test_an_unseeded_study_is_recorded_as_not_repeatable(tmp_path):
    fake_trial(tmp_path, 0, {"optimizer.lr": 0.5}, [0.2], "completed")
    study = optuna_study.summarise_study(tmp_path, settings(seed=None))
    assert study["repeatable"] is False and "no seed" in study["not_repeatable_because"]


# ------------------------------------------------------------------- a real study, twice

STUDY = [*MICRO, *TINY, "+hparams_search=smoke_optuna", "hydra.sweeper.n_trials=3"]


def run_study(sweep_dir: Path) -> dict:
    cli = Path(sys.executable).with_name("reprotrain")
    cmd = [str(cli)] if cli.exists() else [sys.executable, "-m", "reprotrain"]
    proc = subprocess.run(
        [*cmd, "sweep", *STUDY, f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "optuna study" in proc.stdout
    return json.loads((sweep_dir / "study.json").read_text())


@pytest.mark.slow
def test_the_same_study_twice_runs_the_same_trials_and_finds_the_same_best(tmp_path):
    a, b = run_study(tmp_path / "a"), run_study(tmp_path / "b")
    assert len(a["trials"]) == 3 and all(t["status"] == "completed" for t in a["trials"])
    assert [(t["params"], t["value"]) for t in a["trials"]] == [
        (t["params"], t["value"]) for t in b["trials"]
    ]
    assert a["best"] == b["best"] and a["optuna_best_agrees"] and a["repeatable"]
    assert len({json.dumps(t["params"]) for t in a["trials"]}) == 3, "three distinct trials"
    for t in a["trials"]:  # each trial is a full run record
        run = tmp_path / "a" / t["job"]
        assert (run / "run.json").is_file() and (run / "config.resolved.yaml").is_file()
    # ... and the study archives like any sweep, its record with it
    cli = Path(sys.executable).with_name("reprotrain")
    cmd = [str(cli)] if cli.exists() else [sys.executable, "-m", "reprotrain"]
    proc = subprocess.run(
        [*cmd, "archive", str(tmp_path / "a"), "--out-dir", str(tmp_path / "archives")],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "archive: 3/3 runs copied (100%)" in proc.stdout
    assert "archive [4/4] seal and pack" in proc.stdout
    (archive,) = (tmp_path / "archives").glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert any(n.endswith("sweep/study.json") for n in names)
    assert sum(n.endswith("/run.json") for n in names) == 3
    # ... and replays: every trial with its recorded parameters, bit for bit
    proc = subprocess.run(
        [*cmd, "reproduce", str(archive), "--trust", "--runs-dir", str(tmp_path / "replays")],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1].startswith("REPRODUCED (bitwise): all 3 runs match")
