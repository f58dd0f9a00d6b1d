"""P2 (data pipelines vs torchvision's PIL transforms) and P4 (fast vs reference augment).

P2 feeds the same 3x32x32 uint8 images (the framework's own synthetic set), batch size, crop
32 with padding 4, flip and normalisation through three paths: ``DevicePipeline`` (whole
batches on the training device), ``LoaderPipeline`` (DataLoader of uint8 tensors, batched
augmentation after), and the common torchvision recipe (a PIL image per sample,
``transforms.v2`` per sample, a DataLoader with workers). Each side runs one epoch per
repeat; images/s counts batches delivered on the training device, ready for the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.stats import compare, interleave
from reprotrain.data.augment import augment_batch, reference_augment_batch
from reprotrain.data.base import InMemoryImages, Splits, TensorSplit
from reprotrain.data.pipeline import DevicePipeline, LoaderPipeline, PipelineSpec
from reprotrain.repro.seeding import Seeds
from reprotrain.selfcheck.images import make_images

MEAN, STD = [0.5, 0.5, 0.5], [0.25, 0.25, 0.25]


@dataclass
class PipelineSetup:
    device: str = "cpu"
    num_images: int = 20_000
    batch_size: int = 512
    workers: int = 2
    repeats: int = 3


def build_template_pipeline(kind: str, x, y, batch_size: int, device, num_workers: int = 0):
    """The pipelines as train.py builds them (kept in one place: if their constructor
    changes, only this function follows)."""
    seeds = Seeds(base=0, init=1, data=2, augment=3, train=4, source="config")
    spec = PipelineSpec(batch_size, batch_size, torch.device(device), seeds)
    dataset = InMemoryImages(mean=MEAN, std=STD, augment=True)
    test = TensorSplit((x[:batch_size], y[:batch_size]))
    splits = Splits(train=TensorSplit((x, y)), val=None, test=test, num_classes=10)
    if kind == "device":
        return DevicePipeline(splits, dataset, spec)
    return LoaderPipeline(splits, dataset, spec, num_workers=num_workers)


class PILImages(Dataset):
    """What a torchvision user writes: one PIL image per sample, transformed per sample."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        from torchvision.transforms import v2

        self.images = x.permute(0, 2, 3, 1).contiguous().numpy()  # HWC uint8 for PIL
        self.labels = y.numpy()
        self.transform = v2.Compose(
            [
                v2.RandomCrop(32, padding=4),
                v2.RandomHorizontalFlip(),
                v2.ToImage(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(MEAN, STD),
            ]
        )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        from PIL import Image

        return self.transform(Image.fromarray(self.images[i])), int(self.labels[i])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pipeline_epoch(pipe, device: torch.device, epoch: int, limit: int | None = None) -> float:
    t0, seen = time.perf_counter(), 0
    for step, (xb, _) in pipe.epoch(epoch):
        seen += len(xb)
        if limit is not None and step + 1 >= limit:
            break
    _sync(device)
    return seen / (time.perf_counter() - t0)


def _torchvision_epoch(loader, device: torch.device, limit: int | None = None) -> float:
    t0, seen = time.perf_counter(), 0
    for i, (xb, yb) in enumerate(loader):
        xb = xb.to(device, non_blocking=True)
        yb = yb.to(device, non_blocking=True)
        seen += len(xb)
        if limit is not None and i + 1 >= limit:
            break
    _sync(device)
    return seen / (time.perf_counter() - t0)


def measure_p2(setup: PipelineSetup, log=print) -> dict:
    """images/s of each pipeline and its ratio to torchvision's PIL DataLoader."""
    device = torch.device(setup.device)
    x, y, _, _ = make_images(setup.num_images, 16, 4321, 48.0)
    pipes = {
        "device": build_template_pipeline("device", x, y, setup.batch_size, device),
        "loader_0_workers": build_template_pipeline("loader", x, y, setup.batch_size, device, 0),
        f"loader_{setup.workers}_workers": build_template_pipeline(
            "loader", x, y, setup.batch_size, device, setup.workers
        ),
    }
    tv_loader = DataLoader(
        PILImages(x, y),
        batch_size=setup.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=setup.workers,
        pin_memory=device.type == "cuda",
    )
    for pipe in pipes.values():  # warm-up: allocator, first worker fork, lazy CUDA init
        _pipeline_epoch(pipe, device, epoch=1, limit=2)
    _torchvision_epoch(tv_loader, device, limit=2)

    epoch_no = iter(range(2, 10_000))
    sides = {
        name: (lambda p=pipe: _pipeline_epoch(p, device, next(epoch_no)))
        for name, pipe in pipes.items()
    }
    sides["torchvision_pil"] = lambda: _torchvision_epoch(tv_loader, device)
    values = interleave(
        {k: (lambda k=k, f=f: _log(log, k, f())) for k, f in sides.items()}, setup.repeats
    )
    out = {
        f"{name}_vs_torchvision": compare(values[name], values["torchvision_pil"]) for name in pipes
    }
    out["images_per_s"] = values
    out["setup"] = {
        "num_images": setup.num_images,
        "batch_size": setup.batch_size,
        "workers": setup.workers,
        "device": setup.device,
    }
    return out


def _log(log, name: str, value: float) -> float:
    log(f"  {name:<28} {value:10.0f} images/s")
    return value


def measure_p4(device: str, batch_size: int, calls: int, repeats: int, log=print) -> dict:
    """Seconds per batch of the reference gather vs the fast path (a speed-up ratio)."""
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (batch_size, 3, 32, 32), generator=g, dtype=torch.uint8).to(dev)
    identical = all(
        torch.equal(augment_batch(x, 1, 1, s), reference_augment_batch(x, 1, 1, s))
        for s in range(4)
    )

    def per_batch(fn) -> float:
        _sync(dev)
        t0 = time.perf_counter()
        for s in range(calls):
            fn(x, 1, 1, s)
        _sync(dev)
        return (time.perf_counter() - t0) / calls

    per_batch(augment_batch), per_batch(reference_augment_batch)  # warm-up
    values = interleave(
        {
            "reference_s": lambda: per_batch(reference_augment_batch),
            "fast_s": lambda: per_batch(augment_batch),
        },
        repeats,
    )
    # > 1: the fast path is faster
    result = compare(values["reference_s"], values["fast_s"], higher_is_better=False)
    result["bit_identical"] = identical
    result["batch_size"] = batch_size
    log(
        f"  augment reference {result['a_median'] * 1e3:.2f} ms, fast "
        f"{result['b_median'] * 1e3:.2f} ms per batch of {batch_size}"
    )
    return result
