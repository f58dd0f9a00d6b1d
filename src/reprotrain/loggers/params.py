"""What a tracker is told about a run: parameters, tags, its stable key, its sweep.

Secrets: nothing from the environment is sent. Parameters are the resolved config (which
records ``${oc.env:...}`` values as the interpolation, never the value: ``repro/secrets.py``)
and the identity fields of ``run.json``; ``run.json["environment"]`` and the command line are
never sent. Tracker credentials are read by the trackers from their own env vars.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from reprotrain.dotted import flatten

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


def hparam_values(run_dir: Path) -> dict[str, bool | int | float | str]:
    """The flattened resolved config with the types TensorBoard's HParams tab can show:
    numbers and booleans stay numbers and booleans, everything else becomes text."""
    out: dict[str, bool | int | float | str] = {}
    for k, v in flatten(resolved_config(run_dir)).items():
        out[k] = v if isinstance(v, bool | int | float | str) else str(v)
    return out


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
