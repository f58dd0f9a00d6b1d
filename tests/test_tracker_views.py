"""What a user sees of a sweep in their own tools (issues 46, 55.2): a sweep counts its job
directories, never a logger's copy of a record; TensorBoard's HParams over a root of many
runs shows each run's swept keys; TensorBoard, MLflow and W&B name a run by its experiment,
a short id and its overrides, so two sweeps and their jobs are told apart; MLflow's
experiment opens in its training view (docs/img/mlflow-training-view.png, by a real
browser). Read back with each tool's own reader (TensorBoard's HParams backend,
``mlflow.search_runs``, W&B's offline transaction log). The same with a real sweep of every
logger is the slow ``test_a_sweep_with_every_logger_on_counts_names_and_shows_its_runs``."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
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


def hparams_at(root: Path):
    """What TensorBoard's HParams dashboard shows for ``tensorboard --logdir root``: its
    experiment as the plugin's own backend computes it, and each session's values."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import backend_context, metadata

    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(root))
    mux.Reload()
    provider = data_provider.MultiplexerDataProvider(mux, str(root))
    hp = backend_context.Context(base_plugin.TBContext(logdir=str(root), data_provider=provider))
    ctx = context.RequestContext()
    tags = hp.hparams_metadata(ctx, "")
    exp = hp.experiment_from_metadata(
        ctx, "", True, tags, hp.hparams_from_data_provider(ctx, "", 0)
    )
    start = metadata.SESSION_START_INFO_TAG
    sessions = {
        run: dict(metadata.parse_session_start_info_plugin_data(t[start]).hparams)
        for run, t in tags.items() if start in t
    }  # fmt: skip
    return exp, sessions


def test_hparams_over_a_root_of_many_runs_show_each_runs_swept_keys_and_only_outcomes(
    tmp_path, monkeypatch
):
    """A grid sweep's job and an Optuna trial under one root (the documented ``tb/``): the
    trial's optimizer.weight_decay is a column (before, the first run's experiment summary
    was every run's: its keys only); the columns are the outcomes, not every curve."""
    monkeypatch.chdir(tmp_path)  # the project root: tb/ is its index of links
    cfg = LoggerConfig(tensorboard=True)
    log_a_run(cfg, *sweep_job(tmp_path / "multirun" / "grid", 0, 0.05, 1))
    trial, record = sweep_job(tmp_path / "multirun" / "optuna", 0, 0.3, 0)
    overrides = ["experiment=selfcheck", "optimizer.lr=0.3", "optimizer.weight_decay=0.01"]
    (trial / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    log_a_run(cfg, trial, record)
    exp, sessions = hparams_at(tmp_path / "tb")
    keys = {h.name: h.differs for h in exp.hparam_infos}
    assert keys == {"experiment": False, "optimizer.lr": True, "seed.base": False,
                    "optimizer.weight_decay": False, "group": True}  # fmt: skip
    columns = sorted(m.name.tag for m in exp.metric_infos)
    assert columns == ["best/val_acc", "final/test_acc", "final/test_loss", "final/val_acc",
                       "final/val_loss"]  # fmt: skip
    (job,) = [v for run, v in sessions.items() if "optimizer.weight_decay" not in v]
    assert job["optimizer.lr"].number_value == 0.05 and job["seed.base"].number_value == 1
    # The seeds of one configuration share a group: its overrides less the seeds.
    assert job["group"].string_value == "experiment=selfcheck optimizer.lr=0.05"


def test_hparams_are_written_by_tensorboards_summary_api_not_by_hand():
    """tensorboard.plugins.hparams.summary_v2 builds the session summary (the hand-built
    protobufs of tensorboard_sink.py are gone)."""
    from tensorboard.plugins.hparams import metadata, summary_v2

    from reprotrain.loggers import tensorboard_sink

    def start(summary):  # the session start, its time aside
        (value,) = summary.value
        info = metadata.parse_session_start_info_plugin_data(value.metadata.plugin_data.content)
        return value.tag, info.group_name, dict(info.hparams)

    values = {"optimizer.lr": 0.1, "group": "x"}
    assert start(tensorboard_sink.hparams_pb(values)) == start(summary_v2.hparams_pb(values))
    source = Path(tensorboard_sink.__file__).read_text()
    assert "plugin_data_pb2" not in source and "api_pb2" not in source


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


def test_mlflow_names_a_sweeps_runs_by_experiment_id_and_swept_values_in_its_training_view(
    tmp_path, monkeypatch
):
    """Children named ``selfcheck <sweep id>-<job> optimizer.lr=0.1 seed.base=0``, read with
    ``mlflow.search_runs``: two sweeps' jobs differ by their sweep's id (before, both
    "multirun/selfcheck/202…" in the UI); the experiment's link opens the training view:
    the locked UI reads the ``workflowType`` parameter and starts on GenAI without it, and
    no longer reads the experiment's kind tag (checked in a real browser:
    docs/img/mlflow-training-view.png). W&B gets the same names: the slow sweep test."""
    pytest.importorskip("mlflow", reason="optional extra not installed: make install EXTRAS=mlflow")
    import mlflow
    from mlflow.tracking import MlflowClient

    from reprotrain.loggers.mlflow_sink import TRAINING_VIEW, start_sweep_run, ui_link
    from reprotrain.loggers.params import short_id

    ui = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    bundle = "".join(p.read_text(errors="replace") for p in ui.glob("main.*.js"))
    param, value = TRAINING_VIEW.split("=")
    assert f'get("{param}")' in bundle and f'MACHINE_LEARNING="{value}"' in bundle
    monkeypatch.chdir(tmp_path)  # the project root
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    cfg = LoggerConfig(mlflow=True, mlflow_tracking_uri=uri)
    names = []
    for sweep in (
        tmp_path / "multirun" / "selfcheck" / "a",
        tmp_path / "multirun" / "selfcheck" / "b",
    ):
        start_sweep_run(cfg, sweep, "selfcheck", TASK)
        for number, (lr, seed) in enumerate([(0.1, 0), (0.2, 0)]):
            log_a_run(cfg, *sweep_job(sweep, number, lr, seed))
            names.append(f"selfcheck {short_id(sweep)}-{number} optimizer.lr={lr} seed.base={seed}")
    assert job_run_names(uri) == sorted(names)
    exp = MlflowClient(uri).get_experiment_by_name("selfcheck").experiment_id
    assert ui_link(uri, exp) == f"http://127.0.0.1:5000/#/experiments/{exp}?{TRAINING_VIEW}"
    server = "https://user:sekrit@mlflow.example.org/"
    assert ui_link(server, "3") == f"https://mlflow.example.org/#/experiments/3?{TRAINING_VIEW}"


def test_a_single_run_is_named_by_its_experiment_id_and_overrides(tmp_path):
    from reprotrain.loggers.params import run_key, run_name

    run = tmp_path / "outputs" / "smoke" / "2026-01-01_00-00-00"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- experiment=smoke\n- trainer.epochs=5\n")
    record = {"name": "smoke", "started_at": "t"}
    assert run_name(run, record) == f"smoke {run_key(run, record)[:6]} trainer.epochs=5"


def test_typed_params_and_tags_reach_mlflow_and_wandb(tmp_path, monkeypatch):
    """W&B's config keeps each value's type; MLflow's params (text in its data model) are
    in the config's spelling, read back typed by ``yaml.safe_load``; ``tags=`` are each
    tool's tags (before: ``"False"``, ``"0.2"``, and no tags)."""
    pytest.importorskip("mlflow", reason="optional extra not installed: make install EXTRAS=mlflow")
    pytest.importorskip("wandb", reason="optional extra not installed: make install EXTRAS=wandb")
    from mlflow.tracking import MlflowClient

    from test_loggers_stores import wandb_records

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    job, record = sweep_job(tmp_path / "multirun" / "s", 0, 0.2, 1)
    record["tags"] = ["baseline", "lr-scan"]
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    cfg = LoggerConfig(mlflow=True, wandb=True, wandb_mode="offline", mlflow_tracking_uri=uri)
    (run_id,) = log_a_run(cfg, job, record)
    run = MlflowClient(uri).get_run(run_id)
    params = run.data.params
    typed = {"config.optimizer.lr": 0.2, "config.seed.data": None, "config.seed.base": 1,
             "config.optimizer._target_": "torch.optim.SGD"}  # fmt: skip
    assert {k: yaml.safe_load(params[k]) for k in typed} == typed
    assert params["config.seed.data"] == "null"
    assert {"baseline", "lr-scan"} <= set(run.data.tags)
    (log,) = (job / "wandb").glob("offline-run-*/*.wandb")
    records = list(wandb_records(log))
    run_record = next(r.run for r in records if r.HasField("run"))
    assert list(run_record.tags) == ["baseline", "lr-scan"]
    config = {i.key: json.loads(i.value_json) for i in run_record.config.update}
    assert {k: config[k] for k in typed} == typed  # JSON numbers and null, not "0.2"


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
    from conftest import run_json
    from reprotrain.loggers.params import run_name
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
    names = sorted(run_name(job, run_json(job)) for job in sweep_jobs(sweep))
    assert {n.split(" ", 2)[2] for n in names} == {
        f"optimizer.lr={lr} seed.base={s}" for lr in (0.05, 0.2) for s in (0, 1)
    }
    assert job_run_names(uri) == names
    shown = []
    for job in sweep_jobs(sweep):
        (log,) = (job / "wandb").glob("offline-run-*/*.wandb")
        run = next(r.run for r in wandb_records(log) if r.HasField("run"))
        shown.append(run.display_name)
        assert run.run_group == sweep.name
    exp, _ = hparams_at(sweep)  # the sweep as TensorBoard shows it
    assert {h.name for h in exp.hparam_infos if h.differs} == {"optimizer.lr", "seed.base", "group"}
    assert "final/epoch" not in {m.name.tag for m in exp.metric_infos}
    assert sorted(shown) == names
