"""Batches for training and evaluation: the device-resident and the DataLoader paths.

``epoch(e, s)`` yields ``(step, batch)``, ``eval_batches`` yields ``batch``: on the training
device, this rank's share (docs/randomness.md has each source and its key).

Closes: sample order (``randperm`` seeded with ``(data seed, e)``, or a user's sampler drawing
from that generator: ``EpochOrder``; step ``s`` is slice ``s``);
augmentation (``batch_transform`` from ``(augment seed, e, s)``, per-sample ``transform``
from ``(augment seed, e, i)``, every global RNG seeded and restored); the collate (keyed per
batch; per micro-batch under ``microbatch_collate``, the same on any world size).
"""

from __future__ import annotations

import inspect
import itertools
import random
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from reprotrain.batches import Batch, MicroBatches, batch_size, narrow, take, to_device
from reprotrain.config import check_workers
from reprotrain.data import worker_death  # noqa: F401  (its exit hook kills left workers)
from reprotrain.data.base import Splits, TensorSplit
from reprotrain.data.sampler import CONTRACT
from reprotrain.distributed import shard_global_batch
from reprotrain.errors import ReprotrainError
from reprotrain.repro.rng import Scoped
from reprotrain.repro.seeding import SeededGenerators, Seeds, counter_generator, stable_hash


def epoch_order(n: int, data_seed: int, epoch: int) -> torch.Tensor:
    """Sample order of one epoch: a pure function of (data seed, epoch)."""
    return torch.randperm(n, generator=counter_generator(data_seed, epoch))


class EpochOrder:
    """Each epoch's global order of training-sample indices, a pure function of ``(data seed,
    epoch)``: ``epoch_order``'s ``randperm``, or the ``sampler``'s draw from that same generator
    (set as its ``generator``, every global RNG seeded from the key and restored around it).
    ``size``: the samples an epoch draws. A sampler is drawn twice at the start: two different
    orders mean it keeps state of its own, which no resume could restore."""

    def __init__(self, n: int, data_seed: int, sampler: Any = None) -> None:
        self.n, self.data_seed, self.sampler = n, data_seed, sampler
        self.who = f"sampler {type(sampler).__module__}.{type(sampler).__qualname__}"
        if sampler is None:
            self.size = n
            return
        missing = [m for m in ("__iter__", "__len__", "generator") if not hasattr(sampler, m)]
        if missing or sampler.generator is not None:
            what = f"has no {', '.join(missing)}" if missing else "brings its own generator"
            raise ReprotrainError(f"{self.who} {what}; {CONTRACT}")
        self.size = len(sampler)
        if not torch.equal(self(1), self(1)):
            raise ReprotrainError(
                f"{self.who} drew two orders for epoch 1 from the same generator: draw only "
                "from its `generator`, keep no state of your own"
            )

    def __call__(self, epoch: int) -> torch.Tensor:
        if self.sampler is None:
            return epoch_order(self.n, self.data_seed, epoch)
        self.sampler.generator = counter_generator(self.data_seed, epoch)
        try:
            with Scoped(stable_hash(self.data_seed, epoch, "sampler")):
                drawn = list(self.sampler)
        finally:
            self.sampler.generator = None  # nothing of the framework's left between epochs
        try:
            order = torch.as_tensor(drawn, dtype=None if drawn else torch.int64)
        except (TypeError, ValueError, RuntimeError):  # ragged lists, objects: not indices
            order = torch.zeros(0, 0)
        if order.dim() != 1 or order.is_floating_point() or order.dtype == torch.bool:
            batches = "a batch sampler is not one: trainer.batch_size makes the batches"
            raise ReprotrainError(f"{self.who} yields {drawn[0]!r}, not indices ({batches})")
        if len(order) != self.size:
            raise ReprotrainError(f"{self.who} drew {len(order)} indices; its len() is {self.size}")
        if len(order) and not 0 <= int(order.min()) <= int(order.max()) < self.n:
            raise ReprotrainError(f"{self.who} drew an index outside the {self.n} training samples")
        return order.long()

    def keys(self, epoch: int) -> list[tuple[int, ...]]:
        """The epoch's sample keys in order: ``(epoch, i)``; the ``r``-th repeat of a sample
        in one epoch (a sampler may draw one again) is ``(epoch, i, r)``, so its per-sample
        transform draws apart from its first."""
        order = self(epoch).tolist()
        if self.sampler is None:  # a permutation: no repeats
            return [(epoch, i) for i in order]
        seen: dict[int, int] = {}
        for place, i in enumerate(order):
            seen[i] = r = seen.get(i, -1) + 1
            order[place] = (epoch, i, r) if r else (epoch, i)
        return order


def channels_last(batch: Batch) -> Batch:
    """Every 4-D tensor of the batch in channels-last memory layout (values unchanged)."""
    return pytree.tree_map(
        lambda t: t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t, batch
    )


@dataclass(frozen=True)
class PipelineSpec:
    """What a pipeline serves: batch sizes, device, seeds, limits and this rank's share."""

    batch_size: int
    eval_batch_size: int
    device: torch.device
    seeds: Seeds
    channels_last: bool = False
    limit_train_steps: int = 0
    limit_eval_batches: int = 0
    overfit_batches: int = 0
    rank: int = 0
    world_size: int = 1
    microbatch_collate: int = 0  # samples per collate call (invariant runs); 0: a rank's share
    sampler: Any = None  # the user's sampler (data/sampler.py); None: the framework's shuffle


class _Base:
    def __init__(self, splits: Splits, dataset: Any, spec: PipelineSpec) -> None:
        vars(self).update(vars(spec))  # the spec's fields as attributes: batch_size, device, ...
        self.data_seed, self.augment_seed = spec.seeds.data, spec.seeds.augment
        self.order = EpochOrder(len(splits.train), self.data_seed, spec.sampler)
        self.n, self.dataset = self.order.size, dataset  # the samples an epoch draws
        if self.n < spec.batch_size:
            size = f"trainer.batch_size={spec.batch_size}"
            raise ReprotrainError(f"{size} is larger than an epoch's samples ({self.n}); lower it")
        evaluated = (("val", splits.val), ("test", splits.test))
        self.eval_splits = {k: s for k, s in evaluated if s is not None}

    @property
    def steps_per_epoch(self) -> int:
        steps = self.n // self.batch_size  # drop_last: every step sees a full batch
        for limit in (self.limit_train_steps, self.overfit_batches):
            steps = min(steps, limit) if limit else steps
        return steps

    def data_epoch(self, epoch: int) -> int:
        """The epoch whose order and augmentation a step uses: always 1 when overfitting."""
        return 1 if self.overfit_batches else epoch

    def has_split(self, split: str) -> bool:
        return split in self.eval_splits

    def eval_steps(self, split: str) -> int:
        """How many batches :meth:`eval_batches` yields for ``split`` (its progress bar's total)."""
        steps = -(-len(self.eval_splits[split]) // self.eval_batch_size)
        return min(steps, self.limit_eval_batches) if self.limit_eval_batches else steps

    def _rank_share(self, batch: Batch) -> Batch:
        """This rank's samples of a global batch that was drawn and transformed whole."""
        if self.world_size == 1:
            return batch
        rows = shard_global_batch(range(batch_size(batch)), self.rank, self.world_size)
        if rows.step == 1:
            return narrow(batch, rows.start, len(rows))
        return take(batch, torch.tensor(rows, device=self.device))

    def _on_device(self, batch: Batch, key: tuple | None, scope: tuple = (), moved=False) -> Batch:
        """In-memory tensors moved (unless ``moved``) through the batch transform, the global
        RNGs seeded from ``key`` (training) or ``scope`` (evaluation)."""
        if not moved:
            batch = to_device(batch, self.device)
        if getattr(type(self.dataset).batch_transform, "draws_no_global_rng", False):
            batch = self.dataset.batch_transform(batch, key)  # the framework's own: no draw
        else:
            where = key if key is not None else (self.augment_seed, *scope)
            seed = stable_hash(*where, "global")  # apart from counter_generator(*key)'s stream
            with Scoped(seed, self.device):
                batch = self.dataset.batch_transform(batch, key)
        return channels_last(batch) if self.channels_last else batch


class DevicePipeline(_Base):
    """Whole in-memory dataset resident on the training device; batches are gathers on it."""

    def __init__(self, splits: Splits, dataset: Any, spec: PipelineSpec) -> None:
        super().__init__(splits, dataset, spec)
        self.train = to_device(splits.train.samples, self.device)
        self.resident = {k: to_device(s.samples, self.device) for k, s in self.eval_splits.items()}

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[int, Batch]]:
        epoch, steps = self.data_epoch(epoch), self.steps_per_epoch
        order = self.order(epoch).to(self.device)
        # Step s's sample indices, for the whole epoch at once (views, one call).
        rows = order[: steps * self.batch_size].view(steps, self.batch_size).unbind(0)
        for step in range(start_step, steps):
            batch = take(self.train, rows[step])  # gathered on the device: nothing to move
            batch = self._on_device(batch, (self.augment_seed, epoch, step), moved=True)
            yield step, self._rank_share(batch)

    def eval_batches(self, split: str) -> Iterator[Batch]:
        samples = self.resident[split]
        n, size = batch_size(samples), self.eval_batch_size
        for k, i in enumerate(range(0, n, size)):
            if self.limit_eval_batches and k >= self.limit_eval_batches:
                return
            yield self._on_device(narrow(samples, i, min(size, n - i)), None, ("eval", split, k))


class KeyBatch(list):
    """One collate call's keys ``[(epoch, index), ...]`` (``(epoch, index, r)``: a sample's
    ``r``-th repeat in the epoch, ``EpochOrder.keys``), its ``step`` and ``microbatch``
    (when collated alone, else None), handed to ``keyed_items`` in any worker; there, the
    batch's samples with the same place and their first ``key``: its collate's seed."""

    key: tuple = (None, 0)
    step: int | None = None
    microbatch: int | None = None


def key_batch(keys: list, step: int | None, microbatch: int | None = None) -> KeyBatch:
    batch = KeyBatch(keys)
    batch.step, batch.microbatch = step, microbatch
    return batch


def keyed_items(dataset: Dataset, keys: list[tuple[int | None, int]]) -> KeyBatch:
    """``dataset.__getitems__``: the samples of ``keys``, with their first key and place."""
    step, microbatch = getattr(keys, "step", None), getattr(keys, "microbatch", None)
    samples = key_batch([dataset[k] for k in keys], step, microbatch)
    samples.key = keys[0] if keys else (None, 0)
    return samples


class TensorItems(Dataset):
    """Item ``(epoch, i)`` of an in-memory split: sample ``i`` (transformed per batch)."""

    def __init__(self, split: TensorSplit) -> None:
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, key: tuple[int | None, int]):
        return take(self.split.samples, key[1])

    __getitems__ = keyed_items


class SeededSamples(Dataset):
    """Item ``(epoch, i)``: sample ``i`` through ``transform`` under a counter-based seed.

    Closes: every global RNG in ``__getitem__`` and the transform, seeded from ``(augment
    seed, epoch or "eval", i)`` (a repeat's ``r`` after it: key ``(epoch, i, r)``) and restored
    (an ``rng`` parameter gets a numpy Generator)."""

    def __init__(self, base: Dataset, transform: Any, augment_seed: int, train: bool) -> None:
        self.base, self.transform, self.augment_seed = base, transform, augment_seed
        self.train = train
        self.takes_rng = takes_keyword(transform, "rng")

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key: tuple):
        epoch, i, *repeat = key
        seed = stable_hash(self.augment_seed, "eval" if epoch is None else epoch, i, *repeat)
        with Scoped(seed):
            if self.takes_rng:
                return self.transform(self.base[i], self.train, rng=np.random.default_rng(seed))
            return self.transform(self.base[i], self.train)

    __getitems__ = keyed_items


class CollateContext(SeededGenerators):
    """A collate's ``ctx``: ``training``, ``epoch`` (None in evaluation), ``step``,
    ``microbatch`` (collated alone, else None), and ``seed``/``generator``/``numpy_generator``
    from the batch's key, made on first use."""

    __slots__ = ("_generator", "_numpy_generator", "epoch", "microbatch", "seed", "step")
    __slots__ += ("training",)

    def __init__(
        self, seed: int, *, epoch: int | None, step: int | None, microbatch: int | None
    ) -> None:
        self.seed, self.epoch, self.step, self.microbatch = seed, epoch, step, microbatch
        self.training = epoch is not None
        self._generator = self._numpy_generator = None  # SeededGenerators makes them on use


class SeededCollate:
    """The dataset's collate under its batch's key (a ``ctx`` parameter gets a CollateContext).

    Closes: every global RNG in the collate, seeded from ``(augment seed, "collate", epoch,
    first index[, its repeat])`` or, collated alone, ``(..., epoch, step, "microbatch", j)``;
    restored."""

    def __init__(self, collate: Any, augment_seed: int) -> None:
        self.collate, self.augment_seed = collate, augment_seed
        self.takes_ctx = takes_keyword(collate, "ctx")

    def __call__(self, samples: list) -> Batch:
        epoch, first, *repeat = getattr(samples, "key", (None, 0))
        step, micro = getattr(samples, "step", None), getattr(samples, "microbatch", None)
        if micro is None:
            key = (self.augment_seed, "collate", "eval" if epoch is None else epoch, first, *repeat)
        else:
            key = (self.augment_seed, "collate", epoch, step, "microbatch", micro)
        with Scoped(stable_hash(*key)):
            if not self.takes_ctx:
                return self.collate(list(samples))
            ctx = CollateContext(stable_hash(*key, "ctx"), epoch=epoch, step=step, microbatch=micro)
            return self.collate(list(samples), ctx=ctx)


def takes_keyword(fn: Any, name: str) -> bool:
    """Whether ``fn`` has a parameter ``name`` (a transform's ``rng``, a collate's ``ctx``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False
    return name in params


class EpochBatchSampler(Sampler[list[tuple[int, int]]]):
    """Key batches ``[(epoch, index), ...]`` of one epoch's ``steps`` of ``order`` (None: all
    of them): the ``shard`` rank's share, or (``microbatch`` size ``m``) its micro-batches
    ``j`` (samples ``j*m .. (j+1)*m - 1`` of the global batch) one by one."""

    def __init__(
        self,
        order: EpochOrder,
        batch_size: int,
        epoch: int,
        steps: range | None = None,
        shard: tuple[int, int] = (0, 1),
        microbatch: int = 0,
    ):
        self.order, self.batch_size, self.shard, self.epoch = order, batch_size, shard, epoch
        self.steps = range(order.size // batch_size) if steps is None else steps
        self.microbatch = microbatch
        self.per_step = batch_size // microbatch // shard[1] if microbatch else 1

    def __len__(self) -> int:
        return len(self.steps) * self.per_step

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        keys, m = self.order.keys(self.epoch), self.microbatch
        for step in self.steps:
            batch = keys[step * self.batch_size : (step + 1) * self.batch_size]
            if not m:
                yield key_batch(shard_global_batch(batch, *self.shard), step)
                continue
            for j in shard_global_batch(range(self.batch_size // m), *self.shard):
                yield key_batch(batch[j * m : (j + 1) * m], step, j)


def seed_worker(worker_id: int) -> None:
    """Seed python and numpy in a worker from torch's per-worker seed (else forked workers
    share the parent's); ignore stop signals, so the main process finishes its step and
    checkpoints (it shuts the workers down)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    seed = torch.initial_seed() % (1 << 32)
    random.seed(seed)
    np.random.seed(seed)


_WORKER_ERROR = re.compile(r"^reprotrain\.errors\.(\w+): (.*)$", re.M)


def _one_line_from_worker(e: Exception) -> Exception:
    """A ReprotrainError raised in a worker comes back wrapped with its traceback text."""
    found = _WORKER_ERROR.findall(str(e))
    return ReprotrainError(found[-1][1]) if found else e


def stack_samples(samples: list) -> Batch:
    """torch's default collate; samples it cannot stack are one line saying to bring one."""
    try:
        return default_collate(samples)
    except (RuntimeError, TypeError) as e:
        tensors = [t for t in pytree.tree_leaves(samples) if isinstance(t, torch.Tensor)]
        shapes = sorted({str(list(t.shape)) for t in tensors if t.dim()})
        reason = f"tensor shapes {', '.join(shapes[:3])}" if len(shapes) > 1 else str(e)
        raise ReprotrainError(
            f"the default collate cannot stack these samples ({reason.splitlines()[0]}); give "
            "the dataset a collate (see conf/dataset/sequences.yaml) that pads or packs them"
        ) from None


class LoaderPipeline(_Base):
    """DataLoader path: map-style datasets (per-sample transform, collate) or in-memory tensors."""

    def __init__(
        self, splits: Splits, dataset: Any, spec: PipelineSpec, num_workers: int = 0
    ) -> None:
        super().__init__(splits, dataset, spec)
        self.num_workers = num_workers
        self.per_sample = not isinstance(splits.train, TensorSplit)
        self.collate = getattr(dataset, "collate", None) or stack_samples
        self.train_set = self._items(splits.train, train=True)
        self.eval_sets = {k: self._items(s, train=False) for k, s in self.eval_splits.items()}

    def _items(self, split: Any, train: bool) -> Dataset:
        if self.per_sample:
            return SeededSamples(split, self.dataset.transform, self.augment_seed, train=train)
        return TensorItems(split)

    def _batches(self, dataset, batch_sampler, epoch: int) -> Iterator[Batch]:
        g = torch.Generator().manual_seed(stable_hash(self.data_seed, "workers", epoch))
        loader = DataLoader(
            dataset,
            batch_sampler=batch_sampler,
            num_workers=self.num_workers,
            collate_fn=SeededCollate(self.collate, self.augment_seed),
            generator=g,
            worker_init_fn=seed_worker,
            pin_memory=self.device.type == "cuda",
        )
        batches = iter(loader)
        try:
            for batch in batches:
                batch_size(batch)  # a pytree of tensors, samples first, or one line
                yield batch
        except Exception as e:  # a worker's error comes back with its traceback as text
            raise _one_line_from_worker(e) from None
        finally:  # an epoch left early (error, stop, break): its workers go now, not at exit
            shutdown = getattr(batches, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()

    def _finish(self, batch: Batch, key: tuple[int, int, int] | None, scope: tuple = ()) -> Batch:
        if self.per_sample:  # already this rank's samples, transformed per sample
            batch = to_device(batch, self.device)
            return channels_last(batch) if self.channels_last else batch
        batch = self._on_device(batch, key, scope)
        return batch if key is None else self._rank_share(batch)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[int, Batch]]:
        epoch = self.data_epoch(epoch)
        shard = (self.rank, self.world_size) if self.per_sample else (0, 1)
        micro = self.microbatch_collate if self.per_sample else 0  # tensors: fixed shapes
        steps = range(start_step, self.steps_per_epoch)
        sampler = EpochBatchSampler(self.order, self.batch_size, epoch, steps, shard, micro)
        batches = self._batches(self.train_set, sampler, epoch)
        if micro:  # each micro-batch collated alone: a step is its rank's micro-batches
            batches = by_step(batches, sampler.per_step)
        for step, batch in enumerate(batches, start_step):
            yield step, self._finish(batch, (self.augment_seed, epoch, step))

    def eval_batches(self, split: str) -> Iterator[Batch]:
        dataset = self.eval_sets[split]
        keys = [(None, i) for i in range(len(dataset))]
        size = self.eval_batch_size
        starts = range(0, len(keys), size)
        batches = [key_batch(keys[i : i + size], k) for k, i in enumerate(starts)]
        if self.limit_eval_batches:
            batches = batches[: self.limit_eval_batches]
        for k, batch in enumerate(self._batches(dataset, batches, epoch=0)):
            yield self._finish(batch, None, ("eval", split, k))


def by_step(batches: Iterator[Batch], per_step: int) -> Iterator[MicroBatches]:
    """Micro-batches collated one by one, ``per_step`` at a time: one step's batch each."""
    while parts := list(itertools.islice(batches, per_step)):
        yield MicroBatches(parts)


def build_pipeline(
    pipeline: str, splits: Splits, dataset: Any, num_workers: int, spec: PipelineSpec
):
    """``trainer.pipeline``: ``auto`` takes the device path for in-memory tensors, else the
    DataLoader; workers checked."""
    configured = pipeline
    if pipeline == "auto":
        pipeline = "device" if dataset.in_memory else "loader"
    if pipeline == "device":
        if not dataset.in_memory:
            raise ReprotrainError(
                "trainer.pipeline=device needs an in-memory dataset; use trainer.pipeline=auto"
            )
        check_workers(configured, num_workers, in_memory=True, target=type(dataset).__name__)
        return DevicePipeline(splits, dataset, spec)
    return LoaderPipeline(splits, dataset, spec, num_workers)
