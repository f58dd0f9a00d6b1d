"""A resume proves what it claims: state the checkpoint cannot restore is named, recorded as
not bitwise, and refused under repro=strict unless allowed.

The user's task here appends every score to ``self.preds`` (tests/numpy_user_code.py), the
obvious way to collect them for an AUROC; no ``state_dict`` holds the list, so a resumed
run would silently count 1 step's scores where the uninterrupted one counts 3.
"""

from __future__ import annotations

import signal

import numpy as np
import pytest
import torch
from torch import nn

from conftest import REPO, TINY, assert_ok, base_env, jsonl, run_json, train
from numpy_user_code import PredictionList, RestoredPredictionList
from reprotrain.data.base import InMemoryImages
from reprotrain.repro.seeding import seed_globals
from reprotrain.resume.audit import ResumeAudit

CPU = torch.device("cpu")


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


def audited(task=None, dataset=None, model=None) -> ResumeAudit:
    return ResumeAudit(task or PredictionList(), dataset, model or nn.Linear(2, 2), CPU)


def started(task=None, dataset=None, model=None) -> ResumeAudit:
    """Construction, then the `train` stream seeded: where a run starts."""
    audit = audited(task, dataset, model)
    seed_globals(0)
    return audit


def resumed(recorded: dict, task=None, dataset=None, model=None) -> list[str]:
    """What a fresh process that restored ``recorded`` finds (construction, re-derived
    global RNGs, restore)."""
    audit = started(task, dataset, model)
    audit.load_state_dict(recorded)
    return audit.unrestored()


def test_a_task_list_outside_its_state_dict_is_named_with_its_size():
    first = started()
    first.owners["task"].preds.extend([0.5] * 250)
    assert resumed(first.state_dict()) == [
        "task attribute `preds` (list, 250 items) is not in its state_dict(): "
        "this resume cannot be bitwise"
    ]


def test_a_task_whose_state_dict_holds_the_list_resumes_clean():
    task = RestoredPredictionList()
    first = started(task)
    task.preds.extend([1.0] * 7)
    sd = first.state_dict()
    again = RestoredPredictionList()
    again.load_state_dict(task.state_dict())  # what TrainerState restores before the audit
    assert resumed(sd, task=again) == []


def test_a_model_counter_and_a_consumed_global_rng_are_named():
    model = Counting()
    first = started(model=model)
    model(torch.ones(1, 2))
    np.random.normal()  # drawn outside any seeded scope
    lines = resumed(first.state_dict(), model=Counting())
    assert lines[0].startswith("model attribute `calls` (int) is not in the model's state_dict()")
    assert any(line.startswith("the global numpy RNG was drawn") for line in lines)
    assert not any("python" in line or "torch RNG" in line for line in lines)


def test_unchanged_objects_and_declared_caches_are_not_reported():
    class Images(InMemoryImages):
        pass

    data = Images(mean=[0.5], std=[0.5])
    first = started(dataset=data)
    data._device_stats(CPU)  # a cache filled on first use, declared in cache_attributes
    assert resumed(first.state_dict(), dataset=Images(mean=[0.5], std=[0.5])) == []


# --- the trainer ---------------------------------------------------------------------------

USER = ["experiment=selfcheck", *TINY, "trainer.checkpoint_every_steps=1"]
PREDS = ["task._target_=numpy_user_code.PredictionList"]


def user_env(**extra: str) -> dict[str, str]:
    return base_env(PYTHONPATH=str(REPO / "tests"), **extra)


def killed(run_dir, *overrides: str):
    proc = train(run_dir, *USER, *overrides, micro=False,
                 env=user_env(), fault="step:2")  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    return run_dir


# Without the replay (trainer.verify_resume=false) the audit is what is left to find lost
# state; with it, the replay from the run's start rebuilds `preds` (tests/test_resume_replay.py).
UNVERIFIED = "trainer.verify_resume=false"


def test_strict_refuses_a_resume_that_cannot_be_bitwise_then_the_flag_records_why(tmp_path):
    run = killed(tmp_path / "run", *PREDS)
    before = {name: (run / name).read_bytes() for name in ("run.json", "config.resolved.yaml")}
    listing = sorted(p.name for p in run.iterdir() if p.name != ".lock")  # a dead holder's
    refused = train(run, *USER, *PREDS, "resume=auto", UNVERIFIED, micro=False, env=user_env())
    assert refused.returncode == 2
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert errors == [errors[0]] and "Traceback" not in refused.stderr
    assert "task attribute `preds` (list, 32 items) is not in its state_dict()" in errors[0]
    assert "trainer.allow_unrestored_state=true" in errors[0]
    assert {name: (run / name).read_bytes() for name in before} == before  # nothing written
    assert sorted(p.name for p in run.iterdir() if p.name != ".lock") == listing
    assert run_json(run)["status"] == "running" and run_json(run)["resumes"] == []

    allowed = "trainer.allow_unrestored_state=true"
    assert_ok(train(run, *USER, *PREDS, "resume=auto", allowed, UNVERIFIED, micro=False,
                    env=user_env()))  # fmt: skip
    (entry,) = run_json(run)["resumes"]
    assert entry["bitwise_guarantee"] is False
    assert entry["verified"] == "not verified (trainer.verify_resume=false)"
    assert entry["unrestored"] == [
        "task attribute `preds` (list, 32 items) is not in its state_dict(): "
        "this resume cannot be bitwise"
    ]
    # The record is right: the resumed run saw 2 steps' scores, an uninterrupted one 3.
    assert jsonl(run / "metrics.jsonl")[0]["train_seen"] == 64.0


@pytest.mark.slow
def test_a_task_that_checkpoints_its_list_resumes_bitwise_and_says_so(tmp_path):
    restored = ["task._target_=numpy_user_code.RestoredPredictionList"]
    assert_ok(train(tmp_path / "ref", *USER, *restored, micro=False, env=user_env()))
    run = killed(tmp_path / "run", *restored)
    assert_ok(train(run, *USER, *restored, "resume=auto", micro=False, env=user_env()))
    (entry,) = run_json(run)["resumes"]
    assert entry["bitwise_guarantee"] is True and entry["unrestored"] == []
    assert entry["audited"] is True
    assert jsonl(run / "metrics.jsonl")[0]["train_seen"] == 96.0
    assert (
        run_json(run)["final_weights_sha256"] == run_json(tmp_path / "ref")["final_weights_sha256"]
    )
