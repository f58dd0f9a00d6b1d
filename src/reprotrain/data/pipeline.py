"""Batches for training and evaluation: the device-resident and the DataLoader paths.

Closes: sample order. The order of epoch ``e`` is ``randperm`` from a generator seeded with
``(data seed, e)``; step ``s`` takes slice ``s`` of it, so either path can start at step ``s``
of an epoch (exact mid-epoch resume needs only ``(e, s)``).

Closes: augmentation randomness, two ways.
- In-memory uint8 tensors get the batched crop+flip of ``augment.py``, keyed by
  ``(augment seed, e, s)``, on the training device.
- File datasets get their own per-sample torchvision transforms, each run under torch and
  python generators seeded from ``(augment seed, e, sample index)`` (``SeededSamples``), so
  the result never depends on which worker ran it, how many there are, or what ran before.

- ``DevicePipeline`` keeps a whole in-memory dataset on the training device (CIFAR-10 is
  150 MB): indexing, augmentation and normalisation run there, with no worker processes.
- ``LoaderPipeline`` is a ``DataLoader`` over keys ``(epoch, index)`` with an explicit
  generator and a ``worker_init_fn``, so ``num_workers=0`` and ``2`` give the same batches.
"""

from __future__ import annotations

import random
import re
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from reprotrain.data.augment import augment_batch, normalize
from reprotrain.data.base import Splits, TensorSplit
from reprotrain.errors import ReprotrainError
from reprotrain.repro.seeding import Seeds, counter_generator, stable_hash


def epoch_order(n: int, data_seed: int, epoch: int) -> torch.Tensor:
    """Sample order of one epoch: a pure function of (data seed, epoch)."""
    return torch.randperm(n, generator=counter_generator(data_seed, epoch))


class _Base:
    def __init__(
        self,
        splits: Splits,
        *,
        batch_size: int,
        eval_batch_size: int,
        device: torch.device,
        seeds: Seeds,
        augment: bool,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        channels_last: bool = False,
        limit_train_steps: int = 0,
        limit_eval_batches: int = 0,
        overfit_batches: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.n = len(splits.train)
        if batch_size % world_size:
            raise ReprotrainError(
                f"trainer.batch_size={batch_size} (the global batch) is not divisible by the "
                f"world size {world_size}; pick a multiple of {world_size}"
            )
        self.rank, self.world_size = rank, world_size
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
        self.augment = augment
        self.eval_splits = {"val": splits.val, "test": splits.test}
        if mean is not None:
            self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
            self.std = torch.tensor(std, device=device).view(1, -1, 1, 1)

    @property
    def steps_per_epoch(self) -> int:
        steps = self.n // self.batch_size  # drop_last: every step sees a full batch
        for limit in (self.limit_train_steps, self.overfit_batches):
            steps = min(steps, limit) if limit else steps
        return steps

    def data_epoch(self, epoch: int) -> int:
        """The epoch whose order and augmentation a step uses: always 1 when overfitting."""
        return 1 if self.overfit_batches else epoch

    def _eval_limit(self, batches: Iterator) -> Iterator:
        for i, batch in enumerate(batches):
            if self.limit_eval_batches and i >= self.limit_eval_batches:
                return
            yield batch

    def has_split(self, split: str) -> bool:
        return self.eval_splits.get(split) is not None

    def _shard(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank r's contiguous part of a global batch (the whole batch on one process).

        The global batch is drawn and augmented first, keyed by (epoch, step) and sample
        position, so what a global step sees does not depend on the world size."""
        if self.world_size == 1:
            return x, y
        part = len(y) // self.world_size
        rows = slice(self.rank * part, (self.rank + 1) * part)
        return x[rows], y[rows]

    def _layout(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def _finish_tensors(self, xb, yb, epoch: int | None, step: int):
        """uint8 batch -> augmented (train only), normalised float batch on the device."""
        xb, yb = xb.to(self.device, non_blocking=True), yb.to(self.device, non_blocking=True)
        if self.augment and epoch is not None:
            xb = augment_batch(xb, self.augment_seed, epoch, step)
        return self._layout(normalize(xb, self.mean, self.std)), yb


class DevicePipeline(_Base):
    """Whole in-memory dataset resident on the training device; batches are gathers on it."""

    kind = "device"

    def __init__(self, splits: Splits, **kw: Any) -> None:
        super().__init__(splits, **kw)
        self.x, self.y = splits.train.x.to(self.device), splits.train.y.to(self.device)
        self.resident = {
            name: (s.x.to(self.device), s.y.to(self.device))
            for name, s in self.eval_splits.items()
            if s is not None
        }

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[int, Any]]:
        epoch = self.data_epoch(epoch)
        order = epoch_order(self.n, self.data_seed, epoch).to(self.device)
        for step in range(start_step, self.steps_per_epoch):
            idx = order[step * self.batch_size : (step + 1) * self.batch_size]
            yield step, self._shard(*self._finish_tensors(self.x[idx], self.y[idx], epoch, step))

    def eval_batches(self, split: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y = self.resident[split]
        starts = self._eval_limit(iter(range(0, len(y), self.eval_batch_size)))
        for i in starts:
            yield self._finish_tensors(
                x[i : i + self.eval_batch_size], y[i : i + self.eval_batch_size], None, 0
            )


class TensorItems(Dataset):
    """Item ``(epoch, i)`` of an in-memory split: (uint8 image, label); augmented per batch."""

    def __init__(self, split: TensorSplit) -> None:
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, key: tuple[int, int]):
        _, i = key
        return self.split.x[i], self.split.y[i]


class SeededSamples(Dataset):
    """Item ``(epoch, i)``: sample ``i`` through ``transform`` under a counter-based seed.

    torch's and python's global generators are seeded from ``(augment seed, epoch, i)`` for
    the call and restored afterwards, so a stock torchvision transform draws the same crop
    for sample ``i`` of epoch ``e`` in any worker, in any order, after any resume.
    ``epoch=None`` (evaluation) seeds nothing: eval transforms must be deterministic.
    """

    def __init__(self, base: Dataset, transform: Any, augment_seed: int) -> None:
        self.base, self.transform, self.augment_seed = base, transform, augment_seed

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key: tuple[int | None, int]):
        epoch, i = key
        image, label = self.base[i]
        if epoch is None:
            return self.transform(image), label
        seed = stable_hash(self.augment_seed, epoch, i)
        py_state = random.getstate()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random.seed(seed)
            try:
                return self.transform(image), label
            finally:
                random.setstate(py_state)


class EpochBatchSampler(Sampler[list[tuple[int, int]]]):
    """Key batches ``[(epoch, index), ...]`` of one epoch, from step ``start_step`` on."""

    def __init__(
        self,
        n: int,
        batch_size: int,
        data_seed: int,
        epoch: int,
        start_step: int = 0,
        steps: int | None = None,
        shard: tuple[int, int] = (0, 1),
    ):
        self.n, self.batch_size, self.shard = n, batch_size, shard
        self.data_seed, self.epoch, self.start_step = data_seed, epoch, start_step
        self.steps = n // batch_size if steps is None else steps

    def __len__(self) -> int:
        return self.steps - self.start_step

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        order = epoch_order(self.n, self.data_seed, self.epoch).tolist()
        for step in range(self.start_step, self.steps):
            batch = order[step * self.batch_size : (step + 1) * self.batch_size]
            rank, world = self.shard
            part = len(batch) // world
            yield [(self.epoch, i) for i in batch[rank * part : (rank + 1) * part]]


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


class LoaderPipeline(_Base):
    """DataLoader path: file datasets (per-sample transforms) or in-memory tensors."""

    kind = "loader"

    def __init__(self, splits: Splits, num_workers: int = 0, dataset: Any = None, **kw: Any):
        super().__init__(splits, **kw)
        self.num_workers = num_workers
        self.per_sample = not isinstance(splits.train, TensorSplit)
        if self.per_sample:
            self.train_set = SeededSamples(splits.train, dataset.train_transform, self.augment_seed)
            self.eval_sets = {
                k: SeededSamples(s, dataset.eval_transform, self.augment_seed)
                for k, s in self.eval_splits.items()
                if s is not None
            }
        else:
            self.train_set = TensorItems(splits.train)
            self.eval_sets = {
                k: TensorItems(s) for k, s in self.eval_splits.items() if s is not None
            }

    def _batches(self, dataset, batch_sampler, epoch: int) -> Iterator:
        g = torch.Generator().manual_seed(stable_hash(self.data_seed, "workers", epoch))
        loader = DataLoader(
            dataset,
            batch_sampler=batch_sampler,
            num_workers=self.num_workers,
            generator=g,
            worker_init_fn=seed_worker,
            pin_memory=self.device.type == "cuda",
        )
        try:
            yield from loader
        except ReprotrainError:
            raise
        except Exception as e:
            raise _one_line_from_worker(e) from None

    def _finish(self, xb, yb, epoch: int | None, step: int):
        if self.per_sample:  # already this rank's samples, transformed per sample
            xb = xb.to(self.device, non_blocking=True)
            return self._layout(xb), yb.to(self.device, non_blocking=True)
        if epoch is None:
            return self._finish_tensors(xb, yb, epoch, step)
        return self._shard(*self._finish_tensors(xb, yb, epoch, step))

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[int, Any]]:
        epoch = self.data_epoch(epoch)
        shard = (self.rank, self.world_size) if self.per_sample else (0, 1)
        sampler = EpochBatchSampler(
            self.n, self.batch_size, self.data_seed, epoch, start_step, self.steps_per_epoch, shard
        )
        batches = self._batches(self.train_set, sampler, epoch)
        for step, (xb, yb) in enumerate(batches, start_step):
            yield step, self._finish(xb, yb, epoch, step)

    def eval_batches(self, split: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        dataset = self.eval_sets[split]
        keys = [(None, i) for i in range(len(dataset))]
        size = self.eval_batch_size
        batches = [keys[i : i + size] for i in range(0, len(keys), size)]
        if self.limit_eval_batches:
            batches = batches[: self.limit_eval_batches]
        for xb, yb in self._batches(dataset, batches, epoch=0):
            yield self._finish(xb, yb, None, 0)


def build_pipeline(kind: str, splits: Splits, dataset: Any, num_workers: int, **kw: Any):
    """``auto``: the device path for in-memory tensors, the DataLoader path for files."""
    if kind == "auto":
        kind = "device" if dataset.in_memory else "loader"
    if kind == "device":
        if not dataset.in_memory:
            raise ReprotrainError(
                "trainer.pipeline=device needs an in-memory dataset; use trainer.pipeline=auto"
            )
        if num_workers:
            raise ReprotrainError("trainer.num_workers needs trainer.pipeline=loader (or auto)")
        return DevicePipeline(splits, **kw)
    return LoaderPipeline(splits, num_workers=num_workers, dataset=dataset, **kw)
