"""Experiment loggers: TensorBoard, MLflow, W&B or none, as sinks of the run record.

``metrics.jsonl`` and ``fingerprints.jsonl`` are the truth; a logger receives copies of the
same numbers so a run can be watched live, and nothing it does may change the bits:

- it gets python numbers the loop has already synced (in batches, at the logging cadence
  and at epoch ends), so it never adds a host sync per step to the hot path;
- the global RNGs (python, NumPy, torch CPU) are saved before and restored after every
  call into a backend, because third-party code may draw from them (run ids, sampling)
  and the `train` stream would then diverge from a run without that logger;
- a backend that fails mid-run (network, full disk) is reported once and switched off:
  losing a dashboard must not lose a training run;
- only rank 0 logs; every other rank gets a no-op, so N processes do not write N copies;
- after a resume, TensorBoard's event stream is rebuilt from the record up to the
  checkpoint's step (:class:`History`: the fingerprints' per-step losses and lrs, the
  metrics rows, the resumed epoch's steps) and continues from there, so every step appears
  exactly once, whatever an earlier attempt had or had not flushed before it was killed.

The config group is ``conf/logger/``: each option switches one backend on, and a list
combines them (``logger=[tensorboard,mlflow]``); ``logger=none`` switches all off. MLflow
and W&B are optional extras, imported only when chosen.

Secrets: nothing from the environment is logged. Parameters are the resolved config and
the identity fields of ``run.json``; ``run.json["environment"]`` is never sent.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import netrc
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reprotrain.errors import ReprotrainError

log = logging.getLogger("reprotrain")

# mlflow-skinny has no SQL store; sqlalchemy + alembic + sqlparse add the local SQLite one.
EXTRAS_INSTALL = ".venv/bin/pip install mlflow-skinny sqlalchemy alembic sqlparse wandb"
WANDB_MODES = ("auto", "online", "offline", "disabled")


@dataclass
class LoggerConfig:
    """Schema of ``conf/logger/*``. One switch per backend, so a list of options merges
    into the union of switches (a list-valued field would be replaced, not combined)."""

    tensorboard: bool = False
    mlflow: bool = False
    wandb: bool = False
    # The loop hands over per-step losses and lr every this many steps (and at each epoch
    # end). 0: only at epoch ends. Larger means fewer calls, never a per-step sync.
    log_every_steps: int = 50
    tensorboard_dir: str = "tensorboard"  # relative to the run dir
    # "" : a local file store inside the run dir (<run_dir>/mlruns): offline, archived with it
    mlflow_tracking_uri: str = ""
    mlflow_experiment: str = ""  # "": the run's `name`
    wandb_project: str = "reprotrain"
    wandb_entity: str = ""  # "": the account's default entity
    # auto: online when an API key is configured (WANDB_API_KEY or `wandb login`), else
    # offline (sync later with `wandb sync <run_dir>/wandb/offline-run-*`).
    wandb_mode: str = "auto"


def enabled_backends(cfg: Any) -> list[str]:
    return [name for name in ("tensorboard", "mlflow", "wandb") if bool(getattr(cfg, name))]


def check_logger_config(cfg: Any) -> None:
    """Range checks and optional-extra availability; one-line ``ReprotrainError``.

    Cheap (no backend is imported), so preflight can call it before a run dir exists.
    """
    if cfg.log_every_steps < 0:
        raise ReprotrainError(f"logger.log_every_steps={cfg.log_every_steps} must be >= 0")
    if cfg.wandb_mode not in WANDB_MODES:
        raise ReprotrainError(
            f"logger.wandb_mode={cfg.wandb_mode!r} is not one of {', '.join(WANDB_MODES)}"
        )
    missing = [b for b in enabled_backends(cfg) if any(_absent(m) for m in _modules_for(b, cfg))]
    if missing:
        raise ReprotrainError(
            f"logger={','.join(missing)} needs an optional package that is not installed; "
            f"install the extras with `{EXTRAS_INSTALL}` or choose logger=tensorboard/none"
        )


# --------------------------------------------------------------------------------------------
# The object the loop talks to
# --------------------------------------------------------------------------------------------


class Loggers:
    """Fan-out to the enabled backends; every call is RNG-neutral and failure-isolated."""

    def __init__(self, backends: list[_Backend], log_every_steps: int = 0) -> None:
        self._backends = backends
        self.log_every_steps = log_every_steps

    @property
    def names(self) -> list[str]:
        return [b.name for b in self._backends]

    def log_steps(self, global_steps: list[int], series: dict[str, list[float | None]]) -> None:
        """Per-step values of the steps since the last call (e.g. train_loss, lr).

        Every series has one value per entry of ``global_steps``; ``None`` or non-finite
        values are skipped by backends that cannot store them.
        """
        for key, values in series.items():
            if len(values) != len(global_steps):
                raise ValueError(f"series {key!r}: {len(values)} values, {len(global_steps)} steps")
        if global_steps:
            self._call("log_steps", list(global_steps), series)

    def log_epoch(self, epoch: int, global_step: int, row: dict[str, Any]) -> None:
        """One metrics.jsonl row (train/val/test metrics, lr, timings) at the epoch's end."""
        numeric = _numeric(row, skip=("epoch", "global_step"))
        self._call("log_epoch", epoch, global_step, numeric)

    def log_final(self, metrics: dict[str, Any]) -> None:
        self._call("log_final", _numeric(metrics, skip=()))

    def close(self, status: str = "completed") -> None:
        self._call("close", status)
        self._backends = []

    def __enter__(self) -> Loggers:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        self.close("completed" if exc_type is None else "failed")

    def _call(self, method: str, *args: Any) -> None:
        for backend in list(self._backends):
            try:
                with preserved_rng():
                    getattr(backend, method)(*args)
            except Exception as e:  # a dashboard failing must not end the training run
                log.warning(
                    "logger %s failed in %s (%s: %s); it is switched off for the rest of "
                    "this run (metrics.jsonl is unaffected)",
                    backend.name,
                    method,
                    type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "",
                )
                self._backends.remove(backend)
                with contextlib.suppress(Exception), preserved_rng():
                    backend.close("failed")


@dataclass
class History:
    """What the record says was logged up to a resumed checkpoint's step."""

    steps: list[int]
    series: dict[str, list[float | None]]
    epochs: list[tuple[int, int, dict[str, Any]]]  # (epoch, global step, metrics row)


def resumed_history(
    fingerprints: list[dict],
    metrics: list[dict],
    partial_losses: list[float],
    partial_lrs: list[float],
    global_step: int,
) -> History:
    """The per-step series of every completed epoch (from its fingerprint row) and of the
    resumed epoch so far, and every epoch row: the numbers the loop had logged."""
    steps: list[int] = []
    losses: list[float | None] = []
    lrs: list[float | None] = []
    for row in fingerprints:
        n = len(row.get("step_losses") or [])
        steps += range(row["global_step"] - n + 1, row["global_step"] + 1)
        losses += list(row.get("step_losses") or [])
        lrs += list(row.get("step_lrs") or [None] * n)[:n]
    steps += range(global_step - len(partial_losses) + 1, global_step + 1)
    losses += list(partial_losses)
    lrs += list(partial_lrs)
    rows = [(r["epoch"], r["global_step"], r) for r in metrics]
    return History(steps, {"train_loss": losses, "lr": lrs}, rows)


def build_loggers(
    cfg: Any,
    run_dir: Path,
    record: dict[str, Any],
    start_step: int = 0,
    history: History | None = None,
) -> Loggers:
    """The loggers chosen in ``cfg`` (a ``LoggerConfig`` or the ``logger`` DictConfig).

    ``record`` is run.json's data (identity fields are sent as parameters; the environment
    is not). ``start_step``: the global step a resumed run continues from; TensorBoard
    rewrites its event files from ``history`` (the record up to that step), so curves have
    neither gaps nor doubles. Non-zero ranks get an empty ``Loggers``.
    """
    check_logger_config(cfg)
    if _rank() != 0:
        return Loggers([], cfg.log_every_steps)
    run_dir = Path(run_dir)
    params = run_params(run_dir, record)
    factories: dict[str, Callable[[], _Backend]] = {
        "tensorboard": lambda: _TensorBoard(
            run_dir / cfg.tensorboard_dir, start_step, params, history
        ),
        "mlflow": lambda: _MLflow(cfg, run_dir, record, params),
        "wandb": lambda: _WandB(cfg, run_dir, record, params),
    }
    backends: list[_Backend] = []
    try:
        for name in enabled_backends(cfg):
            with preserved_rng():
                backends.append(factories[name]())
    except ReprotrainError:
        for b in backends:
            b.close("failed")
        raise
    if backends:
        log.info("logging to %s", ", ".join(b.describe() for b in backends))
    return Loggers(backends, cfg.log_every_steps)


def _rank() -> int:
    """Rank of this process: torch.distributed when initialised, else the launcher's env."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    return int(os.environ.get("RANK", "0") or 0)


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore python, NumPy and torch CPU RNG state after third-party code ran.

    A logger that draws a random run id from the global ``random`` module would otherwise
    shift every later draw of the `train` stream (dropout, user code), and the same config
    with the logger on and off would train differently. CUDA generators are not touched by
    logging code, and copying them would sync the device, so they are left alone.
    """
    import random

    import numpy as np
    import torch

    py, npy, th = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.random.set_rng_state(th)


def _numeric(row: dict[str, Any], skip: tuple[str, ...]) -> dict[str, float]:
    """Numbers only: bools, strings and nulls are dropped. NaN/inf are kept on purpose, so
    a diverged loss shows up on the dashboard (all three backends can store them)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k not in skip and not isinstance(v, bool) and isinstance(v, int | float)
    }


def run_params(run_dir: Path, record: dict[str, Any]) -> dict[str, str]:
    """Parameters for a tracker: the resolved config plus identity fields of run.json.

    Deliberately not ``record["environment"]`` (host names, env vars) and not the command
    line: those can carry paths and tokens that do not belong on a shared server.
    """
    params: dict[str, str] = {}
    resolved = Path(run_dir) / "config.resolved.yaml"
    if resolved.exists():
        import yaml

        params.update(_flatten(yaml.safe_load(resolved.read_text()) or {}, "config."))
    seeds = record.get("seeds") or {}
    git = record.get("git") or {}
    identity = {
        "experiment_id": record.get("experiment_id"),
        "config_sha256": record.get("config_sha256"),
        "repro.level": (record.get("repro") or {}).get("level"),
        "git.commit": git.get("commit"),
        "git.dirty": git.get("dirty"),
        "lock_sha256": record.get("lock_sha256"),
        **{f"seed.{k}": v for k, v in seeds.items()},
    }
    params.update({f"run.{k}": str(v) for k, v in identity.items() if v is not None})
    return params


def _flatten(d: dict, prefix: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


def _run_key(run_dir: Path, record: dict[str, Any]) -> str:
    """Stable id of this run directory: the same after a resume, different for every run."""
    text = f"{Path(run_dir).resolve()}|{record.get('started_at', '')}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _modules_for(backend: str, cfg: Any) -> list[str]:
    if backend == "mlflow" and not cfg.mlflow_tracking_uri:
        return ["mlflow", "sqlalchemy", "alembic"]
    return [backend]


def _absent(module: str) -> bool:
    return importlib.util.find_spec(module) is None


def _require(module: str, backend: str) -> Any:
    if _absent(module):
        raise ReprotrainError(
            f"logger={backend} needs the optional package {module!r}; "
            f"install the extras with `{EXTRAS_INSTALL}`"
        )
    return importlib.import_module(module)


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------


class _Backend:
    name = "backend"

    def describe(self) -> str:
        return self.name

    def log_steps(self, steps: list[int], series: dict[str, list[float | None]]) -> None: ...

    def log_epoch(self, epoch: int, global_step: int, row: dict[str, float | None]) -> None: ...

    def log_final(self, metrics: dict[str, float | None]) -> None: ...

    def close(self, status: str) -> None: ...


class _TensorBoard(_Backend):
    """Event files under <run_dir>/tensorboard: ``tensorboard --logdir <run_dir>``.

    Tags: ``step/<series>`` per step, ``epoch/<metric>`` at each epoch's last global step
    (so both share the step axis), and a text card with the run's identity.
    """

    name = "tensorboard"

    def __init__(
        self,
        log_dir: Path,
        start_step: int,
        params: dict[str, str],
        history: History | None = None,
    ) -> None:
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        if start_step:
            # A resume: what an earlier attempt wrote may stop short of the checkpoint
            # (unflushed when killed) or run past it. Start the stream again from the record.
            for old in Path(log_dir).glob("events.out.tfevents.*"):
                old.unlink()
        self.writer = SummaryWriter(log_dir=str(log_dir))
        ident = {k: v for k, v in params.items() if k.startswith("run.")}
        table = "\n".join(f"| {k[4:]} | `{v}` |" for k, v in sorted(ident.items()))
        self.writer.add_text("run", "| field | value |\n|---|---|\n" + table, 0)
        if start_step and history is not None:
            self.log_steps(history.steps, history.series)
            for epoch, global_step, row in history.epochs:
                numeric = _numeric(row, skip=("epoch", "global_step"))
                self.log_epoch(epoch, global_step, numeric)

    def describe(self) -> str:
        return f"tensorboard ({self.log_dir})"

    def log_steps(self, steps: list[int], series: dict[str, list[float | None]]) -> None:
        for key, values in series.items():
            for step, value in zip(steps, values, strict=True):
                if value is not None:
                    self.writer.add_scalar(f"step/{key}", value, step)

    def log_epoch(self, epoch: int, global_step: int, row: dict[str, float | None]) -> None:
        self.writer.add_scalar("epoch/epoch", epoch, global_step)
        for key, value in row.items():
            if value is not None:
                self.writer.add_scalar(f"epoch/{key}", value, global_step)
        self.writer.flush()

    def log_final(self, metrics: dict[str, float | None]) -> None:
        rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(metrics.items()))
        self.writer.add_text("final_metrics", "| metric | value |\n|---|---|\n" + rows, 0)

    def close(self, status: str) -> None:
        self.writer.close()


class _MLflow(_Backend):
    """One MLflow run per run directory, via ``MlflowClient`` (no global active run).

    The default store is ``sqlite:///<run_dir>/mlflow.db`` with artifacts in
    ``<run_dir>/mlartifacts``: offline, archived with the run, browsable with
    ``mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db``. (MLflow 3.13+ refuses
    the old ``./mlruns`` file store unless ``MLFLOW_ALLOW_FILE_STORE=true``.) A resumed run
    finds its MLflow run again by the ``reprotrain.run_key`` tag and continues it.
    """

    name = "mlflow"
    _BATCH = 1000  # MLflow's limit on metrics per log_batch call

    def __init__(self, cfg: Any, run_dir: Path, record: dict[str, Any], params: dict) -> None:
        run_dir = Path(run_dir).resolve()
        _require("mlflow", "mlflow")
        if not cfg.mlflow_tracking_uri:  # the local SQLite store needs these beside skinny
            for module in ("sqlalchemy", "alembic"):
                _require(module, "mlflow")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._Metric = Metric
        self.uri = cfg.mlflow_tracking_uri or f"sqlite:///{run_dir / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=self.uri)
        name = cfg.mlflow_experiment or str(record.get("name") or "reprotrain")
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            exp_id = exp.experiment_id
        elif cfg.mlflow_tracking_uri:  # a server decides where its artifacts go
            exp_id = self.client.create_experiment(name)
        else:
            artifacts = (run_dir / "mlartifacts").as_uri()
            exp_id = self.client.create_experiment(name, artifact_location=artifacts)
        key = _run_key(run_dir, record)
        found = self.client.search_runs(
            [exp_id], filter_string=f"tags.`reprotrain.run_key` = '{key}'", max_results=1
        )
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(
                exp_id,
                run_name=str(record.get("experiment_id") or run_dir.name),
                tags={"reprotrain.run_key": key, "reprotrain.run_dir": str(run_dir)},
            )
            self.run_id = run.info.run_id
            items = [Param(k, v[:6000]) for k, v in sorted(params.items())]
            for i in range(0, len(items), 100):  # MLflow's limit on params per batch
                self.client.log_batch(self.run_id, params=items[i : i + 100])

    def describe(self) -> str:
        return f"mlflow ({self.uri}, run {self.run_id})"

    def _log(self, points: list[tuple[str, float, int]]) -> None:
        import time

        now = int(time.time() * 1000)
        metrics = [self._Metric(k, v, now, s) for k, v, s in points]
        for i in range(0, len(metrics), self._BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + self._BATCH])

    def log_steps(self, steps: list[int], series: dict[str, list[float | None]]) -> None:
        self._log(
            [
                (f"step/{key}", v, s)
                for key, values in series.items()
                for s, v in zip(steps, values, strict=True)
                if v is not None
            ]
        )

    def log_epoch(self, epoch: int, global_step: int, row: dict[str, float | None]) -> None:
        points = [(f"epoch/{k}", v, global_step) for k, v in row.items() if v is not None]
        self._log([("epoch/epoch", float(epoch), global_step), *points])

    def log_final(self, metrics: dict[str, float | None]) -> None:
        self._log([(f"final/{k}", v, 0) for k, v in metrics.items() if v is not None])

    def close(self, status: str) -> None:
        mlflow_status = {"completed": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED")
        self.client.set_terminated(self.run_id, status=mlflow_status)


def wandb_key_configured() -> bool:
    """Whether W&B credentials exist (env or ``wandb login``'s netrc); never reads them out."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def resolve_wandb_mode(mode: str) -> str:
    """``auto``: online only when the user configured a key, so nothing leaves the machine
    by accident and a run without an account still works (offline, sync later)."""
    if mode != "auto":
        return mode
    return "online" if wandb_key_configured() else "offline"


class _WandB(_Backend):
    """A W&B run under <run_dir>/wandb, with an id derived from the run dir so a resumed
    run continues the same W&B run (``resume="allow"``)."""

    name = "wandb"

    def __init__(self, cfg: Any, run_dir: Path, record: dict[str, Any], params: dict) -> None:
        wandb = _require("wandb", "wandb")
        self.mode = resolve_wandb_mode(cfg.wandb_mode)
        self.run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity or None,
            name=str(record.get("experiment_id") or Path(run_dir).name),
            id=_run_key(run_dir, record),
            resume="allow",
            dir=str(run_dir),
            mode=self.mode,
            config=params,
        )

    def describe(self) -> str:
        return f"wandb ({self.mode})"

    def log_steps(self, steps: list[int], series: dict[str, list[float | None]]) -> None:
        for i, step in enumerate(steps):
            point = {f"step/{k}": v[i] for k, v in series.items() if v[i] is not None}
            if point:
                self.run.log(point, step=step)

    def log_epoch(self, epoch: int, global_step: int, row: dict[str, float | None]) -> None:
        point = {f"epoch/{k}": v for k, v in row.items() if v is not None}
        self.run.log({"epoch/epoch": epoch, **point}, step=global_step)

    def log_final(self, metrics: dict[str, float | None]) -> None:
        self.run.summary.update({f"final/{k}": v for k, v in metrics.items() if v is not None})

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "completed" else 1)
