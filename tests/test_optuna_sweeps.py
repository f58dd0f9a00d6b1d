"""hydra/sweeper=optuna: a seeded study runs the same trials twice and finds the same best;
the example's TPE looks at earlier results; what cannot work is refused in one line;
study.json records the study; it archives like a sweep (its journal too)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import read_write

from conftest import MICRO, REPO, TINY, base_env
from reprotrain import CONF_DIR, preflight
from reprotrain.config import register_configs
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


def view(cfg) -> optuna_study.StudyView:
    """What the sweep callback's hooks take of a composed config."""
    return optuna_study.StudyView.of(cfg.hydra, cfg.get("trainer"), cfg.get("seed"))


def ask_and_tell(cfg, sweep_dir: Path, n_trials: int = 12, score=None) -> tuple[list[dict], dict]:
    """What the sweeper does with this config (its own search-space parser, one trial asked
    and told at a time, its storage in ``sweep_dir``), on a synthetic objective and without
    training: (trials' params, best params)."""
    import optuna
    from omegaconf import OmegaConf

    from reprotrain.tools.sweeps import optuna_sweeper
    from test_optuna_storage import FakeLauncher, objective

    settings = OmegaConf.to_container(cfg.hydra.sweeper, resolve=True)
    settings["n_trials"] = n_trials  # past the start-up trials: TPE proper at the end
    with read_write(cfg):
        cfg.hydra.sweep.dir = str(sweep_dir)
    launch = FakeLauncher(score=score or objective)
    runner = optuna_sweeper.StudyRunner(
        settings,
        optuna_study.StudyView.of(cfg.hydra, cfg.trainer, name=cfg.name),
        launch=launch,
        job_dir=lambda overrides, n: sweep_dir / str(n),
    )
    runner.run(list(cfg.hydra.overrides.task))
    journal = optuna_sweeper.open_journal(sweep_dir / "study.journal")
    study = optuna.load_study(study_name=runner.study_name, storage=journal)
    return [t.params for t in study.trials], study.best_params


def test_the_example_study_is_seeded_from_seed_base_and_repeats_its_trials(tmp_path):
    cfg = compose_study(*SEARCH)
    assert cfg.hydra.sweeper.sampler.seed is None, "optuna's samplers have no seed"
    assert cfg.hydra.sweeper.direction is None, "the sweeper's default: nobody chose one"
    optuna_study.prepare(view(cfg))
    assert cfg.hydra.sweeper.sampler.seed == cfg.seed.base
    assert cfg.hydra.sweeper.direction == "maximize", "smoke monitors val_acc, max"
    first, second = ask_and_tell(cfg, tmp_path / "a"), ask_and_tell(cfg, tmp_path / "b")
    assert first == second, "the same study twice: the same trials, the same best"
    other = compose_study(*SEARCH, "seed.base=1")
    optuna_study.prepare(view(other))
    assert ask_and_tell(other, tmp_path / "c")[0][0] != first[0][0], "control: the seed decides"


def test_the_example_uses_tpe_for_real_later_proposals_depend_on_earlier_results(tmp_path):
    """Was: 8 trials with TPE's n_startup_trials at 10, every trial a random start-up one."""
    cfg = compose_study(*SEARCH)
    sampler, n_trials = cfg.hydra.sweeper.sampler, cfg.hydra.sweeper.n_trials
    assert sampler._target_ == "optuna.samplers.TPESampler"
    assert 0 < sampler.n_startup_trials < n_trials, "some trials are TPE's own proposals"
    optuna_study.prepare(view(cfg))
    start = sampler.n_startup_trials
    good, _ = ask_and_tell(cfg, tmp_path / "good", n_trials)
    again, _ = ask_and_tell(cfg, tmp_path / "again", n_trials)
    from test_optuna_storage import objective

    bad, _ = ask_and_tell(cfg, tmp_path / "bad", n_trials, score=lambda p: -objective(p))
    assert good == again, "the same seed and the same results: the same proposals"
    assert good[:start] == bad[:start], "the start-up trials do not look at results"
    differ = sum(good[i] != bad[i] for i in range(start, n_trials))
    assert differ >= (n_trials - start) / 2, f"the later ones do: {differ} of {n_trials - start}"


def test_an_explicit_sampler_seed_is_kept():
    cfg = compose_study(*SEARCH, "hydra.sweeper.sampler.seed=7")
    optuna_study.prepare(view(cfg))
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
        (["experiment=smoke", "hydra/sweeper=optuna"], "no search space"),
    ],
)
def test_a_study_that_cannot_work_is_refused_in_one_line_before_any_trial(overrides, says, capsys):
    with pytest.raises(SystemExit) as stop:
        optuna_study.prepare(view(compose_study(*overrides)))
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and says in line


def test_a_basic_sweep_is_left_alone():
    cfg = compose_study("experiment=smoke")
    optuna_study.prepare(view(cfg))  # no refusal, nothing set
    assert not optuna_study.is_optuna(cfg.hydra.sweeper)


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
        "storage": None, "optuna_storage": "study.journal",
        "sampler": {"class": "optuna.samplers.TPESampler", **sampler},
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
    assert a["storage_agrees"] and b["storage_agrees"], "the journal holds the same trials"
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
    assert any(n.endswith("sweep/study.journal") for n in names), "the study's storage too"
    assert sum(n.endswith("/run.json") for n in names) == 3
    # ... and replays: every trial with its recorded parameters, bit for bit
    proc = subprocess.run(
        [*cmd, "reproduce", str(archive), "--trust", "--runs-dir", str(tmp_path / "replays")],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1].startswith("REPRODUCED (bitwise): all 3 runs match")
