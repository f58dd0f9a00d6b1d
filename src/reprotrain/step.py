"""The optimizer step a user can own: the ``step`` config group.

Once per optimizer step the framework calls the run's step object with a runner
(``engine.StepRunner``)::

    class PlainStep:
        def __call__(self, runner) -> None:
            runner.gradients()  # forward + backward of every micro-batch, combined
            runner.apply()      # unscale/clip, scaler + optimizer step, scheduler step

What the runner offers a step:

- ``runner.gradients()``: the framework's micro-batch loop through the run's reduction
  (Local, DDP or Exact): zero the gradients, forward and backward every micro-batch with its
  counter-based RNG, combine. Returns ``(loss, sums)`` on the device. It may be called more
  than once in one step (SAM: at the weights, then at the perturbed weights); each call
  re-runs the same micro-batches with the same seeds. **Only the first call's loss and
  metric sums are recorded** (the step's loss in the fingerprints, ``train_<name>``, the
  non-finite guard); the gradients the optimizer uses are the last call's.
- ``runner.apply()``: framework-owned and called exactly once per step: unscale and clip
  (``trainer.grad_clip_norm``; the norm feeds the non-finite guard), the GradScaler's and
  the optimizer's step, the scheduler's step. Returns the gradient norm or None.
- ``runner.model`` (the bare module, no DDP/compile wrapper), ``runner.optimizer``,
  ``runner.global_step``.

A step with ``state_dict``/``load_state_dict`` is checkpointed as its own part
(``TrainerState.step``) and restored on resume. A step with ``evaluation_weights(model)``,
a context manager, has validation and test evaluated inside it (EMA weights swapped in);
its ``evaluated_with`` text is recorded in run.json's ``components``. A step whose callable
takes ``model`` gets the bare model when it is built (``_partial_: true`` in its YAML).

The framework keeps owning accumulation, DDP, the non-finite guard and checkpointing.
Worked examples (EMA weights, SAM): the user package's ``steps.py`` and ``conf/step/``.
"""

from __future__ import annotations

from typing import Any


class PlainStep:
    """One gradient pass, one update: the default ``step``."""

    def __call__(self, runner: Any) -> None:
        runner.gradients()
        runner.apply()
