"""AUROC, average precision, F1 (binary, macro, micro) and the confusion matrix: exact over a
split, whatever the batching, the number of ranks or a mid-split checkpoint, and equal to
scikit-learn's values on the same predictions.

Ranks and checkpoints are simulated exactly as the framework combines metric sums: a
``MetricSums`` per rank added up (what the all-reduce does), its ``state_dict`` saved with
``torch.save`` and loaded into a fresh one (what a mid-epoch checkpoint does), and the
world-size-invariant mode's ``exact_sum``. The trainer end to end: tests/starter/.
"""

from __future__ import annotations

import io
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from sklearn.metrics import (
    average_precision_score,
    confusion_matrix,
    f1_score,
    precision_score,
    recall_score,
    roc_auc_score,
)
from torch import nn

from reprotrain.errors import ReprotrainError
from reprotrain.invariant.exact_sum import exact_sum
from reprotrain.state import MetricSums
from reprotrain.step.runner import evaluate
from reprotrain.tasks import BinaryClassification, ClassificationF1, StepContext
from reprotrain.tasks.confusion import confusion_counts, f1_scores
from reprotrain.tasks.ranking import auroc, average_precision, read_slots, score_slots

CPU = torch.device("cpu")


def fixture(n: int = 301, seed: int = 0, ties: bool = True):
    """Scores (float32, some tied), 0/1 labels (~15% positives), each sample's index."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.15).astype(np.int64)
    s = (rng.normal(size=n) + 1.2 * y).astype(np.float32)
    if ties:
        s[::3] = np.round(s[::3], 1)
    return torch.from_numpy(s), torch.from_numpy(y), torch.arange(n)


def exact_auroc(s: np.ndarray, y: np.ndarray) -> Fraction:
    """The definition, in fractions: P(positive > negative) + P(tie) / 2."""
    pos, neg = s[y == 1].astype(np.float64), s[y == 0].astype(np.float64)
    wins = sum(int((p > neg).sum()) * 2 + int((p == neg).sum()) for p in pos)
    return Fraction(wins, 2 * len(pos) * len(neg))


def ulps(a: float, b: float) -> float:
    return abs(a - b) / math.ulp(max(abs(a), abs(b)))


@pytest.mark.parametrize("seed", range(6))
def test_auroc_and_average_precision_match_scikit_learn(seed):
    s, y, i = fixture(seed=seed, ties=seed % 2 == 0)
    scores, labels = read_slots(score_slots(s, y, i, len(s)), len(s))
    value = auroc(scores, labels)
    assert value == float(exact_auroc(s.numpy(), y.numpy()))  # the exact ratio, rounded once
    assert ulps(value, roc_auc_score(y.numpy(), s.numpy())) <= 2  # sklearn's trapezoid rounding
    ap = average_precision(scores, labels)
    assert ulps(ap, average_precision_score(y.numpy(), s.numpy())) <= 2


@pytest.mark.parametrize("classes", [2, 3, 7, 12])
def test_confusion_matrix_and_f1_match_scikit_learn_bit_for_bit(classes):
    rng = np.random.default_rng(classes)
    y = rng.integers(0, classes, 500)
    p = np.where(rng.random(500) < 0.6, y, rng.integers(0, classes, 500))
    p[p == classes - 1] = 0  # a class never predicted: its F1 is 0 and counts in the mean
    m = sum(
        confusion_counts(torch.from_numpy(p[k : k + 64]), torch.from_numpy(y[k : k + 64]), classes)
        for k in range(0, 500, 64)
    )
    labels = list(range(classes))
    assert (m.numpy() == confusion_matrix(y, p, labels=labels)).all()
    f1 = f1_scores(m)
    kw = {"labels": labels, "zero_division": 0}
    assert f1["f1_macro"] == f1_score(y, p, average="macro", **kw)
    assert f1["f1_micro"] == f1_score(y, p, average="micro", **kw)


def binary_sums(task, logits, y, i, parts):
    """One MetricSums per part (a rank, or the steps before and after a checkpoint)."""
    out = []
    for rows in parts:
        sums = MetricSums(CPU)
        for chunk in torch.split(rows, 50):
            loss = task.loss_fn(logits[chunk], y[chunk].float())
            sums.add(task.sums(logits[chunk], y[chunk], loss, i[chunk]), len(chunk))
        out.append(sums)
    return out


def reference(logits: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    s, t = logits.numpy(), y.numpy()
    pred = (s > 0).astype(np.int64)
    return {
        "auroc": roc_auc_score(t, s),
        "ap": average_precision_score(t, s),
        "f1": f1_score(t, pred, zero_division=0),
        "precision": precision_score(t, pred, zero_division=0),
        "recall": recall_score(t, pred, zero_division=0),
        "f1_macro": f1_score(t, pred, average="macro", zero_division=0),
        "f1_micro": f1_score(t, pred, average="micro", zero_division=0),
    }


def assert_matches(got: dict[str, float], want: dict[str, float]) -> None:
    for name, value in want.items():
        assert ulps(got[name], value) <= 2, (name, got[name], value)


def test_binary_task_on_two_ranks_equals_one_rank_and_scikit_learn():
    logits, y, i = fixture(400, seed=3)
    task = BinaryClassification(num_samples=400)
    order = torch.randperm(400, generator=torch.Generator().manual_seed(1))
    (one,) = binary_sums(task, logits, y, i, [order])
    rank0, rank1 = binary_sums(task, logits, y, i, [order[0::2], order[1::2]])
    for name, total in rank1.sums.items():  # what the all-reduce does
        rank0.sums[name] += total
    rank0.samples += rank1.samples
    # the integer sums are the same bits; the float loss sum is as exact as float adds are
    assert torch.equal(one.sums["confusion"], rank0.sums["confusion"])
    assert torch.equal(one.sums["slots"], rank0.sums["slots"])
    got, two = task.compute(one.host()), task.compute(rank0.host())
    assert {k: v for k, v in got.items() if k != "loss"} == {
        k: v for k, v in two.items() if k != "loss"
    }
    assert_matches(got, reference(logits, y))
    (tn, fp), (fn, tp) = confusion_matrix(y.numpy(), (logits > 0).long().numpy())
    assert (got["tn"], got["fp"], got["fn"], got["tp"]) == (tn, fp, fn, tp)


def test_binary_task_restored_from_a_mid_split_checkpoint_is_exact():
    logits, y, i = fixture(400, seed=4)
    task = BinaryClassification(num_samples=512)
    order = torch.randperm(400, generator=torch.Generator().manual_seed(2))
    (whole,) = binary_sums(task, logits, y, i, [order])
    (before,) = binary_sums(task, logits, y, i, [order[:150]])
    buffer = io.BytesIO()
    torch.save(before.state_dict(), buffer)
    buffer.seek(0)
    resumed = MetricSums(CPU)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for chunk in torch.split(order[150:], 50):
        loss = task.loss_fn(logits[chunk], y[chunk].float())
        resumed.add(task.sums(logits[chunk], y[chunk], loss, i[chunk]), len(chunk))
    assert all(torch.equal(whole.sums[k], resumed.sums[k]) for k in whole.sums)
    assert task.compute(whole.host()) == task.compute(resumed.host())


def test_slot_vectors_survive_the_invariant_modes_exact_sum_bit_for_bit():
    s, y, i = fixture(256, seed=5)
    parts = [[score_slots(s[k::4], y[k::4], i[k::4], 256)] for k in range(4)]
    (total,) = exact_sum(parts, total_parts=4)
    assert torch.equal(total, score_slots(s, y, i, 256))


def test_a_repeated_or_out_of_range_sample_index_is_refused_in_one_line():
    s, y, _ = fixture(10)
    slots = score_slots(s, y, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 8]), 10)
    with pytest.raises(ReprotrainError, match="10 samples but 8 distinct sample indices"):
        read_slots(slots, 10)
    beyond = score_slots(s, y, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 12]), 9)  # 10 > 9
    with pytest.raises(ReprotrainError, match="below the task's num_samples"):
        read_slots(beyond, 10)


def test_evaluation_over_uneven_batches_equals_scikit_learn_over_the_split():
    torch.manual_seed(0)
    x = torch.randn(333, 5)
    y = (x[:, 0] + 0.5 * torch.randn(333) > 1.0).long()
    model = nn.Linear(5, 1)
    batches = [(x[k : k + 100], y[k : k + 100], torch.arange(k, min(k + 100, 333)))
               for k in range(0, 333, 100)]  # fmt: skip
    task = BinaryClassification(num_samples=333)
    got = evaluate(task, model, iter(batches), prefix="test", device=CPU)
    with torch.no_grad():
        logits = model(x).reshape(-1)
    want = reference(logits, y)
    assert_matches({k.removeprefix("test_"): v for k, v in got.items()}, want)


def test_multiclass_f1_task_logs_macro_and_micro_f1_of_the_split():
    torch.manual_seed(1)
    x, y = torch.randn(200, 6), torch.randint(0, 4, (200,))
    model = nn.Linear(6, 4)
    task = ClassificationF1(num_classes=4)
    ctx = StepContext(CPU, global_step=0, training=False)
    sums = MetricSums(CPU)
    for k in range(0, 200, 64):
        sums.add(
            task.evaluation_step(model, (x[k : k + 64], y[k : k + 64]), ctx), len(x[k : k + 64])
        )
    got = task.compute(sums.host())
    with torch.no_grad():
        pred = model(x).argmax(1).numpy()
    assert got["f1_macro"] == f1_score(y.numpy(), pred, average="macro", labels=[0, 1, 2, 3],
                                       zero_division=0)  # fmt: skip
    assert got["f1_micro"] == f1_score(y.numpy(), pred, average="micro")
    assert (task.confusion_matrix(sums.host()).numpy() == confusion_matrix(y.numpy(), pred)).all()


def test_task_classification_f1_passes_preflight_and_declares_its_metrics():
    from reprotrain import preflight
    from reprotrain.config import register_configs

    register_configs()
    preflight.register_resolvers()
    preflight.check(["experiment=selfcheck", "task=classification_f1",
                     "trainer.monitor=val_f1_macro"])  # fmt: skip
    with pytest.raises(ReprotrainError, match="it logs: val_loss, val_acc, val_f1_macro"):
        preflight.check(["experiment=selfcheck", "task=classification_f1",
                         "trainer.monitor=val_f1"])  # fmt: skip


@pytest.mark.slow
def test_a_run_with_task_classification_f1_logs_f1_and_micro_f1_is_the_accuracy(tmp_path):
    from conftest import TINY, assert_ok, jsonl, train

    assert_ok(train(tmp_path / "run", *TINY, "task=classification_f1"))
    (row,) = jsonl(tmp_path / "run" / "metrics.jsonl")
    assert 0.0 <= row["val_f1_macro"] <= 1.0
    assert row["val_f1_micro"] == row["val_acc"] and row["train_f1_micro"] == row["train_acc"]
