"""A sampler the user brings (``sampler=<name>``, conf/sampler/): which training samples an
epoch draws, how often and in which order, in place of the framework's ``randperm``.

A sampler is a torch ``Sampler`` (torch's ``WeightedRandomSampler``, ``RandomSampler``,
``SubsetRandomSampler`` or one of your own) with a ``generator`` attribute: each epoch the
framework sets it to ``counter_generator(data seed, epoch)``, the generator its own shuffle
draws from, draws the epoch's whole global order in the main process, and puts it back to
None. Each step's global batch is a slice of that order and each rank takes its part, so a
sampler keeps every guarantee: twins, a mid-epoch resume (the order is drawn again from its
key), ``num_workers`` and the world size. ``pipeline.EpochOrder`` draws; this module builds and
checks the sampler.

Closes: a sampler's randomness (its ``generator``; every global RNG seeded from the same key
around the draw and restored: ``pipeline.EpochOrder``); a sampler given any other way (a
``sampler`` attribute or key on the dataset, a sampler the framework cannot seed), refused in
one line, before the run directory where the config or the class shows it, never left unused.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from reprotrain.errors import ReprotrainError

#: Where a DataLoader takes a sampler, and where the framework never looks for one.
ELSEWHERE = ("sampler", "batch_sampler")
HOW = (
    "bring it as its own group, sampler=<name> with conf/sampler/<name>.yaml "
    "(docs/bring-your-own.md, A sampler)"
)
#: What the framework hands a sampler's ``_target_`` when it takes it: the training split.
SUPPLIED = ("data_source",)


def refuse_keys(dataset: Any, sampler: Any) -> None:
    """Preflight, from the config alone: a sampler among the dataset's keys (a DataLoader
    argument the framework would never pass), a ``sampler`` node without a ``_target_``, or
    one that brings its own ``generator`` (the framework's would replace it unseen)."""
    for key in ELSEWHERE:
        if key in dataset:
            raise ReprotrainError(f"the dataset's YAML has a `{key}` key; {HOW}")
    if sampler is None:
        return
    if not hasattr(sampler, "keys") or "_target_" not in sampler:
        raise ReprotrainError(f"sampler={sampler!r} has no _target_; see conf/sampler/")
    if "generator" in sampler:
        raise ReprotrainError(
            "sampler.generator is set; leave it out: the framework hands the sampler its "
            "generator each epoch, seeded from (seed.data, epoch)"
        )


def refuse_elsewhere(**owners: Any) -> None:
    """A ``sampler``/``batch_sampler`` on the dataset (its class, its instance, its training
    split) would be silently unused by the framework's loader: one line saying where it goes."""
    for where, obj in owners.items():
        for name in ELSEWHERE:
            if getattr(obj, name, None) is not None:
                raise ReprotrainError(
                    f"{where} has a `{name}` attribute, which the framework never uses "
                    f"(it draws each epoch's order itself); {HOW}"
                )


def check_seedable(target: Any) -> None:
    """Preflight of the ``sampler`` group's located ``_target_``: it makes a sampler the
    framework can seed, a class (or a function annotated to return one) whose instances have
    a ``generator`` (a class attribute or an ``__init__`` parameter)."""
    made = target if inspect.isclass(target) else None
    if made is None:
        try:
            made = typing.get_type_hints(target).get("return")
        except Exception:  # an annotation that does not resolve: nothing to check against
            made = None
    if inspect.isclass(made):
        try:
            takes = "generator" in inspect.signature(made).parameters
        except (TypeError, ValueError):  # no signature to read
            takes = False
        if takes or hasattr(made, "generator"):
            return
    made_by = getattr(made, "__qualname__", None) or getattr(target, "__qualname__", target)
    raise ReprotrainError(
        f"sampler: {made_by} has no `generator` the framework can seed; a sampler is a class "
        "(or a function annotated to return one, `-> WeightedRandomSampler`) whose `generator` "
        "attribute its __iter__ draws from (docs/bring-your-own.md, A sampler)"
    )


def checked(sampler: Any) -> Any:
    """A built sampler, if it is one the framework seeds: ``__iter__``, ``__len__`` and a
    ``generator`` that is None until the framework sets it each epoch."""
    who = f"{type(sampler).__module__}.{type(sampler).__qualname__}"
    missing = [m for m in ("__iter__", "__len__", "generator") if not hasattr(sampler, m)]
    if missing or sampler.generator is not None:
        what = f"has no {', '.join(missing)}" if missing else "brings its own generator"
        raise ReprotrainError(
            f"sampler {who} {what}; a sampler has __iter__, __len__ and a `generator` "
            "attribute, None until the framework sets it each epoch (docs/bring-your-own.md, "
            "A sampler)"
        )
    return sampler


def checked_order(drawn: list, n: int, size: int, who: str) -> Any:
    """One epoch's draw as an int64 tensor of ``size`` indices (the sampler's ``len``), each
    a sample of the ``n`` in the training split; anything else is one line naming it."""
    import torch  # lazily: preflight imports this module before torch

    try:
        order = torch.as_tensor(drawn if drawn else [], dtype=None if drawn else torch.int64)
    except (TypeError, ValueError, RuntimeError):  # ragged lists, objects: not indices
        order = None
    if order is None or order.dim() != 1 or order.is_floating_point() or order.dtype == torch.bool:
        raise ReprotrainError(
            f"sampler {who} yields {drawn[0]!r}, not sample indices (a batch sampler is not "
            "one: trainer.batch_size makes the batches)"
        )
    if len(order) != size:
        raise ReprotrainError(f"sampler {who} drew {len(order)} indices but its len() is {size}")
    low, high = (int(order.min()), int(order.max())) if size else (0, -1)
    if low < 0 or high >= n:
        bad = low if low < 0 else high
        raise ReprotrainError(f"sampler {who} drew index {bad}, outside the {n} training samples")
    return order.to(torch.int64)
