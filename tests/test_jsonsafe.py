"""Strict JSON: a NaN never reaches a record as a literal, and is never silently lost."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from reprotrain.run.record import strict_dumps, strict_loads, to_strict_json


def test_non_finite_numbers_become_null_and_their_paths_are_returned() -> None:
    row = {
        "epoch": 3,
        "ok": True,
        "train_loss": float("nan"),
        "lr": 0.1,
        "nested": {"grad_norm": float("inf"), "hist": [1.0, float("-inf"), 2]},
        "name": "x",
        "none": None,
    }
    clean, paths = to_strict_json(row)
    assert paths == ["train_loss", "nested.grad_norm", "nested.hist[1]"]
    assert clean == {
        "epoch": 3,
        "ok": True,
        "train_loss": None,
        "lr": 0.1,
        "nested": {"grad_norm": None, "hist": [1.0, None, 2]},
        "name": "x",
        "none": None,
    }
    assert json.loads(strict_dumps(clean)) == clean
    assert row["train_loss"] != row["train_loss"]  # the input is not modified


def test_bools_stay_bools_and_numpy_scalars_become_python_numbers() -> None:
    clean, paths = to_strict_json([True, np.float32(0.5), np.int64(7), np.float64("nan")])
    assert clean == [True, 0.5, 7, None] and paths == ["[3]"]
    assert type(clean[0]) is bool and type(clean[2]) is int
    assert to_strict_json(float("nan")) == (None, ["$"])


def test_strict_dumps_refuses_what_to_strict_json_would_have_cleaned() -> None:
    with pytest.raises(ValueError):
        strict_dumps({"loss": math.nan})


def test_strict_loads_rejects_the_literals_python_json_writes_by_default() -> None:
    for text in ('{"a": NaN}', '{"a": Infinity}', "[-Infinity]"):
        with pytest.raises(ValueError, match="non-finite JSON constant"):
            strict_loads(text)
    assert strict_loads('{"a": null, "b": 1.5}') == {"a": None, "b": 1.5}
