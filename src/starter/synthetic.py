"""A CIFAR-shaped synthetic dataset that is learnable and never downloads.

Closes: data drift in tests. Generated from ``data_seed`` alone (never from the run seed),
so every run, on every machine, sees the same images; its fingerprint is the hash of the
generation parameters.

Each class is a smooth random 3x8x8 pattern upsampled to 32x32; a sample is its class
pattern with random contrast, a random shift of up to 3 pixels and Gaussian pixel noise,
stored as uint8 exactly like CIFAR-10 so the same pipeline (crop, flip, normalise) applies.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.nn.functional as F

from reprotrain.api import InMemoryImages, ReprotrainError


def stable_hash(*parts: object) -> int:
    """A 63-bit seed from the SHA-256 of ``parts``: the same in every process and machine
    (Python's ``hash()`` is salted per process)."""
    text = "/".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


GENERATOR_VERSION = 1  # bump when the generation code changes: it is part of the fingerprint


def _make_split(protos: torch.Tensor, n: int, noise: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % protos.shape[0]
    labels = labels[torch.randperm(n, generator=g)]
    contrast = 0.6 + 0.4 * torch.rand(n, 1, 1, 1, generator=g)
    x = protos[labels] * contrast
    shifts = torch.randint(-3, 4, (n, 2), generator=g)
    for i in range(n):  # per-sample shift; n is a few thousand, this takes milliseconds
        x[i] = torch.roll(x[i], shifts=(int(shifts[i, 0]), int(shifts[i, 1])), dims=(1, 2))
    x = x + noise * torch.randn(x.shape, generator=g)
    return x.round().clamp(0, 255).to(torch.uint8), labels


def load_synthetic(num_train: int, num_test: int, data_seed: int, noise: float, num_classes=10):
    """(train_x, train_y, test_x, test_y): uint8 [N,3,32,32] images, int64 labels."""
    g = torch.Generator().manual_seed(data_seed)
    protos = F.interpolate(torch.rand(num_classes, 3, 8, 8, generator=g), size=32, mode="bilinear")
    protos = 40 + 175 * protos
    train_x, train_y = _make_split(protos, num_train, noise, stable_hash(data_seed, "train"))
    test_x, test_y = _make_split(protos, num_test, noise, stable_hash(data_seed, "test"))
    return train_x, train_y, test_x, test_y


def synthetic_fingerprint(num_train: int, num_test: int, data_seed: int, noise: float) -> str:
    """sha256 of the generation parameters: the data is a pure function of them."""
    params = {
        "generator_version": GENERATOR_VERSION,
        "num_train": num_train,
        "num_test": num_test,
        "data_seed": data_seed,
        "noise": noise,
    }
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()


class Synthetic(InMemoryImages):
    """The synthetic dataset as a config ``_target_`` (see conf/dataset/synthetic.yaml)."""

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
        self.params = (num_train, num_test, data_seed, noise)
        self.num_classes = num_classes

    def load_tensors(self):
        return load_synthetic(*self.params, num_classes=self.num_classes)

    def fingerprint(self) -> dict:
        sha = synthetic_fingerprint(*self.params)
        if self.num_classes != 10:
            sha = hashlib.sha256(f"{sha}/classes={self.num_classes}".encode()).hexdigest()
        return {"kind": "synthetic-params", "sha256": sha}
