"""Samples are a pure function of their key, checked by drawing them twice.

Closes (as a check): randomness or state a dataset keeps for itself (a private generator, a
counter, a cache, the process it runs in). A few keys spread over the epoch are drawn twice
in the main process and twice in each of ``max(2, trainer.num_workers)`` loader workers
(the second after ``WARMUP`` more samples); every draw must give the same bytes. What it
finds, what it cannot, and its cost: docs/randomness.md, docs/resume.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from reprotrain.digest import Digester, describe, instance_attributes


@dataclass(frozen=True)
class PurityVerdict:
    """Whether the samples drawn were pure; ``reason``: the key(s) and draw that differed."""

    checked: int  # keys drawn
    pure: bool
    reason: str | None = None
    keys: tuple = ()  # the keys, (epoch, index)
    workers: int = 0  # loader workers that drew each key twice
    warmup: int = 0  # samples each worker served between its two draws

    def as_record(self) -> dict[str, Any]:
        keys = {"keys_checked": self.checked, "keys": [list(k) for k in self.keys]}
        pure = {"pure": self.pure, "reason": self.reason}
        return keys | {"workers": self.workers, "warmup_per_worker": self.warmup} | pure


def _first(samples: list) -> Any:
    return samples[0]


#: What an impure sample takes away, recorded with it (and a resume's entry says so again).
NOT_PROMISED = ["the same bits at any trainer.num_workers", "a bitwise resume"]
#: Keys drawn, spread over the epoch (first, last and between).
KEYS = 4
#: Samples each checking worker serves between its two draws of the keys.
WARMUP = 64


def spread(n: int, k: int = KEYS) -> list[int]:
    """``k`` indices spread evenly over ``range(n)``, first and last included."""
    if n <= k:
        return list(range(n))
    return sorted({round(j * (n - 1) / (k - 1)) for j in range(k)})


def check(
    dataset: Dataset, keys: list, owners: dict[str, Any], workers: int = 2,
    warmup: int = WARMUP, fill: list | None = None,
) -> PurityVerdict:  # fmt: skip
    """Draw each key in the main process (in order, then reversed) and in each of ``workers``
    loader workers (forked before the main draws) first and after ``warmup`` more samples
    (``fill``, cycled); every draw of a key must give the same bytes. ``owners``: the
    objects whose attributes may hold the state, named when one changed."""
    digest = Digester()
    before = {name: _attribute_digests(obj, digest) for name, obj in owners.items()}
    pending = _start_workers(dataset, keys, workers, warmup, fill or keys)  # forked now
    fresh = [digest(dataset[k]) for k in keys]
    again = [digest(dataset[k]) for k in reversed(keys)][::-1]
    changed = _changed(owners, before, digest)
    try:
        found = [(_differ(keys, fresh, again), "its second draw in the main process")]
        served = [] if found[0][0] else _worker_draws(pending, workers, digest)
    finally:
        getattr(pending, "_shutdown_workers", lambda: None)()
    for w, (first, later) in enumerate(served):
        where = f"its draw in loader worker {w}"
        found.append((_differ(keys, fresh, first), f"{where} (num_workers 0 vs {workers})"))
        found.append((_differ(keys, first, later), f"{where} after {warmup} more samples"))
    bad, where = next(((bad, where) for bad, where in found if bad), ([], ""))
    reason = _reason(bad, where, changed) if bad else None
    return PurityVerdict(len(keys), not bad, reason, tuple(keys), workers, warmup)


def _differ(keys: list, a: list[str], b: list[str]) -> list:
    return [k for k, x, y in zip(keys, a, b, strict=True) if x != y]


class _Tagged(Dataset):
    """``(tag, key)`` -> ``(tag, worker id, sample)``; a warm-up sample is drawn, not sent."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[str, Any]) -> tuple[str, int, Any]:
        from torch.utils.data import get_worker_info

        tag, key = item
        sample = self.dataset[key]
        return tag, get_worker_info().id, (None if tag == "warm" else sample)


def _start_workers(
    dataset: Dataset, keys: list, workers: int, warmup: int, fill: list
) -> Iterator[tuple[str, int, Any]]:
    """The checking loader's iterator, its workers started: one sample per fetch, so index
    ``j`` goes to worker ``j % workers``, whose sequence is keys, ``warmup`` fill keys, keys."""
    from reprotrain.data.pipeline import seed_worker

    own = [("first", k) for k in keys]
    own += [("warm", fill[t % len(fill)]) for t in range(warmup)]
    own += [("later", k) for k in keys]
    order = [(tag, key) for item in own for tag, key in [item] * workers]
    no_global_draw = torch.Generator().manual_seed(0)
    return iter(DataLoader(_Tagged(dataset), batch_size=1, sampler=order, num_workers=workers,
                           collate_fn=_first, worker_init_fn=seed_worker,
                           generator=no_global_draw))  # fmt: skip


def _worker_draws(
    pending: Iterator[tuple[str, int, Any]], workers: int, digest: Digester
) -> list[tuple[list[str], list[str]]]:
    """Per worker, (first draw, later draw) digests of the keys, each worker id checked."""
    drawn: dict[tuple[int, str], list[str]] = {}
    for j, (tag, wid, sample) in enumerate(pending):
        if wid != j % workers:
            raise RuntimeError(f"sample {j} came from worker {wid}, not {j % workers}")
        if tag != "warm":
            drawn.setdefault((wid, tag), []).append(digest(sample))
    return [(drawn[(w, "first")], drawn[(w, "later")]) for w in range(workers)]


def _attribute_digests(obj: Any, digest: Digester) -> dict[str, str]:
    if obj is None:
        return {}
    return {k: digest(v) for k, v in instance_attributes(obj).items()}


def _changed(owners: dict[str, Any], before: dict[str, dict[str, str]], digest: Digester):
    out = []
    for name, obj in owners.items():
        for attr, value in _attribute_digests(obj, digest).items():
            if before[name].get(attr) != value:
                what = describe(instance_attributes(obj)[attr])
                out.append(f"{name} attribute `{attr}` ({what}) changed while drawing")
    return out


def _reason(keys: list, where: str, changed: list[str]) -> str:
    suspect = "; ".join(changed) if changed else "no attribute changed: it depends on the process"
    named = ", ".join(map(str, keys))
    return (
        f"sample(s) {named} differ between a fresh draw and {where} under the same seed "
        f"({suspect}): draw randomness from the seeded globals or a transform's `rng`, "
        "not from state of your own, the clock or a file that changes"
    )


def check_pipeline(pipeline: Any, n: int = KEYS) -> PurityVerdict | None:
    """:func:`check` on a loader pipeline's training split; None for in-memory slices."""
    from reprotrain.data.pipeline import SeededSamples

    train = getattr(pipeline, "train_set", None)
    if not isinstance(train, SeededSamples) or len(train) == 0:
        return None
    keys = [(0, i) for i in spread(len(train), n)]
    fill = [(0, i) for i in spread(len(train), WARMUP)]  # the warm-up: the epoch's samples
    workers = max(2, getattr(pipeline, "num_workers", 0) or 0)
    owner = getattr(train.transform, "__self__", train.transform)  # a SampleData's method
    return check(train, keys, {"dataset": train.base, "transform": owner}, workers, fill=fill)


def check_samples(pipeline: Any, level: str, record: Any) -> None:
    """The run start's check, recorded as ``sample_purity``: an impure sample refuses the run
    where the level refuses it (strict, portable); at the others it is warned and recorded."""
    import logging

    from reprotrain.errors import ReprotrainError
    from reprotrain.repro.levels import level as repro_level

    verdict = check_pipeline(pipeline)
    if verdict is None:
        slices = {"keys_checked": 0, "pure": None, "reason": "in-memory tensors: slices"}
        record.update(sample_purity=slices)
        return
    found = verdict.as_record()
    if not verdict.pure:  # the record claims nothing the check refuted
        found["not_promised"] = NOT_PROMISED
    record.update(sample_purity=found)
    if verdict.pure:
        return
    if repro_level(level).refuses_impure_samples:
        raise ReprotrainError(
            f"samples are not a pure function of their key: {verdict.reason} (repro=warn "
            "records this and goes on, without promising the bits)"
        )
    logging.getLogger("reprotrain").warning(
        "samples are not a pure function of their key: %s; neither independence from "
        "trainer.num_workers nor a bitwise resume is promised",
        verdict.reason,
    )
