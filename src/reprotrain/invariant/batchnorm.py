"""BatchNorm over micro-batches, running statistics once per step (world-size invariance).

Closes: BatchNorm's two rank-dependent effects. (1) Normalisation: each micro-batch is
forwarded on its own, so it is normalised over its own samples (ghost batches) on every
layout. (2) Running statistics: a plain BatchNorm updates ``running_mean``/``running_var``
once per forward, in the order the micro-batches ran on that rank. Here each micro-batch's
forward writes its per-channel mean and unbiased variance into scratch buffers instead (the
statistics BatchNorm's kernel computes for the normalisation anyway, taken with momentum 1),
every rank gathers all k micro-batches' statistics once per step (exact copies, in
micro-batch order), and each applies the k momentum updates in that order: the running
statistics a single process would have after the k micro-batches, on every layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from reprotrain.invariant.exact_sum import Reducer, no_reduce

_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


class MicroBatchNorm:
    """Record micro-batch statistics of every BatchNorm in ``model``; update once per step."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [
            m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats
        ]
        self.stats: list[list[torch.Tensor]] = []  # per micro-batch: [mean, var] per layer
        self._lent: dict[nn.Module, tuple] = {}  # layer -> its own buffers and momentum

    @contextmanager
    def micro_batch(self) -> Iterator[None]:
        """Forward one micro-batch: normalise over it, record its statistics."""
        if not self.layers:
            yield
            return
        record: list[torch.Tensor] = []
        hooks = [m.register_forward_pre_hook(self._lend) for m in self.layers]
        hooks += [m.register_forward_hook(self._collect(record)) for m in self.layers]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()
            for m in list(self._lent):  # a forward that raised: its layer gets its own back
                self._give_back(m)
        if record:  # eval-mode forwards record nothing
            self.stats.append(record)

    def _lend(self, module: _BatchNorm, args: tuple) -> None:
        """Before a training forward: scratch buffers and momentum 1, so the kernel writes
        this micro-batch's own mean and unbiased variance there (1 * new + 0 * scratch)."""
        if not module.training:
            return
        self._lent[module] = (*(getattr(module, b) for b in _BUFFERS), module.momentum)
        module.running_mean = torch.zeros_like(module.running_mean)
        module.running_var = torch.ones_like(module.running_var)
        module.num_batches_tracked = torch.zeros_like(module.num_batches_tracked)
        module.momentum = 1.0

    def _collect(self, record: list[torch.Tensor]):
        def hook(module: _BatchNorm, args: tuple, output: torch.Tensor) -> None:
            if module in self._lent:
                record.extend([module.running_mean, module.running_var])
                self._give_back(module)

        return hook

    def _give_back(self, module: _BatchNorm) -> None:
        *buffers, module.momentum = self._lent.pop(module)
        for name, tensor in zip(_BUFFERS, buffers, strict=True):
            setattr(module, name, tensor)

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
