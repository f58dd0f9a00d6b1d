"""The ``logger`` config group's schema and its checks (no backend is imported here).

Where things go by default (all relative to the project root, the directory the run was
started from, where ``outputs/`` and ``multirun/`` live):

- TensorBoard: event files in ``<run_dir>/tensorboard`` (archived with the run), and one link
  per run in ``tb/`` (``tb/outputs/<name>/<stamp>``, ``tb/multirun/<name>/<sweep>/<n>``), so
  ``tensorboard --logdir tb`` shows single runs and sweeps side by side;
- MLflow: one tracking store for the project, ``sqlite:///<root>/mlruns.db`` with artifacts
  in ``<root>/mlartifacts``: ``mlflow ui --backend-store-uri sqlite:///mlruns.db``;
- W&B: ``<run_dir>/wandb``, offline unless a key is configured.
"""

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
    """Schema of ``conf/logger/*``. One key per logger, so a list of options merges into
    the union (a list-valued field would be replaced, not combined): each shipped one has
    its slot, a ``_target_`` node (``conf/logger/<name>.yaml``; ``true`` means the shipped
    class with its defaults; ``false``/null: off), and a user's loggers are ``_target_``
    nodes by name under ``sinks``. None of these keys is part of a run's identity
    (``config.NON_IDENTITY_PREFIXES``): a logger never changes the bits."""

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


def chosen_loggers(cfg: Any) -> dict[str, Any]:
    """The loggers that are on, by name: each ``True`` or its ``_target_`` node, the
    shipped slots first, then ``sinks`` in config order."""
    chosen = {name: getattr(cfg, name, False) for name in SHIPPED_KEYS}
    chosen |= dict((getattr(cfg, "sinks", None) or {}).items())
    return {str(name): entry for name, entry in chosen.items() if entry}


def enabled_backends(cfg: Any) -> list[str]:
    return list(chosen_loggers(cfg))


def project_root() -> Path:
    """Where ``outputs/`` and ``multirun/`` are: the directory runs are started from
    (``hydra.job.chdir=false``, so the working directory)."""
    return Path.cwd().resolve()


def mlflow_uri(cfg: Any, root: Path | None = None) -> str:
    """The tracking URI a run uses: the configured one, else the project's SQLite store."""
    if cfg.mlflow_tracking_uri:
        return str(cfg.mlflow_tracking_uri)
    return f"sqlite:///{(root or project_root()) / MLFLOW_DB}"


def modules_for(backend: str, cfg: Any) -> list[str]:
    """The importable modules a backend needs with this config."""
    if backend == "mlflow" and mlflow_uri(cfg).startswith("sqlite:"):
        return list(LOCAL_STORE_MODULES)
    return [backend]


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
    missing = [
        b
        for b in enabled_backends(cfg)
        if b in BACKENDS and any(module_absent(m) for m in modules_for(b, cfg))
    ]
    if missing:
        extras = sorted({EXTRA_OF.get(b, b) for b in missing})
        raise ReprotrainError(
            f"logger={','.join(missing)} needs an optional package that is not installed; "
            f"install the locked extra with `{install_command(*extras)}` or choose "
            "logger=tensorboard/none"
        )
