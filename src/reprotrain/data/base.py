"""What a dataset ``_target_`` returns, and the validation split every dataset shares.

Two kinds, chosen by what the data is, not by a flag:

- ``InMemoryImages``: uint8 ``[N, C, H, W]`` tensors (CIFAR-10, synthetic). They run on the
  device-resident pipeline, with the batched counter-based crop+flip.
- ``SampleImages``: map-style datasets of files (``ImageFolderData``), decoded and
  transformed per sample by any torchvision transform under a counter-based seed; they run
  on the DataLoader pipeline.

Bring your own by subclassing one of them in one module and pointing a YAML at it.

Closes: validation-split drift. ``val_indices`` depends only on the number of training
samples and the fraction, never on ``seed.base``, so every run of a seed sweep validates on
the same images and its val metric measures training variance alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from reprotrain.errors import ReprotrainError
from reprotrain.repro.seeding import stable_hash


def val_indices(n: int, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, val indices) of ``n`` samples: a fixed shuffle of the data alone."""
    if not 0 <= fraction < 1:
        raise ReprotrainError(f"dataset.val_fraction={fraction} must be in [0, 1)")
    n_val = round(n * fraction)
    if fraction and not 0 < n_val < n:
        raise ReprotrainError(
            f"dataset.val_fraction={fraction} leaves no validation or no training sample "
            f"of {n}; change it or use 0 to turn validation off"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(stable_hash("val", n)))
    return order[n_val:].sort().values, order[:n_val].sort().values


@dataclass
class TensorSplit:
    x: torch.Tensor  # uint8 [N, C, H, W]
    y: torch.Tensor  # int64 [N]

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class Splits:
    train: Any  # TensorSplit for in-memory data, a map-style Dataset otherwise
    val: Any | None
    test: Any
    num_classes: int


class InMemoryImages:
    """Base for datasets held as uint8 tensors; subclasses implement ``load_tensors``.

    ``mean``/``std`` (per channel, on the 0..1 scale) normalise batches on the device;
    ``augment`` turns on the counter-based random crop (pad 4) + horizontal flip.
    """

    in_memory = True

    def __init__(
        self,
        val_fraction: float = 0.0,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        augment: bool = True,
    ) -> None:
        self.val_fraction = val_fraction
        self.mean, self.std, self.augment = mean, std, augment

    def load_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(train_x, train_y, test_x, test_y)."""
        raise NotImplementedError

    def fingerprint(self) -> dict:
        """What run.json records as the data's identity (sha256 of files or of parameters)."""
        raise NotImplementedError

    def splits(self) -> Splits:
        train_x, train_y, test_x, test_y = self.load_tensors()
        channels = train_x.shape[1]
        for name, stats in (("mean", self.mean), ("std", self.std)):
            if stats is None or len(stats) != channels:
                raise ReprotrainError(
                    f"dataset.{name} has {len(stats or [])} values for {channels}-channel "
                    f"images; give one per channel"
                )
        if min(self.std) <= 0:
            raise ReprotrainError(f"dataset.std={list(self.std)} must be > 0 in every channel")
        num_classes = int(max(train_y.max(), test_y.max())) + 1
        tr, va = val_indices(len(train_y), self.val_fraction)
        val = TensorSplit(train_x[va], train_y[va]) if len(va) else None
        return Splits(
            TensorSplit(train_x[tr], train_y[tr]), val, TensorSplit(test_x, test_y), num_classes
        )


class SampleImages:
    """Base for file datasets: ``splits`` returns map-style datasets of (image, label).

    ``train_transform`` runs under a generator seeded from (augment seed, epoch, index), so
    any stock torchvision transform is independent of workers and resumable; it must end in
    a float tensor. ``eval_transform`` must be deterministic.
    """

    in_memory = False
    augment = True
    train_transform: Any = None
    eval_transform: Any = None

    def splits(self) -> Splits:
        raise NotImplementedError

    def fingerprint(self) -> dict:
        raise NotImplementedError


class Subset(Dataset):
    """Items ``indices`` of ``base`` (the validation carve-out of a file dataset)."""

    def __init__(self, base: Dataset, indices: torch.Tensor) -> None:
        self.base, self.indices = base, indices.tolist()

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.base[self.indices[i]]
