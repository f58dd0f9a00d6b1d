"""MLflow: one MLflow run per run directory (``MlflowClient``, no global active run), found
again on resume by its ``reprotrain.run_key`` tag; a sweep is a parent run (docs/loggers.md).
Closes: a store URI's credentials in a record (the sweep dir keeps its sha256, never the URI)."""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reprotrain.errors import ReprotrainError
from reprotrain.loggers.fanout import Logger, LoggerRun, preserved_rng
from reprotrain.loggers.params import (
    identity,
    param_text,
    record_files,
    run_key,
    run_name,
    short_id,
)
from reprotrain.loggers.settings import (
    MLFLOW_ARTIFACTS,
    LoggerSettings,
    require_module,
)
from reprotrain.run.record import atomic_write_text, parse_json_object, read_text

log = logging.getLogger("reprotrain")

PARENT_JSON = "mlflow_parent_run.json"
#: Files of a sweep dir attached to the parent run at the end.
SWEEP_ARTIFACTS = ("summary.json", "summary.md", "summary.png", "multirun.yaml")
STATUS = {"completed": "FINISHED", "interrupted": "KILLED"}
#: MLflow 3's experiment kind; the locked UI (3.17) no longer reads it, but a global switch
#: that starts on GenAI, unless the page's address says ``TRAINING_VIEW`` (:func:`ui_link`).
KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
TRAINING_VIEW = "workflowType=machine_learning"
#: Where ``mlflow ui`` serves a local store by default.
LOCAL_UI = "http://127.0.0.1:5000"
_BATCH = 1000  # MLflow's limit on metrics per log_batch call
_PARAMS_BATCH = 100  # ... and on params
#: (run_dir, out_dir) -> (report.md, curves.png or None).
ReportHook = Callable[[Path, Path], tuple[Path, "Path | None"]]


def store_digest(uri: str) -> str:
    return hashlib.sha256(uri.encode()).hexdigest()


def shown_uri(uri: str) -> str:
    """The URI without any ``user:password@`` part, for log lines."""
    scheme, sep, rest = uri.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        rest = rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"


def ui_link(uri: str, experiment: str) -> str:
    """The experiment's page in the model-training view: on the tracking server itself, or
    in ``mlflow ui`` for a local store (credentials never in it)."""
    base = shown_uri(uri).rstrip("/") if uri.startswith(("http://", "https://")) else LOCAL_UI
    return f"{base}/#/experiments/{experiment}?{TRAINING_VIEW}"


def client_for(settings: LoggerSettings):
    """(MlflowClient, uri) for the configured store; one-line error if the extra is absent."""
    for module in settings.modules_for("mlflow"):
        require_module(module, "mlflow")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=settings.mlflow_uri), settings.mlflow_uri


def experiment_id(client, name: str, uri: str) -> str:
    """The experiment's id, created on first use (a local store's artifacts beside its
    database), tagged as model training (:data:`EXPERIMENT_KIND`)."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if KIND_TAG not in exp.tags:
            client.set_experiment_tag(exp.experiment_id, KIND_TAG, EXPERIMENT_KIND)
        return exp.experiment_id
    location = None
    if uri.startswith("sqlite:///"):
        location = (Path(uri[len("sqlite:///") :]).resolve().parent / MLFLOW_ARTIFACTS).as_uri()
    try:
        return client.create_experiment(
            name, artifact_location=location, tags={KIND_TAG: EXPERIMENT_KIND}
        )
    except Exception:  # another process of the same sweep created it first
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def log_params(client, run_id: str, params: dict[str, Any]) -> None:
    """MLflow's parameters are text: each in the config's spelling (``param_text``)."""
    from mlflow.entities import Param

    items = [Param(k, param_text(v)[:6000]) for k, v in sorted(params.items())]
    for i in range(0, len(items), _PARAMS_BATCH):
        client.log_batch(run_id, params=items[i : i + _PARAMS_BATCH])


def read_parent(sweep_dir: Path, uri: str) -> dict[str, str] | None:
    """The parent run a sweep dir records (``mlflow_parent_run.json``) for this store."""
    try:
        path = Path(sweep_dir) / PARENT_JSON
        data = parse_json_object(read_text(path), str(path))  # bounded
    except ReprotrainError:  # none, or unreadable
        return None
    return data if data.get("store_sha256") == store_digest(uri) else None


class MLflowLogger(Logger):
    name = "mlflow"

    def start(self, run: LoggerRun) -> None:
        from mlflow.entities import Metric

        self._Metric = Metric
        self.run_dir, self.report = Path(run.run_dir).resolve(), run.report
        self.client, self.uri = client_for(run.settings)
        parent = read_parent(self.run_dir.parent, self.uri)  # a sweep's, in the same store
        if parent is not None:
            exp_id = parent["experiment_id"]
        else:
            name = run.settings.mlflow_experiment or str(run.record.get("name") or "reprotrain")
            exp_id = experiment_id(self.client, name, self.uri)
        key, self.exp_id = run_key(self.run_dir, run.record), exp_id
        found = self.client.search_runs(
            [exp_id], filter_string=f"tags.`reprotrain.run_key` = '{key}'", max_results=1
        )
        self.last_step = run.start_step  # a resumed run's final metrics land on its last step
        self.logged = {"step": 0, "epoch": 0}  # what an earlier attempt already logged
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            # Steps a killed attempt logged past the checkpoint come again: each kept once.
            for axis, key in (("step", "step/train_loss"), ("epoch", "epoch/epoch")):
                history = self.client.get_metric_history(self.run_id, key)
                self.logged[axis] = max((m.step for m in history), default=0)
            return
        ident = identity(run.record)
        tags = {
            "reprotrain.run_key": key,
            "reprotrain.run_dir": str(self.run_dir),
            "reprotrain.experiment_id": str(ident.get("experiment_id", "")),
            "reprotrain.config_sha256": str(ident.get("config_sha256", "")),
            "repro.level": str(ident.get("repro.level", "")),
        }
        if ident.get("git.commit"):
            tags["mlflow.source.git.commit"] = str(ident["git.commit"])
        if parent is not None:
            tags["mlflow.parentRunId"] = parent["run_id"]
        tags |= dict.fromkeys(map(str, run.record.get("tags") or []), "")  # tags=[a,b]: MLflow's
        name = run_name(self.run_dir, run.record)
        self.run_id = self.client.create_run(exp_id, run_name=name, tags=tags).info.run_id
        log_params(self.client, self.run_id, run.params)

    def describe(self) -> str:
        link = ui_link(self.uri, self.exp_id)
        return f"mlflow ({shown_uri(self.uri)}, run {self.run_id}; model-training view: {link})"

    def _log(self, points: list[tuple[str, float, int]]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._Metric(k, v, now, s) for k, v, s in points]
        for i in range(0, len(metrics), _BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + _BATCH])

    def log_steps(self, steps: list[int], series: dict[str, list[float | None]]) -> None:
        self._log(
            [
                (f"step/{key}", v, s)
                for key, values in series.items()
                for s, v in zip(steps, values, strict=True)
                if v is not None and s > self.logged["step"]
            ]
        )
        self.last_step = max([self.last_step, *steps])

    def log_epoch(self, epoch: int, global_step: int, row: dict[str, float | None]) -> None:
        self.last_step = max(self.last_step, global_step)
        if global_step <= self.logged["epoch"]:
            return
        points = [(f"epoch/{k}", v, global_step) for k, v in row.items() if v is not None]
        self._log([("epoch/epoch", float(epoch), global_step), *points])

    def log_final(self, metrics: dict[str, float | None]) -> None:
        self._log([(f"final/{k}", v, self.last_step) for k, v in metrics.items() if v is not None])

    def close(self, status: str) -> None:
        try:
            self.log_artifacts()
        finally:
            self.client.set_terminated(self.run_id, status=STATUS.get(status, "FAILED"))

    def log_artifacts(self) -> None:
        """The run's record files, and its report and curves drawn from the run dir."""
        with tempfile.TemporaryDirectory(prefix="reprotrain-mlflow-") as tmp:
            for path in record_files(self.run_dir, self.report, Path(tmp), "mlflow"):
                self.client.log_artifact(self.run_id, str(path))


def start_sweep_run(node: Any, sweep_dir: Path, name: str, overrides: list[str]) -> str | None:
    """Before a sweep's first job: its parent run's id (a failure is a warning, not a stop)."""
    if not getattr(node, "mlflow", False):
        return None
    sweep_dir = Path(sweep_dir).resolve()
    try:
        with preserved_rng():
            settings = LoggerSettings.of(node)
            client, uri = client_for(settings)
            exp_id = experiment_id(client, settings.mlflow_experiment or name, uri)
            run = client.create_run(
                exp_id,
                run_name=f"{name} {short_id(sweep_dir)} (sweep)",
                tags={"reprotrain.sweep_dir": str(sweep_dir), "reprotrain.kind": "sweep"},
            )
            log_params(client, run.info.run_id, {"sweep.overrides": " ".join(overrides)})
        data = dict(run_id=run.info.run_id, experiment_id=exp_id, store_sha256=store_digest(uri))
        atomic_write_text(sweep_dir / PARENT_JSON, json.dumps(data, indent=1) + "\n")
        return run.info.run_id
    except Exception as e:
        log.warning("mlflow: no parent run for the sweep (%s: %s)", type(e).__name__, e)
        return None


def end_sweep_run(node: Any, sweep_dir: Path, completed: bool = True) -> None:
    """After a sweep's last job: the summary files as the parent's artifacts, its status."""
    if not getattr(node, "mlflow", False):
        return
    sweep_dir = Path(sweep_dir).resolve()
    try:
        with preserved_rng():
            client, uri = client_for(LoggerSettings.of(node))
            parent = read_parent(sweep_dir, uri)
            if parent is None:
                return
            for name in SWEEP_ARTIFACTS:
                if (sweep_dir / name).is_file():
                    client.log_artifact(parent["run_id"], str(sweep_dir / name))
            client.set_terminated(parent["run_id"], status="FINISHED" if completed else "FAILED")
    except Exception as e:
        log.warning("mlflow: the sweep's parent run was not closed (%s: %s)", type(e).__name__, e)
