"""What a tracker is told about a run: parameters, tags, its stable key, its sweep. Nothing
from the environment: the resolved config (``oc.env`` values as their interpolation,
``repro/secrets.py``) and run.json's identity fields, never its environment or command line.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from reprotrain.quoting import flatten

#: Hydra writes this into every sweep directory; a run dir below one is a sweep's run.
MULTIRUN_YAML = "multirun.yaml"
RESOLVED_CONFIG = "config.resolved.yaml"
#: Files of a run dir a tracker gets as artifacts at the end (when they exist).
RUN_ARTIFACTS = (RESOLVED_CONFIG, "run.json", "metrics.jsonl", "report.md", "curves.png")


def resolved_config(run_dir: Path) -> dict[str, Any]:
    """``config.resolved.yaml`` of the run as a dict ({} before it is written), less the
    ``logger`` group: where a run is logged is not a parameter of the run, and a tracking
    URI is no business of the tracker's table (nor of anyone reading it)."""
    path = Path(run_dir) / RESOLVED_CONFIG
    if not path.is_file():
        return {}
    import yaml

    config = yaml.safe_load(path.read_text()) or {}
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
        **{f"seed.{k}": v for k, v in seeds.items()},
    }
    return {k: v for k, v in fields.items() if v is not None}


def run_params(run_dir: Path, record: dict[str, Any]) -> dict[str, str]:
    """Parameters for a tracker: the flattened resolved config (``config.<key>``) plus the
    identity fields of run.json (``run.<field>``), as strings."""
    params = {k: str(v) for k, v in flatten(resolved_config(run_dir), "config.").items()}
    params.update({f"run.{k}": str(v) for k, v in identity(record).items()})
    return params


def override_key(override: str) -> str:
    """The key (or config group) an override sets: ``+optimizer.lr=0.1`` -> ``optimizer.lr``."""
    return override.partition("=")[0].lstrip("+~")


def _chosen(key: str) -> bool:
    """An override that is a choice about the run: not where it is logged, not Hydra's own."""
    return key.replace("/", ".").split(".")[0] not in ("logger", "hydra")


def run_overrides(run_dir: Path) -> list[str]:
    """The run's own overrides as Hydra recorded them (``.hydra/overrides.yaml``), less the
    ``logger`` ones: what was chosen for this run on top of its config ([] when none)."""
    from reprotrain.run.readers import read_overrides

    return [o for o in read_overrides(run_dir) or [] if _chosen(override_key(o))]


def sweep_record_overrides(sweep_dir: Path) -> list[str] | None:
    """The overrides a sweep was started with, from its ``multirun.yaml``: the command
    line's (``optimizer.lr=0.05,0.2``, ``seed.base=0,1``) and an Optuna search space
    (``hydra.sweeper.params``) as ``key=value``; None without a readable record."""
    from omegaconf import OmegaConf

    record = Path(sweep_dir) / MULTIRUN_YAML
    try:
        saved = OmegaConf.load(record)
    except Exception:  # absent, or only the "claimed by" comment so far
        return None
    overrides = [str(o) for o in OmegaConf.select(saved, "hydra.overrides.task", default=[])]
    params = OmegaConf.select(saved, "hydra.sweeper.params", default=None) or {}
    return overrides + [f"{k}={v}" for k, v in params.items()]


def swept_keys(sweep_dir: Path | None) -> set[str]:
    """The keys a sweep varies: its value lists, ranges and search space (not a key set
    to one value for every job, nor where it logs)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, keys = OverridesParser.create(), set()
    for text in (sweep_record_overrides(sweep_dir) if sweep_dir else None) or []:
        try:
            (override,) = parser.parse_overrides([text])
        except Exception:  # a form Hydra expands only against the config tree: not a key
            continue
        if override.is_sweep_override() and _chosen(override.key_or_group):
            keys.add(override.key_or_group)
    return keys


def is_seed(key: str) -> bool:
    return key == "seed" or key.startswith("seed.")


def config_group(overrides: list[str]) -> str:
    """The configuration a run is one seed of: its overrides less the seeds, sorted."""
    return " ".join(sorted(o for o in overrides if not is_seed(override_key(o))))


def run_name(run_dir: Path, root: Path) -> str:
    """A tracker's name for the run. A sweep's job: its values of the swept keys
    (``optimizer.lr=0.05 seed.base=0``), else its own overrides, else its number; a single
    run: its path below the project root (``outputs/<name>/<stamp>``)."""
    sweep = sweep_dir_of(run_dir)
    if sweep is None:
        return relative_name(run_dir, root)
    overrides, swept = run_overrides(run_dir), swept_keys(sweep)
    chosen = [o for o in overrides if override_key(o) in swept] or overrides
    return " ".join(sorted(chosen)) or Path(run_dir).name


def hparam_values(run_dir: Path) -> dict[str, bool | int | float | str]:
    """HParams' hyperparameters: each key the run's overrides set, with its resolved value
    (a group chosen by name: its option's name), and ``group``: the overrides less the seeds.
    Not the whole config: the keys nobody chose would crowd out the ones that were."""
    flat, overrides = flatten(resolved_config(run_dir)), run_overrides(run_dir)
    out: dict[str, bool | int | float | str] = {}
    for text in overrides:
        value = flat.get(override_key(text), text.partition("=")[2])
        out[override_key(text)] = (
            value if isinstance(value, bool | int | float | str) else str(value)
        )
    out["group"] = config_group(overrides)
    return out


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
    return parent if (parent / MULTIRUN_YAML).is_file() else None


def relative_name(run_dir: Path, root: Path) -> str:
    """The run dir relative to the project root (``outputs/<name>/<stamp>``), else its
    last three parts: a name that tells runs and sweeps apart in a dashboard."""
    run_dir = Path(run_dir).resolve()
    try:
        return run_dir.relative_to(root).as_posix()
    except ValueError:
        return "/".join(run_dir.parts[-3:])


def record_files(run_dir: Path, report: Any, scratch: Path, tracker: str) -> list[Path]:
    """The files of ``RUN_ARTIFACTS`` a tracker attaches at the end: the run's records, and
    its report and curves drawn by ``report(run_dir, scratch)`` from the run dir (the ones
    ``make report`` wrote when there is no hook; a report that cannot be drawn is warned
    about, the rest attached)."""
    import logging

    run_dir, drawn = Path(run_dir), {}
    if report is not None and (run_dir / "metrics.jsonl").is_file():
        try:
            drawn = {p.name: p for p in report(run_dir, Path(scratch)) if p is not None}
        except Exception as e:  # a report that cannot be drawn: attach the rest
            logging.getLogger("reprotrain").warning(
                "%s: no report artifact (%s: %s)", tracker, type(e).__name__, e
            )
    paths = [drawn.get(name) or run_dir / name for name in RUN_ARTIFACTS]
    return [p for p in paths if p.is_file()]
