"""Samples are a pure function of their key, checked by drawing them twice.

Closes (as a check): randomness or state a dataset keeps for itself. The framework seeds
every global RNG per sample from ``(augment seed, epoch, index)`` (``SeededSamples``), so a
sample is the same in any worker, in any order, after any resume, provided the dataset and
its transform draw only from those. A private ``random.Random(0)`` drawn in
``__getitem__``, a counter, a cache that changes what comes out, or anything that reads the
process (worker id, pid) breaks that without an error: the bits then depend on
``num_workers`` and on the history of calls, and a resume cannot reproduce them. No list of
attributes can find every such source, so the check compares bytes instead: each of a few
keys is drawn in the main process, then again in the reverse order, then once more in a
loader worker (a fresh process, as ``trainer.num_workers > 0`` runs it), and every draw
must give the same bytes. Where they differ, the dataset's and transform's attributes that
changed during the draws are named when there are any (a generator or a counter), else the
process is (a sample that reads which process it is in).

The cost is ``3 × n`` samples and one worker start per run (about a second).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from reprotrain.resume.audit import Digester, describe, instance_attributes


@dataclass(frozen=True)
class PurityVerdict:
    """Whether the samples drawn were pure; ``reason``: one line naming what differed."""

    checked: int  # keys drawn (each three times)
    pure: bool
    reason: str | None = None

    def as_record(self) -> dict[str, Any]:
        return {"keys_checked": self.checked, "pure": self.pure, "reason": self.reason}


def _first(samples: list) -> Any:
    return samples[0]


def check(dataset: Dataset, keys: list, owners: dict[str, Any]) -> PurityVerdict:
    """Draw ``dataset[key]`` for each key three times (in order, in reverse, in a loader
    worker) and compare the bytes. ``owners``: the objects whose attributes may hold the
    state (``{"dataset": ..., "transform": ...}``), named when one changed."""
    digest = Digester()
    before = {name: _attribute_digests(obj, digest) for name, obj in owners.items()}
    first = [digest(dataset[k]) for k in keys]
    again = [digest(dataset[k]) for k in reversed(keys)][::-1]
    changed = _changed(owners, before, digest)
    for key, a, b in zip(keys, first, again, strict=True):
        if a != b:
            return PurityVerdict(len(keys), False, _reason(key, "a second draw", changed))
    loader = DataLoader(
        dataset,
        batch_size=1,
        sampler=keys,
        num_workers=1,
        collate_fn=_first,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip  (no global draw)
    in_worker = [digest(sample) for sample in loader]
    for key, a, b in zip(keys, first, in_worker, strict=True):
        if a != b:
            return PurityVerdict(len(keys), False, _reason(key, "a loader worker", changed))
    return PurityVerdict(len(keys), True)


def _attribute_digests(obj: Any, digest: Digester) -> dict[str, str]:
    if obj is None:
        return {}
    return {k: digest(v) for k, v in instance_attributes(obj).items()}


def _changed(owners: dict[str, Any], before: dict[str, dict[str, str]], digest: Digester):
    out = []
    for name, obj in owners.items():
        now = _attribute_digests(obj, digest)
        for attr, value in now.items():
            if before[name].get(attr) != value:
                kind = describe(instance_attributes(obj)[attr])
                out.append(f"{name} attribute `{attr}` ({kind}) changed while drawing")
    return out


def _reason(key: Any, where: str, changed: list[str]) -> str:
    suspect = "; ".join(changed) if changed else "no attribute changed: it depends on the process"
    return (
        f"sample {key} differs between its first draw and {where} under the same seed "
        f"({suspect}): draw randomness from the seeded globals or a transform's `rng`, not "
        "from state of your own"
    )


def check_pipeline(pipeline: Any, n: int = 3) -> PurityVerdict | None:
    """:func:`check` on the first ``n`` samples of a loader pipeline's training split; None
    where samples cannot hold state of their own (an in-memory tensor split: slices)."""
    from reprotrain.data.pipeline import SeededSamples

    train = getattr(pipeline, "train_set", None)
    if not isinstance(train, SeededSamples) or len(train) == 0:
        return None
    keys = [(0, i) for i in range(min(n, len(train)))]
    owner = getattr(train.transform, "__self__", train.transform)  # a SampleData's method
    return check(train, keys, {"dataset": train.base, "transform": owner})


def check_samples(pipeline: Any, level: str, record: Any) -> None:
    """The run start's check: ``record["sample_purity"]`` says what was drawn and found.
    Under strict (and portable) an impure sample refuses the run in one line; at the other
    levels the run goes on, warned and recorded: neither independence from
    ``trainer.num_workers`` nor a bitwise resume is promised (a resume's line says so)."""
    import logging

    from reprotrain.errors import ReprotrainError

    verdict = check_pipeline(pipeline)
    if verdict is None:
        slices = {"keys_checked": 0, "pure": None, "reason": "in-memory tensors: slices"}
        record.update(sample_purity=slices)
        return
    record.update(sample_purity=verdict.as_record())
    if verdict.pure:
        return
    if level in ("strict", "portable"):
        raise ReprotrainError(
            f"samples are not a pure function of their key: {verdict.reason} (repro=warn "
            "records this and goes on, without promising the bits)"
        )
    logging.getLogger("reprotrain").warning(
        "samples are not a pure function of their key: %s; neither independence from "
        "trainer.num_workers nor a bitwise resume is promised",
        verdict.reason,
    )
