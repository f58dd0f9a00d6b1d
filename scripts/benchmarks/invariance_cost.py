"""The ``invariant`` figure: a world-size-invariant step / a plain DDP step, side by side.

Both sides are the framework's own job (``experiment=selfcheck``) at the same world size W,
the same global batch and the same ``trainer.microbatch_size`` (k = batch / micro-batch
pieces per step, k / W per rank), launched under torchrun with the same per-rank thread
count (gloo on CPU, NCCL on CUDA). Only ``trainer.world_size_invariant`` differs: the
invariant side adds per-micro-batch RNG seeding, per-micro-batch BatchNorm and the exact
integer sum of gradients, loss and metric sums in place of DDP's float all-reduce.
The figure is step time invariant / plain = images/s plain / images/s invariant; beside it,
the ops each side dispatches per step (``count_ops``), which is what a GPU step of small
tensors costs (one kernel launch each).
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.stats import compare, interleave
from benchmarks.training import Counter, run_checked, steady_images_per_s
from reprotrain.run.record import read_jsonl

DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


@dataclass
class InvariantSetup:
    """What both sides share; ``world_size`` must divide ``batch_size // microbatch_size``."""

    device: str = "cpu"
    world_size: int = 2
    threads_per_rank: int = 1
    epochs: int = 3
    num_train: int = 1536
    num_test: int = 256
    batch_size: int = 128
    microbatch_size: int = 32
    repeats: int = 2
    widths: tuple[int, ...] = (16, 32, 64)  # the self-check net's size (WIDE on a GPU)
    convs_per_stage: int = 1

    def __post_init__(self) -> None:
        k, rest = divmod(self.batch_size, self.microbatch_size)
        if rest or k % self.world_size:
            raise ValueError(
                f"microbatch_size={self.microbatch_size} must divide batch_size="
                f"{self.batch_size} into a multiple of world_size={self.world_size} pieces"
            )


def side_overrides(setup: InvariantSetup, invariant: bool) -> list[str]:
    """The template overrides of one side; the two differ in world_size_invariant only."""
    return [
        "experiment=selfcheck",
        "repro.level=strict",
        f"repro.num_threads={setup.threads_per_rank}",
        f"trainer.device={setup.device}",
        f"trainer.epochs={setup.epochs}",
        f"trainer.batch_size={setup.batch_size}",
        f"trainer.microbatch_size={setup.microbatch_size}",
        f"trainer.world_size_invariant={str(invariant).lower()}",
        f"dataset.num_train={setup.num_train}",
        f"dataset.num_test={setup.num_test}",
        f"model.widths=[{','.join(map(str, setup.widths))}]",
        f"model.convs_per_stage={setup.convs_per_stage}",
        "logger=none",
    ]


def side_command(setup: InvariantSetup, invariant: bool, run_dir: Path) -> list[str]:
    """``torchrun --nproc-per-node=W -m reprotrain.train ...`` (plain python at W=1)."""
    overrides = [*side_overrides(setup, invariant), f"hydra.run.dir={run_dir}"]
    train = ["-m", "reprotrain.train", *overrides]
    if setup.world_size == 1:
        return [sys.executable, *train]
    torchrun = ["-m", "torch.distributed.run", "--standalone"]
    return [sys.executable, *torchrun, f"--nproc-per-node={setup.world_size}", *train]


def run_side(setup: InvariantSetup, invariant: bool, run_dir: Path) -> float:
    """One side's steady train images/s (global: every rank's samples); checkpoints deleted."""
    run_checked(side_command(setup, invariant, run_dir), drop_env=DISTRIBUTED_ENV)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return steady_images_per_s(read_jsonl(run_dir / "metrics.jsonl"))


def count_ops(setup: InvariantSetup) -> dict:
    """Ops of one plain DDP step and one invariant step at W=1 with the setup's k, counted
    in this process on the CPU (``invariance_profile.ops_per_step``): the measured net and
    the reference model (conf/model/resnet18.yaml, at 8x8 images: the ops do not depend on
    the image size). On a GPU the step of small tensors is launch-bound, so the kernel
    count is what its time follows there."""
    import torch

    from benchmarks.bare_loop import build_model
    from benchmarks.invariance_profile import ops_per_step

    k = setup.batch_size // setup.microbatch_size
    torch.manual_seed(0)  # the models' initial weights: the counts do not depend on them
    net = build_model("selfcheck", list(setup.widths), setup.convs_per_stage)
    return {
        "microbatches_per_step": k,
        "bench net": ops_per_step(net, k),
        "resnet18": ops_per_step(build_model("resnet18", [], 0), k, image_size=8),
    }


def measure_invariant(setup: InvariantSetup, root: Path, log=print, count=count_ops) -> dict:
    """Plain DDP, then invariant, per repeat (adjacent pairs); step time invariant / plain;
    then both steps' op counts (``count``), side by side."""
    fresh = Counter(root)
    runs: dict[str, list[str]] = {"ddp": [], "invariant": []}

    def side(name: str, invariant: bool):
        def measure() -> float:
            run_dir = fresh(f"{name}-w{setup.world_size}")
            value = run_side(setup, invariant, run_dir)
            runs[name].append(str(run_dir))
            log(f"  {name + f' W={setup.world_size}':<28} {value:10.1f} images/s")
            return value

        return measure

    values = interleave({"ddp": side("ddp", False), "invariant": side("invariant", True)},
                        setup.repeats)  # fmt: skip
    # step time invariant / plain = images/s plain / images/s invariant, paired per repeat
    result = compare(values["ddp"], values["invariant"])
    result.update(
        world_size=setup.world_size,
        microbatch_size=setup.microbatch_size,
        microbatches_per_step=setup.batch_size // setup.microbatch_size,
        threads_per_rank=setup.threads_per_rank,
        widths=list(setup.widths),
        convs_per_stage=setup.convs_per_stage,
        runs=runs,
    )
    log(f"  ratio {result['ratio']:.3f} (step time invariant / plain DDP, W={setup.world_size})")
    result["ops_per_step"] = count(setup)
    for model, sides in result["ops_per_step"].items():
        if isinstance(sides, dict):
            ddp, inv = sides["ddp"]["kernels"], sides["invariant"]["kernels"]
            log(f"  ops per step (W=1, kernels) {model:<10} ddp {ddp} / invariant {inv}"
                f" ({inv / ddp:.3f})")  # fmt: skip
    return result
