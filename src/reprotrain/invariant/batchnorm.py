"""BatchNorm over micro-batches, running statistics once per step (world-size invariance).

Closes: BatchNorm's two rank-dependent effects, normalisation (ghost batches) and the running
statistics (applied in micro-batch order). Method: docs/scaling-out.md."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from reprotrain.errors import ReprotrainError
from reprotrain.invariant.exact_sum import Reducer, no_reduce

_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


class MicroBatchNorm:
    """Record micro-batch statistics of every BatchNorm in ``model``; update once per step."""

    def __init__(self, model: nn.Module) -> None:
        named = [(n, m) for n, m in model.named_modules() if isinstance(m, _BatchNorm)]
        named = [(n, m) for n, m in named if m.track_running_stats]
        self.names = [n or type(m).__name__ for n, m in named]
        self.layers = [m for _, m in named]
        self.slot = {m: i for i, m in enumerate(self.layers)}
        # per training micro-batch: every layer's [mean, var] in layer order, one flat row
        self.stats: list[torch.Tensor] = []
        self._lent: dict[nn.Module, tuple] = {}  # layer -> its own buffers and momentum
        # (the [0, 1] row, one num_batches_tracked stand-in per layer), made once
        self._template: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self._scratch: list | None = None  # this micro-batch's slot views, row, stand-ins

    @contextmanager
    def micro_batch(self) -> Iterator[None]:
        """Forward one micro-batch: normalise over it, record its statistics."""
        if not self.layers:
            yield
            return
        calls = [0] * len(self.layers)
        hooks = [m.register_forward_pre_hook(self._lend(calls)) for m in self.layers]
        hooks += [m.register_forward_hook(self._collect) for m in self.layers]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()
            for m in list(self._lent):  # a forward that raised: its layer gets its own back
                self._give_back(m)
            row = None if self._scratch is None else self._scratch[-2]  # the whole row
            self._scratch = None
        if any(calls):  # eval-mode forwards record nothing
            self._check_once(calls)
            self.stats.append(row)

    def _check_once(self, calls: list[int]) -> None:
        """One training forward of every layer per micro-batch: the k rows line up."""
        for name, n in zip(self.names, calls, strict=True):
            if n != 1:
                raise ReprotrainError(
                    f"trainer.world_size_invariant: BatchNorm layer '{name}' ran {n} times in "
                    "one micro-batch; its running statistics are taken once per layer and "
                    "micro-batch: call each BatchNorm once per forward (or give it "
                    "track_running_stats=False)"
                )

    def _lend(self, calls: list[int]):
        def hook(module: _BatchNorm, args: tuple) -> None:
            """Lend the layer its scratch slot and momentum 1: the kernel writes this
            micro-batch's own mean and unbiased variance there (1 * new + 0 * scratch)."""
            if not module.training:
                return
            i = self.slot[module]
            calls[i] += 1
            if self._scratch is None:
                self._scratch = self._fresh_row()
            own = module._buffers  # written directly: Module.__setattr__ costs ~10x more
            self._lent[module] = (*(own[b] for b in _BUFFERS), module.momentum)
            if calls[i] > 1:  # not a row any more (refused at the end of the micro-batch)
                own["running_mean"] = torch.zeros_like(own["running_mean"])
                own["running_var"] = torch.ones_like(own["running_var"])
            else:
                own["running_mean"], own["running_var"] = self._scratch[2 * i : 2 * i + 2]
            own["num_batches_tracked"] = self._scratch[-1][i]  # a count nobody reads
            module.momentum = 1.0

        return hook

    def _collect(self, module: _BatchNorm, args: tuple, output: torch.Tensor) -> None:
        if module in self._lent:
            self._give_back(module)

    def _give_back(self, module: _BatchNorm) -> None:
        *buffers, module.momentum = self._lent.pop(module)
        module._buffers.update(zip(_BUFFERS, buffers, strict=True))

    def _fresh_row(self) -> list[torch.Tensor]:
        """A copy of the [mean 0, var 1] template: slot views, the row, the count stand-ins."""
        first = self.layers[0].running_mean
        kinds = {(m.running_mean.dtype, m.running_mean.device) for m in self.layers}
        if len(kinds) > 1:
            raise ReprotrainError(
                "trainer.world_size_invariant: the BatchNorm layers' running statistics are "
                f"in {len(kinds)} dtypes/devices; move the model to one (model.to(...))"
            )
        made = self._template
        if made is None or (made[0].dtype, made[0].device) != (first.dtype, first.device):
            zeros, ones = torch.zeros_like, torch.ones_like
            init = [t for m in self.layers for t in (zeros(m.running_mean), ones(m.running_var))]
            counts = torch.zeros(len(self.layers), dtype=torch.long, device=first.device)
            self._template = (torch.cat(init), list(counts.unbind()))
        row = self._template[0].clone()
        return [*row.split(self._sizes()), row, self._template[1]]

    def _sizes(self) -> list[int]:
        return [m.running_mean.numel() for m in self.layers for _ in range(2)]

    @torch.no_grad()
    def end_step(self, reduce: Reducer = no_reduce) -> None:
        """Every rank gathers the k micro-batches' statistics (rank order = micro-batch
        order) and applies the k running-stat updates in that order, as one process would."""
        if not self.layers or not self.stats:
            self.stats = []
            return
        every = reduce(torch.stack(self.stats), "gather")  # [k, sum over layers of 2C]
        self.stats = []
        for row in every.unbind(0):
            self._update(row.split(self._sizes()))

    def _update(self, stats: tuple[torch.Tensor, ...]) -> None:
        """One micro-batch's update, a plain BatchNorm's ``x * (1 - f) + f * new``, per momentum."""
        torch._foreach_add_([m.num_batches_tracked for m in self.layers], 1)
        by_momentum: dict[float, list[int]] = {}
        for i, m in enumerate(self.layers):
            if m.momentum is None:  # a cumulative moving average, as in torch's BatchNorm
                factor = 1.0 / float(m.num_batches_tracked)
                m.running_mean.mul_(1 - factor).add_(stats[2 * i], alpha=factor)
                m.running_var.mul_(1 - factor).add_(stats[2 * i + 1], alpha=factor)
            else:
                by_momentum.setdefault(m.momentum, []).append(i)
        for factor, members in by_momentum.items():
            layers = [self.layers[i] for i in members]
            buffers = [t for m in layers for t in (m.running_mean, m.running_var)]
            torch._foreach_mul_(buffers, 1 - factor)
            news = [stats[j] for i in members for j in (2 * i, 2 * i + 1)]
            torch._foreach_add_(buffers, news, alpha=factor)
