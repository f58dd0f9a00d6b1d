"""The loggers as their users use them, checked by reading the real stores back: MLflow's
client (runs, params, metric histories, artifacts, parent/child sweeps), TensorBoard's event
reader (scalars, text, the HParams plugin's data, one logdir for runs and sweeps), and W&B's
offline run directory. Needs the locked extras: ``make install EXTRAS=mlflow,wandb``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MICRO, REFERENCE, REPO, assert_ok, base_env, jsonl, run_json, train
from reprotrain.loggers import LoggerConfig, build_loggers
from reprotrain.loggers.mlflow_sink import PARENT_JSON, end_sweep_run, start_sweep_run
from reprotrain.loggers.params import run_key, run_name, short_id
from reprotrain.metric_names import split_of

INSTALL = "optional extra not installed: make install EXTRAS=mlflow,wandb"
mlflow = pytest.importorskip("mlflow", reason=INSTALL)
pytest.importorskip("sqlalchemy", reason=INSTALL)
wandb = pytest.importorskip("wandb", reason=INSTALL)

from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.plugins.hparams import api_pb2, metadata  # noqa: E402

SECRET = "sekrit-mlflow-password-7f3a"


def uri_in(folder: Path) -> str:
    return f"sqlite:///{folder.resolve() / 'mlruns.db'}"


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory) -> tuple[Path, str]:
    """reference_run's config with all three loggers on: TensorBoard, MLflow into a store in
    a temp folder, W&B offline with no key (HOME without a netrc); a tracker password in the
    environment that must reach no store; per-step values handed over every 2 steps."""
    root = tmp_path_factory.mktemp("logged")
    uri = uri_in(root)
    # Any attempt to reach W&B's servers would hit a closed port and switch the logger off.
    dead = "http://127.0.0.1:9"
    env = base_env(HOME=str(root / "home"), MLFLOW_TRACKING_PASSWORD=SECRET, WANDB_BASE_URL=dead)
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC"):
        env.pop(name, None)
    proc = train(
        root / "run",
        *REFERENCE,
        "logger=[tensorboard,mlflow,wandb]",
        f"logger.mlflow_tracking_uri={uri}",
        "logger.log_every_steps=2",  # 3 mid-epoch batches an epoch; no identity key
        env=env,
    )
    assert_ok(proc)
    return root / "run", uri


def only_run(client: MlflowClient, **filters):
    exps = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(exps, **filters)
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return runs[0]


def test_loggers_are_sinks_all_three_on_train_the_same_bits(logged_run, reference_run) -> None:
    run_dir, _ = logged_run
    assert (
        run_json(run_dir)["final_weights_sha256"] == run_json(reference_run)["final_weights_sha256"]
    )
    assert run_json(run_dir)["config_sha256"] == run_json(reference_run)["config_sha256"]


def test_a_run_with_the_extras_installed_from_their_locks_records_no_drift(logged_run) -> None:
    drift = run_json(logged_run[0])["env_drift"]
    assert drift["status"] == "ok", drift
    assert {"requirements-mlflow.lock", "requirements-wandb.lock"} <= set(drift["locks"])
    assert "environment drift" not in (logged_run[0] / "train.log").read_text()


def test_mlflow_store_holds_params_step_epoch_final_metrics_tags_and_artifacts(logged_run) -> None:
    run_dir, uri = logged_run
    client = MlflowClient(tracking_uri=uri)
    run = only_run(client)
    assert run.info.status == "FINISHED"
    record = run_json(run_dir)
    assert run.data.params["config.trainer.batch_size"] == "64"
    assert run.data.params["run.config_sha256"] == record["config_sha256"]
    assert run.data.tags["reprotrain.run_dir"] == str(run_dir.resolve())
    assert run.data.tags["mlflow.source.git.commit"] == record["git"]["commit"]
    # Per step, at the global step: the same numbers as the record's fingerprints.
    fps = jsonl(run_dir / "fingerprints.jsonl")
    losses = [v for fp in fps for v in fp["step_losses"]]
    lrs = [v for fp in fps for v in fp["step_lrs"]]
    loss = client.get_metric_history(run.info.run_id, "step/train_loss")
    assert [m.step for m in loss] == list(range(1, len(losses) + 1)) == list(range(1, 17))
    assert [m.value for m in loss] == pytest.approx(losses)
    assert [m.value for m in client.get_metric_history(run.info.run_id, "step/lr")] == (
        pytest.approx(lrs)
    )
    # Per epoch, at the epoch's last global step: metrics.jsonl's rows.
    rows = jsonl(run_dir / "metrics.jsonl")
    val = client.get_metric_history(run.info.run_id, "epoch/val_loss")
    assert [(m.step, m.value) for m in val] == [
        (r["global_step"], pytest.approx(r["val_loss"])) for r in rows
    ]
    final = record["final_metrics"]
    assert run.data.metrics["final/test_loss"] == pytest.approx(final["test_loss"])
    assert run.data.metrics["final/test_acc"] == pytest.approx(final["test_acc"])
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.resolved.yaml", "run.json", "metrics.jsonl"} <= names


def test_tensorboard_has_hparams_config_text_and_test_metrics_as_scalars(logged_run) -> None:
    run_dir, _ = logged_run
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    final = run_json(run_dir)["final_metrics"]
    assert [e.value for e in acc.Scalars("final/test_acc")] == [pytest.approx(final["test_acc"])]
    assert [e.step for e in acc.Scalars("final/test_loss")] == [16]  # the last global step
    # The HParams session: its own folder of the run's, with the outcomes beside it.
    session = EventAccumulator(str(run_dir / "tensorboard" / "hparams"), {"scalars": 0})
    session.Reload()
    hp = session.PluginTagToContent(metadata.PLUGIN_NAME)
    start = metadata.parse_session_start_info_plugin_data(hp[metadata.SESSION_START_INFO_TAG])
    # The hyperparameters are the run's overrides (typed from the resolved config), not the
    # whole flattened config (79 columns before, repro.level and the callbacks among them).
    overrides = [o for o in MICRO + REFERENCE if not o.startswith("logger")]
    keys = {o.partition("=")[0] for o in overrides}
    assert set(start.hparams) == keys | {"group"}
    assert start.hparams["trainer.batch_size"].number_value == 64
    assert start.hparams["experiment"].string_value == "selfcheck"
    assert start.hparams["group"].string_value == " ".join(sorted(overrides))
    # The HParams table's columns (the session's scalars): the best monitored value and the
    # final val/test metrics, not every curve (step/*, epoch/*), nor final/epoch, final/lr;
    # TensorBoard computes the experiment from the sessions below the root it is given.
    from test_tracker_views import hparams_at

    exp, _ = hparams_at(run_dir / "tensorboard")
    columns = [m.name.tag for m in exp.metric_infos]
    shown = [k for k, v in final.items() if split_of(k) in ("val", "test") and v is not None]
    outcomes = {f"final/{k}" for k in shown}
    assert set(columns) == outcomes | {"best/val_acc"}
    assert {"final/test_acc", "final/val_acc"} <= outcomes
    rows = jsonl(run_dir / "metrics.jsonl")
    assert [e.value for e in session.Scalars("best/val_acc")] == [
        pytest.approx(max(r["val_acc"] for r in rows))
    ]
    infos = {h.name: h.type for h in exp.hparam_infos}
    assert infos["trainer.batch_size"] == api_pb2.DATA_TYPE_FLOAT64
    assert infos["experiment"] == api_pb2.DATA_TYPE_STRING and set(infos) == set(start.hparams)
    assert not any(h.differs for h in exp.hparam_infos)  # one run: nothing was swept
    texts = acc.Tensors("config/text_summary")
    assert b"batch_size: 64" in texts[0].tensor_proto.string_val[0]


def test_wandb_runs_offline_into_the_run_dir_without_a_key(logged_run) -> None:
    run_dir, _ = logged_run
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb"))
    log = (run_dir / "train.log").read_text()
    assert "logging to" in log and "wandb (offline" in log
    assert "logger wandb failed" not in log  # no backend was switched off


def test_no_store_holds_the_trackers_password(logged_run) -> None:
    run_dir, uri = logged_run
    folders = [run_dir, Path(uri[len("sqlite:///") :]).parent]
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file():
                assert SECRET.encode() not in path.read_bytes(), path


def test_mlflow_artifacts_include_report_and_curves_drawn_outside_the_run_dir(
    logged_run, tmp_path: Path
) -> None:
    from reprotrain.run.report import write_report

    run_dir = tmp_path / "copy"
    shutil.copytree(logged_run[0], run_dir, ignore=shutil.ignore_patterns("wandb", "checkpoints"))
    cfg = LoggerConfig(mlflow=True, mlflow_tracking_uri=uri_in(tmp_path))
    with build_loggers(cfg, run_dir, run_json(run_dir), report=write_report) as lg:
        run_id = lg._backends[0].run_id
    names = {a.path for a in MlflowClient(uri_in(tmp_path)).list_artifacts(run_id)}
    assert {"report.md", "curves.png", "run.json", "config.resolved.yaml"} <= names
    assert not (run_dir / "report.md").exists()  # a sink draws, it does not write the record


def test_a_resumed_run_continues_its_mlflow_run_with_every_step_once(tmp_path: Path) -> None:
    cfg = LoggerConfig(mlflow=True, mlflow_tracking_uri=uri_in(tmp_path))
    record = _record("r")
    killed = build_loggers(cfg, tmp_path / "r", record)  # logged steps 1-5, checkpoint at 3
    killed.log_steps([1, 2, 3, 4, 5], {"train_loss": [5.0, 4.0, 3.0, 2.0, 1.0]})
    killed.close("interrupted")
    with build_loggers(cfg, tmp_path / "r", record, start_step=3) as resumed:
        resumed.log_steps([4, 5, 6], {"train_loss": [2.0, 1.0, 0.5]})
        resumed.log_epoch(1, 6, {"val_loss": 0.7})
        resumed.log_final({"test_loss": 0.6})
    client = MlflowClient(uri_in(tmp_path))
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = client.get_metric_history(run.info.run_id, "step/train_loss")
    assert sorted((m.step, m.value) for m in history) == [
        (1, 5.0), (2, 4.0), (3, 3.0), (4, 2.0), (5, 1.0), (6, 0.5)
    ]  # fmt: skip
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "final/test_loss")] == [6]


def _record(name: str) -> dict:
    return {"name": "sweepy", "started_at": name, "experiment_id": name, "seeds": {"base": 0}}


def test_a_sweep_is_a_parent_run_and_its_runs_are_children(tmp_path: Path) -> None:
    cfg = LoggerConfig(mlflow=True, mlflow_tracking_uri=uri_in(tmp_path))
    sweep = tmp_path / "multirun" / "sweepy" / "2026-01-01_00-00-00"
    parent_id = start_sweep_run(cfg, sweep, "sweepy", ["seed.base=0,1"])
    assert parent_id and (sweep / PARENT_JSON).is_file()
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    children = []
    for n in ("0", "1"):
        with build_loggers(cfg, sweep / n, _record(n)) as lg:
            lg.log_steps([1, 2], {"train_loss": [2.0, 1.0]})
            children.append(lg._backends[0].run_id)
    (sweep / "summary.md").write_text("# summary\n")
    end_sweep_run(cfg, sweep)
    client = MlflowClient(uri_in(tmp_path))
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(parent_id)} >= {"summary.md"}
    for child in children:
        run = client.get_run(child)
        assert run.data.tags["mlflow.parentRunId"] == parent_id
        assert run.info.experiment_id == parent.info.experiment_id
    # The store's URI (a server's may carry credentials) is not written into the sweep dir.
    assert str(tmp_path) not in (sweep / PARENT_JSON).read_text()


def test_one_run_outside_a_sweep_has_no_parent_and_goes_to_the_projects_store(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the project root: where outputs/ and multirun/ are
    with build_loggers(LoggerConfig(mlflow=True), tmp_path / "outputs/x/r1", _record("r1")) as lg:
        run_id = lg._backends[0].run_id
    client = MlflowClient(uri_in(tmp_path))
    run = client.get_run(run_id)
    assert "mlflow.parentRunId" not in run.data.tags
    assert run.info.run_name == f"sweepy {run.data.tags['reprotrain.run_key'][:6]}"
    location = client.get_experiment(run.info.experiment_id).artifact_location
    assert location == (tmp_path / "mlartifacts").resolve().as_uri()


def test_one_tensorboard_logdir_shows_runs_and_sweeps(tmp_path: Path, monkeypatch) -> None:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "multirun" / "x" / "s"
    sweep.mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    for run_dir in (tmp_path / "outputs" / "x" / "r1", sweep / "0"):
        with build_loggers(LoggerConfig(tensorboard=True), run_dir, _record(run_dir.name)) as lg:
            lg.log_steps([1], {"train_loss": [1.0]})
            lg.log_final({"test_acc": 0.5})
    mux = EventMultiplexer().AddRunsFromDirectory(str(tmp_path / "tb"))
    mux.Reload()
    single = f"sweepy {run_key(tmp_path / 'outputs/x/r1', _record('r1'))[:6]}"
    job = f"sweepy {short_id(sweep)}-0"  # a sweep job: its sweep's id and its number
    assert set(mux.Runs()) == {single, f"{single}/hparams", job, f"{job}/hparams"}
    for run in (single, job):
        assert [e.value for e in mux.Scalars(run, "final/test_acc")] == [0.5]


@pytest.mark.slow
def test_a_hydra_multirun_logs_a_parent_and_one_child_per_job(tmp_path: Path) -> None:
    uri = uri_in(tmp_path)
    cmd = [sys.executable, "-m", "reprotrain.train", "--multirun", *MICRO, "trainer.epochs=1",
           "seed.base=0,1", "logger=mlflow", f"logger.mlflow_tracking_uri={uri}",
           f"hydra.sweep.dir={tmp_path / 'sweep'}"]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(uri)
    parent = json.loads((tmp_path / "sweep" / PARENT_JSON).read_text())["run_id"]
    exps = [e.experiment_id for e in client.search_experiments()]
    kids = client.search_runs(exps, filter_string=f"tags.`mlflow.parentRunId` = '{parent}'")
    jobs = [tmp_path / "sweep" / str(n) for n in (0, 1)]
    names = [
        f"{run_json(j)['name']} {short_id(j.parent)}-{j.name} seed.base={j.name}" for j in jobs
    ]
    assert sorted(r.info.run_name for r in kids) == names
    assert all(r.info.status == "FINISHED" for r in kids)
    assert client.get_run(parent).info.status == "FINISHED"
    assert "summary.md" in {a.path for a in client.list_artifacts(parent)}


def test_wandb_gets_the_same_artifacts_as_mlflow_and_a_name_of_its_own(logged_run) -> None:
    """config.resolved.yaml, run.json, metrics.jsonl, report.md and curves.png: in the
    offline run's files and in one run-record artifact (W&B sends both on `wandb sync`);
    the run's name is the trackers' name, not the experiment id two runs of one config
    share."""
    from reprotrain.loggers.params import RUN_ARTIFACTS

    run_dir, _ = logged_run
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    saved = {p.name for p in (offline / "files" / "record").iterdir()}
    assert saved == set(RUN_ARTIFACTS)
    log = (run_dir / "train.log").read_text()
    assert "logger wandb failed" not in log and "no report artifact" not in log
    records = wandb_records(next(offline.glob("*.wandb")))
    (artifact,) = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert artifact.type == "run-record"
    assert {m.path for m in artifact.manifest.contents} == set(RUN_ARTIFACTS)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == run_name(run_dir, run_json(run_dir))
    assert run.display_name != run_json(run_dir)["experiment_id"]


def wandb_history(offline: Path) -> dict[int, dict]:
    """Each committed W&B history row of an offline run, by step: its items, JSON-decoded."""
    rows = {}
    for record in wandb_records(next(offline.glob("*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items}
            assert record.history.step.num not in rows, f"step {record.history.step.num} twice"
            rows[record.history.step.num] = row
    return rows


def test_wandb_writes_each_step_row_with_its_batch_and_the_epoch_row_joins_its_last_step(
    logged_run,
) -> None:
    """logger.log_every_steps=2: every step has one row with the record's loss; a mid-epoch
    batch's rows are written together when it is handed over (the last one used to wait for
    the next batch, W&B closing a row only when a later step came); an epoch's last step
    and its epoch values are one row."""
    run_dir, _ = logged_run
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    rows = wandb_history(offline)
    fingerprints = jsonl(run_dir / "fingerprints.jsonl")
    losses = [v for row in fingerprints for v in row["step_losses"]]
    assert sorted(rows) == list(range(1, len(losses) + 1))
    assert [rows[s]["step/train_loss"] for s in sorted(rows)] == losses
    ends = [row["global_step"] for row in fingerprints]
    assert all("epoch/train_loss" in rows[s] and "step/train_loss" in rows[s] for s in ends)
    runtime = {s: row["_runtime"] for s, row in rows.items()}
    handed = [s for s in rows if s % 2 == 0 and s not in ends]  # a mid-epoch batch's last
    assert handed
    for s in handed:  # with its batch, then two steps of training before the next row
        assert runtime[s] - runtime[s - 1] < runtime[s + 1] - runtime[s], (s, runtime)


@pytest.mark.slow
def test_under_ddp_wandb_gets_step_rows_every_log_every_steps_as_they_happen(tmp_path) -> None:
    """2 processes (gloo), logger.log_every_steps=2: a step's loss is each rank's share until
    the epoch's end, and W&B used to get all of an epoch's step rows at its end, within
    milliseconds. Now a batch every 2 steps (one all-reduce of a copy): every step's row
    once, with the record's loss bits, and the rows of epoch 1 are committed while it trains
    (their _runtime spread over most of the epoch). Fast sibling: test_loss_feed.py."""
    from test_ddp import DDP, ddp_env

    env = ddp_env()
    env.update(HOME=str(tmp_path / "home"), WANDB_BASE_URL="http://127.0.0.1:9")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC"):
        env.pop(name, None)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "reprotrain.train", *DDP, "logger=wandb", "logger.log_every_steps=2",
           f"hydra.run.dir={run_dir}"]  # fmt: skip
    assert_ok(subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900))
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    rows = wandb_history(offline)
    fingerprints = jsonl(run_dir / "fingerprints.jsonl")
    losses = [v for row in fingerprints for v in row["step_losses"]]
    assert sorted(rows) == list(range(1, len(losses) + 1))
    assert [rows[s]["step/train_loss"] for s in sorted(rows)] == losses
    first = fingerprints[0]["global_step"]  # epoch 1's last step: its row waits for the epoch
    runtimes = [rows[s]["_runtime"] for s in range(1, first)]
    seconds = jsonl(run_dir / "metrics.jsonl")[0]["seconds"]
    assert max(runtimes) - min(runtimes) > 0.25 * seconds, (runtimes, seconds)


def wandb_records(path: Path) -> list:
    """Every record of a W&B offline transaction log (what `wandb sync` uploads): a 7-byte
    header, then LevelDB-style 32 KiB blocks of chunks (crc32, length, kind: full, first,
    middle, last), each record a ``wandb_internal_pb2.Record``."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block, pos = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    chunks, pending = [], b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == kind == 0:  # padding to the block's end
            pos += room
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            chunks.append(pending)
    records = []
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def test_mlflow_search_runs_gives_a_dataframe_with_the_locked_extra(logged_run) -> None:
    """The call MLflow's users reach for first: it needs pandas, which mlflow-skinny does not
    bring (ModuleNotFoundError before pandas joined requirements-mlflow.lock)."""
    run_dir, uri = logged_run
    mlflow.set_tracking_uri(uri)
    exps = [e.experiment_id for e in MlflowClient(uri).search_experiments()]
    frame = mlflow.search_runs(experiment_ids=exps)
    assert len(frame) == 1
    final = run_json(run_dir)["final_metrics"]
    assert frame["metrics.final/test_acc"].iloc[0] == pytest.approx(final["test_acc"])
