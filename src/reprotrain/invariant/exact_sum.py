"""Exact, order-independent sums of float tensors across micro-batches and ranks.

Closes: the floating-point summation order of a cross-rank reduction. An all-reduce of
float gradients adds the ranks' partial sums in an order that depends on the world size (and
the partial sums themselves hold different subsets of micro-batches), so 1 and 2 processes
give different bits from the first step.

Method (the "reproducible summation" of HPC codes): for each tensor, every rank finds the
largest exponent over its parts (``torch.frexp``), a MAX all-reduce makes it global, each
part is scaled by the same power of two so that ``parts x max`` fits in 62 bits, rounded to
int64, and added, locally and then by a SUM all-reduce, as integers — exactly. The total is
converted back once (int64 -> float64 -> the tensor's dtype). The result is a function of the
multiset of parts alone.

Precision: every element within 2^(62 - 24 - ceil(log2 k)) of a tensor's largest element
(about 10^11 for k <= 8) is represented with all 24 bits of its float32 mantissa before the
sum, and the sum itself is exact; float32 summation instead rounds at every addition. Elements
smaller than 2^-(62 - ceil(log2 k)) times the largest are flushed to zero. A non-finite part
makes the whole tensor's sum NaN, so the non-finite guard still sees it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

HEADROOM_BITS = 62  # |sum| < 2^62 < 2^63: int64 never overflows

# reduce(tensor, op): "max" and "sum" all-reduce in place (int64: exact); "gather" returns
# every rank's tensor concatenated along dim 0 in rank order. The identity on one process.
Reducer = Callable[[torch.Tensor, str], torch.Tensor | None]


def no_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor | None:
    """The reducer of a single process: its parts are all the parts."""
    return tensor if op == "gather" else None


def torch_reducer() -> Reducer:
    """``torch.distributed`` collectives (int64 sums and maxima are exact on gloo and NCCL)."""
    import torch.distributed as dist

    ops = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}

    def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor | None:
        if op == "gather":
            out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
            dist.all_gather(out, tensor.contiguous())
            return torch.cat(out)
        dist.all_reduce(tensor, op=ops[op])
        return None

    return reduce


def exact_sum(
    parts: Sequence[Sequence[torch.Tensor]],
    total_parts: int,
    reduce: Reducer = no_reduce,
) -> list[torch.Tensor]:
    """Sum over every rank's ``parts`` (this rank's: ``parts[i][j]`` is tensor j of part i).

    ``total_parts`` is the number of parts over all ranks (k), which sets the headroom.
    Every rank must pass the same number of tensors with the same shapes and dtypes, and
    gets the same result. Two collectives (MAX of exponents, SUM of integers) per call.
    """
    if not parts:
        raise ValueError("exact_sum needs at least one part on every rank")
    n = len(parts[0])
    like = parts[0]
    device = like[0].device
    guard = math.ceil(math.log2(total_parts)) if total_parts > 1 else 0

    # 1. One exponent per tensor: |x| < 2^e for every element of every part, on every rank.
    exps = torch.full((n,), -1100, dtype=torch.int64, device=device)
    bad = torch.zeros((n,), dtype=torch.int64, device=device)
    for part in parts:
        for j, t in enumerate(part):
            t64 = t.detach().to(torch.float64)
            finite = torch.isfinite(t64)
            bad[j] += (~finite).sum()
            biggest = (
                torch.where(finite, t64.abs(), 0.0).max() if t64.numel() else t64.new_zeros(())
            )
            exps[j] = torch.maximum(exps[j], torch.frexp(biggest).exponent.to(torch.int64))
    reduce(exps, "max")
    shifts = HEADROOM_BITS - guard - exps  # scale so that |x| * 2^shift < 2^(62 - guard)

    # 2. Quantise each part with the shared scale and add as integers (exact, any order).
    sizes = [t.numel() for t in like]
    total = torch.zeros(sum(sizes) + n, dtype=torch.int64, device=device)
    for part in parts:
        chunks = []
        for j, t in enumerate(part):
            t64 = torch.nan_to_num(t.detach().to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)
            chunks.append(
                torch.round(torch.ldexp(t64, shifts[j].to(torch.float64))).long().flatten()
            )
        total[: total.numel() - n] += torch.cat(chunks)
    total[total.numel() - n :] = bad
    reduce(total, "sum")

    # 3. Back to floats once; a tensor with any non-finite part becomes NaN.
    out, start = [], 0
    nonfinite = total[total.numel() - n :] > 0
    for j, t in enumerate(like):
        q = total[start : start + sizes[j]].view(t.shape)
        start += sizes[j]
        value = torch.ldexp(q.to(torch.float64), (-shifts[j]).to(torch.float64))
        value = torch.where(nonfinite[j], math.nan, value)  # on the device: no host sync
        out.append(value.to(t.dtype))
    return out
