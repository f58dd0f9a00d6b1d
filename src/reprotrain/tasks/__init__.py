"""Tasks: what one (micro-)batch computes. The seam between the framework and the user.

A task is a small object, built from ``conf/task/<name>.yaml``, with a training step and an
evaluation step over one batch. It returns the loss to back-propagate and named metric
*sums* (device tensors); the framework adds the sums up, reduces them across ranks and calls
``task.compute`` once per epoch or split to turn them into the logged values. See
``base.py`` for the protocol, ``classification.py``, ``binary.py`` and ``regression.py`` for
the shipped tasks, ``confusion.py`` and ``ranking.py`` for metrics that are not means (F1,
confusion matrix, AUROC, average precision; exact over a split), and the README's "Bring
your own task".
"""

from reprotrain.tasks.base import StepContext, StepOutput, Task
from reprotrain.tasks.binary import BinaryClassification
from reprotrain.tasks.classification import Classification, ClassificationF1
from reprotrain.tasks.metrics import SAMPLES, mean_sum
from reprotrain.tasks.regression import Regression

__all__ = [
    "SAMPLES",
    "BinaryClassification",
    "Classification",
    "ClassificationF1",
    "Regression",
    "StepContext",
    "StepOutput",
    "Task",
    "mean_sum",
]
