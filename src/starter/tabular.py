"""Tabular regression data, generated: float features, a float target, no images.

Closes: data drift in tests. Generated from ``data_seed`` alone (never from the run seed).
The target is a fixed random nonlinear function of the features plus Gaussian noise:
``y = x @ w + sin(x @ v) + noise * eps``. Samples are ``(features [D], target [1])``,
served as they are (an ``InMemoryTensors``: no scaling, no augmentation).
"""

from __future__ import annotations

import torch

from reprotrain.api import Batch, InMemoryTensors, ReprotrainError
from starter.params_hash import params_fingerprint


class SyntheticTabular(InMemoryTensors):
    """Config ``_target_`` for conf/dataset/tabular.yaml."""

    def __init__(
        self,
        num_train: int = 2048,
        num_test: int = 512,
        num_features: int = 8,
        noise: float = 0.1,
        data_seed: int = 1234,
        val_fraction: float = 0.1,
    ) -> None:
        super().__init__(val_fraction)
        if min(num_train, num_test, num_features) <= 0 or noise < 0:
            raise ReprotrainError(
                "dataset.num_train, num_test and num_features must be > 0, dataset.noise >= 0"
            )
        self.params = dict(
            num_train=num_train, num_test=num_test, num_features=num_features,
            noise=noise, data_seed=data_seed,
        )  # fmt: skip

    def load_samples(self) -> tuple[Batch, Batch]:
        p = self.params
        g = torch.Generator().manual_seed(p["data_seed"])
        w, v = torch.randn(2, p["num_features"], 1, generator=g)
        x = torch.randn(p["num_train"] + p["num_test"], p["num_features"], generator=g)
        y = x @ w + torch.sin(x @ v) + p["noise"] * torch.randn(len(x), 1, generator=g)
        cut = p["num_train"]
        return (x[:cut], y[:cut]), (x[cut:], y[cut:])

    def fingerprint(self) -> dict:
        return params_fingerprint("tabular", 1, **self.params)
