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

Cost (docs/invariance-performance.md): a part is flattened once (``flatten``: one copy per
dtype group, float32 for 16- and 32-bit floats, float64 for the rest), and everything after
that runs on the flat vectors: a fixed number of whole-vector ops per part and per call,
whatever the number of tensors (on a GPU each op is one kernel launch, so a step of a
62-tensor ResNet-18 costs tens of launches, not thousands). A call is two collectives: a MAX
of one exponent and one non-finite flag per tensor, a SUM of one int64 vector holding every
element. Each tensor keeps its own scale, so one call over many lists gives the bits of one
call per list.

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
from dataclasses import dataclass

import torch

HEADROOM_BITS = 62  # |sum| < 2^62 < 2^63: int64 never overflows

# reduce(tensor, op): "max" and "sum" all-reduce in place (int64: exact); "gather" returns
# every rank's tensor concatenated along dim 0 in rank order. The identity on one process.
Reducer = Callable[[torch.Tensor, str], torch.Tensor | None]

# Floats summed from a float32 flat copy: widening them is exact, and so is every product
# with a power of two below (computed in float64); everything else goes through float64.
_FLOAT32_GROUP = (torch.float16, torch.bfloat16, torch.float32)


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


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a part lies once flattened: ``groups`` holds, per flat vector,
    its dtype and the indices of its tensors (in order); tensor order within the call is
    kept by ``order`` (group-major position -> index in the part)."""

    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    groups: tuple[tuple[torch.dtype, tuple[int, ...]], ...]

    @property
    def order(self) -> tuple[int, ...]:
        return tuple(i for _, members in self.groups for i in members)

    def sizes(self, group: int) -> tuple[int, ...]:
        return tuple(self.shapes[i].numel() for i in self.groups[group][1])


def layout_of(part: Sequence[torch.Tensor]) -> Layout:
    """The layout of ``part`` (cached: a step passes the same shapes every time)."""
    return _layout(tuple((t.shape, t.dtype) for t in part))


@functools.lru_cache(maxsize=16)
def _layout(signature: tuple[tuple[torch.Size, torch.dtype], ...]) -> Layout:
    shapes, dtypes = zip(*signature, strict=True) if signature else ((), ())
    groups = []
    for dtype in (torch.float32, torch.float64):
        members = tuple(
            i for i, d in enumerate(dtypes) if (d in _FLOAT32_GROUP) == (dtype == torch.float32)
        )
        if members:
            groups.append((dtype, members))
    return Layout(tuple(shapes), tuple(dtypes), tuple(groups))


def flatten(part: Sequence[torch.Tensor], layout: Layout) -> list[torch.Tensor]:
    """``part`` as one flat vector per group of ``layout`` (one copy each, detached)."""
    if len(part) != len(layout.shapes) or any(
        t.numel() != s.numel() for t, s in zip(part, layout.shapes, strict=False)
    ):
        raise ValueError("exact_sum needs the same tensors (count and shapes) in every part")
    flats = []
    with torch.no_grad():  # detached, without one detach per tensor
        for g, (dtype, members) in enumerate(layout.groups):
            out = torch.empty(sum(layout.sizes(g)), dtype=dtype, device=part[members[0]].device)
            flats.append(torch.cat([part[i].reshape(-1) for i in members], out=out))
    return flats


def exact_sum(
    parts: Sequence[Sequence[torch.Tensor]],
    total_parts: int,
    reduce: Reducer = no_reduce,
) -> list[torch.Tensor]:
    """Sum over every rank's ``parts`` (this rank's: ``parts[i][j]`` is tensor j of part i).

    ``total_parts`` is the number of parts over all ranks (k), which sets the headroom.
    Every rank must pass the same number of tensors with the same shapes and dtypes, and
    gets the same result. Two collectives per call, whatever the number of tensors: one MAX
    of a small vector of exponents and flags, one SUM of one flat int64 bucket.

    Every tensor keeps its own scale, so summing a list of tensors in one call gives the
    same bits as one call per tensor: callers should pass everything a step sums (gradients,
    loss, metric sums) in one call, and pay for two collectives once.
    """
    if not parts:
        raise ValueError("exact_sum needs at least one part on every rank")
    layout = layout_of(parts[0])
    return exact_sum_flat([flatten(part, layout) for part in parts], layout, total_parts, reduce)


def exact_sum_flat(
    flat_parts: Sequence[Sequence[torch.Tensor]],
    layout: Layout,
    total_parts: int,
    reduce: Reducer = no_reduce,
) -> list[torch.Tensor]:
    """:func:`exact_sum` of parts already flattened by :func:`flatten` with ``layout``
    (what a caller that keeps k parts alive holds instead of k lists of tensors)."""
    if not flat_parts:
        raise ValueError("exact_sum needs at least one part on every rank")
    device = flat_parts[0][0].device
    n = len(layout.order)
    guard = math.ceil(math.log2(total_parts)) if total_parts > 1 else 0

    # 1. One exponent per tensor: |x| < 2^e for every element of every part, on every rank
    #    (the exponent of the largest magnitude; 0 for an all-zero tensor), and whether any
    #    element is not finite. One MAX all-reduce of both.
    biggest = torch.cat([_largest(flat_parts, layout, g) for g in range(len(layout.groups))])
    bad = torch.isinf(biggest)  # NaN and inf were made inf by _largest
    exps = torch.frexp(torch.where(bad, 0.0, biggest)).exponent.to(torch.int64)
    flags = torch.cat([exps, bad.to(torch.int64)])
    reduce(flags, "max")
    exps, bad = flags[:n], flags[n:] > 0
    shifts = HEADROOM_BITS - guard - exps  # scale so that |x| * 2^shift < 2^(62 - guard)
    # A tensor with a non-finite element anywhere is NaN whatever its integers: scale 0
    # (then 0 after nan_to_num) keeps its elements from overflowing the int64 cast.
    scale = torch.where(bad, 0.0, power_of_two(shifts))
    unscale = torch.where(bad, math.nan, power_of_two(-shifts))

    # 2. Quantise every element with its tensor's shared scale and add the local parts as
    #    integers (exact, any order): one int64 bucket, one view per group.
    sizes = [sum(layout.sizes(g)) for g in range(len(layout.groups))]
    bucket = torch.zeros(sum(sizes), dtype=torch.int64, device=device)
    values = bucket.split(sizes)
    start = 0
    for g, value in enumerate(values):
        members = len(layout.groups[g][1])
        per_element = _segments(layout.sizes(g), device)
        g_scale = scale[start : start + members].index_select(0, per_element)
        start += members
        product = torch.empty(value.numel(), dtype=torch.float64, device=device)
        integers = torch.empty_like(value)
        for flats in flat_parts:
            torch.mul(flats[g], g_scale, out=product)  # exact: a float times 2^shift
            product.round_().nan_to_num_(0.0, 0.0, 0.0)
            value.add_(integers.copy_(product))
    reduce(bucket, "sum")

    # 3. Back to floats once per group, to each tensor's dtype once per run of one dtype.
    out: list[torch.Tensor | None] = [None] * n
    start = 0
    for g, value in enumerate(values):
        members = layout.groups[g][1]
        per_element = _segments(layout.sizes(g), device)
        back = value.to(torch.float64).mul_(
            unscale[start : start + len(members)].index_select(0, per_element)
        )
        start += len(members)
        for i, piece in zip(members, _as_dtypes(back, layout, members), strict=True):
            out[i] = piece
    return out  # type: ignore[return-value]


def _largest(flat_parts, layout: Layout, group: int) -> torch.Tensor:
    """Per tensor of ``group``: the largest |x| over the parts (float64), inf where any
    element of any part is not finite."""
    magnitude = torch.empty_like(flat_parts[0][group])
    scratch = torch.empty_like(magnitude)
    for i, flats in enumerate(flat_parts):
        if i == 0:
            torch.abs(flats[group], out=magnitude)
        else:
            torch.maximum(magnitude, torch.abs(flats[group], out=scratch), out=magnitude)
    magnitude.nan_to_num_(nan=math.inf, posinf=math.inf)  # torch.maximum propagates NaN
    sizes = layout.sizes(group)
    pieces = [piece for piece in magnitude.split(sizes) if piece.numel()]
    largest = torch.stack(torch._foreach_max(pieces)) if pieces else magnitude.new_zeros(0)
    if len(pieces) < len(sizes):  # empty tensors: largest 0, as for an all-zero tensor
        full = magnitude.new_zeros(len(sizes))
        full[[i for i, s in enumerate(sizes) if s]] = largest
        largest = full
    return largest.to(torch.float64)


def _as_dtypes(flat: torch.Tensor, layout: Layout, members: tuple[int, ...]):
    """``flat``'s pieces as the tensors ``members`` (shape, dtype): one conversion per run
    of consecutive tensors of one dtype, views after that."""
    pieces: list[torch.Tensor] = []
    start = 0
    while start < len(members):
        dtype = layout.dtypes[members[start]]
        end = start
        while end < len(members) and layout.dtypes[members[end]] == dtype:
            end += 1
        run = [layout.shapes[i] for i in members[start:end]]
        lo = sum(layout.shapes[i].numel() for i in members[:start])
        hi = lo + sum(s.numel() for s in run)
        converted = flat[lo:hi].to(dtype)
        pieces += [p.view(s) for p, s in zip(converted.split([s.numel() for s in run]), run,
                                              strict=True)]  # fmt: skip
        start = end
    return pieces


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


@functools.lru_cache(maxsize=16)
def _segments(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[P]: the tensor (0..n-1) each flat element belongs to."""
    counts = torch.tensor(sizes, dtype=torch.int64, device=device)
    return torch.repeat_interleave(torch.arange(len(sizes), device=device), counts)
