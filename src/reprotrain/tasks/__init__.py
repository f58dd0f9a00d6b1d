"""Tasks: what one (micro-)batch computes, the seam between the framework and the user.

``base.py`` holds the protocol; the shipped tasks and the exact split metrics (F1, AUROC,
average precision) are beside it; docs/task.md shows how to bring your own.
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
