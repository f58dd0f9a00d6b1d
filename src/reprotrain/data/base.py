"""What a dataset ``_target_`` returns, and the validation split every dataset shares.

A sample, and so a batch, is a pytree of tensors. Two kinds of dataset, by where the data
lives: ``InMemoryTensors`` (each split one pytree, samples first; ``InMemoryImages`` for
uint8 images) and ``SampleData`` (map-style, one sample per index; ``SampleImages`` for
torchvision transforms). Subclass one and point a YAML at it (docs/bring-your-own.md).

Closes: validation-split drift: ``val_indices`` depends on the sample count and fraction
alone, never on ``seed.base``, so a seed sweep validates every run on the same samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from reprotrain.batches import Batch, batch_size, take
from reprotrain.config import check_std
from reprotrain.data.augment import augment_batch, normalize
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
    """One in-memory split: a pytree of tensors whose first dimension is the sample."""

    samples: Batch

    def __len__(self) -> int:
        return batch_size(self.samples)


@dataclass
class Splits:
    train: Any  # TensorSplit for in-memory data, a map-style Dataset otherwise
    val: Any | None
    test: Any
    num_classes: int | None = None  # None: the data has no classes (regression, ...)


def draws_no_global_rng(batch_transform: Any) -> Any:
    """Marks a framework batch transform that draws from no global RNG: the pipeline runs it
    without the per-batch RNG guard (a subclass's own ``batch_transform`` runs guarded)."""
    batch_transform.draws_no_global_rng = True
    return batch_transform


class InMemoryTensors:
    """Base for datasets held as tensors; subclasses implement ``load_samples``. Served as
    loaded; ``batch_transform`` (on the device, on a step's whole global batch) may change it."""

    in_memory = True
    augment = False
    num_classes: int | None = None
    collate: Callable | None = None  # only the loader pipeline uses it; default: stack

    def __init__(self, val_fraction: float = 0.0) -> None:
        self.val_fraction = val_fraction

    def load_samples(self) -> tuple[Batch, Batch]:
        """(train samples, test samples): pytrees of tensors, samples first."""
        raise NotImplementedError

    def fingerprint(self) -> dict:
        """What run.json records as the data's identity (sha256 of files or of parameters)."""
        raise NotImplementedError

    @draws_no_global_rng
    def batch_transform(self, batch: Batch, key: tuple[int, int, int] | None) -> Batch:
        """A batch on the device -> what the task sees; ``key`` is (augment seed, epoch, step)
        when training (draw any randomness from ``counter_generator(*key)``), None in eval."""
        return batch

    def splits(self) -> Splits:
        train, test = self.load_samples()
        n = _check_samples(train, "train")
        _check_samples(test, "test")
        tr, va = val_indices(n, self.val_fraction)
        val = TensorSplit(take(train, va)) if len(va) else None
        return Splits(TensorSplit(take(train, tr)), val, TensorSplit(test), self.num_classes)


def _check_samples(samples: Batch, split: str) -> int:
    try:
        return batch_size(samples)
    except ReprotrainError as e:
        raise ReprotrainError(f"the dataset's {split} split: {e}") from None


class InMemoryImages(InMemoryTensors):
    """uint8 images ``[N, C, H, W]`` and int labels; subclasses implement ``load_tensors``.
    ``mean``/``std`` (per channel, 0..1 scale) normalise on the device; ``augment``: the
    counter-based crop + flip."""

    # A per-device copy of mean/std made on first use: not state (the resume audit skips it).
    cache_attributes: tuple[str, ...] = ("_stats",)

    def __init__(
        self,
        val_fraction: float = 0.0,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        augment: bool = True,
    ) -> None:
        super().__init__(val_fraction)
        self.mean, self.std, self.augment = mean, std, augment
        self._stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def load_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(train_x, train_y, test_x, test_y)."""
        raise NotImplementedError

    def load_samples(self) -> tuple[Batch, Batch]:
        train_x, train_y, test_x, test_y = self.load_tensors()
        for name, x in (("train", train_x), ("test", test_x)):
            if x.dtype != torch.uint8 or x.dim() != 4:
                raise ReprotrainError(
                    f"{type(self).__name__} gave {name} images of {x.dtype} {list(x.shape)}; "
                    "InMemoryImages takes uint8 [N, C, H, W] (subclass InMemoryTensors for "
                    "other tensors: they are served as they are)"
                )
        channels = train_x.shape[1]
        for name, stats in (("mean", self.mean), ("std", self.std)):
            if stats is None or len(stats) != channels:
                raise ReprotrainError(
                    f"dataset.{name} has {len(stats or [])} values for {channels}-channel "
                    f"images; give one per channel"
                )
        check_std(self.std)
        if self.num_classes is None:
            self.num_classes = int(max(train_y.max(), test_y.max())) + 1
        return (train_x, train_y), (test_x, test_y)

    @draws_no_global_rng
    def batch_transform(self, batch: Batch, key: tuple[int, int, int] | None) -> Batch:
        """uint8 batch -> augmented (train only), normalised float batch."""
        x, y = batch
        if self.augment and key is not None:
            x = augment_batch(x, *key)
        return normalize(x, *self._device_stats(x.device)), y

    def _device_stats(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._stats:
            self._stats[device] = tuple(
                torch.tensor(v, device=device).view(1, -1, 1, 1) for v in (self.mean, self.std)
            )
        return self._stats[device]


class SampleData:
    """Base for map-style data: ``splits`` returns datasets whose item ``i`` is one sample.

    ``transform(sample, train[, rng])`` runs with the global generators seeded per (augment
    seed, epoch, index); ``collate`` (from the YAML; default: stack) runs under a per-batch
    seed, handed ``ctx`` when it takes one (docs/randomness.md, docs/bring-your-own.md).
    """

    in_memory = False
    augment = True
    collate: Callable | None = None

    def transform(self, sample: Any, train: bool) -> Any:
        return sample

    def splits(self) -> Splits:
        raise NotImplementedError

    def fingerprint(self) -> dict:
        raise NotImplementedError


class SampleImages(SampleData):
    """(image, label) samples through torchvision transforms (``eval_transform``: deterministic)."""

    train_transform: Any = None
    eval_transform: Any = None

    def transform(self, sample: Any, train: bool) -> Any:
        image, label = sample
        return (self.train_transform if train else self.eval_transform)(image), label


class Subset(Dataset):
    """Items ``indices`` of ``base`` (the validation carve-out of a map-style dataset)."""

    def __init__(self, base: Dataset, indices: torch.Tensor) -> None:
        self.base, self.indices = base, indices.tolist()

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.base[self.indices[i]]
