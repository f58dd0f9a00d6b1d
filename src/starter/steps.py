"""Your own optimizer steps: EMA weights and SAM, as worked examples of the ``step`` group.

The framework calls a step object once per optimizer step with a runner and the step's batch
(see ``reprotrain.api.Step`` and docs/step.md): ``runner.gradients(batch)`` runs the
framework's micro-batch loop (every micro-batch's forward and backward, combined by the run's
reduction: Local, DDP or Exact) and ``runner.apply()`` the framework's update (clip, the
non-finite guard's norm, optimizer and scheduler steps). A step adds what it needs around
them; ``state_dict``/``load_state_dict`` put its own state in every checkpoint.

Pick one with ``step=ema`` or ``step=sam`` (``conf/step/``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from reprotrain.api import Step


class EMA(Step):
    """The plain step, then an exponential moving average of the weights (and buffers).

    ``shadow = decay * shadow + (1 - decay) * weights`` after every update, in float on the
    weights' device; integer buffers (BatchNorm's ``num_batches_tracked``) are copied.
    Validation and test run with the shadow weights swapped in (``evaluation_weights``);
    the fingerprints and ``final_weights_sha256`` stay the trained model's. The shadow is
    in every checkpoint, so a resumed run continues the same average.
    """

    evaluated_with = "EMA weights"  # recorded in run.json's components

    def __init__(self, model: nn.Module, decay: float = 0.999) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay={decay} must be in [0, 1)")
        self.decay = float(decay)
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def __call__(self, runner: Any, batch: Any) -> None:
        runner.gradients(batch)
        runner.apply()
        self.update(runner.model)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for name, value in model.state_dict().items():
            shadow = self.shadow[name]
            if shadow.is_floating_point():
                shadow.lerp_(value.to(shadow.dtype), 1.0 - self.decay)
            else:
                shadow.copy_(value)

    @contextmanager
    def evaluation_weights(self, model: nn.Module) -> Iterator[None]:
        """The shadow weights in ``model`` for the block, then the trained ones, bit for bit."""
        trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(self.shadow)
        try:
            yield
        finally:
            model.load_state_dict(trained)

    def state_dict(self) -> dict[str, Any]:
        return {
            "decay": self.decay,
            "shadow": {k: v.detach().clone() for k, v in self.shadow.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["decay"] != self.decay:
            raise ValueError(
                f"the checkpoint's EMA has decay {state['decay']}, this run {self.decay}; "
                "resume with the same step.decay"
            )
        for name, value in state["shadow"].items():
            self.shadow[name].copy_(value)


class SAM(Step):
    """Sharpness-aware minimisation (Foret et al., 2021): two gradient passes per step.

    1. ``runner.gradients(batch)`` at the weights w: the step's recorded loss and metrics.
    2. Move to ``w + rho * g / ||g||`` (g: the combined gradient of step 1, the same on
       every rank and under every reduction).
    3. ``runner.gradients(batch)`` again at the perturbed weights; BatchNorm running statistics
       are kept as step 1 left them (the second pass is a probe, not more data).
    4. Put w back exactly (a copy, not a subtraction: ``(w + e) - e`` is not always w in
       float), then ``runner.apply()`` with the gradient of step 3.

    Both passes run the same micro-batches with the same counter-based seeds, so a run
    repeats and resumes bitwise; SAM keeps no state across steps (nothing to checkpoint).
    Under fp16 loss scaling g is scaled, which leaves ``g / ||g||`` unchanged.
    """

    def __init__(self, rho: float = 0.05) -> None:
        if not rho > 0:
            raise ValueError(f"rho={rho} must be > 0")
        self.rho = float(rho)

    def __call__(self, runner: Any, batch: Any) -> None:
        runner.gradients(batch)
        params = [p for p in runner.model.parameters() if p.grad is not None]
        with torch.no_grad():
            weights = [p.detach().clone() for p in params]
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params])
            )
            scale = self.rho / (norm + 1e-12)
            for p in params:
                p.add_((p.grad * scale).to(p.dtype))
        with keep_batchnorm_statistics(runner.model):
            runner.gradients(batch)
        with torch.no_grad():
            for p, w in zip(params, weights, strict=True):
                p.copy_(w)
        runner.apply()


@contextmanager
def keep_batchnorm_statistics(model: nn.Module) -> Iterator[None]:
    """BatchNorm running statistics (and batch counts) as they were before the block."""
    layers = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    saved = [
        [b.detach().clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked)]
        for m in layers
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, (mean, var, count) in zip(layers, saved, strict=True):
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
                m.num_batches_tracked.copy_(count)
