"""The optimizer step a user can own: the ``step`` config group, and its base class.

Once per optimizer step the framework calls the run's step object with a runner
(``engine.StepRunner``) and the step's batch::

    class Step:
        def __call__(self, runner, batch) -> None:
            runner.gradients(batch)  # forward + backward of every micro-batch, combined
            runner.apply()           # unscale/clip, scaler + optimizer step, scheduler step

What the runner offers a step:

- ``runner.gradients(batch)``: the framework's micro-batch loop through the run's reduction
  (Local, DDP or Exact): zero the gradients, forward and backward every micro-batch of
  ``batch`` with its counter-based RNG, combine. Returns ``(loss, sums)`` on the device. It
  may be called more than once in one step (SAM: at the weights, then at the perturbed
  weights); each call re-runs the same micro-batches with the same seeds. **Only the first
  call's loss and metric sums are recorded** (the step's loss in the fingerprints,
  ``train_<name>``, the non-finite guard); the gradients the optimizer uses are the last
  call's.
- ``runner.apply()``: framework-owned and called exactly once per step: unscale and clip
  (``trainer.grad_clip_norm``; the norm feeds the non-finite guard), the GradScaler's and
  the optimizer's step, the scheduler's step. Returns the gradient norm or None.
- ``runner.model`` (the bare module, no DDP/compile wrapper), ``runner.optimizer``,
  ``runner.global_step``.

The hooks a step may give, all declared on :class:`Step`:

- ``__call__(runner, batch)``: the step itself (the base: one pass, one update).
- ``evaluation_weights(model)``: a context manager that validation and test run inside
  (EMA weights swapped in); ``evaluated_with`` names them in run.json's ``components``.
- ``state_dict()`` / ``load_state_dict(state)``: a step that defines both is checkpointed
  as its own part (``TrainerState.user_step``) and restored on resume. The base has no state.

A step whose callable takes ``model`` gets the bare model when it is built (``_partial_:
true`` in its YAML). The framework keeps owning accumulation, DDP, the non-finite guard and
checkpointing. Worked examples (EMA weights, SAM, a second optimizer): the user package's
``steps.py`` and ``conf/step/``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn


class Step:
    """One gradient pass, one update: the default ``step``, and the base of a user's own."""

    evaluated_with = "model weights"  # what validation and test evaluate (run.json)

    def __call__(self, runner: Any, batch: Any) -> None:
        runner.gradients(batch)
        runner.apply()

    @contextlib.contextmanager
    def evaluation_weights(self, model: nn.Module) -> Iterator[None]:
        """The weights validation and test use, in ``model`` for the block: the model's own."""
        yield


class PlainStep(Step):
    """The default ``step`` (conf/step/plain.yaml): :class:`Step` as it is."""
