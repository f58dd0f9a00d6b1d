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

Cost (docs/invariance-performance.md): all of a call's tensors travel as one flat bucket, so a
call is two collectives (a MAX of one exponent per tensor, a SUM of one int64 vector holding
every element and the non-finite counts) and a fixed number of vectorised ops over the local
parts, one flat vector per part, whatever the number of tensors. Each tensor keeps
its own scale, so one call over many lists gives the bits of one call per list.

Precision: every element within 2^(62 - 24 - ceil(log2 k)) of a tensor's largest element
(about 10^11 for k <= 8) is represented with all 24 bits of its float32 mantissa before the
sum, and the sum itself is exact; float32 summation instead rounds at every addition. Elements
smaller than 2^-(62 - ceil(log2 k)) times the largest are flushed to zero. A non-finite part
makes the whole tensor's sum NaN, so the non-finite guard still sees it.
"""

from __future__ import annotations

import functools
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
    gets the same result. Two collectives per call, whatever the number of tensors: one MAX
    of a small vector of exponents, one SUM of one flat int64 bucket.

    Every tensor keeps its own scale, so summing a list of tensors in one call gives the
    same bits as one call per tensor: callers should pass everything a step sums (gradients,
    loss, metric sums) in one call, and pay for two collectives once.
    """
    if not parts:
        raise ValueError("exact_sum needs at least one part on every rank")
    like = parts[0]
    n, device = len(like), like[0].device
    sizes = tuple(t.numel() for t in like)
    guard = math.ceil(math.log2(total_parts)) if total_parts > 1 else 0
    segment = _segments(sizes, device)  # [P]: the tensor each flat element belongs to

    # 1. One exponent per tensor: |x| < 2^e for every finite element of every part, on
    #    every rank (the exponent of the largest magnitude; 0 for an all-zero tensor).
    #    Part by part, so the float64 copies held at once are one part's, whatever k is.
    magnitude = torch.zeros(sum(sizes), dtype=torch.float64, device=device)
    nonfinite = torch.zeros(sum(sizes), dtype=torch.bool, device=device)
    for part in parts:
        flat = _flatten(part, sizes)
        finite = torch.isfinite(flat)
        nonfinite |= ~finite
        torch.maximum(magnitude, torch.where(finite, flat.abs(), 0.0), out=magnitude)
    exps = torch.frexp(_per_tensor(magnitude, sizes, torch.amax)).exponent.to(torch.int64)
    reduce(exps, "max")
    shifts = HEADROOM_BITS - guard - exps  # scale so that |x| * 2^shift < 2^(62 - guard)

    # 2. Quantise every element with its tensor's shared scale and add the local parts as
    #    integers (exact, any order); the non-finite counts ride in the same bucket.
    bucket = torch.zeros(sum(sizes) + n, dtype=torch.int64, device=device)
    values, bad = bucket[: bucket.numel() - n], bucket[bucket.numel() - n :]
    scale = power_of_two(shifts).index_select(0, segment)
    for part in parts:
        flat = torch.nan_to_num(_flatten(part, sizes), nan=0.0, posinf=0.0, neginf=0.0)
        values += flat.mul_(scale).round_().to(torch.int64)
    bad.copy_(_per_tensor(nonfinite.to(torch.int64), sizes, torch.sum))
    reduce(bucket, "sum")

    # 3. Back to floats once; a tensor with any non-finite part becomes NaN.
    value = values.to(torch.float64).mul_(power_of_two(-shifts).index_select(0, segment))
    value = torch.where(
        (bad > 0).index_select(0, segment), math.nan, value
    )  # on the device: no host sync
    return [
        piece.view(t.shape).to(t.dtype) for piece, t in zip(value.split(sizes), like, strict=True)
    ]


def power_of_two(exponents: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponents`` (int64) as exact float64 values, built from their bits: what
    ``torch.ldexp(1.0, e)`` gives (inf above 2^1023, subnormals, 0 below 2^-1074), with
    no rounding anywhere, on the tensor's device."""
    e = exponents.to(torch.int64)
    normal = (e.clamp(-1022, 1023) + 1023) << 52
    subnormal = torch.ones_like(e) << (e.clamp(-1074, -1023) + 1074)
    bits = torch.where(e >= -1022, normal, torch.where(e >= -1074, subnormal, 0))
    bits = torch.where(e > 1023, 0x7FF0000000000000, bits)
    return bits.view(torch.float64)


def _per_tensor(flat: torch.Tensor, sizes: tuple[int, ...], op) -> torch.Tensor:
    """``op`` over each tensor's slice of ``flat`` (0 for an empty tensor): n small
    reductions, no scatter (deterministic on every device, under any determinism level)."""
    zero = flat.new_zeros(())
    return torch.stack([op(piece) if piece.numel() else zero for piece in flat.split(sizes)])


def _flatten(part: Sequence[torch.Tensor], sizes: tuple[int, ...]) -> torch.Tensor:
    if len(part) != len(sizes) or any(t.numel() != s for t, s in zip(part, sizes, strict=False)):
        raise ValueError("exact_sum needs the same tensors (count and shapes) in every part")
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in part])


@functools.lru_cache(maxsize=16)
def _segments(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    counts = torch.tensor(sizes, dtype=torch.int64, device=device)
    return torch.repeat_interleave(torch.arange(len(sizes), device=device), counts)
