"""Synthetic 3x32x32 uint8 images in 10 classes: the framework's own test data (each class a
random 4x4 colour pattern blown up, a sample that pattern at a random brightness, plus noise).

Closes: data drift in the framework's checks: the images are a pure function of ``data_seed``
and the sizes (never of the run seed); the fingerprint is the hash of those parameters."""

from __future__ import annotations

import hashlib
import json

import torch
import torch.nn.functional as F

from reprotrain.data.base import InMemoryImages
from reprotrain.errors import ReprotrainError
from reprotrain.repro.seeding import stable_hash

GENERATOR_VERSION = 1  # bump when the generation changes: it is part of the fingerprint
SHAPE = (3, 32, 32)


def _split(protos: torch.Tensor, n: int, noise: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, protos.shape[0], (n,), generator=g)
    brightness = 0.7 + 0.3 * torch.rand(n, 1, 1, 1, generator=g)
    x = protos[labels] * brightness + noise * torch.randn((n, *SHAPE), generator=g)
    return x.round().clamp(0, 255).to(torch.uint8), labels


def make_images(
    num_train: int, num_test: int, data_seed: int, noise: float, num_classes: int = 10
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train_x, train_y, test_x, test_y): uint8 ``[N, 3, 32, 32]``, int64 labels."""
    g = torch.Generator().manual_seed(data_seed)
    small = torch.rand(num_classes, SHAPE[0], 4, 4, generator=g)
    protos = 30 + 195 * F.interpolate(small, size=SHAPE[1:], mode="nearest")
    train = _split(protos, num_train, noise, stable_hash(data_seed, "selfcheck-train"))
    test = _split(protos, num_test, noise, stable_hash(data_seed, "selfcheck-test"))
    return (*train, *test)


class SyntheticImages(InMemoryImages):
    """The framework's synthetic images as a config ``_target_`` (conf/dataset/selfcheck_images)."""

    def __init__(
        self,
        num_train: int = 4096,
        num_test: int = 1024,
        data_seed: int = 1234,
        noise: float = 48.0,
        num_classes: int = 10,
        **common,
    ) -> None:
        super().__init__(**common)
        if min(num_train, num_test) <= 0 or num_classes < 2 or noise < 0:
            raise ReprotrainError(
                "dataset.num_train and dataset.num_test must be > 0, dataset.num_classes >= 2 "
                "and dataset.noise >= 0"
            )
        self.params = dict(num_train=num_train, num_test=num_test, data_seed=data_seed)
        self.params |= dict(noise=noise, num_classes=num_classes)
        self.num_classes = num_classes

    def load_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return make_images(**self.params)

    def fingerprint(self) -> dict:
        params = {"generator": "selfcheck-images", "version": GENERATOR_VERSION, **self.params}
        sha = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()
        return {"kind": "synthetic-params", "sha256": sha}
