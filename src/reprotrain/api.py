"""The user's face: everything a project's own package imports from the framework.

``from reprotrain.api import Task, Step, InMemoryImages, ...`` (or ``from reprotrain
import ...``: the package re-exports these). Nothing else in ``reprotrain`` is promised to
a user's room: it may move in any template update; a layering test keeps the template's own
room (src/starter) to this module.

- a task: :class:`Task` (and the shipped :class:`Classification` to subclass), with
  :class:`StepContext` and :class:`StepOutput`, and :func:`mean_sum` for a mean metric;
- an optimizer step: :class:`Step`, which declares its hooks;
- a callback: :class:`Callback` (hooks at start, per batch, epoch end, checkpoint and end);
- a logger: :class:`Logger` (a sink of the run's numbers, named by ``_target_`` in
  ``conf/logger/``);
- data: :class:`InMemoryTensors`, :class:`InMemoryImages`, :class:`SampleData`,
  :class:`Splits`, :class:`Subset`, :func:`val_indices`, the ``Batch`` type,
  :func:`data_root` and :func:`files_fingerprint`;
- files from the network: :func:`download_and_verify` (download, md5, safe extraction) and
  :func:`load_pickle` (globals refused unless allowed);
- errors: :class:`ReprotrainError` (one line, exit 2) and :class:`DataMissingError`.
"""

from __future__ import annotations

from reprotrain.batches import Batch
from reprotrain.callbacks import Callback
from reprotrain.data.base import (
    InMemoryImages,
    InMemoryTensors,
    SampleData,
    Splits,
    Subset,
    val_indices,
)
from reprotrain.data.download import data_root, download_and_verify, load_pickle
from reprotrain.errors import DataMissingError, ReprotrainError
from reprotrain.hashing import files_fingerprint
from reprotrain.loggers.fanout import Logger
from reprotrain.step import Step
from reprotrain.tasks.base import StepContext, StepOutput, Task
from reprotrain.tasks.classification import Classification
from reprotrain.tasks.metrics import mean_sum

__all__ = [
    "Batch",
    "Callback",
    "Classification",
    "DataMissingError",
    "InMemoryImages",
    "InMemoryTensors",
    "Logger",
    "ReprotrainError",
    "SampleData",
    "Splits",
    "Step",
    "StepContext",
    "StepOutput",
    "Subset",
    "Task",
    "data_root",
    "download_and_verify",
    "files_fingerprint",
    "load_pickle",
    "mean_sum",
    "val_indices",
]
