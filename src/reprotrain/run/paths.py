"""The one gate for a file or directory that a config value names inside a run directory.

Closes: a config value (a logger's file name, a callback's folder, a run's ``name``) that
writes outside the run, by an absolute path, by ``..``, or through a symlink that leads out.
Every shipped component and every key that forms a run's own directory resolves such a value
here, and nowhere else (tests/test_run_paths.py lists the keys and tries each).
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

from omegaconf import DictConfig, OmegaConf, open_dict

from reprotrain.errors import ReprotrainError
from reprotrain.shown import shown

RUN, PROJECT, SWEEP = "the run directory", "the project root", "hydra.sweep.dir"


class PathOutsideRun(ReprotrainError):
    """A config value names a path that is not inside the run directory."""


def inside(
    run_dir: str | os.PathLike, value: str | os.PathLike, key: str, within: str = RUN
) -> Path:
    """``run_dir / value`` when ``value`` is a relative path that stays inside ``run_dir``
    (``within`` says what it is): no absolute path, no ``..``, no empty part, and no symlink
    (among the parts that exist) that resolves outside it. Otherwise one line naming ``key``."""
    text = os.fspath(value)
    if (why := _why_not(text)) is None:
        target = Path(run_dir, text)
        if not target.resolve().is_relative_to(Path(run_dir).resolve()):
            why = f"it leads out of {within} through a symlink"
    if why is not None:
        raise PathOutsideRun(
            f"{key}={shown(text)}: {why}; give a path relative to {within}, without '..'"
        )
    return target


def _why_not(text: str) -> str | None:
    if not text or not text.strip():
        return "it is empty"
    if "\x00" in text:
        return "it holds a NUL byte"
    if os.path.isabs(text) or text.startswith("~"):
        return "it is absolute"
    if ".." in PurePosixPath(text.replace(os.sep, "/")).parts:
        return "it climbs out with '..'"
    return None


#: Every config key that names a path the framework (or Hydra) writes, and the directory it
#: stays in, as a path relative to it. Checked before Hydra writes (:func:`check_config`); the
#: code that joins one calls :func:`inside` again. tests/test_config_paths.py finds every
#: path-like key and requires it here, in ``UNDER`` or in ``NOT_CONFINED``.
CONFINED = {
    "logger.csv.filename": RUN,  # the CSV logger's rows
    "logger.tensorboard_dir": RUN,  # the event files
    "logger.tensorboard_index": PROJECT,  # the folder of links to every run
    "hydra.output_subdir": RUN,  # Hydra's own record, .hydra/
    "hydra.job.name": RUN,  # the log's name, <hydra.job.name>.log
    "hydra.sweep.subdir": SWEEP,  # a sweep job's run directory
}
#: Keys whose value is a whole path (``${hydra.sweep.dir}/...``) that must lie under one.
UNDER = {
    "hydra.launcher.submitit_folder": SWEEP,  # submitit's pickles and logs
    "hydra.job_logging.handlers.file.filename": RUN,  # the log file
}
#: Path-like keys that name a place the user chooses, never confined, and why. The keys that
#: form a run's own directory from the config (``name`` in ``outputs/${name}/...``) are
#: confined to the text before them (:func:`check_config`).
NOT_CONFINED = {
    "hydra.run.dir": "the run directory itself, chosen on the command line",
    "hydra.sweep.dir": "the sweep directory itself, chosen on the command line",
    "dataset.root": "data read (and fetched once) where the user keeps it; a replay reads "
    "this checkout's data directory instead",
    "resume": "a checkpoint that is read; a fork names another run's",
    "include_untracked": "patterns of this project's own files, read into git.diff",
    "logger.mlflow_tracking_uri": "a tracking store shared by many runs (a server or a file)",
}
_PART = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")


def check_config(cfg: DictConfig, multirun: bool) -> None:
    """Every confined value of a config composed with its ``hydra`` node (changed here: call
    it on a copy), through :func:`inside`, before anything is written. A run directory not
    made yet (stamped, or a sweep's job) has no symlink to follow: its values are text."""
    root = Path.cwd()
    raw = [
        str(OmegaConf.select(cfg, f"hydra.{k}")._get_node("dir")._value()) for k in ("run", "sweep")
    ]
    run = root / ".unmade-run" if multirun or "${" in raw[0] else Path(raw[0]).expanduser()
    with open_dict(cfg.hydra):  # what Hydra sets when the job starts
        cfg.hydra.runtime.output_dir, cfg.hydra.job.num = str(run.absolute()), 0
    bases = {RUN: run, PROJECT: root}
    if multirun:  # its ${now:} and ${run_suffix:}: resolved only where a sweep uses them
        bases[SWEEP] = Path(str(OmegaConf.select(cfg, "hydra.sweep.dir")))
    for key, base in [*CONFINED.items(), *UNDER.items()]:
        value = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
        if value not in (None, "") and base in bases:  # "": the base itself (no index)
            value = _under(bases[base], str(value), key, base) if key in UNDER else str(value)
            inside(bases[base], value, key, base)
    for text in raw:  # name in outputs/${name}/<stamp>: never above outputs/
        for part in _PART.finditer(text):
            key, before = part.group(1), text[: part.start()]
            if not key.startswith("hydra.") and "${" not in before:
                inside(root / before, str(OmegaConf.select(cfg, key)), key, before or PROJECT)


def _under(base: Path, value: str, key: str, within: str) -> str:
    """``value`` (absolute, or relative to the working directory) relative to ``base``, which
    it must lie under."""
    full, top = os.path.abspath(value), os.path.abspath(base)
    if full != top and not full.startswith(top + os.sep):
        raise PathOutsideRun(f"{key}={shown(value)}: it is not inside {within} "
                             f"({shown(base)}); keep it there")  # fmt: skip
    return os.path.relpath(full, top)
