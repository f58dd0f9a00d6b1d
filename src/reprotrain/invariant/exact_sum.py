"""Exact, order-independent sums of float tensors across micro-batches and ranks: int64 fixed
point with one power-of-two scale per tensor (a MAX all-reduce of exponents, a SUM of integers).

Closes: the floating-point summation order of a cross-rank reduction (the result is a function
of the multiset of parts alone). Method, precision, cost: docs/scaling-out.md,
docs/invariance-performance.md."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

HEADROOM_BITS = 62  # |sum| < 2^62 < 2^63: int64 never overflows
# float64/int64 temporaries of at most this many elements at once (128 MB each): every
# part at once for small vectors, one part at a time for a large model's gradients
CHUNK = 1 << 24

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
    """Where each tensor of a part lies once flattened: per flat vector (``groups``) its dtype
    and tensor indices; ``order``: group-major position -> index in the part."""

    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    groups: tuple[tuple[torch.dtype, tuple[int, ...]], ...]

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


def stacked(layout: Layout, parts: int, device: torch.device) -> list[torch.Tensor]:
    """Empty ``[parts, elements]`` buffers, one per group of ``layout``: row i holds part i."""
    return [
        torch.empty(parts, sum(layout.sizes(g)), dtype=d, device=device)
        for g, (d, _) in enumerate(layout.groups)
    ]


def flatten(part: Sequence[torch.Tensor], layout: Layout, out: Sequence[torch.Tensor]) -> None:
    """Copy ``part`` into ``out``: one detached copy per group, in the group's dtype."""
    if len(part) != len(layout.shapes) or any(
        t.numel() != s.numel() for t, s in zip(part, layout.shapes, strict=False)
    ):
        raise ValueError("exact_sum needs the same tensors (count and shapes) in every part")
    with torch.no_grad():  # detached, without one detach per tensor
        for (_, members), flat in zip(layout.groups, out, strict=True):
            torch.cat([part[i].reshape(-1) for i in members], out=flat)


def exact_sum(
    parts: Sequence[Sequence[torch.Tensor]], total_parts: int, reduce: Reducer = no_reduce
) -> list[torch.Tensor]:
    """Sum over every rank's ``parts`` (``parts[i][j]``: tensor j of part i); ``total_parts``
    (k over all ranks) sets the headroom. Same tensors on every rank; two collectives per call."""
    if not parts:
        raise ValueError("exact_sum needs at least one part on every rank")
    layout = layout_of(parts[0])
    buffers = stacked(layout, len(parts), parts[0][0].device)
    for i, part in enumerate(parts):
        flatten(part, layout, [buffer[i] for buffer in buffers])
    return exact_sum_stacked(buffers, layout, total_parts, reduce)


def exact_sum_stacked(
    buffers: Sequence[torch.Tensor], layout: Layout, total_parts: int, reduce: Reducer = no_reduce
) -> list[torch.Tensor]:
    """:func:`exact_sum` of parts already flattened into ``stacked`` buffers."""
    device = buffers[0].device
    n = len(layout.shapes)
    guard = math.ceil(math.log2(total_parts)) if total_parts > 1 else 0

    # 1. One exponent per tensor: |x| < 2^e for every element of every part, on every rank
    #    (the exponent of the largest magnitude; 0 for an all-zero tensor), and whether any
    #    element is not finite. One MAX all-reduce of both.
    biggest = torch.cat([_largest(b, layout.sizes(g)) for g, b in enumerate(buffers)])
    bad = torch.isinf(biggest)  # NaN and inf were made inf by _largest
    exps = torch.frexp(torch.where(bad, 0.0, biggest)).exponent.to(torch.int64)
    flags = torch.cat([exps, bad.to(torch.int64)])
    reduce(flags, "max")
    exps, bad = flags[:n], flags[n:] > 0
    shifts = HEADROOM_BITS - guard - exps  # scale so that |x| * 2^shift < 2^(62 - guard)
    # A tensor with a non-finite element anywhere is NaN whatever its integers: scale 0
    # (then 0 after nan_to_num) keeps its elements from overflowing the int64 cast.
    scale, unscale = power_of_two(torch.cat([shifts, -shifts])).split(n)
    scale = torch.where(bad, 0.0, scale).split([len(m) for _, m in layout.groups])
    unscale = torch.where(bad, math.nan, unscale).split([len(m) for _, m in layout.groups])

    # 2. Quantise every element with its tensor's shared scale and add the local parts as
    #    integers (exact, any order): one int64 bucket, one view per group.
    bucket = torch.zeros(sum(b.shape[1] for b in buffers), dtype=torch.int64, device=device)
    values = bucket.split([b.shape[1] for b in buffers])
    for g, (buffer, value) in enumerate(zip(buffers, values, strict=True)):
        per_element = scale[g].index_select(0, _segments(layout.sizes(g), device))
        chunks = _chunks(buffer)
        product = buffer.new_empty(chunks[0].shape, dtype=torch.float64)  # reused per chunk
        integers = torch.empty_like(product, dtype=torch.int64)
        for chunk in chunks:
            floats, ints = product[: len(chunk)], integers[: len(chunk)]
            torch.mul(chunk, per_element, out=floats)  # exact: a float times 2^shift
            floats.round_().nan_to_num_(0.0, 0.0, 0.0)
            value.add_(_add_rows(ints.copy_(floats), torch.sum))
    reduce(bucket, "sum")

    # 3. Back to floats once per group, to each tensor's dtype once per run of one dtype.
    out: list[torch.Tensor | None] = [None] * n
    for g, value in enumerate(values):
        members = layout.groups[g][1]
        per_element = unscale[g].index_select(0, _segments(layout.sizes(g), device))
        back = value.to(torch.float64).mul_(per_element)
        for i, piece in zip(members, _as_dtypes(back, layout, members), strict=True):
            out[i] = piece
    return out  # type: ignore[return-value]


def _chunks(buffer: torch.Tensor) -> list[torch.Tensor]:
    """Row blocks of ``buffer`` whose float64 copies hold at most ``CHUNK`` elements."""
    return list(buffer.split(max(1, CHUNK // max(1, buffer.shape[1]))))


def _add_rows(block: torch.Tensor, op) -> torch.Tensor:
    """``op`` over the rows of ``block`` (dim 0); a single row as it is."""
    return block[0] if block.shape[0] == 1 else op(block, 0)


def _largest(buffer: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """Per tensor of a group: the largest |x| over the parts (float64), inf if any is not finite."""
    magnitude, scratch = None, None
    for chunk in _chunks(buffer):
        if magnitude is None:  # a fresh tensor: the first block's own
            magnitude = _add_rows(chunk.abs(), torch.amax)  # amax and maximum keep NaN
            continue
        if scratch is None:
            scratch = torch.empty_like(chunk)  # reused by every later block
        top = _add_rows(torch.abs(chunk, out=scratch[: len(chunk)]), torch.amax)
        torch.maximum(magnitude, top, out=magnitude)
    assert magnitude is not None
    magnitude.nan_to_num_(nan=math.inf, posinf=math.inf)
    pieces = [piece for piece in magnitude.split(sizes) if piece.numel()]
    largest = torch.stack(torch._foreach_max(pieces)) if pieces else magnitude.new_zeros(0)
    if len(pieces) < len(sizes):  # empty tensors: largest 0, as for an all-zero tensor
        full = magnitude.new_zeros(len(sizes))
        full[[i for i, s in enumerate(sizes) if s]] = largest
        largest = full
    return largest.to(torch.float64)


def _as_dtypes(flat: torch.Tensor, layout: Layout, members: tuple[int, ...]):
    """``flat``'s pieces as the tensors ``members``: one conversion per run of one dtype."""
    pieces: list[torch.Tensor] = []
    lo = 0
    for dtype, run in itertools.groupby(members, key=layout.dtypes.__getitem__):
        shapes = [layout.shapes[i] for i in run]
        hi = lo + sum(s.numel() for s in shapes)
        split = flat[lo:hi].to(dtype).split([s.numel() for s in shapes])
        pieces += [p.view(s) for p, s in zip(split, shapes, strict=True)]
        lo = hi
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
