"""Micro-batches: k=1 is the step before the seam, op for op; k>1 accumulates the mean
gradient; a SIGKILL between micro-batches resumes bitwise. Plus the pinned smoke bits."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import assert_ok, run_json, train
from reprotrain.distributed import Dist
from reprotrain.reduction import DDP
from reprotrain.step.runner import StepRunner, StepSettings, TrainerState
from reprotrain.tasks import Classification


class OpLog(TorchDispatchMode):
    """Every aten op that runs, in order (name and input shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
        self.ops.append(f"{func}{shapes}")
        return func(*args, **(kwargs or {}))


def tiny(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, object, torch.amp.GradScaler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched, torch.amp.GradScaler("cpu", enabled=False)


def batch(n: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def stepper(microbatch_size: int | None, seed: int = 0, reduction=None) -> StepRunner:
    model, opt, sched, scaler = tiny(seed)
    state = TrainerState(model, opt, sched, scaler, torch.device("cpu"))
    return StepRunner(
        state, Classification(nn.CrossEntropyLoss()), reduction=reduction,
        settings=StepSettings(microbatch_size=microbatch_size),
    )  # fmt: skip


def step_before_the_seam(model, opt, sched, scaler, loss_fn, x, y):
    """step.runner.train_step and EpochProgress.add as they were before tasks existed (git
    583b992): the step, then its metric ops, which feed nothing."""
    with OpLog() as core:
        logits = model(x)
        loss = loss_fn(logits.float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        loss = loss.detach()
    with OpLog() as metric:
        (logits.argmax(1) == y).sum()
        loss.to(torch.float64) * len(y)
    return core.ops, metric.ops


def without(ops: list[str], removed: list[str]) -> list[str]:
    """``ops`` with one occurrence of each op in ``removed`` taken out."""
    rest = list(ops)
    for op in removed:
        rest.remove(op)
    return rest


def test_one_microbatch_runs_the_ops_of_the_step_before_the_seam():
    x, y = batch()
    old = tiny()
    core, metric = step_before_the_seam(*old, nn.CrossEntropyLoss(), x, y)
    for size in (None, len(y)):  # null and "the whole batch" are the same step
        s = stepper(size)
        with OpLog() as now:
            s.step((x, y), global_step=0)
        # The same training ops in the same order, plus the same metric ops (now computed
        # right after the forward; they feed nothing into the update). The one other op is
        # a detach of the loss for its metric sum: a view, no arithmetic.
        rest = without(now.ops, metric)
        rest.remove("aten.detach.default[()]")
        assert rest == core
        for a, b in zip(s.state.model.parameters(), old[0].parameters(), strict=True):
            assert torch.equal(a, b)


def test_two_microbatches_accumulate_the_whole_batch_gradient():
    x, y = batch(8)
    whole, halves = stepper(None), stepper(4)
    loss_w, sums_w, _ = whole.step((x, y), global_step=0)
    loss_h, sums_h, _ = halves.step((x, y), global_step=0)
    assert torch.allclose(loss_w, loss_h, atol=1e-6)
    assert int(sums_w["correct"]) == int(sums_h["correct"])
    assert torch.allclose(sums_w["loss"], sums_h["loss"], atol=1e-5)
    for a, b in zip(whole.state.model.parameters(), halves.state.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    from reprotrain.config import TrainerConfig, check_layout

    with pytest.raises(Exception, match="microbatch_size=3 does not divide"):
        check_layout(TrainerConfig(batch_size=8, microbatch_size=3), 1)


def test_microbatches_see_their_own_counter_based_context():
    seen = []

    class Recording(Classification):
        def training_step(self, model, batch, ctx):
            seen.append((ctx.global_step, ctx.microbatch, ctx.microbatches, len(batch[1])))
            return super().training_step(model, batch, ctx)

    s = stepper(2)
    s.task = Recording(nn.CrossEntropyLoss())
    s.step(batch(8), global_step=7)
    assert seen == [(7, i, 4, 2) for i in range(4)]


# --- SIGKILL between micro-batches --------------------------------------------------------

HALVES = ["trainer.microbatch_size=32", "trainer.epochs=1", "trainer.checkpoint_every_steps=3"]


def test_sigkill_between_microbatches_resumes_bitwise(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert_ok(train(ref, *HALVES, "logger=none"))
    # Killed during global step 5, after its first micro-batch's backward (step 3 saved).
    killed = train(run, *HALVES, "logger=none", fault="microbatch:5")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert run_json(run)["status"] == "running"
    assert (run / "checkpoints" / "step-00000003.pt").is_file()
    assert_ok(train(run, *HALVES, "logger=none", "resume=auto"))
    a, b = run_json(ref), run_json(run)
    assert a["final_weights_sha256"] == b["final_weights_sha256"]
    assert a["final_metrics"] == b["final_metrics"]
    assert len(b["resumes"]) == 1
    assert copy.deepcopy(a["components"])["microbatch_size"] == 32


def test_ddp_gradient_sync_waits_for_the_last_microbatch():
    """A DDP-like forward: every micro-batch but the last runs inside ``no_sync()``."""
    import contextlib

    events: list[str] = []

    class FakeDDP(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module, self.syncing = module, True

        def forward(self, x):
            events.append("forward, sync" if self.syncing else "forward, no sync")
            return self.module(x)

        @contextlib.contextmanager
        def no_sync(self):
            self.syncing = False
            try:
                yield
            finally:
                self.syncing = True

    s = stepper(2, reduction=DDP(Dist()))
    s.forward = FakeDDP(s.state.model)
    s.step(batch(8), global_step=0)
    assert events == ["forward, no sync"] * 3 + ["forward, sync"]
    events.clear()
    one = stepper(None, reduction=DDP(Dist()))
    one.forward = FakeDDP(one.state.model)
    one.step(batch(8), global_step=0)
    assert events == ["forward, sync"]


def test_take_gathers_positions_and_picks_one_position_of_any_integer_kind() -> None:
    """``batches.take``: a 1-D index gathers (``index_select``, the copy ``t[index]`` makes);
    one position, a Python, numpy or 0-dim tensor integer, picks that sample."""
    import numpy as np

    from reprotrain.batches import take

    batch = (torch.arange(12.0).reshape(6, 2), torch.arange(6))
    rows = torch.tensor([4, 1])
    gathered = take(batch, rows)
    assert all(torch.equal(g, t[rows]) for g, t in zip(gathered, batch, strict=True))
    for one in (3, np.int64(3), torch.tensor(3)):
        picked = take(batch, one)
        assert torch.equal(picked[0], batch[0][3]) and int(picked[1]) == 3
