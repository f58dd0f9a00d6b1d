"""A dict batch: small images with side information, ``{"image", "meta", "label"}``.

Neither the image nor the metadata alone gives the class: the label is the class of the
image's pattern, shifted by a class offset carried in ``meta`` (one-hot). Samples are dicts
of tensors, served as they are (an ``InMemoryTensors``); ``ImageMetaNet`` reads both keys and
``ImageMetaClassification`` (a three-line task) tells the stock classification task which
keys are the model's input and which the label.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from reprotrain.api import Batch, Classification, InMemoryTensors
from starter.params_hash import params_fingerprint


class ImageMeta(InMemoryTensors):
    """Config ``_target_`` for conf/dataset/image_meta.yaml."""

    def __init__(
        self,
        num_train: int = 1024,
        num_test: int = 256,
        num_classes: int = 4,
        size: int = 8,
        noise: float = 0.5,
        data_seed: int = 1234,
        val_fraction: float = 0.1,
    ) -> None:
        super().__init__(val_fraction)
        self.num_classes = num_classes
        self.params = dict(
            num_train=num_train, num_test=num_test, num_classes=num_classes, size=size,
            noise=noise, data_seed=data_seed,
        )  # fmt: skip

    def load_samples(self) -> tuple[Batch, Batch]:
        p, k = self.params, self.params["num_classes"]
        g = torch.Generator().manual_seed(p["data_seed"])
        patterns = torch.randn(k, 1, p["size"], p["size"], generator=g)
        n = p["num_train"] + p["num_test"]
        shape, offset = torch.randint(0, k, (2, n), generator=g)
        image = patterns[shape] + p["noise"] * torch.randn(n, 1, p["size"], p["size"], generator=g)
        samples = {
            "image": image,
            "meta": nn.functional.one_hot(offset, k).float(),
            "label": (shape + offset) % k,
        }
        cut = p["num_train"]
        return (
            {key: t[:cut] for key, t in samples.items()},
            {key: t[cut:] for key, t in samples.items()},
        )

    def fingerprint(self) -> dict:
        return params_fingerprint("image_meta", 1, **self.params)


class ImageMetaNet(nn.Module):
    """``{"image": [B, 1, S, S], "meta": [B, M]} -> logits [B, C]``."""

    def __init__(self, size: int, meta_features: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Flatten(), nn.Linear(size * size, hidden), nn.ReLU())
        self.head = nn.Sequential(
            nn.Linear(hidden + meta_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, inputs: dict[str, Tensor]) -> Tensor:
        return self.head(torch.cat([self.image(inputs["image"]), inputs["meta"]], dim=1))


class ImageMetaClassification(Classification):
    """The stock classification task on a dict batch: the model gets image and meta."""

    def split(self, batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor]:
        return {"image": batch["image"], "meta": batch["meta"]}, batch["label"]
