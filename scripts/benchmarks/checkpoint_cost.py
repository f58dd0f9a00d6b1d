"""P5: checkpoint save + load against one epoch, at a reference model size (11.0M parameters).

The checkpoint holds what a resume needs (model, optimizer with momentum buffers,
scheduler, scaler, RNG states and loop position), written and read through the template's
own ``checkpoint.save``/``checkpoint.load`` (atomic write with fsync; ``weights_only``
load). The model is the framework's own conv net at its wide size (``selfcheck.net.WIDE``).
An epoch is estimated as the measured step time times the steps of a 50,000-image epoch at
the reference batch (50000 // 512 = 97): a real CPU epoch takes a quarter hour.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from benchmarks.stats import compare, interleave
from reprotrain.reduction import Local
from reprotrain.repro import checkpoint
from reprotrain.selfcheck.net import WIDE, TinyConvNet
from reprotrain.state import TrainerState

EPOCH_IMAGES = 50_000


@dataclass
class CheckpointSetup:
    device: str = "cpu"
    batch_size: int = 512
    widths: tuple[int, ...] = WIDE["widths"]
    convs_per_stage: int = WIDE["convs_per_stage"]
    steps_per_repeat: int = 1
    repeats: int = 2


def resume_state(state: TrainerState) -> dict:
    """A real resume checkpoint: the trainer's state (what build.build_training builds),
    gathered by the one-process reduction as the trainer's ``checkpoint.Saver`` does."""
    meta = checkpoint.Meta(config={}, config_sha256="", seeds={}, env={})
    return Local().checkpoint(checkpoint.snapshot(state, meta))


def measure_p5(setup: CheckpointSetup, log=print) -> dict:
    device = torch.device(setup.device)
    model = TinyConvNet(list(setup.widths), convs_per_stage=setup.convs_per_stage).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    trainer_state = TrainerState(model, opt, sched, scaler, device)
    loss_fn = nn.CrossEntropyLoss()
    x = torch.randn(setup.batch_size, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (setup.batch_size,), device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        sched.step()

    def step_seconds() -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(setup.steps_per_repeat):
            step()
        sync()
        return (time.perf_counter() - t0) / setup.steps_per_repeat

    step()  # warm-up; also creates the momentum buffers a real checkpoint carries
    sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step-00000001.pt"

        def save_load_seconds() -> float:
            sync()
            t0 = time.perf_counter()
            data = checkpoint.serialise(resume_state(trainer_state))
            checkpoint.save(path, data)
            loaded = checkpoint.load(path, map_location=device)
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optimizer"])
            sync()
            return time.perf_counter() - t0

        save_load_seconds()  # warm-up: first file creation, page cache
        steps_per_epoch = EPOCH_IMAGES // setup.batch_size
        values = interleave(
            {
                "checkpoint_s": save_load_seconds,
                "epoch_estimate_s": lambda: steps_per_epoch * step_seconds(),
            },
            setup.repeats,
        )
        size_mib = path.stat().st_size / 2**20
    result = compare(values["checkpoint_s"], values["epoch_estimate_s"], higher_is_better=False)
    result.update(
        step_s=result["b_median"] / steps_per_epoch,
        steps_per_epoch=steps_per_epoch,
        epoch_is_estimate=True,
        checkpoint_mib=size_mib,
        params=sum(p.numel() for p in model.parameters()),
        widths=list(setup.widths),
        convs_per_stage=setup.convs_per_stage,
        batch_size=setup.batch_size,
    )
    log(
        f"  checkpoint save+load {result['a_median'] * 1e3:.0f} ms ({size_mib:.1f} MiB), "
        f"step {result['step_s'] * 1e3:.0f} ms, epoch estimate {result['b_median']:.0f} s"
    )
    return result
