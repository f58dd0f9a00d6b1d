"""An imbalanced binary task's data, generated: few positives, each sample with its index.

Closes: data drift in tests. Generated from ``data_seed`` alone (never from the run seed).
Features ``x ~ N(0, I)``; a sample is positive with probability ``sigmoid(x @ w + b)``, ``b``
set so that about ``positive_fraction`` of the samples are. Samples are
``(features [D], label, index)``: the index (the sample's position in its split's source)
is what ``reprotrain.tasks.BinaryClassification`` files each score under, so AUROC and
average precision are exact over the split, on any number of processes and across a resume.
"""

from __future__ import annotations

import math

import torch

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
