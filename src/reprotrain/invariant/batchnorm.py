"""BatchNorm over micro-batches, running statistics once per step (world-size invariance).

Closes: BatchNorm's two rank-dependent effects. (1) Normalisation: each micro-batch is
forwarded on its own, so it is normalised over its own samples (ghost batches) on every
layout. (2) Running statistics: a plain BatchNorm updates ``running_mean``/``running_var``
once per forward, in the order the micro-batches ran on that rank. Here the forward does not
touch them; each micro-batch's per-channel mean and unbiased variance are recorded, every
rank gathers all k micro-batches' statistics once per step (exact copies, in micro-batch
order), and each applies the k momentum updates in that order: the running statistics a
single process would have after the k micro-batches, on every layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from reprotrain.invariant.exact_sum import Reducer, no_reduce


class MicroBatchNorm:
    """Record micro-batch statistics of every BatchNorm in ``model``; update once per step."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [
            m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats
        ]
        self.stats: list[list[torch.Tensor]] = []  # per micro-batch: [mean, var] per layer

    @contextmanager
    def micro_batch(self) -> Iterator[None]:
        """Forward one micro-batch: normalise over it, record its statistics."""
        if not self.layers:
            yield
            return
        record: list[torch.Tensor] = []
        hooks = [m.register_forward_pre_hook(self._hook(record)) for m in self.layers]
        for m in self.layers:
            m.track_running_stats = False  # batch statistics, running buffers untouched
        try:
            yield
        finally:
            for m in self.layers:
                m.track_running_stats = True
            for h in hooks:
                h.remove()
        if record:  # eval-mode forwards record nothing
            self.stats.append(record)

    @staticmethod
    def _hook(record: list[torch.Tensor]):
        def hook(module: _BatchNorm, args: tuple) -> None:
            if not module.training:
                return
            x = args[0].detach()
            dims = [d for d in range(x.dim()) if d != 1]
            x64 = x.to(torch.float64)
            record.extend([x64.mean(dims), x64.var(dims, unbiased=True)])

        return hook

    @torch.no_grad()
    def end_step(self, reduce: Reducer = no_reduce) -> None:
        """Move every layer's running statistics by the k micro-batches' statistics, in
        micro-batch order, as k plain forwards on one process would: every rank gathers all
        k (exact copies, rank order = micro-batch order) and applies the same updates."""
        if not self.layers or not self.stats:
            self.stats = []
            return
        local = torch.stack([torch.cat(per_layer) for per_layer in self.stats])  # [k/W, 2C..]
        every = reduce(local, "gather")  # [k, sum over layers of 2C]
        self.stats = []
        for row in every.unbind(0):
            start = 0
            for m in self.layers:
                c = m.running_mean.numel()
                mean, var = row[start : start + c], row[start + c : start + 2 * c]
                start += 2 * c
                m.num_batches_tracked += 1
                # momentum None: a cumulative moving average, as in torch's BatchNorm
                factor = (
                    m.momentum if m.momentum is not None else 1.0 / float(m.num_batches_tracked)
                )
                m.running_mean.mul_(1 - factor).add_(mean.to(m.running_mean.dtype), alpha=factor)
                m.running_var.mul_(1 - factor).add_(var.to(m.running_var.dtype), alpha=factor)
