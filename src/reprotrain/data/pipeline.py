"""Batches for training and evaluation: the device-resident and the DataLoader paths.

A batch is a pytree of tensors (``reprotrain.batches``); both paths move, split and count
it without knowing its shape. ``epoch(e, s)`` yields ``(step, batch)`` and ``eval_batches``
yields ``batch``, always on the training device and always this rank's share.

Closes: sample order. The order of epoch ``e`` is ``randperm`` from a generator seeded with
``(data seed, e)``; step ``s`` takes slice ``s`` of it, so either path can start at step ``s``
of an epoch (exact mid-epoch resume needs only ``(e, s)``). Under DDP each rank takes its
share of that global batch (``distributed.shard_global_batch``, the one place that decides).

Closes: augmentation randomness, two ways.
- In-memory tensors go through the dataset's ``batch_transform`` keyed by
  ``(augment seed, e, s)``, on the training device, on the whole global batch (the uint8
  images' crop+flip of ``augment.py``).
- Map-style datasets run their per-sample ``transform`` (and ``__getitem__``) with every
  global RNG (torch, python ``random``, numpy's ``np.random``) seeded from
  ``(augment seed, e, sample index)`` and restored afterwards (``SeededSamples``), so the
  result never depends on which worker ran it, how many there are, or what ran before; a
  transform that takes an ``rng`` keyword also gets a ``numpy.random.Generator`` for the
  sample. The dataset's ``collate`` then builds the batch.
- The collate runs with every global RNG seeded from its batch's key and restored
  afterwards (``SeededCollate``); a collate with a ``ctx`` parameter is also handed a
  ``CollateContext`` (``ctx.generator``, ``ctx.numpy_generator``, ``ctx.seed``) keyed the
  same way.
- ``batch_transform`` (in-memory tensors) runs with the global RNGs seeded from
  ``(augment seed, e, s)`` (evaluation: ``(augment seed, "eval", split, batch)``), restored
  afterwards.

- ``DevicePipeline`` keeps a whole in-memory dataset on the training device: indexing and
  the batch transform run there, with no worker processes.
- ``LoaderPipeline`` is a ``DataLoader`` over keys ``(epoch, index)`` with an explicit
  generator and a ``worker_init_fn``, so ``num_workers=0`` and ``2`` give the same batches.

Closes (world-size invariant runs, ``microbatch_collate``): the world size's effect on a
collated batch. A collate that pads to the longest sequence it is given, or draws, gives a
rank's share of the global batch a shape and draws that depend on which samples share the
rank. With ``microbatch_collate`` set (the trainer sets it to the micro-batch size when
``trainer.world_size_invariant=true``) the per-sample path collates each micro-batch alone:
micro-batch ``j`` of step ``s`` holds samples ``j*m .. (j+1)*m - 1`` of the step's global
batch, the same on any world size, and its collate draws from ``(augment seed, "collate",
epoch, s, j)``. A step then yields ``batches.MicroBatches`` (its micro-batches, each with its
own padding), which the engine runs as they are.
"""

from __future__ import annotations

import inspect
import itertools
import random
import re
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from reprotrain.batches import Batch, MicroBatches, batch_size, narrow, take, to_device
from reprotrain.config import check_workers
from reprotrain.data import worker_death  # noqa: F401  (its exit hook kills left workers)
from reprotrain.data.base import Splits, TensorSplit
from reprotrain.distributed import shard_global_batch
from reprotrain.errors import ReprotrainError
from reprotrain.repro.seeding import Seeds, counter_generator, scoped_globals, stable_hash


def epoch_order(n: int, data_seed: int, epoch: int) -> torch.Tensor:
    """Sample order of one epoch: a pure function of (data seed, epoch)."""
    return torch.randperm(n, generator=counter_generator(data_seed, epoch))


def channels_last(batch: Batch) -> Batch:
    """Every 4-D tensor of the batch in channels-last memory layout (values unchanged)."""
    return pytree.tree_map(
        lambda t: t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t, batch
    )


class _Base:
    def __init__(
        self,
        splits: Splits,
        dataset: Any,
        *,
        batch_size: int,
        eval_batch_size: int,
        device: torch.device,
        seeds: Seeds,
        channels_last: bool = False,
        limit_train_steps: int = 0,
        limit_eval_batches: int = 0,
        overfit_batches: int = 0,
        rank: int = 0,
        world_size: int = 1,
        microbatch_collate: int = 0,
    ) -> None:
        self.n = len(splits.train)
        self.rank, self.world_size = rank, world_size
        # Samples per collate call in a world-size invariant run (the micro-batch size):
        # the per-sample path collates each micro-batch alone. 0: a rank's share at once.
        self.microbatch_collate = microbatch_collate
        self.limit_train_steps, self.limit_eval_batches = limit_train_steps, limit_eval_batches
        self.overfit_batches = overfit_batches
        if self.n < batch_size:
            raise ReprotrainError(
                f"trainer.batch_size={batch_size} is larger than the training set ({self.n}); "
                "lower it"
            )
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.device, self.channels_last = device, channels_last
        self.data_seed, self.augment_seed = seeds.data, seeds.augment
        self.dataset = dataset
        self.eval_splits = {"val": splits.val, "test": splits.test}

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
        return self.eval_splits.get(split) is not None

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

    def _on_device(
        self, batch: Batch, key: tuple[int, int, int] | None, scope: tuple = (),
        moved: bool = False,
    ) -> Batch:  # fmt: skip
        """A batch of in-memory tensors, moved (unless ``moved``: gathered on the device),
        through the dataset's batch transform, with the global RNGs seeded from ``key``
        (training) or ``scope`` (evaluation)."""
        if not moved:
            batch = to_device(batch, self.device)
        if getattr(type(self.dataset).batch_transform, "draws_no_global_rng", False):
            batch = self.dataset.batch_transform(batch, key)  # the framework's own: no draw
        else:
            where = key if key is not None else (self.augment_seed, *scope)
            seed = stable_hash(*where, "global")  # apart from counter_generator(*key)'s stream
            with scoped_globals(seed, self.device):
                batch = self.dataset.batch_transform(batch, key)
        return channels_last(batch) if self.channels_last else batch


class DevicePipeline(_Base):
    """Whole in-memory dataset resident on the training device; batches are gathers on it."""

    kind = "device"

    def __init__(self, splits: Splits, dataset: Any, **kw: Any) -> None:
        super().__init__(splits, dataset, **kw)
        self.train = to_device(splits.train.samples, self.device)
        self.resident = {
            name: to_device(s.samples, self.device)
            for name, s in self.eval_splits.items()
            if s is not None
        }

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[int, Batch]]:
        epoch, steps = self.data_epoch(epoch), self.steps_per_epoch
        order = epoch_order(self.n, self.data_seed, epoch).to(self.device)
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
    """One collate call's keys ``[(epoch, index), ...]`` and where the batch sits: ``step``
    (the epoch's step; evaluation: the batch's index in its split) and ``microbatch`` (its
    global index in the step when it is one micro-batch collated alone, else None). The
    sampler yields these; they reach ``keyed_items`` in whichever worker runs them."""

    step: int | None = None
    microbatch: int | None = None


def key_batch(keys: list, step: int | None, microbatch: int | None = None) -> KeyBatch:
    batch = KeyBatch(keys)
    batch.step, batch.microbatch = step, microbatch
    return batch


class KeyedSamples(list):
    """One batch's samples, with the key of its first sample and the batch's place
    (``KeyBatch``): what seeds its collate."""

    key: tuple[int | None, int] = (None, 0)
    step: int | None = None
    microbatch: int | None = None


def keyed_items(dataset: Dataset, keys: list[tuple[int | None, int]]) -> KeyedSamples:
    """``dataset.__getitems__``: the samples of ``keys``, remembering the first key and,
    from a ``KeyBatch``, the step and micro-batch."""
    samples = KeyedSamples(dataset[k] for k in keys)
    samples.key = keys[0] if keys else (None, 0)
    samples.step = getattr(keys, "step", None)
    samples.microbatch = getattr(keys, "microbatch", None)
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

    Every global generator (torch CPU, python ``random``, numpy's ``np.random``) is seeded
    from ``(augment seed, epoch, i)`` for the call (``__getitem__`` of the base dataset and
    the transform) and restored afterwards, so a stock torchvision transform, an
    albumentations-style ``np.random`` draw or a user's ``torch.rand`` in ``__getitem__``
    draws the same value for sample ``i`` of epoch ``e`` in any worker, in any order, after
    any resume. A transform with an ``rng`` parameter is also handed
    ``numpy.random.default_rng(seed)`` for the sample. ``epoch=None`` (evaluation) seeds
    from ``(augment seed, "eval", i)``.
    """

    def __init__(self, base: Dataset, transform: Any, augment_seed: int, train: bool) -> None:
        self.base, self.transform, self.augment_seed = base, transform, augment_seed
        self.train = train
        self.takes_rng = takes_rng(transform)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key: tuple[int | None, int]):
        epoch, i = key
        seed = stable_hash(self.augment_seed, "eval" if epoch is None else epoch, i)
        with scoped_globals(seed):
            if self.takes_rng:
                rng = np.random.default_rng(seed)
                return self.transform(self.base[i], self.train, rng=rng)
            return self.transform(self.base[i], self.train)

    __getitems__ = keyed_items


class CollateContext:
    """What a collate with a ``ctx`` parameter is handed: which batch it builds, and
    counter-based randomness for it (``def __call__(self, samples, ctx)``).

    - ``training``: True for a training batch, False in evaluation.
    - ``epoch``: the data epoch (None in evaluation); ``step``: the epoch's step
      (evaluation: the batch's index in its split).
    - ``microbatch``: in a world-size invariant run, the global index of the micro-batch
      being collated (each is collated alone, the same samples on any world size); None
      when the collate builds a rank's share of a step, or an evaluation batch.
    - ``seed``, ``generator`` (a CPU ``torch.Generator``), ``numpy_generator``: seeded from
      the batch's key, made on first use; draw random padding, cropping or token dropout
      from these and the collate gives the same batch in any worker, after any resume and,
      in an invariant run, on any world size.
    """

    __slots__ = ("_generator", "_numpy_generator", "epoch", "microbatch", "seed", "step")
    __slots__ += ("training",)

    def __init__(
        self, seed: int, *, epoch: int | None, step: int | None, microbatch: int | None
    ) -> None:
        self.seed, self.epoch, self.step, self.microbatch = seed, epoch, step, microbatch
        self.training = epoch is not None
        self._generator: torch.Generator | None = None
        self._numpy_generator: np.random.Generator | None = None

    @property
    def generator(self) -> torch.Generator:
        """A fresh CPU ``torch.Generator`` seeded with ``seed``."""
        if self._generator is None:
            self._generator = torch.Generator(device="cpu").manual_seed(self.seed)
        return self._generator

    @property
    def numpy_generator(self) -> np.random.Generator:
        """A fresh ``numpy.random.Generator`` seeded with ``seed``."""
        if self._numpy_generator is None:
            self._numpy_generator = np.random.default_rng(self.seed)
        return self._numpy_generator


class SeededCollate:
    """The dataset's collate with every global RNG seeded from its batch's key and restored
    afterwards: a collate that draws (random padding, cropping a sequence) gives the same
    batch in any worker, after any resume. A collate with a ``ctx`` parameter is also handed
    a ``CollateContext`` whose generators derive from the same key.

    The key: ``(augment seed, "collate", epoch, first sample index)`` for a rank's share of
    a step (``"eval"`` for the epoch in evaluation); ``(augment seed, "collate", epoch, step,
    "microbatch", j)`` for micro-batch ``j`` collated alone (a world-size invariant run):
    the same on any world size."""

    def __init__(self, collate: Any, augment_seed: int) -> None:
        self.collate, self.augment_seed = collate, augment_seed
        self.takes_ctx = takes_keyword(collate, "ctx")

    def __call__(self, samples: list) -> Batch:
        epoch, first = getattr(samples, "key", (None, 0))
        step, micro = getattr(samples, "step", None), getattr(samples, "microbatch", None)
        if micro is None:
            key = (self.augment_seed, "collate", "eval" if epoch is None else epoch, first)
        else:
            key = (self.augment_seed, "collate", epoch, step, "microbatch", micro)
        with scoped_globals(stable_hash(*key)):
            if not self.takes_ctx:
                return self.collate(list(samples))
            ctx = CollateContext(stable_hash(*key, "ctx"), epoch=epoch, step=step,
                                 microbatch=micro)  # fmt: skip
            return self.collate(list(samples), ctx=ctx)


def takes_keyword(fn: Any, name: str) -> bool:
    """Whether ``fn`` has a parameter ``name`` (a transform's ``rng``, a collate's ``ctx``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False
    return name in params


def takes_rng(transform: Any) -> bool:
    """Whether ``transform`` accepts an ``rng`` keyword (then it is handed a seeded
    ``numpy.random.Generator`` per sample)."""
    return takes_keyword(transform, "rng")


class EpochBatchSampler(Sampler[list[tuple[int, int]]]):
    """Key batches ``[(epoch, index), ...]`` of one epoch, from step ``start_step`` on.

    ``shard=(rank, world_size)`` yields that rank's share of each global batch.
    ``microbatch`` (a world-size invariant run's micro-batch size) yields instead, per step,
    this rank's micro-batches one by one (``per_step`` of them): micro-batch ``j`` is
    samples ``j*m .. (j+1)*m - 1`` of the global batch, and the rank's are its share of the
    step's micro-batch indices (``shard_global_batch``), so none depends on the world size."""

    def __init__(
        self,
        n: int,
        batch_size: int,
        data_seed: int,
        epoch: int,
        start_step: int = 0,
        steps: int | None = None,
        shard: tuple[int, int] = (0, 1),
        microbatch: int = 0,
    ):
        self.n, self.batch_size, self.shard = n, batch_size, shard
        self.data_seed, self.epoch, self.start_step = data_seed, epoch, start_step
        self.steps = n // batch_size if steps is None else steps
        self.microbatch = microbatch
        self.per_step = batch_size // microbatch // shard[1] if microbatch else 1

    def __len__(self) -> int:
        return (self.steps - self.start_step) * self.per_step

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        order = epoch_order(self.n, self.data_seed, self.epoch).tolist()
        m = self.microbatch
        for step in range(self.start_step, self.steps):
            batch = order[step * self.batch_size : (step + 1) * self.batch_size]
            if not m:
                keys = [(self.epoch, i) for i in shard_global_batch(batch, *self.shard)]
                yield key_batch(keys, step)
                continue
            for j in shard_global_batch(range(self.batch_size // m), *self.shard):
                yield key_batch([(self.epoch, i) for i in batch[j * m : (j + 1) * m]], step, j)


def seed_worker(worker_id: int) -> None:
    """Seed python and numpy in a worker from torch's per-worker seed; ignore stop signals.

    torch seeds each worker with ``base_seed + worker_id``, where ``base_seed`` comes from
    the loader's explicit generator; python and numpy would otherwise inherit the parent's
    state (the classic duplicated-augmentation bug with forked workers).

    Ctrl-C and schedulers signal the whole process group. A worker that died of SIGINT or
    SIGTERM would crash the main process's next fetch before it could finish the step and
    checkpoint, so workers ignore both and leave stopping to the main process (which shuts
    them down; if it is killed outright, torch's watchdog ends them).
    """
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
    """The default collate (torch's: stack each tensor, numbers become tensors); samples it
    cannot stack (variable lengths) are one line that says to bring a collate."""
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

    kind = "loader"

    def __init__(self, splits: Splits, dataset: Any, num_workers: int = 0, **kw: Any) -> None:
        super().__init__(splits, dataset, **kw)
        self.num_workers = num_workers
        self.per_sample = not isinstance(splits.train, TensorSplit)
        self.collate = getattr(dataset, "collate", None) or stack_samples
        if self.per_sample:
            self.train_set = SeededSamples(
                splits.train, dataset.transform, self.augment_seed, train=True
            )
            self.eval_sets = {
                k: SeededSamples(s, dataset.transform, self.augment_seed, train=False)
                for k, s in self.eval_splits.items()
                if s is not None
            }
        else:
            self.train_set = TensorItems(splits.train)
            self.eval_sets = {
                k: TensorItems(s) for k, s in self.eval_splits.items() if s is not None
            }

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
        sampler = EpochBatchSampler(
            self.n, self.batch_size, self.data_seed, epoch, start_step, self.steps_per_epoch,
            shard, micro,
        )  # fmt: skip
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


def build_pipeline(kind: str, splits: Splits, dataset: Any, num_workers: int, **kw: Any):
    """``auto``: the device path for in-memory tensors, the DataLoader path otherwise.
    Loader workers are checked here, the one place at run time that knows both the
    configured path and whether the data is in memory (preflight checks the same rule
    earlier, from the dataset's class)."""
    configured = kind
    if kind == "auto":
        kind = "device" if dataset.in_memory else "loader"
    if kind == "device":
        if not dataset.in_memory:
            raise ReprotrainError(
                "trainer.pipeline=device needs an in-memory dataset; use trainer.pipeline=auto"
            )
        check_workers(configured, num_workers, in_memory=True, target=type(dataset).__name__)
        return DevicePipeline(splits, dataset, **kw)
    return LoaderPipeline(splits, dataset, num_workers=num_workers, **kw)
