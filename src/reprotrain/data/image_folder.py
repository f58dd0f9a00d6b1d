"""Your own images in torchvision's ImageFolder layout: ``ROOT/{train,test}/<class>/*.png``.

Classes are ``train``'s sorted folder names (``test`` has the same). Closes (as a record):
data drift: the fingerprint is the sha256 of every file's relative path and content.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset
from torchvision.transforms import v2
from torchvision.transforms.v2.functional import pil_to_tensor

from reprotrain.data.base import SampleImages, Splits, Subset, val_indices
from reprotrain.data.download import data_root
from reprotrain.errors import DataMissingError, ReprotrainError
from reprotrain.hashing import files_fingerprint

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
SPLITS = ("train", "test")


class ImageFiles(Dataset):
    """(uint8 image [3,H,W], label) for each file, in sorted (class, path) order."""

    def __init__(self, files: list[tuple[Path, int]]) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.files[i]
        try:
            with Image.open(path) as image:
                return pil_to_tensor(image.convert("RGB")), label
        except (UnidentifiedImageError, OSError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ReprotrainError(f"unreadable image {path} ({reason}); fix or remove it") from None


class ImageFolderData(SampleImages):
    """Config ``_target_`` for conf/dataset/image_folder.yaml."""

    def __init__(
        self,
        root: str,
        val_fraction: float = 0.1,
        size: int = 32,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        train_transforms: list | None = None,
        eval_transforms: list | None = None,
    ) -> None:
        self.root = data_root(root)
        self.val_fraction, self.size = val_fraction, size
        mean, std = list(mean or [0.5] * 3), list(std or [0.25] * 3)
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise ReprotrainError("dataset.mean and dataset.std need 3 values each, std > 0")
        tail = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
        self.train_transform = v2.Compose([*(train_transforms or []), *tail])
        self.eval_transform = v2.Compose([*(eval_transforms or []), *tail])
        self.classes: list[str] = []

    def _scan(self) -> dict[str, list[tuple[Path, int]]]:
        if not self.root.is_dir():
            raise DataMissingError(
                f"dataset.root={self.root} does not exist; give a folder with train/<class>/ "
                "and test/<class>/ image folders"
            )
        found: dict[str, list[tuple[Path, int]]] = {}
        for split in SPLITS:
            split_dir = self.root / split
            if not split_dir.is_dir():
                raise DataMissingError(f"{split_dir} is missing; expected {split}/<class>/*.png")
            classes = sorted(d.name for d in split_dir.iterdir() if d.is_dir())
            if not classes:
                raise DataMissingError(f"{split_dir} has no class folders")
            if split == "train":
                self.classes = classes
            elif classes != self.classes:
                raise ReprotrainError(
                    f"{split_dir} has classes {classes}, train has {self.classes}; make them match"
                )
            files = []
            for label, name in enumerate(classes):
                images = sorted(
                    p for p in (split_dir / name).iterdir() if p.suffix.lower() in EXTENSIONS
                )
                if not images:
                    raise DataMissingError(
                        f"class folder {split_dir / name} has no images ({', '.join(EXTENSIONS)})"
                    )
                files += [(p, label) for p in images]
            found[split] = files
        return found

    @property
    def num_classes(self) -> int:
        if not self.classes:
            self._scan()
        return len(self.classes)

    def splits(self) -> Splits:
        found = self._scan()
        train = ImageFiles(found["train"])
        tr, va = val_indices(len(train), self.val_fraction)
        val = Subset(train, va) if len(va) else None
        return Splits(Subset(train, tr), val, ImageFiles(found["test"]), len(self.classes))

    def fingerprint(self) -> dict:
        if not self.root.is_dir():
            return {"kind": "files", "sha256": None, "missing": [str(self.root)]}
        files = sorted(p for p in self.root.rglob("*") if p.is_file() and p.name[0] != ".")
        # Relative paths enter the hash, so moving a file to another class changes it.
        cache = self.root / ".fingerprint-cache.json"
        sha = files_fingerprint(files, cache_file=cache if os.access(self.root, os.W_OK) else None)
        rel = "\n".join(str(p.relative_to(self.root)) for p in files)
        combined = hashlib.sha256(f"{sha}\n{rel}".encode()).hexdigest()
        return {"kind": "files", "sha256": combined, "num_files": len(files)}
