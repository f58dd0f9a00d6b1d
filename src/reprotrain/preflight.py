"""Check the command line before Hydra starts a run, so a bad override is one clear line.

Hydra itself reports composition errors over several lines and ends with a hint about
HYDRA_FULL_ERROR; a user who typed ``trainer.epoch=3`` deserves one line that names the
problem and what to do. This composes the config exactly as the run would (every value of
a ``--multirun`` sweep included), applies the schema's range checks, and raises
``ReprotrainError`` on the first problem. Nothing is written: no run directory exists yet.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from reprotrain import components
from reprotrain.config import PROJECT_GROUPS, register_configs, validate
from reprotrain.errors import ReprotrainError
from reprotrain.paths import CONF_DIR
from reprotrain.repro import hashseed

_SUFFIX = secrets.token_hex(3)  # once per process: every read of the run dir agrees


def register_resolvers() -> None:
    """``${run_suffix:}``: random hex so two runs started in the same second get two dirs;
    ``${run_stamp:}`` (the same in every torchrun rank) and ``${cores_per_job:}``."""
    from reprotrain import launchers  # also silences the preset/schema deprecation warning

    launchers.register_resolvers()
    if not OmegaConf.has_resolver("run_suffix"):
        OmegaConf.register_new_resolver("run_suffix", lambda: _SUFFIX, use_cache=True)
    from reprotrain import helptext

    helptext.register_resolver()


def _one_line(e: BaseException) -> str:
    if isinstance(e, MissingConfigException) and e.options is not None:
        group = (e.missing_cfg_file or "").rsplit("/", 1)[0]
        options = [o for o in e.options if not o.endswith("_schema")]
        return f"unknown option '{e.missing_cfg_file}'; available in {group}/: {', '.join(options)}"
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    # Hydra puts the reason after "...raised while composing config:" on the next line.
    head = lines[0].rstrip(".:") if lines else type(e).__name__
    parts = [head] + ([lines[1]] if len(lines) > 1 and lines[0].endswith(":") else [])
    cause = e.__cause__
    if isinstance(cause, OmegaConfBaseException):
        detail = str(cause).strip().splitlines()[0]
        full_key = getattr(cause, "full_key", None)
        parts.append(f"{detail}" + (f" (key: {full_key})" if full_key else ""))
    elif isinstance(e, OmegaConfBaseException) and getattr(e, "full_key", None):
        parts.append(f"key: {e.full_key}")
    hint = " (list valid keys with: python -m reprotrain.train --cfg job)"
    return ": ".join(parts) + (hint if "not in" in parts[-1] else "")


def _yaml_error(e: BaseException) -> str | None:
    """A YAML syntax error in a conf/ file, as 'file:line:column: problem'."""
    cause = e
    while cause is not None and not isinstance(cause, yaml.YAMLError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    mark = getattr(cause, "problem_mark", None)
    where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}" if mark else "a config file"
    problem = getattr(cause, "problem", None) or str(cause).splitlines()[0]
    return f"YAML syntax error in {where}: {problem}"


def expand(overrides: list[str]) -> list[list[str]]:
    """One override list per sweep value (others at their first value), or just the input."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    base = [
        f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}"
        if o.is_sweep_override()
        else o.input_line
        for o in parsed
    ]
    variants = [base]
    for i, o in enumerate(parsed):
        if o.is_sweep_override():
            for value in list(o.sweep_string_iterator())[1:]:
                variant = list(base)
                variant[i] = f"{o.get_key_element()}={value}"
                variants.append(variant)
    return variants


def check(argv: list[str], levels: list[str] | None = None) -> str | bool | None:
    """Compose and check every variant; returns the first one's ``resume`` (False when
    Hydra only prints something and nothing runs). ``levels`` gets each variant's
    ``repro.level``."""
    args, _ = get_args_parser().parse_known_args(argv)
    if args.help or args.hydra_help or args.info or args.cfg or args.shell_completion:
        return False  # Hydra's own informational modes: nothing runs
    config_dir = os.path.abspath(args.config_path) if args.config_path else str(CONF_DIR)
    config_name = args.config_name or "train"
    GlobalHydra.instance().clear()
    resume: list[str | None] = []
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            for overrides in expand(args.overrides):
                cfg = compose(config_name=config_name, overrides=overrides)
                check_schema_keys(cfg)
                validate(cfg)
                components.check(cfg)
                resume.append(OmegaConf.select(cfg, "resume", default=None))
                if levels is not None:
                    levels.append(cfg.repro.level)
                check_monitor(cfg)
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as e:
        raise ReprotrainError(_yaml_error(e) or _one_line(e)) from None
    finally:
        GlobalHydra.instance().clear()
    return resume[0] if resume else None


def _override_values(argv: list[str]) -> dict[str, str]:
    """{key: value} of the plain ``key=value`` overrides (quoted values unquoted)."""
    args, _ = get_args_parser().parse_known_args(argv)
    out = {}
    for o in OverridesParser.create().parse_overrides(args.overrides):
        if not o.is_sweep_override() and not o.is_delete():
            value = o.value()
            out[o.get_key_element()] = None if value is None else str(value)
    return out


def explicit_run_dir_is_free(argv: list[str], resume: str | None = None) -> None:
    """Refuse before Hydra writes .hydra/ into a run dir that a live run holds, that already
    holds a run this command would restart (``repro/run_dir.py``), or that cannot be a
    directory (a path through a file, a name over the filesystem's limit); the same for a
    sweep into a used ``hydra.sweep.dir``. ``resume``: the composed config's value."""
    from reprotrain.repro import run_dir as run_dirs
    from reprotrain.repro.run_mutex import refuse_if_held

    values = _override_values(argv)
    resume = values.get("resume", resume)
    if "--multirun" in argv or "-m" in argv:
        sweep_dir = values.get("hydra.sweep.dir")
        if sweep_dir is not None and "${" not in sweep_dir:
            check_creatable(sweep_dir, "hydra.sweep.dir")
            run_dirs.refuse_used_sweep_dir(Path(os.path.expanduser(sweep_dir)))
        return
    run_dir = values.get("hydra.run.dir")
    if run_dir is None or "${" in run_dir:
        return  # the default: a fresh, stamped directory
    check_creatable(run_dir)
    refuse_if_held(run_dir)
    run_dirs.refuse_reuse(Path(os.path.expanduser(run_dir)), resume)


def check_creatable(path: str, key: str = "hydra.run.dir") -> None:
    p = os.path.abspath(os.path.expanduser(path))
    try:
        raw = p.encode("utf-8")
    except UnicodeEncodeError:  # argv bytes this locale could not decode (surrogates)
        raise ReprotrainError(
            f"{key}: the path is not valid text in this locale "
            f"({sys.getfilesystemencoding()}); use a UTF-8 locale (e.g. LC_ALL=C.UTF-8) or "
            "an ASCII name"
        ) from None
    for part in p.split(os.sep):
        if len(part.encode()) > 255:
            raise ReprotrainError(
                f"{key}: the name '{part[:40]}...' is {len(part.encode())} bytes; "
                "the filesystem allows 255"
            )
    probe = p
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    limit = _path_max(probe)
    if len(raw) + 64 >= limit:  # room for the files the run writes inside it
        raise ReprotrainError(
            f"{key}: the path is {len(raw)} bytes; this system allows {limit} for a whole "
            "path, and the run's own files need room under it: choose a shorter one"
        )
    if not os.path.isdir(probe):
        raise ReprotrainError(f"{key}={path}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ReprotrainError(f"{key}={path}: {probe} is not writable")


def check_argv_text(argv: list[str]) -> None:
    """An argument this locale could not decode (non-ASCII bytes under ``LC_ALL=C``) is
    refused by name, before Hydra's lexer reports it as a syntax error."""
    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            key = arg.split("=", 1)[0] if "=" in arg else "an argument"
            raise ReprotrainError(
                f"{key}: the value is not valid text in this locale "
                f"({sys.getfilesystemencoding()}); use a UTF-8 locale (e.g. LC_ALL=C.UTF-8) "
                "or ASCII characters only"
            ) from None


def _path_max(existing: str) -> int:
    try:
        return int(os.pathconf(existing, "PC_PATH_MAX"))
    except (OSError, ValueError):
        return 4096


def check_schema_keys(cfg) -> None:
    """``+trainer.epoch=3`` slips past the struct schema (``+`` adds keys): refuse it here."""
    from dataclasses import fields

    for group, schema in PROJECT_GROUPS.items():
        known = {f.name for f in fields(schema)}
        extra = sorted(set(cfg[group]) - known)
        if extra:
            raise ReprotrainError(
                f"unknown key {group}.{extra[0]}; {group} accepts: {', '.join(sorted(known))}"
            )


def check_monitor(cfg) -> None:
    """``trainer.monitor`` must name a metric the task logs (``train_``/``val_`` + a name in
    its ``metrics``), and ``trainer.monitor_mode`` the direction the task declares for it."""
    declared = components.declared_metrics(cfg.task, cfg.get("loss"))
    monitor, mode = cfg.trainer.monitor, cfg.trainer.monitor_mode
    known = {
        f"{split}_{name}": better for split in ("val", "train") for name, better in declared.items()
    }
    if monitor not in known:
        raise ReprotrainError(
            f"trainer.monitor={monitor} is not a metric of task {cfg.task._target_}; "
            f"it logs: {', '.join(known)}"
        )
    if known[monitor] != mode:
        raise ReprotrainError(
            f"trainer.monitor={monitor} is better when "
            f"{'lower' if known[monitor] == 'min' else 'higher'}; "
            f"set trainer.monitor_mode={known[monitor]}"
        )


_checked = False


def cli_check() -> None:
    """Register the schema and resolvers, check ``sys.argv`` once; exit 2 in one line."""
    global _checked
    register_configs()
    register_resolvers()
    if _checked:
        return
    try:
        check_argv_text(sys.argv[1:])
        levels: list[str] = []
        resume = check(sys.argv[1:], levels)
        hashseed.ensure_cpu_dispatch(levels)  # repro=portable: re-exec with its levers set
        if resume is not False:
            explicit_run_dir_is_free(sys.argv[1:], resume)
    except ReprotrainError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    _checked = True
