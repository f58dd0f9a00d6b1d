"""The invariant step's profile (benchmarks.invariance_profile): its arithmetic and its
clock, in-process; the torchrun run itself is a benchmark, not a test."""

from __future__ import annotations

import time

import pytest
import torch

from benchmarks.invariance_profile import PARTS, Clock, ops_per_step, report


def test_the_report_gives_the_paired_ratio_and_what_is_left_after_the_timed_parts():
    per_step = {"ddp": [0.040, 0.050, 0.020], "invariant": [0.060, 0.060, 0.040]}
    per_step |= {PARTS[0]: [0.010] * 3, PARTS[1]: [0.003] * 3, PARTS[2]: [0.001] * 3}
    per_step["end_step"] = [0.001] * 3
    lines = report(per_step)
    assert "x1.500" in lines[1]  # paired ratios 1.5, 1.2, 2.0: median 1.5 (not 60/40)
    assert lines[-1].split()[-1] == f"{(0.060 - 0.010 - 0.003 - 0.001) * 1e3:.2f}"


def test_the_clock_bills_cpu_time_inside_the_wrapped_call_even_when_it_raises():
    clock = Clock()

    def busy(fail: bool) -> None:
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass
        if fail:
            raise RuntimeError("boom")

    timed = clock.wrap("busy", busy)
    timed(False)
    with pytest.raises(RuntimeError):
        timed(True)
    assert clock.spent["busy"] >= 0.04
    assert set(clock.spent) == {"busy"}


def test_the_invariant_step_launches_about_as_many_kernels_as_plain_ddp_whatever_the_depth():
    """What a GPU step of small tensors costs: one launch per op. The exact sum and the
    BatchNorm updates run on flat vectors, so the invariant step's extra ops do not grow
    with the number of tensors (they were 2.0x DDP's here, ~12 ops per tensor and part)."""
    from reprotrain.selfcheck.net import TinyConvNet

    extra = []
    for convs in (1, 4):  # 11 and 38 parameter tensors, 3 and 12 BatchNorm layers
        torch.manual_seed(0)
        counts = ops_per_step(TinyConvNet(convs_per_stage=convs), microbatches=4)
        ddp, inv = counts["ddp"]["kernels"], counts["invariant"]["kernels"]
        assert inv <= 1.1 * ddp, counts
        extra.append(inv - ddp)
    assert extra[1] <= extra[0], extra  # deeper: no more extra ops (DDP's grow per tensor)
