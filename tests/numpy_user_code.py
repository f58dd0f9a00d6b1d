"""User code written the usual way, full of global numpy draws, brought by ``_target_``.

Not a test module: the trainer imports it in a subprocess (``PYTHONPATH=tests``), exactly
as it imports a user's package. Each class draws from a global RNG the framework does not
own, or keeps state outside any ``state_dict``, the way real user code does:

- ``NoisyImages``: a map-style dataset whose per-sample transform adds ``np.random.normal``
  noise (albumentations-style); the DataLoader path runs it in workers.
- ``NumpyMixup``: mixup with ``lam = np.random.beta(a, a)`` and a ``random.random`` flip.
- ``PredictionList``: a task that appends each step's scores to ``self.preds`` (the obvious
  way to collect scores for an AUROC), which no ``state_dict`` holds.
- ``GeneratorMixup``: mixup drawn from ``ctx.numpy_generator`` (the handed generator).
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any, ClassVar

import numpy as np
import torch
from torch.utils.data import Dataset

from reprotrain.data.base import SampleData, Splits, val_indices
from reprotrain.selfcheck.images import make_images
from reprotrain.selfcheck.net import TinyConvNet
from reprotrain.tasks.base import StepContext, StepOutput
from reprotrain.tasks.classification import Classification
from reprotrain.tasks.metrics import mean_sum


class _Images(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class NoisyImages(SampleData):
    """The selfcheck images served per sample; training adds ``np.random.normal`` noise."""

    def __init__(
        self,
        num_train: int = 320,
        num_test: int = 64,
        data_seed: int = 1234,
        noise: float = 48.0,
        val_fraction: float = 0.0,
        mean: Any = None,
        std: Any = None,
        augment: bool = True,
        pixel_noise: float = 0.2,
    ) -> None:
        self.params = {"num_train": num_train, "num_test": num_test, "data_seed": data_seed,
                       "noise": noise}  # fmt: skip
        self.val_fraction, self.pixel_noise = val_fraction, pixel_noise

    def splits(self) -> Splits:
        train_x, train_y, test_x, test_y = make_images(**self.params)
        tr, va = val_indices(len(train_y), self.val_fraction)
        val = _Images(train_x[va], train_y[va]) if len(va) else None
        return Splits(_Images(train_x[tr], train_y[tr]), val, _Images(test_x, test_y), 10)

    def transform(self, sample: Any, train: bool) -> Any:
        x, y = sample
        x = x.float() / 255
        if train:  # the global numpy RNG, as albumentations and hand-written code use it
            x = x + torch.from_numpy(np.random.normal(0, self.pixel_noise, x.shape)).float()
        return x, y

    def fingerprint(self) -> dict:
        sha = hashlib.sha256(json.dumps(self.params, sort_keys=True).encode()).hexdigest()
        return {"kind": "synthetic-params", "sha256": sha}


class RngImages(NoisyImages):
    """``NoisyImages`` whose noise comes from the ``rng`` the pipeline hands the transform."""

    def transform(self, sample: Any, train: bool, rng: np.random.Generator) -> Any:
        x, y = sample
        x = x.float() / 255
        if train:
            x = x + torch.from_numpy(rng.normal(0, self.pixel_noise, x.shape)).float()
        return x, y


class PrivateRngImages(NoisyImages):
    """``NoisyImages`` whose noise comes from a ``random.Random(0)`` of its own: each draw
    depends on the draws before it and, in a loader worker, on that worker's copy."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.rng = random.Random(0)

    def transform(self, sample: Any, train: bool) -> Any:
        x, y = sample
        return x.float() / 255 + (self.rng.random() if train else 0.0), y


class WarmUpImages(NoisyImages):
    """``NoisyImages`` whose augmentation warms up: stronger after its 30th call in a
    process (each loader worker counts its own calls), otherwise seeded as it should be."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.calls = 0

    def transform(self, sample: Any, train: bool) -> Any:
        self.calls += 1
        x, y = sample
        return x.float() / 255 * (1.5 if self.calls > 30 else 1.0), y


class NumpyMixup(Classification):
    """Mixup written the usual way: global ``np.random.beta`` and ``random.random``."""

    def __init__(self, alpha: float = 0.4, loss_fn: Any = None) -> None:
        super().__init__(loss_fn)
        self.alpha = alpha

    def weight(self, ctx: StepContext) -> float:
        lam = float(np.random.beta(self.alpha, self.alpha))
        return 1 - lam if random.random() < 0.5 else lam

    def training_step(self, model, batch, ctx: StepContext) -> StepOutput:
        x, y = batch
        lam = self.weight(ctx)
        perm = torch.arange(len(y) - 1, -1, -1, device=y.device)  # fixed: only lam draws
        logits = model(lam * x + (1 - lam) * x[perm]).float()
        loss = lam * self.loss_fn(logits, y) + (1 - lam) * self.loss_fn(logits, y[perm])
        return StepOutput(
            loss, {"loss": mean_sum(loss, len(y)), "correct": (logits.argmax(1) == y).sum()}
        )


class GeneratorMixup(NumpyMixup):
    """The same mixup drawing from the generator the framework hands the step."""

    def weight(self, ctx: StepContext) -> float:
        return float(ctx.numpy_generator.beta(self.alpha, self.alpha))


class PredictionList(Classification):
    """Collects every training score in a python list (state no ``state_dict`` holds)."""

    metrics: ClassVar[dict[str, str]] = {"loss": "min", "acc": "max", "seen": "max"}

    def __init__(self, loss_fn: Any = None) -> None:
        super().__init__(loss_fn)
        self.preds: list[float] = []

    def training_step(self, model, batch, ctx: StepContext) -> StepOutput:
        out = super().training_step(model, batch, ctx)
        self.preds.extend(out.sums["correct"].new_ones(len(batch[1])).float().tolist())
        return out

    def compute(self, sums: dict) -> dict[str, float]:
        return {**super().compute(sums), "seen": float(len(self.preds))}


class RestoredPredictionList(PredictionList):
    """``PredictionList`` that checkpoints its list: a resume restores it."""

    def state_dict(self) -> dict:
        return {"preds": list(self.preds)}

    def load_state_dict(self, state: dict) -> None:
        self.preds = list(state["preds"])


class Pcg64Net(TinyConvNet):
    """A model that installs a PCG64 as numpy's global bit generator when it is built, then
    scales its training output by a global numpy draw."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        np.random.set_bit_generator(np.random.PCG64(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * (1 + 1e-2 * float(np.random.rand())) if self.training else out


class OwnBitGenerator(np.random.PCG64):
    """A bit generator that is not numpy's own class (a checkpoint names no code)."""


class OwnBitGeneratorNet(Pcg64Net):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        np.random.set_bit_generator(OwnBitGenerator(0))
