"""An imbalanced binary task's data, generated: few positives, each sample with its index.

Closes: data drift in tests. Generated from ``data_seed`` alone (never from the run seed).
Features ``x ~ N(0, I)``; a sample is positive with probability ``sigmoid(x @ w + b)``, ``b``
set so that about ``positive_fraction`` of the samples are. Samples are
``(features [D], label, index)``: the index (the sample's position in its split's source)
is what ``reprotrain.tasks.BinaryClassification`` files each score under, so AUROC and
average precision are exact over the split, on any number of processes and across a resume.

Two samplers for it (conf/sampler/, docs/bring-your-own.md "A sampler"): ``class_balanced``
(torch's ``WeightedRandomSampler``, each class equally often) and ``Oversample`` (a sampler of
your own: the positives repeated). Each draws only from its ``generator``, which the framework
sets every epoch from ``(seed.data, epoch)``: the guarantees stay the framework's.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import Sampler, WeightedRandomSampler

from reprotrain.api import Batch, InMemoryTensors, ReprotrainError
from starter.params_hash import params_fingerprint


class SyntheticImbalanced(InMemoryTensors):
    """Config ``_target_`` for conf/dataset/imbalanced.yaml."""

    num_classes = 2

    def __init__(
        self,
        num_train: int = 2048,
        num_test: int = 512,
        num_features: int = 8,
        positive_fraction: float = 0.1,
        data_seed: int = 1234,
        val_fraction: float = 0.1,
    ) -> None:
        super().__init__(val_fraction)
        if min(num_train, num_test, num_features) <= 0 or not 0 < positive_fraction < 1:
            raise ReprotrainError(
                "dataset.num_train, num_test, num_features must be > 0 and "
                "dataset.positive_fraction between 0 and 1"
            )
        self.params = dict(
            num_train=num_train, num_test=num_test, num_features=num_features,
            positive_fraction=positive_fraction, data_seed=data_seed,
        )  # fmt: skip

    def load_samples(self) -> tuple[Batch, Batch]:
        p = self.params
        g = torch.Generator().manual_seed(p["data_seed"])
        w = torch.randn(p["num_features"], generator=g)
        x = torch.randn(p["num_train"] + p["num_test"], p["num_features"], generator=g)
        bias = math.log(p["positive_fraction"] / (1 - p["positive_fraction"]))
        prob = torch.sigmoid(2 * x @ w / w.norm() + bias)
        y = (torch.rand(len(x), generator=g) < prob).long()
        cut = p["num_train"]
        train_index, test_index = torch.arange(cut), torch.arange(len(x) - cut)
        return (x[:cut], y[:cut], train_index), (x[cut:], y[cut:], test_index)

    def fingerprint(self) -> dict:
        return params_fingerprint("imbalanced", 1, **self.params)


def labels_of(data_source) -> torch.Tensor:
    """The training split's labels: an in-memory split's ``samples`` are ``(x, y, index)``."""
    return data_source.samples[1]


def class_balanced(data_source, num_samples: int | None = None) -> WeightedRandomSampler:
    """Config ``_target_`` for conf/sampler/class_balanced.yaml: each sample weighted by
    1 / (its class's count), drawn with replacement, so every class is drawn equally often."""
    labels = labels_of(data_source)
    weights = (1.0 / torch.bincount(labels).double())[labels]
    return WeightedRandomSampler(weights, num_samples or len(labels), replacement=True)


class Oversample(Sampler[int]):
    """Config ``_target_`` for conf/sampler/oversample.yaml: each positive ``factor`` times
    per epoch, every other sample once, in an order drawn from ``generator``."""

    generator: torch.Generator | None = None  # set by the framework each epoch

    def __init__(self, data_source, factor: int = 4) -> None:
        if factor < 1:
            raise ReprotrainError(f"sampler.factor={factor} must be an integer >= 1")
        labels = labels_of(data_source)
        self.indices = torch.arange(len(labels)).repeat_interleave(1 + (factor - 1) * labels)

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self):
        order = torch.randperm(len(self.indices), generator=self.generator)
        return iter(self.indices[order].tolist())
