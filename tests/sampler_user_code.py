"""A user's samplers and datasets, as tests/test_sampler.py gives them by ``_target_`` (with
tests/ on PYTHONPATH): the ways a sampler keeps the framework's guarantees, and the ways
given elsewhere that are refused."""

from __future__ import annotations

import torch
from torch.utils.data import Sampler, WeightedRandomSampler

from reprotrain.api import InMemoryTensors, SampleData, Splits
from reprotrain.selfcheck.images import SyntheticImages

MINORITY = 0.117  # the share of class 1 in Skewed's training split


class Skewed(InMemoryTensors):
    """1000 feature vectors, 117 of class 1 and 883 of class 0, each with its index."""

    num_classes = 2

    def load_samples(self):
        g = torch.Generator().manual_seed(5)
        y = (torch.arange(1000) < round(1000 * MINORITY)).long()[torch.randperm(1000, generator=g)]
        x = torch.randn(1000, 4, generator=g) + y[:, None]
        return (x, y, torch.arange(1000)), (x[:100], y[:100], torch.arange(100))

    def fingerprint(self) -> dict:
        return {"kind": "test", "sha256": "0" * 64}


class Noisy(SampleData):
    """Map-style: sample ``i`` is ``(i, class, noise drawn from the global RNG)``, so a repeat
    shows whether it was transformed under its own key."""

    def splits(self) -> Splits:
        items = [(torch.tensor(i), torch.tensor(int(i % 8 == 0))) for i in range(96)]
        return Splits(items, None, items[:16], num_classes=2)

    def transform(self, sample, train: bool):
        i, label = sample
        return i, label, torch.rand(())

    def fingerprint(self) -> dict:
        return {"kind": "test", "sha256": "0" * 64}


def class_balanced(data_source) -> WeightedRandomSampler:
    """Each class equally often: weight 1 / (its class's count); labels of an in-memory split
    (``samples[1]``) or of map-style items (``item[1]``)."""
    samples = getattr(data_source, "samples", None)
    labels = samples[1] if samples is not None else torch.stack([s[1] for s in data_source])
    weights = (1.0 / torch.bincount(labels).double())[labels]
    return WeightedRandomSampler(weights, len(labels), replacement=True)


class Repeat(Sampler[int]):
    """Every sample ``times`` times per epoch, shuffled with ``generator``."""

    generator: torch.Generator | None = None

    def __init__(self, data_source, times: int = 2) -> None:
        self.n, self.times = len(data_source), times

    def __len__(self) -> int:
        return self.n * self.times

    def __iter__(self):
        order = torch.randperm(self.n * self.times, generator=self.generator) % self.n
        return iter(order.tolist())


class Counting(Repeat):
    """Draws from its generator and from a count of its own: each draw differs."""

    def __iter__(self):
        self.times_drawn = getattr(self, "times_drawn", 0) + 1
        return iter(((torch.arange(len(self)) + self.times_drawn) % self.n).tolist())


class Pairs(Repeat):
    """Yields lists of indices, as a batch sampler does."""

    def __iter__(self):
        return iter([[i, i] for i in range(self.n)])


def unannotated(data_source):
    return Repeat(data_source)


class ImagesWithSamplerAttribute(SyntheticImages):
    """The framework's images with a ``sampler`` class attribute, as a DataLoader user writes."""

    sampler = WeightedRandomSampler([1.0, 2.0], 2)


class ImagesWithSamplerInInit(SyntheticImages):
    """A sampler set on the instance when the dataset is built."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.sampler = WeightedRandomSampler([1.0] * 10, 10)


class ImagesWithSamplerFromLabels(SyntheticImages):
    """A sampler set on the instance from the labels, once the data is loaded."""

    def load_tensors(self):
        train_x, train_y, test_x, test_y = super().load_tensors()
        self.sampler = WeightedRandomSampler((1.0 + train_y).double(), len(train_y))
        return train_x, train_y, test_x, test_y
