"""The ``logger`` group's schema and the settings read once from it (docs/loggers.md)."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ValidationError

from reprotrain.errors import ReprotrainError
from reprotrain.extras import EXTRAS, install_command

WANDB_MODES = ("auto", "online", "offline", "disabled")
BACKENDS = ("tensorboard", "mlflow", "wandb")  # the shipped ones that need a store or extra
SHIPPED_KEYS = (*BACKENDS, "csv")  # the logger config's own slots (``shipped.SHIPPED``)
#: The optional extra each backend needs (TensorBoard is in the runtime lock): the extras'
#: one list is ``extras.EXTRAS`` (each names its backend).
EXTRA_OF = {backend: backend for backend in BACKENDS if backend in EXTRAS}
#: The local SQLite store needs sqlalchemy + alembic beside mlflow (all in the mlflow extra).
LOCAL_STORE_MODULES = ("mlflow", "sqlalchemy", "alembic")
MLFLOW_DB = "mlruns.db"
#: The text settings a logger gets as the ``logger`` node holds them.
TEXT_KEYS = ("tensorboard_dir", "tensorboard_index", "mlflow_experiment", "wandb_project")
TEXT_KEYS += ("wandb_entity", "wandb_mode")
MLFLOW_ARTIFACTS = "mlartifacts"


@dataclass
class LoggerConfig:
    """The settings of ``conf/logger/*`` and the shipped loggers' slots (``_target_``,
    ``true``, or off); any other key is a logger of the user's, a ``_target_`` node, as in
    lightning-hydra-template (``conf/logger/<name>.yaml``). None is part of a run's identity;
    :meth:`LoggerSettings.of` checks the types (the group has no schema, so it can hold them)."""

    tensorboard: Any = False
    mlflow: Any = False
    wandb: Any = False
    csv: Any = False  # metrics.csv in the run dir, one row per epoch
    # Per-step losses and lr handed over every this many steps (0: at epoch ends only).
    log_every_steps: int = 50
    tensorboard_dir: str = "tensorboard"  # relative to the run dir
    # The project's folder of links to every run (`tensorboard --logdir tb`); "": no links.
    tensorboard_index: str = "tb"
    # "": sqlite:///<project root>/mlruns.db; any MLflow URI otherwise (credentials: MLflow's
    # own env vars, never here).
    mlflow_tracking_uri: str = ""
    mlflow_experiment: str = ""  # "": the run's `name`
    wandb_project: str = "reprotrain"
    wandb_entity: str = ""  # "": the account's default entity
    # auto: online when an API key is configured, else offline.
    wandb_mode: str = "auto"


def project_root() -> Path:
    """Where ``outputs/`` and ``multirun/`` are: the working directory (no chdir)."""
    return Path.cwd().resolve()


@dataclass(frozen=True)
class LoggerSettings:
    """The ``logger`` node read once (:meth:`of`): what every logger is told."""

    chosen: tuple[tuple[str, Any], ...] = ()  # (name, True or its _target_ node), config order
    tensorboard_dir: str = "tensorboard"
    tensorboard_index: str = "tb"
    mlflow_uri: str = ""  # the store a run uses: the configured URI, else the project's
    mlflow_experiment: str = ""
    wandb_project: str = "reprotrain"
    wandb_entity: str = ""
    wandb_mode: str = "auto"

    @classmethod
    def of(cls, node: Any, root: Path | None = None) -> LoggerSettings:
        """Read the ``logger`` node once, type- and range-checked; ``root``: the default store's
        home."""
        node = node if isinstance(node, DictConfig) else OmegaConf.structured(node)
        known = [f.name for f in fields(LoggerConfig)]
        users = {str(k): node[k] for k in node if k not in known}
        for name, entry in users.items():
            if not (isinstance(entry, DictConfig) and "_target_" in entry):
                raise ReprotrainError(
                    f"logger.{name}: not a setting ({', '.join(known)}) and no logger: a logger "
                    "of your own is a _target_ node (conf/logger/<name>.yaml, docs/loggers.md)"
                )
        try:
            OmegaConf.merge(OmegaConf.structured(LoggerConfig), OmegaConf.masked_copy(node, known))
        except ValidationError as e:
            raise ReprotrainError(f"logger.{e.full_key}: {str(e).splitlines()[0]}") from None
        if node.log_every_steps < 0:
            raise ReprotrainError(f"logger.log_every_steps={node.log_every_steps} must be >= 0")
        if node.wandb_mode not in WANDB_MODES:
            raise ReprotrainError(
                f"logger.wandb_mode={node.wandb_mode!r} is not one of {', '.join(WANDB_MODES)}"
            )
        chosen = {name: node[name] for name in SHIPPED_KEYS} | users
        uri = node.mlflow_tracking_uri or f"sqlite:///{(root or project_root()) / MLFLOW_DB}"
        texts = {k: str(getattr(node, k)) for k in TEXT_KEYS}
        on = tuple((str(name), entry) for name, entry in chosen.items() if entry)
        return cls(on, mlflow_uri=str(uri), **texts)

    @property
    def backends(self) -> list[str]:
        """The names of the loggers that are on: the shipped slots first, then the user's."""
        return [name for name, _ in self.chosen]

    def modules_for(self, backend: str) -> list[str]:
        """The importable modules a backend needs with these settings."""
        if backend == "mlflow" and self.mlflow_uri.startswith("sqlite:"):
            return list(LOCAL_STORE_MODULES)
        return [backend]


def check_extras(settings: LoggerSettings) -> LoggerSettings:
    """``settings``, once every chosen backend's extra is importable (nothing imported)."""
    shipped = [b for b in settings.backends if b in BACKENDS]
    missing = [b for b in shipped if any(map(module_absent, settings.modules_for(b)))]
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
