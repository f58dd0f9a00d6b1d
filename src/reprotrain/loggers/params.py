"""What a tracker is told about a run: parameters, tags, its stable key, its sweep.
Closes: a secret in a tracker: the resolved config (``oc.env`` as its interpolation) and
run.json's identity fields only, never the environment or command line (docs/loggers.md)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from reprotrain.loggers.fanout import log
from reprotrain.quoting import flatten
from reprotrain.run.bounded import load_yaml
from reprotrain.run.directory import SWEEP_RECORD
from reprotrain.run.record import METRICS, RESOLVED_CONFIG, RUN_JSON

#: Files of a run dir a tracker gets as artifacts at the end (when they exist).
RUN_ARTIFACTS = (RESOLVED_CONFIG, RUN_JSON, METRICS, "report.md", "curves.png")


def resolved_config(run_dir: Path) -> dict[str, Any]:
    """``config.resolved.yaml`` as a dict ({} before it exists), less the ``logger`` group
    (not a parameter of the run; a tracking URI is nobody's business in the table)."""
    path = Path(run_dir) / RESOLVED_CONFIG
    if not path.is_file():
        return {}
    config = load_yaml(path.read_text(), str(path)) or {}
    config.pop("logger", None)
    return config


def identity(record: dict[str, Any]) -> dict[str, Any]:
    """The identity fields of run.json a tracker may show (no environment, no command)."""
    seeds = record.get("seeds") or {}
    git = record.get("git") or {}
    fields = {
        "experiment_id": record.get("experiment_id"),
        "config_sha256": record.get("config_sha256"),
        "repro.level": (record.get("repro") or {}).get("level"),
        "git.commit": git.get("commit"),
        "git.dirty": git.get("dirty"),
        "lock_sha256": record.get("lock_sha256"),
        "lr": (record.get("components") or {}).get("lr"),  # the schedule's (OneCycleLR's max_lr)
        **{f"seed.{k}": v for k, v in seeds.items()},
    }
    return {k: v for k, v in fields.items() if v is not None}


def run_params(run_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    """``config.<key>`` of the flattened resolved config and ``run.<field>``, with their
    types (bool, int, float, text, null, lists): W&B keeps them; MLflow, whose parameters
    are text, gets :func:`param_text`."""
    params = flatten(resolved_config(run_dir), "config.")
    return params | {f"run.{k}": v for k, v in identity(record).items()}


def param_text(value: Any) -> str:
    """A parameter as text in the config's own spelling (``true``, ``null``, ``0.2``,
    ``[1, 2]``; text as it is), so ``yaml.safe_load`` gives the typed value back."""
    return value if isinstance(value, str) else json.dumps(value)


def override_key(override: str) -> str:
    """The key (or config group) an override sets: ``+optimizer.lr=0.1`` -> ``optimizer.lr``."""
    return override.partition("=")[0].lstrip("+~")


def _chosen(key: str) -> bool:
    """An override that is a choice about the run: not where it is logged, not Hydra's own."""
    return key.replace("/", ".").split(".")[0] not in ("logger", "hydra")


def run_overrides(run_dir: Path) -> list[str]:
    """The run's own overrides (``.hydra/overrides.yaml``), less the ``logger`` ones."""
    from reprotrain.run.readers import read_overrides

    return [o for o in read_overrides(run_dir) or [] if _chosen(override_key(o))]


def sweep_record_overrides(sweep_dir: Path) -> list[str] | None:
    """A sweep's command-line overrides and Optuna search space (``multirun.yaml``), or None.
    Read through ``read_sweep_record``: the same bounds every reader of that record obeys."""
    from omegaconf import OmegaConf

    from reprotrain.run.readers import read_sweep_record

    saved = read_sweep_record(Path(sweep_dir))
    if saved is None:  # absent, or only the "claimed by" comment so far
        return None
    overrides = [str(o) for o in OmegaConf.select(saved, "hydra.overrides.task", default=[])]
    params = OmegaConf.select(saved, "hydra.sweeper.params", default=None) or {}
    return overrides + [f"{k}={v}" for k, v in params.items()]


def swept_keys(sweep_dir: Path) -> set[str]:
    """The keys a sweep varies: value lists, ranges, search space (not where it logs)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, keys = OverridesParser.create(), set()
    for text in sweep_record_overrides(sweep_dir) or []:
        try:
            (override,) = parser.parse_overrides([text])
        except Exception:  # a form Hydra expands only against the config tree: not a key
            continue
        if override.is_sweep_override() and _chosen(override.key_or_group):
            keys.add(override.key_or_group)
    return keys


def is_seed(key: str) -> bool:
    """Whether an override's key is a seed's (``seed`` or ``seed.<stream>``)."""
    return key == "seed" or key.startswith("seed.")


def run_name(run_dir: Path, record: dict[str, Any]) -> str:
    """A tracker's name for the run, told apart at a glance from any other: the experiment
    (``name``), a short id (a sweep job's: its sweep's and its number, shared by no other
    sweep), then what was chosen (a sweep job's swept values, a single run's overrides)."""
    sweep, overrides = sweep_dir_of(run_dir), run_overrides(run_dir)
    if sweep is None:
        short = run_key(run_dir, record)[:6]
    else:
        short = f"{short_id(sweep)}-{Path(run_dir).name}"
        swept = swept_keys(sweep)
        overrides = [o for o in overrides if override_key(o) in swept] or overrides
    chosen = [o for o in overrides if override_key(o) != "experiment"]
    return " ".join([str(record.get("name") or "run"), short, *sorted(chosen)])


def short_id(path: Path) -> str:
    """Six hex digits of a directory's resolved path: its sweep's part of a job's name."""
    return hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:6]


def hparam_values(run_dir: Path) -> dict[str, bool | int | float | str]:
    """HParams' hyperparameters: each key the overrides set, resolved, and ``group`` (the
    overrides less the seeds); not the whole config."""
    flat, overrides = flatten(resolved_config(run_dir)), run_overrides(run_dir)
    out: dict[str, bool | int | float | str] = {}
    for text in overrides:
        key = override_key(text)
        value = flat.get(key, text.partition("=")[2])
        out[key] = value if isinstance(value, bool | int | float | str) else str(value)
    out["group"] = " ".join(sorted(o for o in overrides if not is_seed(override_key(o))))
    return out | ({"tags": ",".join(tags)} if (tags := flat.get("tags")) else {})


def monitor_of(run_dir: Path) -> tuple[str, str] | None:
    """(``trainer.monitor``, ``trainer.monitor_mode``) of the run's resolved config."""
    trainer = resolved_config(run_dir).get("trainer") or {}
    monitor = trainer.get("monitor")
    return (str(monitor), str(trainer.get("monitor_mode", "max"))) if monitor else None


def run_key(run_dir: Path, record: dict[str, Any]) -> str:
    """Stable id of this run directory: the same after a resume, different for every run."""
    text = f"{Path(run_dir).resolve()}|{record.get('started_at', '')}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sweep_dir_of(run_dir: Path) -> Path | None:
    """The Hydra sweep directory a run dir belongs to (its parent holds multirun.yaml)."""
    parent = Path(run_dir).resolve().parent
    return parent if (parent / SWEEP_RECORD).is_file() else None


def record_files(run_dir: Path, report: Any, scratch: Path, tracker: str) -> list[Path]:
    """The ``RUN_ARTIFACTS`` a tracker attaches at the end, report and curves drawn by
    ``report(run_dir, scratch)`` (one that cannot be drawn is warned about)."""
    run_dir, drawn = Path(run_dir), {}
    if report is not None and (run_dir / METRICS).is_file():
        try:
            drawn = {p.name: p for p in report(run_dir, Path(scratch)) if p is not None}
        except Exception as e:  # a report that cannot be drawn: attach the rest
            log.warning("%s: no report artifact (%s: %s)", tracker, type(e).__name__, e)
    paths = [drawn.get(name) or run_dir / name for name in RUN_ARTIFACTS]
    return [p for p in paths if p.is_file()]
