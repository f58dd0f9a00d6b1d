"""A seed counts once: ``--seeds 1,1`` is refused before anything runs, a sweep that holds a
seed twice is counted once, and a verdict with one distinct seed on a side is INCONCLUSIVE.
``--seeds`` never silently becomes a searched parameter or loses to a seed.base override."""

from __future__ import annotations

import json

import pytest
import yaml

from reprotrain import commands
from reprotrain.tools.sweeps import compare_sweeps


def sweep_with_seeds(root, seeds: list[int], values: list[float]):
    for n, (seed, value) in enumerate(zip(seeds, values, strict=True)):
        job = root / str(n)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"seed.base={seed}"]))
        (job / "config.resolved.yaml").write_text(
            yaml.safe_dump({"trainer": {"monitor": "val_acc", "monitor_mode": "max"}})
        )
        record = {"status": "completed", "seeds": {"base": seed},
                  "final_metrics": {"val_acc": value}}  # fmt: skip
        (job / "run.json").write_text(json.dumps(record))
    return root


def test_the_same_seed_twice_per_side_is_one_seed_and_inconclusive(tmp_path, capsys):
    a = sweep_with_seeds(tmp_path / "a", [1, 1], [0.80, 0.80])
    b = sweep_with_seeds(tmp_path / "b", [2, 2], [0.60, 0.60])
    assert compare_sweeps.main([str(a), str(b)]) == 3
    out = capsys.readouterr().out
    assert "(n=1)" in out and "INCONCLUSIVE" in out.splitlines()[-1]
    assert "ran 2 times, counted once" in out


def test_a_repeated_seed_does_not_add_to_n(tmp_path, capsys):
    a = sweep_with_seeds(tmp_path / "a", [0, 1, 2, 2], [0.80, 0.82, 0.81, 0.81])
    b = sweep_with_seeds(tmp_path / "b", [0, 1, 2], [0.80, 0.82, 0.81])
    assert compare_sweeps.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "A 81 pts (n=3)" in out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--seeds", "1,1"], "seed 1 is given twice"),
        (["--seeds", "0,1,01"], "seed 1 is given twice"),
        (["seed.base=2,2"], "seed 2 is given twice"),
        (["--seeds", ""], "has an empty seed"),
        (["seed.base=1,2", "--seeds", "3"], "--seeds and a seed.base= override both"),
        (["--seeds", "0,1", "+hparams_search=smoke_optuna"], "searched parameter"),
        (["--seeds", "0,1", "hydra/sweeper=optuna"], "searched parameter"),
    ],
)
def test_sweep_refuses_a_seed_list_it_cannot_honour_before_anything_runs(argv, says, capsys):
    assert commands.sweep(["experiment=selfcheck", *argv]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and says in line


def test_a_good_seed_list_is_swept():
    assert commands.sweep_args(["--seeds", "0,1,2"])[1] == ["--multirun", "seed.base=0,1,2"]
