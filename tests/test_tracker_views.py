"""What a user sees of a sweep in their own tools (issue 46): a sweep counts its job
directories, never a logger's copy of a record; TensorBoard's HParams shows what was swept;
MLflow and W&B name a sweep's runs by their swept values; MLflow's experiment opens in its
training view. Read back with each tool's own reader (TensorBoard's EventAccumulator,
``mlflow.search_runs``, W&B's offline transaction log). The same with a real sweep of every
logger is the slow ``test_a_sweep_with_every_logger_on_counts_names_and_shows_its_runs``."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from conftest import MICRO, REPO, assert_ok, base_env
from reprotrain.loggers import LoggerConfig, build_loggers
from reprotrain.run.directory import sweep_jobs
from reprotrain.tools.archive import sweep_archive
from reprotrain.tools.sweeps import compare_sweeps, sweep_progress
from reprotrain.tools.sweeps import sweep_summary as ss
from reprotrain.tools.sweeps.optuna_study import StudyView
from test_sweep import lr_sweep

#: Where W&B copies a run's record at the end (wandb_sink.log_artifacts): a run.json that
#: is not a run.
WANDB_COPY = "wandb/offline-run-20260101_000000-abc123/files/record"
TASK = ["experiment=selfcheck", "optimizer.lr=0.1,0.2", "seed.base=0,1,2",
        "logger=[tensorboard,mlflow,wandb]"]  # fmt: skip


def sweep_with_wandb_copies(sweep: Path) -> list[Path]:
    """optimizer.lr=0.1,0.2 x seed.base=0,1,2 as Hydra and the trainer leave it, each job
    with W&B's copy of its record inside it; returns the six job directories."""
    lr_sweep(sweep)
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {"task": TASK}}}))
    jobs = [sweep / str(n) for n in range(6)]
    for job in jobs:
        (job / "config.resolved.yaml").write_text("trainer: {monitor: test_acc}\n")
        copy = job / WANDB_COPY
        copy.mkdir(parents=True)
        for name in ("run.json", "metrics.jsonl", "config.resolved.yaml"):
            shutil.copyfile(job / name, copy / name)
    return jobs


def test_a_sweeps_runs_are_its_job_directories_not_a_loggers_copy_of_a_record(tmp_path):
    """Progress, summary, compare, archive (and reproduce, through the summary's jobs):
    before, each W&B copy was a run: "12/6 runs done (200%)" and a summary group
    "(no .hydra/overrides.yaml)" pooling both learning rates."""
    sweep = tmp_path / "sweep"
    jobs = sweep_with_wandb_copies(sweep)
    assert sweep_jobs(sweep) == jobs
    said: list[str] = []
    job_end = {"hydra": {"mode": "MULTIRUN", "sweep": {"dir": str(sweep)}, "sweeper": {}}}
    sweep_progress.job_done(StudyView.of(OmegaConf.create(job_end).hydra), emit=said.append)
    assert said == [f"sweep {sweep}: 6/6 runs done (100%)"]
    summary = ss.write_summary(sweep)
    groups = {" ".join(g["overrides"]): g["n_completed"] for g in summary["groups"]}
    assert groups == {
        "experiment=selfcheck optimizer.lr=0.1": 3,
        "experiment=selfcheck optimizer.lr=0.2": 3,
    }
    assert ss.UNKNOWN_OVERRIDES not in (sweep / "summary.md").read_text()
    compared = compare_sweeps.read_sweep(sweep, "test_acc")
    assert sorted(len(g.values) for g in compared.groups.values()) == [3, 3]
    assert sweep_archive.is_sweep_dir(sweep) and sweep_jobs(sweep) == jobs


def test_a_run_directory_is_never_searched_for_more_runs(tmp_path):
    """The one rule, whatever a run keeps below itself; hand-gathered runs (no .hydra/)
    are still runs, and a folder of sweeps holds each sweep's jobs."""
    for name in ("a/0", "a/1", "b/x/run", "a/0/nested/deeper"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "run.json").write_text("{}")
    assert sweep_jobs(tmp_path) == [tmp_path / "a/0", tmp_path / "a/1", tmp_path / "b/x/run"]
    assert sweep_jobs(tmp_path / "a/0") == [tmp_path / "a/0"]
    assert sweep_jobs(tmp_path / "absent") == []


# -------------------------------------------------------------------------- the trackers


def sweep_job(sweep: Path, number: int, lr: float, seed: int) -> tuple[Path, dict]:
    """Job ``number`` of ``TASK``'s sweep as Hydra leaves it before the trainer logs:
    its overrides and its resolved config (every key, as a real one has)."""
    if not (sweep / "multirun.yaml").is_file():
        sweep.mkdir(parents=True, exist_ok=True)
        (sweep / "multirun.yaml").write_text(
            yaml.safe_dump({"hydra": {"overrides": {"task": TASK}}})
        )
    job = sweep / str(number)
    (job / ".hydra").mkdir(parents=True)
    overrides = [TASK[0], f"optimizer.lr={lr}", f"seed.base={seed}", TASK[3]]
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    config = {
        "name": "selfcheck",
        "optimizer": {"_target_": "torch.optim.SGD", "lr": lr, "momentum": 0.9},
        "seed": {"base": seed, "data": None},
        "trainer": {"monitor": "val_acc", "monitor_mode": "max", "epochs": 2},
        "dataset": {"_target_": "reprotrain.data.Synthetic", "num_train": 576},
        "logger": {"tensorboard": True},
    }
    (job / "config.resolved.yaml").write_text(yaml.safe_dump(config))
    record = {"name": "selfcheck", "started_at": f"job{number}", "seeds": {"base": seed}}
    return job, record


ROWS = [
    {"epoch": 1, "global_step": 9, "val_loss": 0.9, "val_acc": 0.7},
    {"epoch": 2, "global_step": 18, "val_loss": 0.8, "val_acc": 0.6},  # worse: best is epoch 1
]
FINAL = {"epoch": 2, "global_step": 18, "lr": 0.01, "train_loss": 0.5, "val_loss": 0.8,
         "val_acc": 0.6, "test_loss": 0.85, "test_acc": 0.65}  # fmt: skip


def log_a_run(cfg: LoggerConfig, job: Path, record: dict):
    with build_loggers(cfg, job, record) as loggers:
        loggers.log_steps([1, 2], {"train_loss": [2.0, 1.0]})
        for row in ROWS:
            loggers.log_epoch(row["epoch"], row["global_step"], row)
        loggers.log_final(dict(FINAL))
        return [b.run_id for b in loggers._backends if hasattr(b, "run_id")]


def test_hparams_show_the_swept_keys_and_the_outcomes_not_the_whole_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    job, record = sweep_job(tmp_path / "sweep", 0, 0.05, 1)
    log_a_run(LoggerConfig(tensorboard=True, tensorboard_index=""), job, record)
    acc = EventAccumulator(str(job / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    hp = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    start = metadata.parse_session_start_info_plugin_data(hp[metadata.SESSION_START_INFO_TAG])
    assert dict(start.hparams) == {
        "experiment": start.hparams["experiment"],
        "optimizer.lr": start.hparams["optimizer.lr"],
        "seed.base": start.hparams["seed.base"],
        "group": start.hparams["group"],
    }  # not trainer.epochs, dataset._target_, optimizer.momentum, nor where it logs
    assert start.hparams["optimizer.lr"].number_value == 0.05
    assert start.hparams["seed.base"].number_value == 1
    assert start.hparams["experiment"].string_value == "selfcheck"
    # The seeds of one configuration share a group: its overrides less the seeds.
    assert start.hparams["group"].string_value == "experiment=selfcheck optimizer.lr=0.05"
    exp = metadata.parse_experiment_plugin_data(hp[metadata.EXPERIMENT_TAG])
    differs = {h.name: h.differs for h in exp.hparam_infos}
    assert differs == {"experiment": False, "optimizer.lr": True, "seed.base": True, "group": True}
    columns = [m.name.tag for m in exp.metric_infos]
    assert columns == ["best/val_acc", "final/val_loss", "final/val_acc", "final/test_loss",
                       "final/test_acc"]  # fmt: skip
    assert [e.value for e in acc.Scalars("best/val_acc")] == [pytest.approx(0.7)]


def job_run_names(uri: str) -> list[str]:
    """The names of the store's runs that are a sweep's jobs (not its parent), read with
    ``mlflow.search_runs``."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    try:
        runs = mlflow.search_runs(search_all_experiments=True)
    finally:
        mlflow.set_tracking_uri("")
    jobs = runs[runs["tags.reprotrain.kind"] != "sweep"]
    return sorted(jobs["tags.mlflow.runName"])


def test_mlflow_names_a_sweeps_runs_by_their_swept_values_in_its_training_view(
    tmp_path, monkeypatch
):
    """Children named ``optimizer.lr=0.1 seed.base=0`` (they were "0", "1"), read with
    ``mlflow.search_runs``; the experiment tagged ``mlflow.experimentKind`` with the value
    the locked UI's own code names its training kind (MLflow 3 opens an experiment without
    it in its GenAI view), a new experiment and one made before the tag alike. W&B gets
    the same names (``run_name``): read from its offline runs in the slow sweep test."""
    pytest.importorskip("mlflow", reason="optional extra not installed: make install EXTRAS=mlflow")
    import mlflow
    from mlflow.tracking import MlflowClient

    from reprotrain.loggers.mlflow_sink import EXPERIMENT_KIND, KIND_TAG, start_sweep_run

    ui = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    bundle = "".join(p.read_text(errors="replace") for p in ui.glob("main.*.js"))
    assert KIND_TAG in bundle
    assert re.search(rf'CUSTOM_MODEL_DEVELOPMENT="{EXPERIMENT_KIND}"', bundle)
    monkeypatch.chdir(tmp_path)  # the project root
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    client = MlflowClient(uri)
    old = client.create_experiment("older", artifact_location=(tmp_path / "a").as_uri())
    cfg = LoggerConfig(mlflow=True, mlflow_tracking_uri=uri)
    sweep = tmp_path / "multirun" / "selfcheck" / "s"
    start_sweep_run(cfg, sweep, "selfcheck", TASK)
    for number, (lr, seed) in enumerate([(0.1, 0), (0.2, 0)]):
        log_a_run(cfg, *sweep_job(sweep, number, lr, seed))
    assert job_run_names(uri) == ["optimizer.lr=0.1 seed.base=0", "optimizer.lr=0.2 seed.base=0"]
    single = tmp_path / "outputs" / "r"
    with build_loggers(replace(cfg, mlflow_experiment="older"), single, {"started_at": "o"}):
        pass
    assert client.get_experiment_by_name("selfcheck").tags[KIND_TAG] == EXPERIMENT_KIND
    assert client.get_experiment(old).tags[KIND_TAG] == EXPERIMENT_KIND


def test_a_sweeps_job_is_named_by_its_swept_values_and_a_single_run_by_its_path(tmp_path):
    from reprotrain.loggers.params import run_name

    job, _ = sweep_job(tmp_path / "multirun" / "x" / "s", 3, 0.2, 1)
    assert run_name(job, tmp_path) == "optimizer.lr=0.2 seed.base=1"
    run = tmp_path / "outputs" / "smoke" / "2026-01-01_00-00-00"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- experiment=smoke\n")
    assert run_name(run, tmp_path) == "outputs/smoke/2026-01-01_00-00-00"


# ------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_a_sweep_with_every_logger_on_counts_names_and_shows_its_runs(tmp_path):
    """``make sweep SEEDS=0,1 ARGS="... optimizer.lr=0.05,0.2 'logger=[tensorboard,mlflow,
    wandb]'"``, as the issue ran it: 4/4 runs (not 6/4, 8/4), two groups of two seeds, the
    MLflow children and W&B runs named by their swept values, HParams marks them."""
    pytest.importorskip(
        "mlflow", reason="optional extra not installed: make install EXTRAS=mlflow,wandb"
    )
    pytest.importorskip(
        "wandb", reason="optional extra not installed: make install EXTRAS=mlflow,wandb"
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    from test_loggers_stores import wandb_records

    sweep, uri = tmp_path / "sweep", f"sqlite:///{tmp_path / 'mlruns.db'}"
    env = base_env(HOME=str(tmp_path / "home"), WANDB_BASE_URL="http://127.0.0.1:9")
    env.pop("WANDB_API_KEY", None)
    cmd = [sys.executable, "-m", "reprotrain.train", "--multirun", *MICRO, "trainer.epochs=1",
           "optimizer.lr=0.05,0.2", "seed.base=0,1", "logger=[tensorboard,mlflow,wandb]",
           f"logger.mlflow_tracking_uri={uri}", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert_ok(proc)
    counted = re.findall(r"sweep \S+: (\d+)/(\d+) runs done", proc.stdout + proc.stderr)
    assert [(int(d), int(t)) for d, t in counted] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert len(sweep_jobs(sweep)) == 4 and list(sweep.glob("*/wandb/*/files/record/run.json"))
    summary = json.loads((sweep / "summary.json").read_text())
    assert sorted(g["n_completed"] for g in summary["groups"]) == [2, 2]
    assert ss.UNKNOWN_OVERRIDES not in (sweep / "summary.md").read_text()
    names = sorted(f"optimizer.lr={lr} seed.base={s}" for lr in (0.05, 0.2) for s in (0, 1))
    assert job_run_names(uri) == names
    shown = []
    for job in sweep_jobs(sweep):
        (log,) = (job / "wandb").glob("offline-run-*/*.wandb")
        run = next(r.run for r in wandb_records(log) if r.HasField("run"))
        shown.append(run.display_name)
        assert run.run_group == sweep.name
        acc = EventAccumulator(str(job / "tensorboard"))
        acc.Reload()
        hp = acc.PluginTagToContent(metadata.PLUGIN_NAME)
        exp = metadata.parse_experiment_plugin_data(hp[metadata.EXPERIMENT_TAG])
        assert {h.name for h in exp.hparam_infos if h.differs} == {
            "optimizer.lr", "seed.base", "group"}  # fmt: skip
        assert "final/epoch" not in {m.name.tag for m in exp.metric_infos}
    assert sorted(shown) == names
