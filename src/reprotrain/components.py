"""User-brought code by config: resolve each ``_target_``, check its keys, build it.

``check`` runs at preflight, before any run directory exists: it imports and binds every
target without calling it and dry-builds the cheap ones, so a typo or a bad value is one
line naming the group and key (docs/bring-your-own.md).
"""

from __future__ import annotations

import inspect
import os
import traceback
from collections.abc import Callable
from typing import Any

import hydra
from hydra._internal.utils import _locate
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from reprotrain.allowlist import allowing, targets_in
from reprotrain.errors import ReprotrainError

# Arguments the trainer passes itself, per group (never expected in the YAML).
SUPPLIED: dict[str, tuple[str, ...]] = {
    "model": (),
    "optimizer": ("params",),
    "scheduler": ("optimizer", "total_steps"),
    "loss": (),
    "task": ("loss_fn",),
    "dataset": (),
    "step": ("model",),
}
_META = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}


class ComponentError(ReprotrainError):
    """A user-brought component that cannot be imported, bound or built."""


def locate(path: str, where: str) -> Callable[..., Any]:
    """Import ``a.b.C`` (or ``a.b.fn``); one line naming ``where`` when it cannot be found."""
    try:
        target = _locate(path)
    except Exception as e:  # ImportError, AttributeError, or an error inside the module
        raise ComponentError(f"{where}._target_={path!r} {import_failure(path, e)}") from None
    if not callable(target):
        raise ComponentError(f"{where}._target_={path!r} is not a class or function")
    return target


def import_failure(path: str, error: BaseException) -> str:
    """Why ``path`` could not be imported, in one clause (the module's error, file and line)."""
    root = error
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    missing = getattr(root, "name", None) if isinstance(root, ModuleNotFoundError) else None
    if root is error or (missing and (path == missing or path.startswith(f"{missing}."))):
        lines = str(error).strip().splitlines()
        return f"cannot be imported ({lines[-1] if lines else type(error).__name__})"
    reason = f"{type(root).__name__}: {_first_line(root)}"
    where = _raised_at(root)
    top = missing.split(".")[0] if missing else None
    hint = (  # another package: install it; a module of the user's own package: a typo
        f"; install the package that provides {top!r} (add it to requirements.in, then make lock)"
        if top and top != path.split(".")[0]
        else ""
    )
    return f"cannot be imported: {reason}" + (f" (at {where})" if where else "") + hint


def _first_line(e: BaseException) -> str:
    if isinstance(e, SyntaxError) and e.msg:
        return e.msg
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _raised_at(e: BaseException) -> str | None:
    """``file:line`` of ``e``'s innermost frame outside importlib and Hydra."""
    if isinstance(e, SyntaxError) and e.filename and e.lineno:
        name, line = e.filename, e.lineno
    else:
        skip = ("<", os.path.dirname(hydra.__file__))
        tb = traceback.extract_tb(e.__traceback__)
        frames = [
            f for f in tb if not f.filename.startswith(skip) and "importlib" not in f.filename
        ]
        if not frames:
            return None
        name, line = frames[-1].filename, frames[-1].lineno
    rel = os.path.relpath(name)
    return f"{name if rel.startswith('..') else rel}:{line}"


def signature(target: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):  # builtins without a signature: accept anything
        return None


def accepted(target: Callable[..., Any]) -> tuple[list[str], bool, list[str]]:
    """(parameter names, takes **kwargs, required names) of a callable."""
    if (sig := signature(target)) is None:
        return [], True, []
    names, var_kw, required = [], False, []
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
        elif p.kind is not p.VAR_POSITIONAL:
            names.append(p.name)
            if p.default is p.empty:
                required.append(p.name)
    return names, var_kw, required


def refuse_list_for_tensor(target: Callable[..., Any], node: Any, key: str, where: str) -> None:
    """A YAML list given to a parameter annotated as a tensor (``CrossEntropyLoss(weight=)``)
    is refused by name: the callable would fail only when built, after the run began."""
    value, sig = node[key], signature(target)
    if not isinstance(value, ListConfig | list) or sig is None:
        return
    param = sig.parameters.get(key)
    if param is None or param.annotation is param.empty:
        return
    text = str(param.annotation)
    if "Tensor" not in text or any(w in text.lower() for w in ("list", "sequence", "tuple")):
        return
    shown = OmegaConf.to_container(value, resolve=True) if isinstance(value, ListConfig) else value
    raise ComponentError(
        f"{where}.{key}={shown} is a list but {node['_target_']} takes a tensor; write "
        f"{where}.{key}: {{_target_: torch.tensor, data: {shown}}}"
    )


def bound_names(target: Callable[..., Any], n_args: int, keys: list[str], where: str) -> set[str]:
    """The parameters a node's ``_args_`` and keys bind (nothing called), or one line why not."""
    if (sig := signature(target)) is None:
        return set(keys)
    try:
        bound = sig.bind_partial(*[None] * n_args, **dict.fromkeys(keys))
    except TypeError as e:
        raise ComponentError(f"{where}: {e}; fix {where}'s _args_ / keys") from None
    return set(bound.arguments)


def check_node(node: Any, where: str, supplied: tuple[str, ...] | None = None) -> None:
    """Import and bind one ``_target_`` node and every nested one, without calling any.
    ``supplied``: what the trainer passes a top-level group's callable; a nested
    ``_partial_`` node (``supplied`` None) has only its keys checked, not what is missing."""
    if isinstance(node, ListConfig | list):
        for i, item in enumerate(node):
            check_node(item, f"{where}[{i}]")
        return
    if not isinstance(node, DictConfig | dict):
        return
    if "_target_" not in node:
        for key in node:
            check_node(node[key], f"{where}.{key}")
        return
    path = str(node["_target_"])
    target = locate(path, where)
    names, var_kw, required = accepted(target)
    keys = [k for k in node if k not in _META]
    given = tuple(supplied or ())
    for key in keys:
        if key not in names and not var_kw:
            raise ComponentError(
                f"{where}: unknown key '{key}' for {path}; accepted: "
                f"{', '.join(n for n in names if n not in given) or '(none)'}"
            )
        refuse_list_for_tensor(target, node, key, where)
        check_node(node[key], f"{where}.{key}")
    bound = bound_names(target, len(node.get("_args_") or []), keys, where)
    if supplied is None and node.get("_partial_", False) is True:
        return  # the caller of the partial supplies the rest
    if missing := [n for n in required if n not in bound and n not in given]:
        raise ComponentError(
            f"{where}: {path} needs {', '.join(missing)}; add "
            f"{', '.join(f'{where}.{m}=<value>' for m in missing)}"
        )


def check(cfg: DictConfig) -> None:
    """Preflight of every user-brought group; then dry-build the optimizer and scheduler."""
    for group, supplied in SUPPLIED.items():
        node = cfg[group]
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ComponentError(f"{group} has no _target_; see conf/{group}/ for examples")
        check_node(node, group, supplied)
    import torch

    def dry_optimizer(node: DictConfig) -> Any:
        return build("optimizer", node, params=[torch.nn.Parameter(torch.zeros(2))])

    optimizer = build_naming_key("optimizer", cfg.optimizer, dry_optimizer)
    scheduler = build_naming_key(
        "scheduler", cfg.scheduler, lambda node: build_scheduler(node, optimizer, total_steps=10)
    )
    from reprotrain.optim import check_schedule

    target, trainer = str(cfg.scheduler["_target_"]), cfg.trainer
    if refused := check_schedule(scheduler, target, trainer.monitor, trainer.monitor_mode):
        raise ComponentError(refused)
    for name, node in (cfg.get("callbacks") or {}).items():
        if isinstance(node, DictConfig) and "_target_" in node:
            group = f"callbacks.{name}"
            check_node(node, group)
            if str(node["_target_"]).startswith(f"{__package__}.callbacks."):
                # The framework's own build nothing but themselves: their value checks
                # (patience=-1) refuse here, before a run directory exists.
                build_naming_key(group, node, lambda n, g=group: build(g, n))
    if isinstance(cfg.get("step"), DictConfig):  # a step's own argument checks (step.rho=0)
        build_naming_key("step", cfg.step, lambda node: build_step(node, torch.nn.Linear(1, 1)))
    from reprotrain.data.base import InMemoryTensors

    dataset = locate(str(cfg.dataset["_target_"]), "dataset")
    if isinstance(dataset, type) and issubclass(dataset, InMemoryTensors):
        # An in-memory dataset loads nothing until load_samples (its base's contract), so
        # building it here runs only its argument checks (dataset.positive_fraction=0).
        build_naming_key("dataset", cfg.dataset, lambda node: build("dataset", node))


def build_naming_key(group: str, node: DictConfig, make: Callable[[DictConfig], Any]) -> Any:
    """Build; on failure (only), find the key whose removal makes it build, and name it."""
    try:
        return make(node)
    except ComponentError as e:
        for key in [k for k in node if k not in _META]:
            trial = OmegaConf.masked_copy(node, [k for k in node if k != key])
            try:
                make(trial)
            except ComponentError:
                continue
            raise ComponentError(
                f"{group}.{key}={OmegaConf.to_container(node, resolve=True)[key]!r} is refused "
                f"by {node['_target_']}: {str(e).split(': ', 2)[-1]}"
            ) from None
        raise


def build(group: str, node: DictConfig, *args: Any, **supplied: Any) -> Any:
    """``instantiate`` (a ``_partial_`` then called with ``supplied``) under Hydra's allowlist of
    the node's own targets; failures name the group."""
    try:
        with allowing(targets_in(node)):
            obj = instantiate(node, _convert_="all")
        if OmegaConf.select(node, "_partial_", default=False):
            obj = obj(*args, **supplied)
        return obj
    except ReprotrainError:
        raise
    except Exception as e:
        cause = e.__cause__ or e
        reason = str(cause).strip().splitlines()
        detail = reason[-1] if reason else type(cause).__name__
        raise ComponentError(
            f"{group} ({node.get('_target_')}) could not be built: {type(cause).__name__}: {detail}"
        ) from None


def build_scheduler(node: DictConfig, optimizer: Any, total_steps: int) -> Any:
    """Schedulers get ``optimizer``, and ``total_steps`` when their callable takes it; one
    whose ``step`` takes the metric comes wrapped to be stepped on it (``optim.for_loop``)."""
    from reprotrain.optim import for_loop

    extra = {"total_steps": total_steps} if takes(node, "scheduler", "total_steps") else {}
    return for_loop(build("scheduler", node, optimizer, **extra))


def build_callbacks(node: Any) -> dict[str, Any]:
    """The ``callbacks`` group: names to ``_target_`` nodes (a null entry is skipped)."""
    if node is None:
        return {}
    if not isinstance(node, DictConfig):
        raise ComponentError("callbacks must be a mapping of names to _target_ nodes")
    built = {}
    for name, child in node.items():
        if child is None:
            continue
        if not isinstance(child, DictConfig) or "_target_" not in child:
            raise ComponentError(f"callbacks.{name} has no _target_; see conf/callbacks/")
        group = f"callbacks.{name}"
        built[str(name)] = build_naming_key(group, child, lambda n, g=group: build(g, n))
    return built


def qualname(obj: Any) -> str:
    """``module.Class`` of what actually ran, for run.json (a partial names its function)."""
    cls = obj if inspect.isclass(obj) or inspect.isfunction(obj) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def takes(node: DictConfig, group: str, name: str) -> bool:
    """Whether the callable of ``node``'s ``_target_`` takes an argument ``name``."""
    names, var_kw, _ = accepted(locate(str(node["_target_"]), group))
    return name in names or var_kw


def build_given(group: str, node: DictConfig, **supplied: Any) -> Any:
    """``node`` built as a partial, then called with ``supplied``."""
    partial = OmegaConf.create(OmegaConf.to_container(node, resolve=True))
    partial["_partial_"] = True
    return build(group, partial, **supplied)


def build_task(node: DictConfig, loss_node: DictConfig | None) -> Any:
    """The task, given the ``loss`` group's module as ``loss_fn`` when it takes one."""
    if not takes(node, "task", "loss_fn") or loss_node is None:
        return build("task", node)
    return build_given("task", node, loss_fn=build("loss", loss_node))


def build_step(node: DictConfig, model: Any) -> Any:
    """The ``step``, given the bare ``model`` when it takes one (an EMA of the weights)."""
    if not takes(node, "step", "model"):
        return build("step", node)
    return build_given("step", node, model=model)


def declared_metrics(node: DictConfig, loss_node: DictConfig | None) -> dict[str, str]:
    """``{name: "min" | "max"}`` the task logs: its class's ``metrics`` (else an instance's)."""
    metrics = getattr(locate(str(node["_target_"]), "task"), "metrics", None)
    if not isinstance(metrics, dict):
        metrics = getattr(build_task(node, loss_node), "metrics", None)
    if not isinstance(metrics, dict) or not metrics:
        raise ComponentError(
            f"task {node['_target_']} declares no metrics; give it a class attribute "
            'metrics = {"loss": "min", ...} naming what compute() returns'
        )
    for name, mode in metrics.items():
        if mode not in ("min", "max"):
            raise ComponentError(
                f"task {node['_target_']}: metrics[{name!r}]={mode!r}; use 'min' or 'max'"
            )
    return dict(metrics)


#: Losses whose ``weight`` holds one value per class (``[C]``).
CLASS_WEIGHTED = ("CrossEntropyLoss", "NLLLoss", "MultiMarginLoss")


def check_loss(node: DictConfig, num_classes: int | None) -> None:
    """Preflight of a torch loss (``torch.nn.*Loss``: side-effect free, unlike a user's):
    built once and, when class-weighted, its ``weight`` checked and run once on zeros."""
    import torch

    target = locate(str(node["_target_"]), "loss")
    if not (inspect.isclass(target) and target.__module__.startswith("torch.nn.")):
        return
    loss = build_naming_key("loss", node, lambda n: build("loss", n))
    weight = getattr(loss, "weight", None)
    classes = [c for c in (getattr(torch.nn, n) for n in CLASS_WEIGHTED) if isinstance(loss, c)]
    if not classes or not isinstance(weight, torch.Tensor):
        return
    shape = list(weight.shape)
    if weight.ndim != 1 or (num_classes is not None and shape[0] != num_classes):
        count = f"{num_classes}" if num_classes is not None else "C"
        raise ComponentError(
            f"loss.weight has shape {shape}; {classes[0].__name__} takes one weight per "
            f"class, shape [{count}]: give {count} values"
        )
    if not weight.is_floating_point():
        raise ComponentError(
            f"loss.weight has dtype {str(weight.dtype).removeprefix('torch.')}; write its "
            "values as floats (1.0, not 1)"
        )
    if num_classes is None:
        return
    try:
        loss(torch.zeros(2, num_classes), torch.zeros(2, dtype=torch.long))
    except Exception as e:
        lines = str(e).strip().splitlines()
        raise ComponentError(
            f"loss ({node.get('_target_')}) fails on {num_classes}-class logits: "
            f"{type(e).__name__}: {lines[0] if lines else ''}"
        ) from None


def build_dataset(node: DictConfig) -> Any:
    """The dataset ``_target_`` (cheap: files are read by ``splits``)."""
    return build("dataset", node)


def data_fingerprint(node: DictConfig) -> dict:
    """What run.json records as the data's identity (reproduce compares it before it trains)."""
    return build_dataset(node).fingerprint()
