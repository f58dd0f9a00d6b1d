"""A sampler the user brings (``sampler=<name>``, conf/sampler/): which training samples an
epoch draws, how often, in which order. It is a torch ``Sampler`` with a ``generator``
attribute, which ``pipeline.EpochOrder`` sets to the generator of the framework's own shuffle,
``(data seed, epoch)``, before it draws the epoch's whole global order; each step's global
batch is a slice of it, each rank takes its part. So twins, a mid-epoch resume, any
``num_workers`` and the world size keep their bits with a sampler as without one.

Closes (as preflight checks, before any run directory): a sampler given any other way (a
``sampler`` key or class attribute of the dataset, never used by the framework's loader) or
one the framework cannot seed (no ``generator``, or one of its own).
"""

from __future__ import annotations

import contextlib
import inspect
import typing
from typing import Any

from reprotrain.errors import ReprotrainError

#: Where a DataLoader takes a sampler, and where the framework never looks for one.
ELSEWHERE = ("sampler", "batch_sampler")
HOW = "bring it as its own group: sampler=<name>, conf/sampler/<name>.yaml (docs/bring-your-own.md)"
#: The contract, for every refusal of a sampler (docs/bring-your-own.md, "A sampler").
CONTRACT = (
    "a sampler is a class (or a function annotated to return one) with __iter__, __len__ and "
    "a `generator` attribute, None until the framework sets it each epoch"
)
#: What the framework hands a sampler's ``_target_`` when it takes it: the training split.
SUPPLIED = ("data_source",)


def refuse_keys(dataset: Any, sampler: Any) -> None:
    """A sampler among the dataset's keys (a DataLoader argument the framework never passes),
    or a ``sampler`` node with its own ``generator`` (the framework's would replace it)."""
    for key in ELSEWHERE:
        if key in dataset:
            raise ReprotrainError(f"the dataset's YAML has a `{key}` key; {HOW}")
    if sampler is not None and "generator" in sampler:
        hands = "the framework hands the sampler its generator each epoch, (seed.data, epoch)"
        raise ReprotrainError(f"sampler.generator is set; leave it out: {hands}")


def refuse_elsewhere(**owners: Any) -> None:
    """A ``sampler``/``batch_sampler`` on the dataset (its class, its instance, its training
    split) would be silently unused by the framework's loader: one line saying where it goes."""
    for where, obj in owners.items():
        for name in ELSEWHERE:
            if getattr(obj, name, None) is not None:
                raise ReprotrainError(
                    f"{where} has a `{name}` attribute, which the framework never uses (it "
                    f"draws each epoch's order itself); {HOW}"
                )


def check_seedable(target: Any) -> None:
    """The ``sampler`` group's located ``_target_`` makes a sampler the framework can seed:
    a class (or a function's annotated return class) with ``generator`` as a class attribute
    or an ``__init__`` parameter (torch's ``WeightedRandomSampler``, ``RandomSampler``)."""
    made = target
    if not inspect.isclass(target):
        with contextlib.suppress(Exception):  # an annotation that does not resolve: refused
            made = typing.get_type_hints(target).get("return")
    params: Any = ()
    with contextlib.suppress(TypeError, ValueError):  # no signature to read
        params = inspect.signature(made).parameters
    if not (inspect.isclass(made) and (hasattr(made, "generator") or "generator" in params)):
        name = getattr(made, "__qualname__", None) or getattr(target, "__qualname__", target)
        raise ReprotrainError(f"sampler: {name} has no `generator` to seed; {CONTRACT}")
