"""Check the command line before Hydra writes anything, so a bad override is one clear line.

Closes: a refusal that leaves ``.hydra/`` or ``multirun.yaml`` behind; the one write is the
last step (:func:`claim_explicit_sweep_dir`). What is checked: docs/how-a-run-flows.md.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from reprotrain import CONF_DIR, components, config, hydra_api
from reprotrain import sweep_checks as sweeps
from reprotrain.data import sampler
from reprotrain.errors import ReprotrainError
from reprotrain.repro import hashseed, levels
from reprotrain.repro import secrets as env_secrets
from reprotrain.run import paths
from reprotrain.shown import safe_line

#: The composed config as the run records it, computed on demand (``secrets.redact``).
Redacted = Callable[[], dict]
_SUFFIX = secrets.token_hex(3)  # once per process: every read of the run dir agrees


def register_resolvers() -> None:
    """``${run_suffix:}`` (two runs started in one second: two dirs), launchers' and help's."""
    from reprotrain import helptext, launchers  # launchers silences the presets' warning

    launchers.register_resolvers()
    hydra_api.register_resolver("run_suffix", lambda: _SUFFIX, use_cache=True)
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
    values = [sweeps.sweep_values(o) if o.is_sweep_override() else [] for o in parsed]
    pairs = list(zip(parsed, values, strict=True))
    base = [f"{o.get_key_element()}={v[0]}" if v else o.input_line for o, v in pairs]
    variants = [base]
    for i, (o, v) in enumerate(pairs):
        for value in v[1:]:
            variants.append([*base[:i], f"{o.get_key_element()}={value}", *base[i + 1 :]])
    return variants


def check(argv: list[str]) -> str | bool | None:
    """Compose and check every variant: the first one's ``resume`` (False: nothing runs)."""
    composed = compose_all(argv)  # never empty: one config per variant
    return composed and OmegaConf.select(composed[0], "resume", default=None)


class Composed(list):
    """Each variant's config, and ``hydra.mode`` as composed (Hydra's main asks for it)."""

    hydra_mode: Any = None


def compose_all(argv: list[str]) -> Composed | bool:
    """Every variant's composed and checked config (False for Hydra's informational modes)."""
    args, _ = get_args_parser().parse_known_args(argv)
    if args.help or args.hydra_help or args.info or args.cfg or args.shell_completion:
        return False  # Hydra's own informational modes: nothing runs
    config_dir = os.path.abspath(args.config_path) if args.config_path else str(CONF_DIR)
    config_name = args.config_name or "train"
    GlobalHydra.instance().clear()
    composed = Composed()
    try:
        if not args.multirun:
            refuse_sweep_without_multirun(args.overrides)
        refuse_a_group_without_an_option(args.overrides, config_dir)
        with initialize_config_dir(config_dir=config_dir, **hydra_api.VERSION_BASE):
            if args.multirun:
                sweeps.check_sweep_overrides(args.overrides)
            variants = expand(args.overrides)
            if args.multirun:  # the sweeper and its search space, before anything is written
                first = compose(config_name, variants[0], return_hydra_config=True)
                sweeps.check_sweep(first.hydra.sweeper, first.trainer, args.overrides)
            for overrides in variants:
                cfg = compose(config_name, overrides, return_hydra_config=True)
                paths.check_config(cfg, args.multirun)  # before Hydra writes a path it names
                composed.hydra_mode = cfg.hydra.mode  # for hydra_api.answer_mode
                with open_dict(cfg):
                    del cfg["hydra"]  # what compose() without the hydra node returns
                check_schema_keys({group: cfg[group] for group in config.PROJECT_GROUPS})
                check_text_lists({key: cfg.get(key) for key in TEXT_LISTS})
                config.validate(cfg, config.launch_world_size())
                if levels.level(cfg.repro.level).pins_cpu_dispatch:  # before user code imports
                    hashseed.refuse_portable_here()  # torch: a CPU without AVX2 may not run it
                check_sampler(cfg.dataset, cfg.sampler)  # before the dataset's own keys
                components.check(cfg)
                if isinstance(cfg.get("loss"), DictConfig) and "_target_" in cfg.loss:
                    components.check_loss(cfg.loss, class_count(cfg.model, cfg.dataset))
                check_data_settings(cfg.dataset, cfg.trainer, cfg.model.get("num_classes"))
                composed.append(cfg)
                check_monitor(cfg.task, cfg.get("loss"), cfg.trainer)
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as e:
        raise ReprotrainError(
            _yaml_error(e) or not_in_defaults(e, args.overrides) or _one_line(e)
        ) from None
    finally:
        GlobalHydra.instance().clear()
    return composed


def not_in_defaults(e: BaseException, overrides: list[str]) -> str | None:
    """Hydra's "No match in the defaults list" (no ``+``) as the override that works."""
    found = re.match(r"Could not override '([^']+)'\. No match in the defaults list", str(e))
    if found is None:
        return None
    group = found.group(1)
    given = next((o for o in overrides if o.partition("=")[0] == group), f"{group}=<option>")
    why = "is not in the defaults list of conf/train.yaml, so it is added, not overridden"
    return f"{given}: {group} {why}: write +{given}"


def refuse_sweep_without_multirun(overrides: list[str]) -> None:
    """``trainer.epochs=3,4`` without ``--multirun``: Hydra's "Ambiguous value" in one line."""
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_sweep_override():
            key = o.get_key_element()
            raise ReprotrainError(
                f"{o.input_line} gives {key} several values, which only a sweep runs: add "
                f"--multirun (or use make sweep); for one list value write {key}=[a,b], for "
                f"one text value {key}='a,b'"
            )


def refuse_a_group_without_an_option(overrides: list[str], config_dir: str) -> None:
    """``callbacks=null`` (the group's own default): Hydra takes only an option's name for a
    config group and raises a bare ValueError (a traceback, exit 1); here it is one line."""
    for o in OverridesParser.create().parse_overrides(overrides):
        group = o.key_or_group
        if o.is_delete() or o.is_sweep_override() or isinstance(o.value(), str | list):
            continue
        if Path(config_dir, group).is_dir():
            raise ReprotrainError(
                f"{o.input_line}: {group} is a config group, set to an option's name "
                f"(conf/{group}/); leave it out for its default, or drop it with ~{group}"
            )


def check_data_settings(node: DictConfig, trainer: DictConfig, num_classes: Any) -> None:
    """What the trainer would refuse only after loading the data, from the ``dataset`` node
    and its class alone (the channel count stays the trainer's check)."""
    mean, std = node.get("mean"), node.get("std")
    if _numbers(std):
        config.check_std(std)
    if _numbers(mean) and _numbers(std) and len(mean) != len(std):
        raise ReprotrainError(
            f"dataset.mean has {len(mean)} values but dataset.std has {len(std)}; give one "
            "per image channel in each"
        )
    cls = components.locate(str(node["_target_"]), "dataset")
    in_memory = getattr(cls, "in_memory", False) is True
    target = str(node["_target_"])
    config.check_workers(trainer.pipeline, trainer.num_workers, in_memory=in_memory, target=target)
    config.check_num_classes(num_classes, declared_num_classes(cls, node))


def check_sampler(dataset: DictConfig, node: Any) -> None:
    """A sampler only in the ``sampler`` group (data/sampler.py): none among the dataset's
    keys or on its class; the group's target located, seedable, its keys bound."""
    if not isinstance(dataset, DictConfig) or "_target_" not in dataset:
        return  # components.check says what the dataset lacks
    sampler.refuse_keys(dataset, node)
    cls = components.locate(str(dataset["_target_"]), "dataset")
    sampler.refuse_elsewhere(**{f"dataset {dataset['_target_']}": cls})
    if node is not None:
        sampler.check_seedable(components.locate(str(node["_target_"]), "sampler"))
        components.check_node(node, "sampler", sampler.SUPPLIED)


def _numbers(value: Any) -> bool:
    numbers = isinstance(value, ListConfig | list) and len(value) > 0
    return numbers and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)


def declared_num_classes(cls, node) -> int | None:
    """``dataset.num_classes``, else the default of its ``num_classes`` argument, else attribute."""
    if "num_classes" in node:
        value = node["num_classes"]
    else:
        sig = components.signature(cls)
        param = None if sig is None else sig.parameters.get("num_classes")
        if param is not None and param.default is not param.empty:
            value = param.default
        else:
            value = getattr(cls, "num_classes", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _override_values(argv: list[str]) -> dict[str, str]:
    """{key: value} of the plain ``key=value`` overrides (quoted values unquoted)."""
    args, _ = get_args_parser().parse_known_args(argv)
    parsed = OverridesParser.create().parse_overrides(args.overrides)
    plain = [o for o in parsed if not o.is_sweep_override() and not o.is_delete()]
    return {o.get_key_element(): None if o.value() is None else str(o.value()) for o in plain}


def explicit_run_dir_is_free(argv: list[str], resume: str | None = None) -> None:
    """Refuse a run dir (or ``hydra.sweep.dir``) that is held, used, or cannot be a directory."""
    from reprotrain.run import directory as run_dirs
    from reprotrain.run.mutex import refuse_if_held

    values = _override_values(argv)
    if _multirun(argv) and sweeps.continues_study(values):  # hydra.sweeper.resume=true
        sweeps.check_continued_study(values.get("hydra.sweep.dir"))
    elif _multirun(argv) and (sweep_dir := _explicit(values, "hydra.sweep.dir")) is not None:
        check_creatable(sweep_dir, "hydra.sweep.dir")
        run_dirs.refuse_used_sweep_dir(Path(os.path.expanduser(sweep_dir)))
        run_dirs.refuse_unmade(Path(os.path.expanduser(sweep_dir)), "hydra.sweep.dir")
    elif not _multirun(argv) and (run_dir := _explicit(values, "hydra.run.dir")) is not None:
        check_creatable(run_dir)  # none given: a fresh, stamped directory
        refuse_if_held(run_dir)
        run_dirs.refuse_reuse(Path(os.path.expanduser(run_dir)), values.get("resume", resume))
        run_dirs.refuse_unmade(Path(os.path.expanduser(run_dir)))  # another app's, a folder


def check_creatable(path: str, key: str = "hydra.run.dir") -> None:
    p = os.path.abspath(os.path.expanduser(path))
    try:
        raw = p.encode("utf-8")
    except UnicodeEncodeError:  # argv bytes this locale could not decode (surrogates)
        raise _not_text(f"{key}: the path", "an ASCII name") from None
    for part in p.split(os.sep):
        if len(part.encode()) > 255:
            raise ReprotrainError(
                f"{key}: the name '{part[:40]}...' is {len(part.encode())} bytes; "
                "the filesystem allows 255"
            )
    probe = p
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        limit = int(os.pathconf(probe, "PC_PATH_MAX"))
    except (OSError, ValueError):
        limit = 4096
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
    """Refuse by name an argument this locale could not decode (non-ASCII under ``LC_ALL=C``)."""
    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            key = arg.split("=", 1)[0] if "=" in arg else "an argument"
            raise _not_text(f"{key}: the value", "ASCII characters only") from None


def _not_text(what: str, fix: str) -> ReprotrainError:
    """Argv bytes this locale could not decode (non-ASCII under ``LC_ALL=C``), in one line."""
    locale = f"this locale ({sys.getfilesystemencoding()})"
    fix = f"use a UTF-8 locale (e.g. LC_ALL=C.UTF-8) or {fix}"
    return ReprotrainError(f"{what} is not valid text in {locale}; {fix}")


def check_schema_keys(groups: dict[str, DictConfig]) -> None:
    """``+trainer.epoch=3`` slips past the struct schema (``+`` adds keys): refuse it here."""
    from dataclasses import fields

    for group, node in groups.items():
        known = {f.name for f in fields(config.PROJECT_GROUPS[group])}
        if extra := sorted(set(node) - known):
            raise ReprotrainError(
                f"unknown key {group}.{extra[0]}; {group} accepts: {', '.join(sorted(known))}"
            )


#: ``list[str]`` keys whose items an override can still make mappings (``tags=[a,{b:c}]``).
TEXT_LISTS = ("tags", "include_untracked")


def check_text_lists(values: dict[str, Any]) -> None:
    """``tags`` / ``include_untracked`` hold text, one label or path each."""
    for key, value in values.items():
        if value is None:
            continue
        if not isinstance(value, ListConfig):
            raise ReprotrainError(f"{key} must be a list of text, e.g. {key}=[a,b]")
        for item in value:
            if isinstance(item, DictConfig | ListConfig):
                shown = str(OmegaConf.to_container(item))[:60]
                raise ReprotrainError(
                    f"{key}: the item {shown} is not text; each item is one label (quote one "
                    f"that holds a colon or brackets: {key}=[a,'b:c'])"
                )


def check_monitor(task: DictConfig, loss: Any, trainer: DictConfig) -> None:
    """``trainer.monitor`` names a metric the task logs; ``monitor_mode`` is its direction."""
    declared = components.declared_metrics(task, loss)
    monitor, mode = trainer.monitor, trainer.monitor_mode
    known = {f"{s}_{name}": better for s in ("val", "train") for name, better in declared.items()}
    if monitor not in known:
        raise ReprotrainError(
            f"trainer.monitor={monitor} is not a metric of task {task._target_}; "
            f"it logs: {', '.join(known)}"
        )
    if known[monitor] != mode:
        raise ReprotrainError(
            f"trainer.monitor={monitor} is better when "
            f"{'lower' if known[monitor] == 'min' else 'higher'}; "
            f"set trainer.monitor_mode={known[monitor]}"
        )


def class_count(*nodes: DictConfig) -> int | None:
    """The first positive ``num_classes`` of ``nodes`` (``model``, then ``dataset``)."""
    for node in nodes:
        value = OmegaConf.select(
            node, "num_classes", default=None, throw_on_resolution_failure=False
        )
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


_checked = False


def cli_check() -> None:
    """Register the schema and resolvers, check ``sys.argv`` once; exit 2 in one line."""
    global _checked
    config.register_configs()
    register_resolvers()
    if _checked:
        return
    argv = sys.argv[1:]
    try:
        check_argv_text(argv)
        composed = compose_all(argv)
        if composed is not False:
            # repro=portable: re-exec with its levers set, before anything is decided or written
            hashseed.ensure_cpu_dispatch([cfg.repro.level for cfg in composed])
            first = composed[0]
            resume = OmegaConf.select(first, "resume", default=None)
            explicit_run_dir_is_free(argv, resume)
            sys.argv += resume_overrides(argv, resume, lambda: env_secrets.redact(first)[0])
            claim_explicit_sweep_dir(argv)  # last: nothing may refuse after the claim
            hydra_api.answer_mode(sys.argv[1:], composed.hydra_mode)
    except ReprotrainError as e:
        # AlreadyCompleted (exit 0), told by its code: importing resume.guard imports torch.
        # Hydra's parse errors echo the override as typed: escaped, never a raw control byte
        print(safe_line(f"error: {e}" if e.exit_code else e), file=sys.stderr)
        sys.exit(e.exit_code)
    _checked = True


def _multirun(argv: list[str]) -> bool:
    return "--multirun" in argv or "-m" in argv


def _explicit(values: dict[str, str | None], key: str) -> str | None:
    """``key``'s value when given on the command line without interpolation, else None."""
    value = values.get(key)
    return None if value is None or "${" in value else value


def resume_overrides(argv: list[str], resume: str | None, redacted: Redacted) -> list[str]:
    """``hydra.output_subdir=null`` when ``resume`` continues a recorded run, decided
    read-only by ``resume.guard.resume_before_hydra`` (imported only for a resume: torch)."""
    values = _override_values(argv)
    run_dir = _explicit(values, "hydra.run.dir")
    if _multirun(argv) or resume is None or (resume == "auto" and run_dir is None):
        return []  # a fresh start (``auto`` in a new stamped directory starts fresh)
    from reprotrain.resume.guard import resume_before_hydra

    run_path = None if run_dir is None else Path(os.path.expanduser(run_dir))
    if not resume_before_hydra(str(resume), run_path, redacted) or "hydra.output_subdir" in values:
        return []
    return ["hydra.output_subdir=null"]


def claim_explicit_sweep_dir(argv: list[str]) -> None:
    """A ``--multirun`` claims an explicit ``hydra.sweep.dir`` atomically: of two, one runs."""
    from reprotrain.run import directory as run_dirs

    values = _override_values(argv)
    sweep_dir = _explicit(values, "hydra.sweep.dir")
    if _multirun(argv) and sweep_dir is not None and not sweeps.continues_study(values):
        run_dirs.claim_sweep_dir(Path(os.path.expanduser(sweep_dir)))


def check_nproc(text: str) -> int:
    """``make train NPROC=<text>``: a positive process count, or one line (as resume says)."""
    if not re.fullmatch(r"[+-]?[0-9]+", text.strip()):
        raise ReprotrainError(
            f"NPROC={text}: not a number of processes; give a positive integer, e.g. NPROC=2"
        )
    nproc = int(text)
    if nproc < 1:
        raise ReprotrainError(f"NPROC={nproc}: give at least 1 process")
    return nproc


def torchrun_cli_check() -> None:
    """``make train NPROC=N`` before torchrun starts: ``sys.argv[1]`` is NPROC's text."""
    try:
        nproc = check_nproc(sys.argv.pop(1) if len(sys.argv) > 1 else "")
    except ReprotrainError as e:
        print(safe_line(f"error: {e}"), file=sys.stderr)
        sys.exit(e.exit_code)
    os.environ["WORLD_SIZE"] = str(nproc)  # what torchrun will announce: config checks k % W
    cli_check()
