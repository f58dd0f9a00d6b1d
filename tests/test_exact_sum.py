"""The order-independent sum behind world-size invariance (reprotrain.invariant.exact_sum).

Ranks are simulated by threads that meet at each collective, so the same code path as under
torchrun runs with 1, 2 and 4 "ranks" in one process.
"""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch

from reprotrain.invariant.exact_sum import exact_sum


class ThreadGroup:
    """W threads as ranks: each collective waits for all, then combines their tensors."""

    def __init__(self, world: int) -> None:
        self.world, self.barrier = world, threading.Barrier(world)
        self.slots: list[torch.Tensor | None] = [None] * world

    def reducer(self, rank: int):
        def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor | None:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            if op == "gather":
                out = torch.cat(self.slots)  # type: ignore[arg-type]
                self.barrier.wait()
                return out
            stack = torch.stack(self.slots)  # type: ignore[arg-type]
            combined = stack.amax(0) if op == "max" else stack.sum(0)
            self.barrier.wait()
            tensor.copy_(combined)
            return None

        return reduce


def run_ranks(parts, world: int):
    """exact_sum over ``parts`` split into ``world`` contiguous shares, one thread each."""
    group, results = ThreadGroup(world), [None] * world
    share = len(parts) // world

    def rank(r: int) -> None:
        mine = parts[r * share : (r + 1) * share]
        results[r] = exact_sum(mine, len(parts), group.reducer(r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def gradient_like_parts(k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 3, 3, 3), (16,), (10, 64)]
    return [
        [torch.randn(s, generator=g) * 10.0 ** torch.randint(-6, 3, (), generator=g).item()
         for s in shapes]
        for _ in range(k)
    ]  # fmt: skip


def bits(tensors) -> list[bytes]:
    return [t.detach().numpy().tobytes() for t in tensors]


def test_the_sum_has_the_same_bits_on_1_2_and_4_ranks():
    parts = gradient_like_parts(8)
    one = run_ranks(parts, 1)[0]
    for world in (2, 4):
        for result in run_ranks(parts, world):
            assert bits(result) == bits(one)


def test_float_summation_is_not_order_independent_here_but_the_exact_sum_is():
    """The problem being solved is real for these parts: float32 sums in two groupings
    differ, and the exact sum of a reordering is bitwise the same."""
    parts = gradient_like_parts(8, seed=3)
    sequential = [sum(p[j] for p in parts) for j in range(3)]
    pairs = [
        (parts[0][j] + parts[1][j] + parts[2][j] + parts[3][j])
        + (parts[4][j] + parts[5][j] + parts[6][j] + parts[7][j])
        for j in range(3)
    ]
    assert bits(sequential) != bits(pairs)
    assert bits(exact_sum(parts, 8)) == bits(exact_sum(parts[::-1], 8))


def test_the_exact_sum_is_at_least_as_accurate_as_float32_summation():
    parts = gradient_like_parts(8, seed=5)
    exact = exact_sum(parts, 8)
    for j in range(3):
        truth = sum(p[j].double() for p in parts)
        float32 = sum(p[j] for p in parts).double()
        err_exact = (exact[j].double() - truth).abs().max().item()
        err_f32 = (float32 - truth).abs().max().item()
        assert err_exact <= err_f32


def test_a_non_finite_part_makes_the_sum_nan_and_float64_keeps_its_precision():
    parts = [[torch.tensor([1.0, 2.0])], [torch.tensor([math.inf, 0.5])]]
    assert torch.isnan(exact_sum(parts, 2)[0]).all()
    x = [[torch.tensor(0.1, dtype=torch.float64)] for _ in range(3)]
    assert exact_sum(x, 3)[0].item() == pytest.approx(0.3, rel=1e-15)
    assert exact_sum(x, 3)[0].dtype == torch.float64


def test_batchnorm_running_statistics_are_those_of_k_micro_batches_in_order_on_any_layout():
    from reprotrain.invariant.batchnorm import MicroBatchNorm

    g = torch.Generator().manual_seed(1)
    batch = torch.randn(8, 3, 5, 5, generator=g) * 3 + 1
    micro = batch.split(2)  # k = 4 micro-batches of 2

    torch.manual_seed(0)
    template = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    plain = copy.deepcopy(template)  # a plain BatchNorm fed the 4 micro-batches in order
    for mb in micro:
        plain(mb)

    def layout(world: int):
        group, out = ThreadGroup(world), [None] * world
        share = len(micro) // world

        def rank(r: int) -> None:
            model = copy.deepcopy(template)
            bn = MicroBatchNorm(model)
            outputs = []
            for mb in micro[r * share : (r + 1) * share]:
                with bn.micro_batch():
                    outputs.append(model(mb))
            assert int(model[1].num_batches_tracked) == 0  # forwards left the buffers alone
            bn.end_step(group.reducer(r))
            out[r] = (model[1].running_mean.clone(), model[1].running_var.clone(), outputs)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    (mean1, var1, outs1) = layout(1)[0]
    assert not torch.equal(mean1, torch.zeros(4))  # the statistics did move
    torch.testing.assert_close(mean1, plain[1].running_mean)  # as k plain forwards would
    torch.testing.assert_close(var1, plain[1].running_var)
    for world in (2, 4):
        for r, (mean, var, outs) in enumerate(layout(world)):
            assert bits([mean, var]) == bits([mean1, var1])
            share = 4 // world
            assert bits(outs) == bits(outs1[r * share : (r + 1) * share])  # ghost-batch forward


def test_on_real_gradients_the_exact_sum_is_the_correctly_rounded_float32_sum():
    """The README's precision claim, measured: 8 micro-batch gradients of the self-check
    net, summed exactly vs in float32, against the float64 sum rounded once."""
    from reprotrain.selfcheck.net import TinyConvNet

    torch.manual_seed(0)
    model = TinyConvNet(widths=[16, 32, 64], num_classes=10)
    x, y = torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,))
    parts = []
    for i in range(8):
        model.zero_grad()
        out = model(x[i * 16 : (i + 1) * 16])
        torch.nn.functional.cross_entropy(out, y[i * 16 : (i + 1) * 16]).mul(1 / 8).backward()
        parts.append([p.grad.clone() for p in model.parameters()])
    exact = exact_sum(parts, 8)
    right = {"exact": 0, "float32": 0}
    total = 0
    for j in range(len(parts[0])):
        rounded = sum(p[j].double() for p in parts).float()
        float32 = parts[0][j].clone()
        for p in parts[1:]:
            float32 += p[j]
        right["exact"] += int((exact[j] == rounded).sum())
        right["float32"] += int((float32 == rounded).sum())
        total += rounded.numel()
    assert right["exact"] / total >= 0.999  # measured here: 1.0 (float32 summation: 0.49)
    assert right["exact"] > right["float32"]


def per_tensor_exact_sum(parts, total_parts: int) -> list[torch.Tensor]:
    """The specification, one tensor at a time on one process: the largest finite magnitude
    over the parts sets a power-of-two scale (62 bits less the guard bits of k), each part is
    rounded at that scale to int64 and the integers are added; a non-finite part gives NaN."""
    guard = math.ceil(math.log2(total_parts)) if total_parts > 1 else 0
    out = []
    for j, like in enumerate(parts[0]):
        column = [p[j].detach().to(torch.float64) for p in parts]
        finite = [torch.isfinite(c) for c in column]
        biggest = max(
            (float(torch.where(f, c.abs(), 0.0).max()) if c.numel() else 0.0)
            for c, f in zip(column, finite, strict=True)
        )
        shift = 62 - guard - math.frexp(biggest)[1]
        total = sum(
            torch.round(torch.ldexp(c.nan_to_num(0.0, 0.0, 0.0), torch.tensor(float(shift)))).long()
            for c in column
        )
        value = torch.ldexp(total.to(torch.float64), torch.tensor(float(-shift)))
        if not all(bool(f.all()) for f in finite):
            value = torch.full_like(value, math.nan)
        out.append(value.to(like.dtype))
    return out


def mixed_parts(k: int, seed: int):
    """float32 gradients over 80 decades, float64 sums out to 1e+-300, int64 counts, a
    scalar, an empty and an all-zero tensor; some parts hold an inf or a NaN."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for i in range(k):
        f32 = 10.0 ** torch.randint(-40, 40, (), generator=g).item()
        f64 = 10.0 ** torch.randint(-300, 300, (), generator=g).item()
        part = [
            (torch.randn(16, 3, 3, 3, generator=g, dtype=torch.float64) * f32).float(),
            torch.randn((), generator=g, dtype=torch.float64) * f64,
            torch.randint(-1000, 1000, (7,), generator=g),
            torch.zeros(0),
            torch.zeros(5),
        ]
        if seed % 4 == 1 and i == k - 1:
            part[0].view(-1)[3] = (math.inf, -math.inf, math.nan)[seed % 3]
        parts.append(part)
    return parts


@pytest.mark.parametrize("seed", range(8))
def test_the_flat_bucket_sum_equals_the_per_tensor_sum_bit_for_bit(seed):
    k = 1 + seed % 4
    parts = mixed_parts(k, seed)
    for total in (k, 2 * k, 8 * k):
        got, want = exact_sum(parts, total), per_tensor_exact_sum(parts, total)
        assert [t.dtype for t in got] == [t.dtype for t in want]
        assert [t.shape for t in got] == [t.shape for t in want]
        assert bits(got) == bits(want)


def test_one_call_over_many_tensors_equals_one_call_per_tensor_on_any_layout():
    """What the step relies on when it sums gradients, loss and metric sums together: each
    tensor keeps its own scale, so joining the lists changes no bit, on 1, 2 or 4 ranks, and
    any order of the parts (over ranks and within a rank) gives the same bits."""
    parts = mixed_parts(8, seed=2)
    alone = [exact_sum([[p[j]] for p in parts], 8)[0] for j in range(len(parts[0]))]
    assert bits(exact_sum(parts, 8)) == bits(alone)
    shuffled = [parts[i] for i in torch.randperm(8, generator=torch.Generator().manual_seed(0))]
    for world in (1, 2, 4):
        for result in run_ranks(shuffled, world):
            assert bits(result) == bits(alone)


def test_one_exact_sum_is_two_collectives_whatever_the_number_of_tensors():
    calls = []

    def counting(tensor, op):
        calls.append((op, tensor.dtype, tensor.numel()))

    parts = gradient_like_parts(4)
    exact_sum(parts, 4, counting)
    sizes = sum(t.numel() for t in parts[0])
    # MAX: one exponent and one non-finite flag per tensor; SUM: one integer per element
    assert calls == [("max", torch.int64, 2 * 3), ("sum", torch.int64, sizes)]


def test_powers_of_two_are_exact_over_the_whole_float64_range():
    from reprotrain.invariant.exact_sum import power_of_two

    exponents = torch.arange(-1100, 1100)
    want = torch.stack(
        [torch.ldexp(torch.tensor(1.0, dtype=torch.float64), torch.tensor(float(e)))
         for e in exponents.tolist()]
    )  # fmt: skip
    assert torch.equal(power_of_two(exponents).view(torch.int64), want.view(torch.int64))
    assert power_of_two(torch.tensor([1024]))[0] == math.inf
    assert power_of_two(torch.tensor([-1074]))[0] == math.ldexp(1.0, -1074)
    assert power_of_two(torch.tensor([-1075]))[0] == 0.0


def test_parts_of_different_shapes_are_refused():
    with pytest.raises(ValueError, match="same tensors"):
        exact_sum([[torch.zeros(3)], [torch.zeros(4)]], 2)


def _batchnorm_net(momentum: float | None = 0.1) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, momentum=momentum))


def test_each_micro_batch_records_the_statistics_batchnorm_computes_for_it_bit_for_bit():
    from reprotrain.invariant.batchnorm import MicroBatchNorm

    x = torch.randn(6, 3, 7, 7, generator=torch.Generator().manual_seed(2)) * 2 + 0.5
    model = _batchnorm_net()
    reference = copy.deepcopy(model)
    reference[1].momentum = 1.0  # a plain layer whose running buffers become this batch's own
    reference[1].running_mean.zero_()
    reference[1].running_var.fill_(1.0)
    expected_out = reference(x)
    bn = MicroBatchNorm(model)
    with bn.micro_batch():
        out = model(x)
    (row,) = bn.stats  # one flat row per micro-batch: [mean, var] of every layer
    mean, var = row.split(4)
    assert bits([mean, var]) == bits([reference[1].running_mean, reference[1].running_var])
    assert bits([out]) == bits([expected_out])  # normalised over the micro-batch, as plain
    h = reference[0](x).detach().double()
    torch.testing.assert_close(var.double(), h.var((0, 2, 3)), rtol=1e-5, atol=0)  # unbiased


def test_micro_batch_forwards_leave_the_layers_own_buffers_and_momentum_even_when_one_raises():
    from reprotrain.invariant.batchnorm import MicroBatchNorm

    model = _batchnorm_net(momentum=None)
    layer = model[1]
    own = [layer.running_mean, layer.running_var, layer.num_batches_tracked]
    before = [t.clone() for t in own]
    bn = MicroBatchNorm(model)
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(3))
    with bn.micro_batch():
        model(x)
    with pytest.raises(ValueError, match="4D input"), bn.micro_batch():
        layer(torch.randn(4, 4))  # raises inside BatchNorm's forward, after the swap
    now = [layer.running_mean, layer.running_var, layer.num_batches_tracked]
    assert all(a is b for a, b in zip(now, own, strict=True))  # the module's own tensors
    assert bits(now) == bits(before) and layer.momentum is None


def test_a_layer_called_twice_is_refused_in_one_line_and_an_eval_forward_records_nothing():
    from reprotrain.errors import ReprotrainError
    from reprotrain.invariant.batchnorm import MicroBatchNorm

    model = _batchnorm_net()
    bn = MicroBatchNorm(model)
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(4))
    twice = r"layer '1' ran 2 times in one micro-batch"
    with pytest.raises(ReprotrainError, match=twice), bn.micro_batch():
        model(x)
        model(x * 2)
    assert model[1].momentum == 0.1 and int(model[1].num_batches_tracked) == 0  # given back
    assert bn.stats == []
    model.eval()
    with bn.micro_batch():
        model(x)
    assert bn.stats == []


def test_layers_that_run_out_of_their_registration_order_keep_their_own_statistics():
    """The row is laid out by layer, not by call order: a net that runs its second
    BatchNorm first gets each layer's own running statistics (as plain forwards would)."""
    from reprotrain.invariant.batchnorm import MicroBatchNorm

    class Swapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.late, self.early = torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)

        def forward(self, x):
            return self.late(self.early(x) * 5 + 2)

    torch.manual_seed(0)
    model = Swapped()
    plain = copy.deepcopy(model)
    bn = MicroBatchNorm(model)
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        x = torch.randn(8, 3, generator=g)
        plain(x)
        with bn.micro_batch():
            model(x)
    bn.end_step()
    for mine, want in ((model.early, plain.early), (model.late, plain.late)):
        torch.testing.assert_close(mine.running_mean, want.running_mean)
        torch.testing.assert_close(mine.running_var, want.running_var)
        assert int(mine.num_batches_tracked) == 2


def test_momentum_none_is_a_cumulative_average_over_the_micro_batches_as_in_plain_batchnorm():
    from reprotrain.invariant.batchnorm import MicroBatchNorm

    model, plain = _batchnorm_net(momentum=None), _batchnorm_net(momentum=None)
    bn = MicroBatchNorm(model)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):  # 3 steps of 2 micro-batches
        for _ in range(2):
            x = torch.randn(4, 3, 6, 6, generator=g) * 3
            plain(x)
            with bn.micro_batch():
                model(x)
        bn.end_step()
    assert int(model[1].num_batches_tracked) == int(plain[1].num_batches_tracked) == 6
    torch.testing.assert_close(model[1].running_mean, plain[1].running_mean)
    torch.testing.assert_close(model[1].running_var, plain[1].running_var)


@pytest.mark.slow
def test_under_torch_compile_each_micro_batch_still_records_its_own_statistics():
    from reprotrain.invariant.batchnorm import MicroBatchNorm

    eager = _batchnorm_net()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model)
    on, off = MicroBatchNorm(model), MicroBatchNorm(eager)
    g = torch.Generator().manual_seed(6)
    for _ in range(3):  # new scratch buffers every micro-batch: no stale capture, no recompile
        x = torch.randn(4, 3, 6, 6, generator=g) * 2
        with on.micro_batch():
            compiled(x)
        with off.micro_batch():
            eager(x)
    assert int(model[1].num_batches_tracked) == 0
    for mine, plain in zip(on.stats, off.stats, strict=True):
        for a, b in zip(mine, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
