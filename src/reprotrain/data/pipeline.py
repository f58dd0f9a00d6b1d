"""Batches for training and evaluation: the device-resident and the DataLoader paths.

Closes: sample order. The order of epoch ``e`` is ``randperm`` from a generator seeded with
``(data seed, e)``; step ``s`` takes slice ``s`` of it. Both paths share that order and the
counter-based augmentation, so they yield bitwise-identical batches, and either can start
at step ``s`` of an epoch (exact mid-epoch resume needs only ``(e, s)``).

- ``DevicePipeline`` keeps the whole uint8 dataset on the training device (CIFAR-10 is
  150 MB): indexing, augmentation and normalisation run there, with no worker processes.
- ``LoaderPipeline`` serves datasets that are not held in memory: a ``DataLoader`` with an
  explicit generator, a ``worker_init_fn`` that seeds python/numpy/torch in each worker, and
  ``EpochBatchSampler``, so ``num_workers=0`` and ``2`` give the same batches.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from reprotrain.data.augment import augment_batch, normalize
from reprotrain.repro.seeding import counter_generator, stable_hash


def epoch_order(n: int, data_seed: int, epoch: int) -> torch.Tensor:
    """Sample order of one epoch: a pure function of (data seed, epoch)."""
    return torch.randperm(n, generator=counter_generator(data_seed, epoch))


class _Base:
    def __init__(self, x, y, batch_size, eval_batch_size, mean, std, device, seeds, augment):
        self.n = len(y)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.device = device
        self.data_seed, self.augment_seed = seeds.data, seeds.augment
        self.augment = augment
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, device=device).view(1, -1, 1, 1)

    @property
    def steps_per_epoch(self) -> int:
        return self.n // self.batch_size  # drop_last: every step sees a full batch

    def _finish(self, xb, yb, epoch: int, step: int):
        xb, yb = xb.to(self.device, non_blocking=True), yb.to(self.device, non_blocking=True)
        if self.augment:
            xb = augment_batch(xb, self.augment_seed, epoch, step)
        return normalize(xb, self.mean, self.std), yb


class DevicePipeline(_Base):
    """Whole dataset resident on the training device; batches are gathers on it."""

    kind = "device"

    def __init__(self, x, y, test_x, test_y, **kw):
        super().__init__(x, y, **kw)
        self.x, self.y = x.to(self.device), y.to(self.device)
        self.test_x, self.test_y = test_x.to(self.device), test_y.to(self.device)

    def epoch(
        self, epoch: int, start_step: int = 0
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        order = epoch_order(self.n, self.data_seed, epoch).to(self.device)
        for step in range(start_step, self.steps_per_epoch):
            idx = order[step * self.batch_size : (step + 1) * self.batch_size]
            yield (step, *self._finish(self.x[idx], self.y[idx], epoch, step))

    def eval_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(0, len(self.test_y), self.eval_batch_size):
            xb = self.test_x[i : i + self.eval_batch_size]
            yield normalize(xb, self.mean, self.std), self.test_y[i : i + self.eval_batch_size]


class TensorImages(Dataset):
    """Stand-in for an on-disk dataset: item ``i`` is (uint8 image, label).

    Replace with a dataset that decodes files; keep any randomness out of ``__getitem__``
    (augmentation is applied per batch, counter-based, after loading).
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class EpochBatchSampler(Sampler[list[int]]):
    """Yields the index batches of one epoch, from step ``start_step`` on."""

    def __init__(self, n: int, batch_size: int, data_seed: int, epoch: int, start_step: int = 0):
        self.n, self.batch_size = n, batch_size
        self.data_seed, self.epoch, self.start_step = data_seed, epoch, start_step

    def __len__(self) -> int:
        return self.n // self.batch_size - self.start_step

    def __iter__(self) -> Iterator[list[int]]:
        order = epoch_order(self.n, self.data_seed, self.epoch).tolist()
        for step in range(self.start_step, self.n // self.batch_size):
            yield order[step * self.batch_size : (step + 1) * self.batch_size]


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
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    seed = torch.initial_seed() % (1 << 32)
    random.seed(seed)
    np.random.seed(seed)


class LoaderPipeline(_Base):
    """DataLoader path for datasets that do not fit on the device."""

    kind = "loader"

    def __init__(self, x, y, test_x, test_y, num_workers: int = 0, **kw):
        super().__init__(x, y, **kw)
        self.train_set, self.test_set = TensorImages(x, y), TensorImages(test_x, test_y)
        self.num_workers = num_workers

    def _loader(self, dataset, batch_sampler, epoch: int) -> DataLoader:
        g = torch.Generator().manual_seed(stable_hash(self.data_seed, "workers", epoch))
        return DataLoader(
            dataset,
            batch_sampler=batch_sampler,
            num_workers=self.num_workers,
            generator=g,
            worker_init_fn=seed_worker,
            pin_memory=self.device.type == "cuda",
        )

    def epoch(
        self, epoch: int, start_step: int = 0
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        sampler = EpochBatchSampler(self.n, self.batch_size, self.data_seed, epoch, start_step)
        for step, (xb, yb) in enumerate(self._loader(self.train_set, sampler, epoch), start_step):
            yield (step, *self._finish(xb, yb, epoch, step))

    def eval_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        idx = list(range(len(self.test_set)))
        batches = [
            idx[i : i + self.eval_batch_size] for i in range(0, len(idx), self.eval_batch_size)
        ]
        for xb, yb in self._loader(self.test_set, batches, epoch=0):
            yield normalize(xb.to(self.device), self.mean, self.std), yb.to(self.device)
