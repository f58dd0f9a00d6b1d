"""The bare PyTorch loop the template is measured against (P1): same work, no template.

    python -m benchmarks.bare_loop --level strict --epochs 3 --out bare.jsonl

Same model, synthetic data, batch, counter-based crop+flip, normalisation, optimizer (SGD lr
0.2, momentum 0.9, nesterov, weight decay 5e-4, a one-cycle lr) and thread count as
``experiment=selfcheck`` (the framework's own net and images), and the determinism flags of
the same ``repro`` level written out by hand, as a careful user of plain PyTorch would. What
it leaves out is the template: Hydra, the run record, checkpoints, fingerprints, progress
and eval. Loss and correct counts stay on the device and are read once per epoch. Each epoch
appends ``{"epoch", "images_per_s", ...}`` to ``--out``, timed like the template: training
steps only, the clock stopped after the device has finished.

``--null``: the null model of the overhead figure (``benchmarks/overhead.py``): the selfcheck
job with ``model=selfcheck_null dataset.augment=false`` by hand (``NullNet``, no augmentation,
the template's own ``reprotrain.optim.onecycle`` schedule), so a step is almost all loop work.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from reprotrain.data.augment import augment_batch, normalize
from reprotrain.optim import onecycle
from reprotrain.selfcheck.images import make_images
from reprotrain.selfcheck.net import NullNet, TinyConvNet

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)  # selfcheck/conf/dataset/selfcheck_images.yaml


def set_level(
    level: str, threads: int, fill_uninitialized_memory: bool, precision: str = "32-true"
) -> None:
    """The flags a determinism level and a ``trainer.precision`` mean in plain PyTorch (see
    repro/determinism.py, repro/precision.py): TF32 is the precision's, not the level's."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(threads)
    deterministic = level in ("strict", "warn")
    torch.use_deterministic_algorithms(deterministic, warn_only=level == "warn")
    fill = deterministic and fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"


def build_model(name: str, widths: list[int], convs_per_stage: int) -> nn.Module:
    """The self-check net, or a model of the project's conf/model/ (``resnet18``: the
    reference job's), built from its YAML as a run builds it: the benchmark imports no
    package of the user's room by name."""
    if name == "selfcheck":
        return TinyConvNet(widths, convs_per_stage=convs_per_stage)
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from reprotrain import CONF_DIR

    return instantiate(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="bare PyTorch training loop for make bench")
    p.add_argument("--level", choices=("strict", "warn", "fast"), default="strict")
    p.add_argument("--no-fill", action="store_true", help="fill_uninitialized_memory off")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--num-train", type=int, default=4096)
    p.add_argument("--num-test", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--widths", default="16,32,64")
    p.add_argument("--convs-per-stage", type=int, default=1)
    p.add_argument("--model", choices=("selfcheck", "resnet18"), default="selfcheck")
    p.add_argument("--precision", choices=("32-true", "tf32", "bf16-mixed"), default="32-true")
    p.add_argument("--channels-last", action="store_true", help="NHWC model and batches")
    p.add_argument("--null", action="store_true", help="the null model, no augmentation")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    set_level(args.level, args.threads, not args.no_fill, args.precision)
    layout = torch.channels_last if args.channels_last else torch.contiguous_format
    autocast = torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16,
                              enabled=args.precision == "bf16-mixed")  # fmt: skip
    device = torch.device(args.device)
    x, y, _, _ = make_images(args.num_train, args.num_test, 1234, 48.0)
    x, y = x.to(device), y.to(device)
    mean = torch.tensor(MEAN, device=device).view(1, -1, 1, 1)
    std = torch.tensor(STD, device=device).view(1, -1, 1, 1)

    torch.manual_seed(0)
    widths = [int(v) for v in args.widths.split(",")]
    model = NullNet() if args.null else build_model(args.model, widths, args.convs_per_stage)
    model = model.to(device, memory_format=layout)
    steps = len(y) // args.batch_size
    opt = torch.optim.SGD(
        model.parameters(), lr=0.2, momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    if args.null:  # the template's own schedule: its per-step cost is the user's choice
        sched = onecycle(opt, steps * args.epochs, 0.25)
    else:
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=0.2, total_steps=steps * args.epochs, pct_start=0.25, cycle_momentum=False
        )
    loss_fn = nn.CrossEntropyLoss()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("")
    for epoch in range(1, args.epochs + 1):
        model.train()
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), dtype=torch.long, device=device)
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(epoch)
        order = torch.randperm(len(y), generator=g).to(device)
        for step in range(steps):
            idx = order[step * args.batch_size : (step + 1) * args.batch_size]
            xb = x[idx] if args.null else augment_batch(x[idx], 7, epoch, step)
            xb = normalize(xb, mean, std).contiguous(memory_format=layout)
            yb = y[idx]
            with autocast:
                logits = model(xb)
                loss = loss_fn(logits, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += loss.detach() * len(yb)
            correct += (logits.argmax(1) == yb).sum()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        seen = steps * args.batch_size
        row = {
            "epoch": epoch,
            "images_per_s": seen / seconds,
            "seconds": seconds,
            "steps": steps,
            "train_loss": loss_sum.item() / seen,
            "train_acc": correct.item() / seen,
        }
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
