"""Exercise reprotrain.distributed under torchrun; each rank writes what it saw as JSON.

    python -m torch.distributed.run --standalone --nproc-per-node=2 \
        scripts/ddp_selfcheck.py OUT_DIR [--stop-loop] [--bench N]

tests/test_distributed.py runs it on gloo and compares the ranks' files. ``--stop-loop``
runs a fake training loop (a few ms per step) that only ends when some rank gets SIGUSR2 or
SIGTERM: the test signals one rank and checks that every rank stopped after the same step.
``--bench N`` times ``all_reduce_any`` (the per-step stop check) and prints microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import time
from pathlib import Path

import torch

from reprotrain.distributed import (
    init_from_env,
    shard_global_batch,
    threads_per_rank,
)
from reprotrain.launchers import die_with_parent, run_stamp


def collectives(d, out: dict) -> None:
    out["run_stamp"] = run_stamp()  # agreed through the agent's store, before any collective
    # Each rank invents its own run dir, as Hydra's ${now:}/${run_suffix:} would; rank 0 wins.
    own = f"outputs/x/{time.time_ns()}-{secrets.token_hex(3)}"
    out["own_run_dir"] = own
    out["run_dir"] = d.broadcast_object(own)

    # Per-rank RNG state: different per rank, gathered on rank 0, handed back by scatter.
    torch.manual_seed(1000 + d.rank)
    state = torch.get_rng_state()
    out["rng_sha"] = torch.get_rng_state().sum().item()
    gathered = d.gather_objects({"rank": d.rank, "torch": state})
    out["gathered_ranks"] = None if gathered is None else [g["rank"] for g in gathered]
    mine = d.scatter_objects(gathered)
    out["scatter_returns_own_state"] = bool(torch.equal(mine["torch"], state))

    # One global batch of the (data seed, epoch) order, sharded by rank.
    order = torch.randperm(1000, generator=torch.Generator().manual_seed(7))
    global_batch = order[64:128]  # step 1 with a global batch of 64
    part = shard_global_batch(global_batch, d.rank, d.world_size)
    parts = d.all_gather_objects(part.tolist())
    out["global_batch"] = global_batch.tolist()
    out["union_of_parts"] = [i for p in parts for i in p]
    out["part"] = part.tolist()

    out["any_false"] = d.all_reduce_any(False)
    out["any_only_rank1"] = d.all_reduce_any(d.rank == 1)
    out["threads_per_rank"] = threads_per_rank(d.local_world_size)
    out["record"] = d.as_record()


def stop_loop(d, out: dict, out_dir: Path) -> None:
    got: list[str] = []

    def handler(signum, frame):
        got.append(signal.Signals(signum).name)

    signal.signal(signal.SIGUSR2, handler)
    signal.signal(signal.SIGTERM, handler)
    (out_dir / f"pid{d.rank}").write_text(str(os.getpid()))
    d.barrier()
    step = 0
    while True:
        time.sleep(0.003 * (1 + d.rank))  # ranks run at different speeds
        step += 1
        if d.all_reduce_any(bool(got)) or step >= 100_000:
            break
    out["stopped_after_step"] = step
    out["signal_here"] = got[0] if got else None


def bench(d, n: int) -> None:
    """The stop check against one DDP step of the framework's self-check net (global batch 64)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from reprotrain.selfcheck.net import TinyConvNet

    torch.set_num_threads(1)
    model = DDP(TinyConvNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64 // d.world_size, 3, 32, 32), torch.randint(0, 10, (64 // d.world_size,))

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def timed(fn, reps: int) -> float:
        fn()
        d.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps

    check = timed(lambda: d.all_reduce_any(False), n)
    train = timed(step, max(5, n // 50))
    if d.is_main:
        print(
            f"all_reduce_any {check * 1e6:.0f} us, DDP step {train * 1e3:.1f} ms "
            f"({d.backend}, world {d.world_size}): stop check every step = "
            f"{100 * check / train:.1f}% of a step"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--stop-loop", action="store_true")
    parser.add_argument("--bench", type=int, default=0)
    args = parser.parse_args()
    die_with_parent()  # as the trainer's entry point does, first thing
    if not args.stop_loop and not args.bench:
        run_stamp()  # before the process group, as Hydra would resolve hydra.run.dir
    d = init_from_env("cpu")
    try:
        out = {"rank": d.rank, "world_size": d.world_size, "backend": d.backend}
        if args.bench:
            bench(d, args.bench)
            return
        if args.stop_loop:
            stop_loop(d, out, args.out_dir)
        else:
            collectives(d, out)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / f"rank{d.rank}.json").write_text(json.dumps(out))
    finally:
        d.destroy()


if __name__ == "__main__":
    main()
