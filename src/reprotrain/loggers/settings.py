"""The ``logger`` config group: its schema, and the frozen settings the loggers get, read
once from it (where each backend writes: docs/loggers.md). No backend is imported here."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reprotrain.errors import ReprotrainError

WANDB_MODES = ("auto", "online", "offline", "disabled")
BACKENDS = ("tensorboard", "mlflow", "wandb")  # the shipped ones that need a store or extra
SHIPPED_KEYS = (*BACKENDS, "csv")  # the logger config's own slots (``shipped.SHIPPED``)
#: The optional extra each backend needs (``requirements-<extra>.lock``); none for TensorBoard,
#: which is in the runtime lock.
EXTRA_OF = {"mlflow": "mlflow", "wandb": "wandb"}
#: The local SQLite store needs sqlalchemy + alembic beside mlflow (all in the mlflow extra).
LOCAL_STORE_MODULES = ("mlflow", "sqlalchemy", "alembic")
MLFLOW_DB = "mlruns.db"
MLFLOW_ARTIFACTS = "mlartifacts"


def install_command(*extras: str) -> str:
    """The one command that installs the hashed, locked extras."""
    return f"make install EXTRAS={','.join(extras)}"


EXTRAS_INSTALL = install_command("mlflow", "wandb")


@dataclass
class LoggerConfig:
    """Schema of ``conf/logger/*``: one key per logger (a ``_target_`` node, ``true`` for the
    shipped class, ``false``/null: off; a user's under ``sinks``), so a list of options
    merges into the union. No key is part of a run's identity: a logger changes no bit."""

    tensorboard: Any = False
    mlflow: Any = False
    wandb: Any = False
    csv: Any = False  # metrics.csv in the run dir, one row per epoch
    # A user's loggers: name -> _target_ node of a reprotrain.api.Logger subclass.
    sinks: dict[str, Any] | None = field(default_factory=dict)
    # The loop hands over per-step losses and lr every this many steps (and at each epoch
    # end). 0: only at epoch ends. Larger means fewer calls, never a per-step sync.
    log_every_steps: int = 50
    tensorboard_dir: str = "tensorboard"  # relative to the run dir
    # One folder for the whole project with a link per run (runs and sweeps), relative to
    # the project root: `tensorboard --logdir tb`. "": no links.
    tensorboard_index: str = "tb"
    # "": the project's store, sqlite:///<project root>/mlruns.db (artifacts beside it in
    # mlartifacts/). Any MLflow URI otherwise: sqlite:///abs/path.db, http://host:5000.
    # Credentials for a server come from MLflow's own env vars, never from here.
    mlflow_tracking_uri: str = ""
    mlflow_experiment: str = ""  # "": the run's `name`
    wandb_project: str = "reprotrain"
    wandb_entity: str = ""  # "": the account's default entity
    # auto: online when an API key is configured (WANDB_API_KEY or `wandb login`), else
    # offline (sync later with `wandb sync <run_dir>/wandb/offline-run-*`).
    wandb_mode: str = "auto"


def project_root() -> Path:
    """Where ``outputs/`` and ``multirun/`` are: the directory runs are started from
    (``hydra.job.chdir=false``, so the working directory)."""
    return Path.cwd().resolve()


@dataclass(frozen=True)
class LoggerSettings:
    """The ``logger`` node read once (:meth:`of`): what every logger is told."""

    chosen: tuple[tuple[str, Any], ...] = ()  # (name, True or its _target_ node), config order
    log_every_steps: int = 50
    tensorboard_dir: str = "tensorboard"
    tensorboard_index: str = "tb"
    mlflow_uri: str = ""  # the store a run uses: the configured URI, else the project's
    mlflow_experiment: str = ""
    wandb_project: str = "reprotrain"
    wandb_entity: str = ""
    wandb_mode: str = "auto"

    @classmethod
    def of(cls, node: Any, root: Path | None = None) -> LoggerSettings:
        """Read the ``logger`` node (a ``LoggerConfig`` or its DictConfig) once, range-checked
        (one-line ``ReprotrainError``). ``root``: the project root the default MLflow store
        lives in (:func:`project_root`)."""
        if node.log_every_steps < 0:
            raise ReprotrainError(f"logger.log_every_steps={node.log_every_steps} must be >= 0")
        if node.wandb_mode not in WANDB_MODES:
            raise ReprotrainError(
                f"logger.wandb_mode={node.wandb_mode!r} is not one of {', '.join(WANDB_MODES)}"
            )
        chosen = {name: getattr(node, name, False) for name in SHIPPED_KEYS}
        chosen |= dict((getattr(node, "sinks", None) or {}).items())
        uri = node.mlflow_tracking_uri or f"sqlite:///{(root or project_root()) / MLFLOW_DB}"
        return cls(
            chosen=tuple((str(name), entry) for name, entry in chosen.items() if entry),
            log_every_steps=int(node.log_every_steps),
            tensorboard_dir=str(node.tensorboard_dir),
            tensorboard_index=str(node.tensorboard_index),
            mlflow_uri=str(uri),
            mlflow_experiment=str(node.mlflow_experiment),
            wandb_project=str(node.wandb_project),
            wandb_entity=str(node.wandb_entity),
            wandb_mode=str(node.wandb_mode),
        )

    @property
    def backends(self) -> list[str]:
        """The names of the loggers that are on: the shipped slots first, then ``sinks``."""
        return [name for name, _ in self.chosen]

    def modules_for(self, backend: str) -> list[str]:
        """The importable modules a backend needs with these settings."""
        if backend == "mlflow" and self.mlflow_uri.startswith("sqlite:"):
            return list(LOCAL_STORE_MODULES)
        return [backend]


def check_extras(settings: LoggerSettings) -> LoggerSettings:
    """``settings``, once every chosen backend's optional extra is importable (no backend is
    imported: cheap, so preflight runs it before a run dir exists); else one line naming
    the install command."""
    missing = [
        b
        for b in settings.backends
        if b in BACKENDS and any(module_absent(m) for m in settings.modules_for(b))
    ]
    if missing:
        extras = sorted({EXTRA_OF.get(b, b) for b in missing})
        raise ReprotrainError(
            f"logger={','.join(missing)} needs an optional package that is not installed; "
            f"install the locked extra with `{install_command(*extras)}` or choose "
            "logger=tensorboard/none"
        )
    return settings


def module_absent(module: str) -> bool:
    return importlib.util.find_spec(module) is None


def require_module(module: str, backend: str) -> Any:
    """Import an optional backend's module, or fail in one line naming the install command."""
    if module_absent(module):
        raise ReprotrainError(
            f"logger={backend} needs the optional package {module!r}; install the locked "
            f"extra with `{install_command(EXTRA_OF.get(backend, backend))}`"
        )
    return importlib.import_module(module)
