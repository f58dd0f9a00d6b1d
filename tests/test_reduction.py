"""One reduction per run (reduction.py): Local, DDP or Exact, chosen once; each owns how a
step's micro-batch results combine, what the epoch end reduces, and what a checkpoint keeps
per rank. Checked in process: a fake ``Dist`` stands in for a process group, and two
threads with a shared reducer stand in for two Exact ranks."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from reprotrain.config import ReductionSettings
from reprotrain.distributed import Dist
from reprotrain.reduction import DDP, Exact, Local, for_run
from reprotrain.state import EpochProgress
from step_harness import BATCH, Harness, batch


@dataclass(frozen=True)
class TwoRanks(Dist):
    """Rank ``rank`` of a job of two identical ranks: all_reduce doubles, gather repeats."""

    backend: str | None = "fake"

    def all_reduce(self, tensor: torch.Tensor) -> None:
        tensor.mul_(2)

    def gather_objects(self, obj, dst: int = 0):
        return [obj, obj] if self.rank == dst else None


def test_the_mode_and_the_job_choose_the_reduction_once():
    one, two = Dist(), TwoRanks(rank=0, world_size=2)
    plain, invariant = ReductionSettings(), ReductionSettings(world_size_invariant=True)
    assert type(for_run(plain, one)) is Local
    assert type(for_run(plain, two)) is DDP
    assert type(for_run(invariant, one)) is Exact and type(for_run(invariant, two)) is Exact
    assert [r.world_size_invariant for r in (Local(), DDP(two), Exact())] == [False, False, True]


def test_ddp_makes_the_epoch_global_once_losses_averaged_sums_and_counts_added():
    progress = EpochProgress(torch.device("cpu"))
    progress.add(torch.tensor(1.0), {"correct": torch.tensor(3)}, 8, 0.1)
    progress.add(torch.tensor(3.0), {"correct": torch.tensor(2)}, 8, 0.1)
    reduction = DDP(TwoRanks(rank=0, world_size=2))
    reduction.end_epoch(progress)
    assert progress.losses() == [1.0, 3.0]  # the mean of two equal ranks
    assert int(progress.metrics.sums["correct"]) == 10 and progress.seen == 32
    assert reduction.global_count(16) == 32 and not reduction.step_values_are_global
    local = EpochProgress(torch.device("cpu"))
    local.add(torch.tensor(1.0), {"correct": torch.tensor(3)}, 8, 0.1)
    Local().end_epoch(local)
    Exact().end_epoch(local)
    assert local.seen == 8 and int(local.metrics.sums["correct"]) == 3


def test_a_checkpoint_gathers_every_ranks_rng_and_partial_sums_where_it_is_built(monkeypatch):
    def no_collective(*a, **k):
        raise AssertionError("state_dict ran a collective")

    monkeypatch.setattr(torch.distributed, "all_gather_object", no_collective)
    h = Harness().run(2)
    mine = h.state.state_dict()  # this rank's view: no collective
    assert "ranks" not in mine["loop"]["progress"] and "ranks" not in mine["rng"]
    ddp = DDP(TwoRanks(rank=0, world_size=2))
    ckpt = ddp.checkpoint(mine)
    assert ckpt["rng"]["world_size"] == 2 and len(ckpt["rng"]["ranks"]) == 2
    assert ckpt["loop"]["progress"]["ranks"] == [mine["loop"]["progress"]] * 2
    assert DDP(TwoRanks(rank=1, world_size=2)).checkpoint(mine) is mine  # rank 1 writes none
    # Rank 1 of a resumed job takes its own share back.
    ckpt["loop"]["progress"]["ranks"][1] = {**mine["loop"]["progress"], "step_lrs": [9.0, 9.0]}
    again = Harness()
    again.state.rank = 1
    again.state.load_state_dict(ckpt)
    assert again.state.loop.progress.step_lrs == [9.0, 9.0]


def test_an_exact_checkpoint_holds_nothing_per_rank_and_may_resume_on_any_world_size():
    h = Harness(reduction="exact", microbatch_size=4).run(2)
    ckpt = h.reduction.checkpoint(h.state.state_dict())
    assert "rng" not in ckpt and "ranks" not in ckpt["loop"]["progress"]
    assert h.reduction.resume_check(saved_world_size=4, allow_change=False) is None
    refused = Local().resume_check(saved_world_size=2, allow_change=False)
    assert refused is not None and "NPROC=2" in refused
    assert Local().resume_check(saved_world_size=2, allow_change=True) is None


class ThreadReducer:
    """Collectives between ``n`` threads: MAX/SUM all-reduce in place, gather in rank order."""

    def __init__(self, n: int) -> None:
        self.n, self.barrier, self.box = n, threading.Barrier(n), [None] * n

    def for_rank(self, rank: int):
        def reduce(tensor: torch.Tensor, op: str):
            self.box[rank] = tensor.clone()
            self.barrier.wait()
            parts = list(self.box)
            self.barrier.wait()
            if op == "gather":
                return torch.cat(parts)
            total = parts[0]
            for p in parts[1:]:
                total = torch.maximum(total, p) if op == "max" else total + p
            tensor.copy_(total)
            return None

        return reduce


def test_exact_gives_one_process_bits_when_two_ranks_share_the_micro_batches():
    # No dropout here: threads share the process's global RNG, which real ranks do not.
    steps, kw = 3, {"reduction": "exact", "microbatch_size": 4, "dropout": False}
    one = Harness(**kw).run(steps)
    shared = ThreadReducer(2)
    ranks = [Harness(**kw) for _ in range(2)]
    for r, h in enumerate(ranks):
        h.reduction.dist = Dist(rank=r, world_size=2)
        h.reduction.reduce = shared.for_rank(r)

    def train(r: int) -> None:
        h = ranks[r]
        for s in range(steps):
            x, y = batch(s)
            half = BATCH // 2  # rank r's contiguous share of the global batch
            loss, sums, _ = h.runner.step(
                (x[r * half : (r + 1) * half], y[r * half : (r + 1) * half]), s
            )
            h.state.loop.progress.add(loss, sums, h.reduction.samples(half), 0.0)

    threads = [threading.Thread(target=train, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for h in ranks:
        assert h.bits()[0] == one.bits()[0]  # weights and BatchNorm statistics, bit for bit
        assert h.bits()[1] == one.bits()[1]  # every step loss
        assert h.state.loop.progress.seen == one.state.loop.progress.seen
    local = Harness(microbatch_size=4, dropout=False).run(steps)
    assert local.bits()[0] != one.bits()[0]  # the float path is another computation


@pytest.mark.parametrize("reduction", ["local", "exact"])
def test_micro_batch_contexts_count_over_every_rank(reduction):
    seen = []
    h = Harness(reduction=reduction, microbatch_size=4)
    h.reduction.dist = Dist(rank=1, world_size=2)
    task = h.runner.task
    original = task.training_step

    def recording(model, micro, ctx):
        seen.append((ctx.microbatch, ctx.microbatches, ctx.eval_batch, ctx.training))
        return original(model, micro, ctx)

    task.training_step = recording
    if reduction == "exact":
        h.reduction.reduce = ThreadReducer(1).for_rank(0)  # a lone rank 1 of "2"
    x, y = batch(0)
    h.runner.step((x[:8], y[:8]), 0)
    assert seen == [(2, 4, 0, True), (3, 4, 0, True)]  # rank 1 runs micro-batches 2 and 3


def test_the_layout_is_checked_once_in_config_with_the_launchers_world_size(monkeypatch):
    from reprotrain import preflight
    from reprotrain.config import register_configs
    from reprotrain.errors import ReprotrainError

    register_configs()
    preflight.register_resolvers()
    argv = ["experiment=selfcheck", "trainer.batch_size=64", "trainer.microbatch_size=16"]
    invariant = [*argv, "trainer.world_size_invariant=true"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    preflight.check(invariant)  # 4 micro-batches over 2 ranks
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ReprotrainError, match="not divisible by the world size 3"):
        preflight.check(argv)
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ReprotrainError, match=r"microbatch_size=16 does not divide the per-rank"):
        preflight.check(argv)  # 8 samples per rank: no micro-batch of 16 fits
    with pytest.raises(ReprotrainError, match=r"world size \(8\) to divide the 4 micro-batch"):
        preflight.check(invariant)
