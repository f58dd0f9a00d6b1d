"""Read a run's record files, or fail in one line that names the file (and line).
Closes: a corrupt record turning ``make archive`` / ``resume`` / ``reproduce`` into a
traceback or exit 1 (DIVERGED). The parsers take text: archive members are checked unextracted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from reprotrain.errors import RecordError
from reprotrain.run import schema as run_schema
from reprotrain.run.bounded import load_yaml
from reprotrain.run.directory import SWEEP_RECORD
from reprotrain.run.record import RUN_JSON, parse_json_object, parse_jsonl, read_text

__all__ = ["parse_json_object", "parse_jsonl", "parse_record", "parse_yaml_config"]
__all__ += ["read_run_json", "read_sweep_record", "read_text"]


def parse_yaml_config(text: str, label: str) -> DictConfig:
    """A YAML mapping as a DictConfig, or RecordError naming the file, line and problem."""
    try:
        # OmegaConf.create("text") would make {"text": None}: check the YAML's own type.
        shape = load_yaml(text, label)  # bounded: aliases, depth, digits (run/bounded.py)
        if not isinstance(shape, dict):
            found = "nothing" if shape is None else type(shape).__name__
            raise RecordError(f"{label}: expected a YAML mapping at the top level, found {found}")
        cfg = OmegaConf.create(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecordError(f"{label}:{where}: YAML syntax error ({problem})") from None
    except OmegaConfBaseException as e:
        raise RecordError(f"{label}: {str(e).splitlines()[0]}") from None
    if not isinstance(cfg, DictConfig):
        raise RecordError(f"{label}: expected a YAML mapping at the top level")
    return cfg


def read_run_json(run_dir: Path, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The one reader of a run directory's run.json, checked against the schema."""
    path = Path(run_dir) / RUN_JSON
    return parse_record(read_text(path), str(path), required)


def parse_record(text: str, label: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """run.json's text (an archive member, say) parsed and checked like :func:`read_run_json`."""
    return run_schema.check(parse_json_object(text, label), label, required)


def read_config(path: Path) -> DictConfig:
    return parse_yaml_config(read_text(path), str(path))


def completion_problem(record: dict[str, Any], fingerprint_rows: int | None) -> str | None:
    """Why a record that says ``completed`` cannot be (hand-edited), or None."""
    if record.get("status") != "completed":
        return None
    done = record.get("epochs_completed")
    if not isinstance(done, int) or isinstance(done, bool):
        why = "the trainer writes both at the end; was the status edited?"
        return f"says completed but records no epochs_completed ({why})"
    if fingerprint_rows is not None and done != fingerprint_rows:
        return f"says completed with {done} epoch(s) but fingerprints.jsonl has {fingerprint_rows}"
    return None


def read_overrides(run_dir: Path) -> list[str] | None:
    """The run's Hydra overrides (``.hydra/overrides.yaml``); None when none are recorded."""
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    try:
        data = load_yaml(read_text(path), str(path))
    except yaml.YAMLError as e:
        raise RecordError(f"{path}: YAML syntax error ({str(e).splitlines()[0]})") from None
    return [str(o) for o in data] if isinstance(data, list) else []


def read_sweep_record(sweep_dir: Path) -> DictConfig | None:
    """A sweep directory's ``multirun.yaml`` (Hydra's record of the sweep), read within
    bounds: None when there is none, or only the "claimed by" line so far; else the config,
    or one RecordError line (an alias bomb, a recursive alias, a syntax error)."""
    path = Path(sweep_dir) / SWEEP_RECORD
    if not path.is_file():
        return None
    text = read_text(path)
    if load_yaml(text, str(path)) is None:  # bounded before OmegaConf walks it
        return None
    return parse_yaml_config(text, str(path))
