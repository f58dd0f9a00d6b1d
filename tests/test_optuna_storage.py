"""The study lives in an Optuna storage others open, and a killed study continues.

Fast tier: the sweeper's study (``tools/sweeps/optuna_sweeper.StudyRunner``) on a synthetic
objective with a stand-in launcher, no training: a 6-trial study killed during trial 3 and
continued by a new runner (its own samplers, as a new process has) ends with the same
trials and best as the one never stopped; ``optuna.load_study`` opens its journal (and a
SQLite storage, which optuna 2 with SQLAlchemy 2 could not create). The same promise with
real training, a SIGKILL and ``reprotrain resume <sweep dir>`` is the slow
``test_a_sigkilled_study_continued_by_make_resume_equals_the_uninterrupted_one``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import REPO, TINY, base_env
from reprotrain import preflight, sweep_checks
from reprotrain.config import register_configs
from reprotrain.errors import ReprotrainError
from reprotrain.tools.sweeps import continuation, optuna_study
from reprotrain.tools.sweeps import optuna_sweeper as impl

SPACE = {
    "optimizer.lr": "tag(log, interval(0.01, 1.0))",
    "optimizer.weight_decay": "choice(0.0, 0.0005)",
}
FIXED = ["experiment=smoke", "+hparams_search=smoke_optuna"]


class Killed(BaseException):
    """What a SIGKILL does to the sweep: nothing after it runs (not an Exception)."""


class Ret:
    def __init__(self, value):
        self.return_value = value


def objective(params: dict) -> float:
    """A smooth synthetic val_acc, best near lr=0.1 without weight decay."""
    lr, wd = params["optimizer.lr"], params["optimizer.weight_decay"]
    return 1.0 - (math.log10(lr) + 1.0) ** 2 - 100 * wd


class FakeLauncher:
    """Runs each job as ``objective`` of its overrides; ``kill_at``: the job number during
    which the sweep dies (nothing told). Records every job's overrides by number."""

    def __init__(self, kill_at: int | None = None, score=objective) -> None:
        self.kill_at, self.score, self.jobs = kill_at, score, {}

    def __call__(self, batch, first):
        out = []
        for i, overrides in enumerate(batch):
            number = first + i
            self.jobs.setdefault(number, []).append(list(overrides))
            if number == self.kill_at:
                raise Killed
            params = {}
            for line in overrides:
                key, _, value = line.partition("=")
                if key in SPACE:
                    params[key] = float(value)
            out.append(Ret(self.score(params)))
        return out


def settings(**over) -> dict:
    base = {
        "sampler": {"_target_": "optuna.samplers.TPESampler", "seed": 7, "n_startup_trials": 2},
        "direction": "maximize", "storage": None, "study_name": "smoke", "n_trials": 6,
        "n_jobs": 1, "params": dict(SPACE), "resume": False,
    }  # fmt: skip
    return {**base, **over}


def config(sweep_dir: Path) -> optuna_study.StudyView:
    cfg = OmegaConf.create({"name": "smoke", "hydra": {"sweep": {"dir": str(sweep_dir)}},
                            "trainer": {"monitor": "val_acc", "monitor_mode": "max"}})  # fmt: skip
    return optuna_study.StudyView.of(cfg.hydra, cfg.trainer, name=cfg.name)


def runner(sweep_dir: Path, launch, **over) -> impl.StudyRunner:
    return impl.StudyRunner(settings(**over), config(sweep_dir), launch=launch,
                            job_dir=lambda overrides, n: sweep_dir / str(n))  # fmt: skip


def stored(sweep_dir: Path, name: str = "smoke", storage=None) -> list[tuple]:
    """(number, params, value, state) of every trial, read back with optuna.load_study."""
    import optuna

    storage = storage or impl.open_journal(sweep_dir / impl.JOURNAL)
    study = optuna.load_study(study_name=name, storage=storage)
    return [(t.number, t.params, t.value, t.state.name) for t in study.trials]


def test_a_study_killed_during_trial_3_and_continued_equals_the_uninterrupted_one(tmp_path):
    whole = runner(tmp_path / "whole", FakeLauncher())
    whole.run(FIXED)
    expected = stored(tmp_path / "whole")
    assert [t[3] for t in expected] == ["COMPLETE"] * 6
    assert len({json.dumps(t[1]) for t in expected}) == 6, "six distinct proposals"

    killed = tmp_path / "killed"
    with pytest.raises(Killed):
        runner(killed, FakeLauncher(kill_at=2)).run(FIXED)
    left = stored(killed)
    assert [t[3] for t in left] == ["COMPLETE", "COMPLETE", "RUNNING"], "trial 2 was killed"
    again = FakeLauncher()
    runner(killed, again, resume=True).run(FIXED)  # a new runner: fresh samplers, as a new process
    assert stored(killed) == expected, "the same trials (params, values) and states"
    assert again.jobs[2][0][-1] == "resume=auto", "the killed trial is resumed in its run dir"
    assert sorted(again.jobs) == [2, 3, 4, 5], "the finished trials are kept, not re-run"
    best = [yaml_best(tmp_path / d) for d in ("whole", "killed")]
    assert best[0] == best[1] and best[0]["best_value"] == max(t[2] for t in expected)


def yaml_best(sweep_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((sweep_dir / impl.OPTUNA_RESULTS).read_text())


def test_one_sampler_for_the_whole_study_would_not_continue_the_same(tmp_path, monkeypatch):
    """Control: with the seeded sampler built once per process (its generator advancing with
    every proposal), the continued study proposes other trials than the uninterrupted one."""
    made: dict[int, tuple[object, object]] = {}
    real = impl.make_sampler

    def once_per_runner(sampler, number, space):
        # The runner's sampler config is kept alive beside its sampler: a config collected
        # after the first study could hand its id to the next runner's (a flaky pass).
        if id(sampler) not in made:
            made[id(sampler)] = (sampler, real(sampler, 0, space))
        return made[id(sampler)][1]

    monkeypatch.setattr(impl, "make_sampler", once_per_runner)
    runner(tmp_path / "whole", FakeLauncher()).run(FIXED)
    with pytest.raises(Killed):
        runner(tmp_path / "killed", FakeLauncher(kill_at=2)).run(FIXED)
    runner(tmp_path / "killed", FakeLauncher(), resume=True).run(FIXED)
    params = [[t[1] for t in stored(tmp_path / d)] for d in ("whole", "killed")]
    assert params[0][:3] == params[1][:3] and params[0][3:] != params[1][3:]


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_optunas_own_plots_open_the_study_from_its_journal(tmp_path):
    import matplotlib
    import optuna

    matplotlib.use("Agg")
    runner(tmp_path, FakeLauncher(), n_trials=3).run(FIXED)
    journal = impl.open_journal(tmp_path / impl.JOURNAL)
    study = optuna.load_study(study_name="smoke", storage=journal)
    ax = optuna.visualization.matplotlib.plot_optimization_history(study)
    assert len(ax.collections[0].get_offsets()) == 3, "one point per trial"


def test_the_study_names_its_metric_and_each_trial_its_run_directory(tmp_path):
    """What optuna-dashboard and Optuna's plots read: the objective's name (not "Objective
    0") and, per trial, where its run is (a continued trial keeps the one it had)."""
    import optuna

    with pytest.raises(Killed):
        runner(tmp_path, FakeLauncher(kill_at=2), n_trials=4).run(FIXED)
    runner(tmp_path, FakeLauncher(), n_trials=4, resume=True).run(FIXED)
    journal = impl.open_journal(tmp_path / impl.JOURNAL)
    study = optuna.load_study(study_name="smoke", storage=journal)
    assert study.metric_names == ["val_acc"]
    assert [t.user_attrs for t in study.trials] == [
        {"run_dir": str(tmp_path / str(n))} for n in range(4)
    ]


def test_trials_dataframe_names_the_objective_by_its_metric(tmp_path):
    """``study.trials_dataframe()`` has ``value_val_acc``, not ``value``. It needs pandas,
    which no base or dev lock pins (the MLflow extra brings it: docs/sweeps-optuna.md)."""
    pytest.importorskip("pandas", reason="optional extra not installed: make install EXTRAS=mlflow")
    import optuna

    runner(tmp_path, FakeLauncher(), n_trials=2).run(FIXED)
    journal = impl.open_journal(tmp_path / impl.JOURNAL)
    study = optuna.load_study(study_name="smoke", storage=journal)
    assert "value_val_acc" in study.trials_dataframe().columns


def test_a_trial_killed_after_its_run_finished_is_told_from_its_record(tmp_path):
    killed = tmp_path / "killed"
    with pytest.raises(Killed):
        runner(killed, FakeLauncher(kill_at=2)).run(FIXED)
    params = stored(killed)[2][1]
    job = killed / "2"
    job.mkdir()
    (job / "run.json").write_text(json.dumps({"status": "completed"}))
    rows = [{"epoch": 1, "val_acc": 0.25}, {"epoch": 2, "val_acc": 0.5}]
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    again = FakeLauncher()
    runner(killed, again, resume=True).run(FIXED)
    assert 2 not in again.jobs, "a completed run is not launched again"
    assert stored(killed)[2] == (2, params, 0.5, "COMPLETE")


def test_a_non_finite_value_is_a_failed_trial_and_the_study_goes_on(tmp_path):
    launch = FakeLauncher(score=lambda p: float("nan") if p["optimizer.weight_decay"] else 0.5)
    runner(tmp_path, launch).run(FIXED)
    states = {t[3] for t in stored(tmp_path)}
    assert len(stored(tmp_path)) == 6 and states <= {"COMPLETE", "FAIL"} and "FAIL" in states


def test_a_sqlite_storage_of_your_own_is_created_and_loaded(tmp_path):
    """Was: optuna 2 with SQLAlchemy 2 raised a bare AssertionError and left a database."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    runner(tmp_path / "sweep", FakeLauncher(), storage=url, n_trials=3).run(FIXED)
    assert [t[3] for t in stored(tmp_path, storage=url)] == ["COMPLETE"] * 3
    assert not (tmp_path / "sweep" / impl.JOURNAL).exists(), "the study is in the database"


def test_continuing_refuses_what_would_not_be_the_same_study(tmp_path):
    with pytest.raises(impl.StudyError, match="holds no study named smoke: nothing to continue"):
        runner(tmp_path / "none", FakeLauncher(), resume=True).run(FIXED)
    runner(tmp_path, FakeLauncher(), n_trials=2).run(FIXED)
    with pytest.raises(impl.StudyError, match="already holds a study named smoke: continue it"):
        runner(tmp_path, FakeLauncher()).run(FIXED)
    other = {**SPACE, "optimizer.lr": "interval(0.01, 1.0)"}
    with pytest.raises(impl.StudyError, match="the search space differs"):
        runner(tmp_path, FakeLauncher(), resume=True, params=other).run(FIXED)
    with pytest.raises(impl.StudyError, match="was run to maximize"):
        runner(tmp_path, FakeLauncher(), resume=True, direction="minimize").run(FIXED)
    more = FakeLauncher()  # n_trials may grow, like trainer.epochs
    runner(tmp_path, more, resume=True, n_trials=4).run(FIXED)
    assert sorted(more.jobs) == [2, 3] and len(stored(tmp_path)) == 4


def test_the_command_lines_ranges_join_the_search_space_and_win_over_the_file():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    space, fixed = impl.search_space(SPACE, [
        "experiment=smoke", "optimizer.lr=interval(0.001,0.1)", "trainer.epochs=range(1,4)",
        "+model.width=tag(int,interval(8,64))", "optimizer=choice(sgd,adamw)",
    ])  # fmt: skip
    assert fixed == ["experiment=smoke"]
    assert space["optimizer.lr"] == FloatDistribution(0.001, 0.1), "the command line wins"
    assert space["optimizer.weight_decay"] == CategoricalDistribution([0.0, 0.0005])
    assert space["trainer.epochs"] == IntDistribution(1, 3), "range: Hydra's values, 4 excluded"
    assert space["+model.width"] == IntDistribution(8, 64)
    assert space["optimizer"] == CategoricalDistribution(["sgd", "adamw"])
    with pytest.raises(impl.StudyError, match="choices are numbers, booleans or text"):
        impl.search_space(None, ["x=choice([1],[2])"])


def test_overrides_read_back_as_the_suggested_values():
    import yaml

    for value in (1e-05, 0.1 + 0.2, 3, True, "adamw", "a b", 2.5e-300):
        text = impl.override_text("k", value).partition("=")[2]
        assert yaml.safe_load(text) == value, text


def test_the_grid_sampler_gets_the_grid_of_the_searched_values(tmp_path):
    launch = FakeLauncher()
    grid = {"_target_": "optuna.samplers.GridSampler", "seed": 1, "search_space": None}
    space = {"optimizer.lr": "choice(0.01, 0.1)", "optimizer.weight_decay": "choice(0.0, 0.0005)"}
    runner(tmp_path, launch, sampler=grid, params=space, n_trials=10).run(FIXED)
    seen = {tuple(sorted(t[1].items())) for t in stored(tmp_path)}
    assert len(stored(tmp_path)) == 4 and len(seen) == 4, "every combination once, then stop"
    with pytest.raises(impl.StudyError, match=r"cannot search optimizer\.lr"):
        runner(tmp_path / "g", launch, sampler=grid).run(FIXED)


# ---------------------------------------------------- the command line: preflight, resume


def compose(*overrides: str):
    register_configs()
    preflight.register_resolvers()
    return preflight.compose_all(["--multirun", *overrides])


def test_hparams_search_without_a_plus_says_to_add_it_in_one_line():
    with pytest.raises(ReprotrainError) as refused:
        compose("experiment=smoke", "hparams_search=smoke_optuna")
    message = str(refused.value)
    assert "write +hparams_search=smoke_optuna" in message and "\n" not in message


def test_continuing_needs_the_studys_own_sweep_dir_in_one_line(tmp_path):
    values = {"hydra.sweeper.resume": "True"}
    assert sweep_checks.continues_study(values)
    with pytest.raises(ReprotrainError, match="give its directory"):
        sweep_checks.check_continued_study(None)
    with pytest.raises(ReprotrainError, match="holds no sweep"):
        sweep_checks.check_continued_study(str(tmp_path))
    (tmp_path / "multirun.yaml").write_text("hydra: {}\n")
    sweep_checks.check_continued_study(str(tmp_path))  # a sweep to continue: passes
    argv = ["--multirun", f"hydra.sweep.dir={tmp_path}", "hydra.sweeper.resume=true"]
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "run.json").write_text("{}")
    preflight.explicit_run_dir_is_free(argv)  # a used sweep dir is this study's own: passes
    with pytest.raises(ReprotrainError, match="already holds a sweep"):
        preflight.explicit_run_dir_is_free(argv[:2])


def test_make_resume_of_a_study_dir_reruns_its_command_into_it_with_resume(tmp_path):
    record = {"hydra": {
        "sweeper": {"_target_": optuna_study.OPTUNA_SWEEPER},
        "overrides": {"hydra": ["hydra.mode=MULTIRUN", f"hydra.sweep.dir={tmp_path}",
                                "hydra.sweeper.n_trials=6"],
                      "task": ["experiment=smoke", "+hparams_search=smoke_optuna"]},
    }}  # fmt: skip
    (tmp_path / "multirun.yaml").write_text(OmegaConf.to_yaml(record))
    assert continuation.is_sweep_dir(tmp_path)
    cmd = continuation.continue_command(tmp_path, ["hydra.sweeper.n_trials=8"])
    assert cmd[1:] == [
        "-m", "reprotrain.train", "--multirun", "hydra.sweeper.n_trials=6", "experiment=smoke",
        "+hparams_search=smoke_optuna", f"hydra.sweep.dir='{tmp_path}'",
        "hydra.sweeper.resume=true", "hydra.sweeper.n_trials=8",
    ]  # fmt: skip
    basic = tmp_path / "basic"
    basic.mkdir()
    (basic / "multirun.yaml").write_text("hydra: {sweeper: {_target_: x.BasicSweeper}}\n")
    assert continuation.continue_command(basic, [])[4] == "hydra/sweeper=continued"


def test_the_plugin_is_found_by_hydra_and_hydra_optuna_sweeper_is_gone():
    from hydra.core.plugins import Plugins
    from hydra.plugins.sweeper import Sweeper

    found = {f"{c.__module__}.{c.__name__}" for c in Plugins.instance().discover(Sweeper)}
    assert optuna_study.OPTUNA_SWEEPER in found
    locks = [p.read_text() for p in REPO.glob("requirements*.lock")]
    assert not any("hydra-optuna-sweeper" in text for text in locks)
    assert any("\noptuna==5." in text for text in locks), "a current optuna"


# ------------------------------------------------------ a real study, SIGKILLed, continued

STUDY = ["experiment=selfcheck", *TINY, "trainer.epochs=2", "+hparams_search=smoke_optuna",
         "hydra.sweeper.n_trials=6", "hydra.sweeper.sampler.n_startup_trials=2"]  # fmt: skip


def cli(*args: str, **kwargs) -> list[str]:
    script = Path(sys.executable).with_name("reprotrain")
    return [*([str(script)] if script.exists() else [sys.executable, "-m", "reprotrain"]), *args]


def kill_during_trial(sweep_dir: Path, number: int) -> None:
    """Start the study; SIGKILL its process group once trial ``number`` wrote a checkpoint."""
    proc = subprocess.Popen(cli("sweep", *STUDY, f"hydra.sweep.dir={sweep_dir}"), cwd=REPO,
                            env=base_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip
    ckpts = sweep_dir / str(number) / "checkpoints"
    deadline = time.monotonic() + 900
    try:
        while not (ckpts.is_dir() and any(ckpts.glob("*.pt"))):
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "trial never checkpointed"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
        proc.stderr.close()


def run_ok(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cli(*args), cwd=REPO, env=base_env(), capture_output=True, text=True,
                          timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_a_sigkilled_study_continued_by_make_resume_equals_the_uninterrupted_one(tmp_path):
    """Fast sibling:
    test_a_study_killed_during_trial_3_and_continued_equals_the_uninterrupted_one."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run_ok("sweep", *STUDY, f"hydra.sweep.dir={whole}")
    kill_during_trial(killed, 2)
    assert not (killed / "study.json").exists() and not (killed / "3").exists()
    assert json.loads((killed / "2" / "run.json").read_text())["status"] == "running"
    proc = run_ok("resume", str(killed))
    assert "continuing trial 2" in proc.stdout
    a, b = (json.loads((d / "study.json").read_text()) for d in (whole, killed))
    assert [(t["params"], t["value"], t["status"]) for t in a["trials"]] == [
        (t["params"], t["value"], t["status"]) for t in b["trials"]
    ]
    assert len(a["trials"]) == 6 and a["best"] == b["best"]
    assert b["storage_agrees"] and b["optuna_best_agrees"] and b["repeatable"]
    for d in (whole, killed):  # the killed trial resumed bitwise: the same final weights
        assert stored(d, "selfcheck")[2][3] == "COMPLETE"
    weights = [json.loads((d / "2" / "run.json").read_text())["final_weights_sha256"]
               for d in (whole, killed)]  # fmt: skip
    assert weights[0] == weights[1]
    assert stored(whole, "selfcheck") == stored(killed, "selfcheck")
