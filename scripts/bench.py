"""Benchmarks, measured side by side in one process: ResNet-18 step time and checkpoint
overhead (save + load of a full resume checkpoint) on this machine's CPU (or GPU).

    make bench                       # batch 128, 3 timed steps after 1 warm-up
    make bench ARGS="--batch-size 512 --steps 2 --device cuda"

Prints each timing and the ratio checkpoint-time / step-time, which is what decides how
often `trainer.checkpoint_every_steps` can afford to checkpoint.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from reprotrain.models.resnet import CifarResNet
from reprotrain.repro import checkpoint, determinism


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    determinism.apply("strict", args.threads)
    device = torch.device(args.device)
    model = CifarResNet([64, 128, 256, 512], [2, 2, 2, 2]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    loss_fn = nn.CrossEntropyLoss()
    x = torch.randn(args.batch_size, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        sched.step()

    step()  # warm-up; also creates the momentum buffers a real checkpoint carries
    steps = timed(step, args.steps)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": checkpoint.rng_state(),
        "epoch": 1,
        "step": 0,
        "global_step": 1,
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step-00000001.pt"
        saves = timed(lambda: checkpoint.save(path, state), 3)
        loads = timed(lambda: checkpoint.load(path), 3)
        size_mb = path.stat().st_size / 2**20

    step_s, save_s, load_s = (statistics.median(v) for v in (steps, saves, loads))
    print(
        f"device={device} threads={torch.get_num_threads()} batch={args.batch_size} "
        f"params={sum(p.numel() for p in model.parameters()):,}"
    )
    print(f"train step        {step_s * 1000:9.1f} ms  (median of {args.steps})")
    print(f"checkpoint save   {save_s * 1000:9.1f} ms  ({size_mb:.1f} MiB, fsync + rename)")
    print(f"checkpoint load   {load_s * 1000:9.1f} ms  (weights_only=True)")
    print(f"ratio save/step   {save_s / step_s:9.3f}")
    print(f"ratio (save+load)/step {(save_s + load_s) / step_s:6.3f}")


if __name__ == "__main__":
    main()
