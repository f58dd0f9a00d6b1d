"""Where the world-size-invariant step's time goes, beside a plain DDP step, at W ranks.

    PYTHONPATH=scripts python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        -m benchmarks.invariance_profile [--steps 5] [--repeats 5]

Each rank builds the self-check net twice from one seed: a ``StepRunner`` with the ``DDP``
reduction (the plain step) and one with the ``Exact`` reduction (the invariant step), with
the same global batch, micro-batch size and one intra-op thread. Repeats run
the two sides back to back (interleaved), each for ``--steps`` steps on the same batch.
Times are per-rank CPU seconds of the stepping thread (``time.thread_time``): a shared
host preempts a process, and preemption is not billed as CPU time, so the split below is
steady where wall time is not. (The side-by-side wall-clock figure is ``make bench``'s
``invariant`` row.) The invariant step's parts are timed by wrapping, on this rank only:
the BatchNorm statistics hook, ``exact_sum`` (each micro-batch's ``flatten`` and the
step's ``exact_sum_stacked``), ``MicroBatchNorm.end_step`` and every
collective the reducer runs; what is left is forward, backward and the optimizer step.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.stats import median
from reprotrain import reduction as reductions
from reprotrain.distributed import Dist
from reprotrain.selfcheck.net import TinyConvNet
from reprotrain.state import TrainerState
from reprotrain.step.runner import StepRunner, StepSettings
from reprotrain.tasks.classification import Classification

# Dispatched ops that launch no work: allocations and the scalars Python numbers become.
# Views (``OpOverload.is_view``: detach, view, split, select, ...) are metadata as well.
NO_KERNEL = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.scalar_tensor",
             "aten.lift_fresh", "profiler._record_function_enter_new",
             "profiler._record_function_exit"}  # fmt: skip

PARTS = ("BatchNorm statistics hook", "exact_sum (all)", "  of which collectives", "end_step")


class Clock:
    """CPU seconds spent inside wrapped callables, by label."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    def wrap(self, label: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[label] += time.thread_time() - start

        return timed


def build(
    invariant: bool, model: torch.nn.Module, microbatch_size: int, clock: Clock, where: Dist
) -> StepRunner:
    """The plain DDP step or the invariant (Exact) step over a copy of ``model``; the
    invariant side's BatchNorm hook, collectives and ``end_step`` are timed by ``clock``."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    device = torch.device("cpu")
    reduction = reductions.Exact(where) if invariant else reductions.DDP(where)
    model, forward = reduction.prepare(model)
    if invariant:
        reduction.reduce = clock.wrap("  of which collectives", reduction.reduce)
        bn = reduction.bn
        lend, collect = bn._lend, bn._collect  # the hooks around each BatchNorm forward
        bn._lend = lambda calls: clock.wrap(PARTS[0], lend(calls))
        bn._collect = clock.wrap(PARTS[0], collect)
        bn.end_step = clock.wrap("end_step", bn.end_step)
    task = Classification()
    rank_state = reduction.checkpoints_rank_state
    state = TrainerState(model, optimizer, schedule, scaler, device, rng_state=rank_state,
                         rank=reduction.rank)  # fmt: skip
    return StepRunner(state, task, forward=forward, reduction=reduction,
                      settings=StepSettings(microbatch_size=microbatch_size))  # fmt: skip


class OpCount(TorchDispatchMode):
    """The aten ops dispatched inside the block: ``kernels`` (each one kernel launch or
    more on a GPU, where a step of small tensors is launch-bound) and ``metadata`` (views
    and allocations, host work only). Forward, backward and optimizer all count."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = self.metadata = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view or str(func.overloadpacket) in NO_KERNEL:
            self.metadata += 1
        else:
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(model: torch.nn.Module, microbatches: int, image_size: int = 32) -> dict:
    """Ops of one plain DDP step and one invariant step at W=1 (a one-process gloo group
    in this process, CPU), ``microbatches`` of 2 images each, after two warm-up steps: the
    launch counts behind the GPU figure, the same on every device. {side: {kernels,
    metadata}}."""
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    where = Dist(rank=0, world_size=1, local_world_size=1, backend="gloo")
    g = torch.Generator().manual_seed(0)
    n = 2 * microbatches
    batch = (torch.randn(n, 3, image_size, image_size, generator=g),
             torch.randint(0, 10, (n,), generator=g))  # fmt: skip
    counts = {}
    try:
        for name, invariant in (("ddp", False), ("invariant", True)):
            runner = build(invariant, model, 2, Clock(), where)
            for step in range(2):  # warm-up: the optimizer's state, DDP's rebuilt buckets
                runner.step(batch, step)
            with OpCount() as count:
                runner.step(batch, 2)
            counts[name] = {"kernels": count.kernels, "metadata": count.metadata}
    finally:
        if own_group:
            dist.destroy_process_group()
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=128, help="the step's global batch")
    p.add_argument("--microbatch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=5, help="steps per side per repeat")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats (+1 warm-up)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % (args.microbatch_size * world):
        print("error: --batch-size must be a multiple of --microbatch-size x world size",
              file=sys.stderr)  # fmt: skip
        return 2
    torch.manual_seed(0)
    model, clock = TinyConvNet(), Clock()
    where = Dist(rank=rank, world_size=world, local_world_size=world, backend="gloo")
    sides = {"ddp": build(False, model, args.microbatch_size, clock, where),
             "invariant": build(True, model, args.microbatch_size, clock, where)}  # fmt: skip
    g = torch.Generator().manual_seed(rank)
    n = args.batch_size // world
    batch = (torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    # what the step calls, this rank only: each micro-batch's flatten, the step's exact sum
    original = {name: getattr(reductions, name) for name in ("flatten", "exact_sum_stacked")}
    for name, fn in original.items():
        setattr(reductions, name, clock.wrap(PARTS[1], fn))
    per_step: dict[str, list[float]] = defaultdict(list)
    global_step = 0
    try:
        for repeat in range(args.repeats + 1):  # repeat 0 warms up
            for name, runner in sides.items():
                before = dict(clock.spent)
                dist.barrier()
                start = time.thread_time()
                for _ in range(args.steps):
                    runner.step(batch, global_step)
                    global_step += 1
                spent = (time.thread_time() - start) / args.steps
                if repeat and name == "invariant":
                    for label in PARTS:
                        per_step[label].append(
                            (clock.spent[label] - before.get(label, 0.0)) / args.steps
                        )
                if repeat:
                    per_step[name].append(spent)
    finally:
        for name, fn in original.items():
            setattr(reductions, name, fn)
    rows = report(per_step)
    for r in range(world):  # one rank at a time, rank order
        dist.barrier()
        if r == rank:
            print(f"rank {rank} of {world}: CPU ms per step (median of {args.repeats})")
            print("\n".join(rows), flush=True)
    dist.destroy_process_group()
    return 0


def report(per_step: dict[str, list[float]]) -> list[str]:
    """Lines: both sides, their ratio (paired per repeat), and the invariant step's parts."""
    ddp, inv = per_step["ddp"], per_step["invariant"]
    ratio = median([a / b for a, b in zip(inv, ddp, strict=True)])
    lines = [f"  {'plain DDP step':<34}{median(ddp) * 1e3:8.2f}",
             f"  {'invariant step':<34}{median(inv) * 1e3:8.2f}   x{ratio:.3f}"]  # fmt: skip
    parts = {label: median(per_step[label]) for label in PARTS}
    rest = median(inv) - parts[PARTS[0]] - parts[PARTS[1]] - parts["end_step"]
    lines += [f"    {label:<32}{value * 1e3:8.2f}" for label, value in parts.items()]
    lines.append(f"    {'forward, backward, optimizer':<32}{rest * 1e3:8.2f}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
