"""A resume proves what it claims: state the checkpoint cannot restore is named, recorded as
not bitwise, and refused under repro=strict unless allowed.

The user's task here appends every score to ``self.preds`` (tests/numpy_user_code.py), the
obvious way to collect them for an AUROC; no ``state_dict`` holds the list, so a resumed
run would silently count 1 step's scores where the uninterrupted one counts 3.
"""

from __future__ import annotations

import importlib
import signal
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

import callback_user_code
import hidden_state_user_code as hidden
from conftest import REPO, TINY, assert_ok, base_env, jsonl, run_json, train
from numpy_user_code import PredictionList, RestoredPredictionList
from reprotrain.callbacks import Callbacks
from reprotrain.data.base import InMemoryImages
from reprotrain.data.pipeline import LoaderPipeline, PipelineSpec
from reprotrain.repro.seeding import Seeds, seed_globals
from reprotrain.resume.audit import ResumeAudit
from reprotrain.selfcheck.net import TinyConvNet

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


# --- everything reachable from the run's objects (issue 45) ---------------------------------


class Task:
    """A task holding its loss module (as the built-in tasks do)."""

    def __init__(self, loss: nn.Module) -> None:
        self.loss_fn = loss


def parts(model=None, loss=None, optimizer=torch.optim.SGD, lr_lambda=None, callbacks=None):
    """One process's run objects, built as a run builds them, and its audit."""
    model = model or TinyConvNet(widths=[4])
    opt = optimizer(model.parameters(), lr=0.1, momentum=0.9)
    if lr_lambda is None:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    else:
        sched = lr_lambda(opt, 10)
    cbs = Callbacks(callbacks or {}, CPU)
    state = SimpleNamespace(optimizer=opt, scheduler=sched, callbacks=cbs)
    task = Task(loss or nn.CrossEntropyLoss())
    audit = ResumeAudit(task, None, model, CPU, trainer_state=state)
    seed_globals(0)
    return SimpleNamespace(model=model, opt=opt, sched=sched, task=task, cbs=cbs, audit=audit)


def trained(run: SimpleNamespace, steps: int = 4) -> None:
    """``steps`` optimizer steps and epoch ends, as a run between two checkpoints."""
    for _ in range(steps):
        run.opt.zero_grad()
        out = run.model(torch.ones(2, 3, 8, 8))
        run.task.loss_fn(out, torch.tensor([0, 1])).backward()
        run.opt.step()
        run.sched.step()
        for callback in run.cbs.callbacks.values():
            callback.on_epoch_end(None, {})


def restored(saved: SimpleNamespace, again: SimpleNamespace, recorded=None) -> list[str]:
    """What a fresh process finds after restoring every state_dict of ``saved``'s run
    (``recorded``: its checkpoint's digests, taken now if not given)."""
    recorded = recorded or saved.audit.state_dict()
    again.model.load_state_dict(saved.model.state_dict())
    again.opt.load_state_dict(saved.opt.state_dict())
    again.sched.load_state_dict(saved.sched.state_dict())
    if again.cbs.has_state():
        again.cbs.load_state_dict(saved.cbs.state_dict())
    again.audit.load_state_dict(recorded)
    return again.audit.unrestored()


KINDS = {
    "a private counter acting later": (
        {"model": lambda: hidden.LaterCounterNet(widths=[4])}, "model attribute `_calls` (int)"
    ),
    "a non-persistent buffer": (
        {"model": lambda: hidden.LaterBufferNet(widths=[4])},
        "model attribute `seen [non-persistent buffer]` (Tensor [])",
    ),
    "a loss module's private counter": (
        {"loss": hidden.CountingLoss}, "task attribute `loss_fn` (CountingLoss)"
    ),
    "an optimizer's private counter": (
        {"optimizer": lambda: hidden.CountingSGD}, "optimizer attribute `_steps` (int)"
    ),
    "a LambdaLR closure's count": (
        {"lr_lambda": lambda: hidden.counting_lambda_lr}, "scheduler attribute `lr_lambdas`"
    ),
    "a callback attribute changed in on_epoch_end": (
        {"callbacks": lambda: {"ends": callback_user_code.EpochEnds()}},
        "callback `ends` attribute `ends` (int)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(KINDS))
def test_state_no_state_dict_holds_is_named_by_its_path(kind):
    """The issue's false claims: state whose effect lands after the replayed interval. The
    checkpointing process's digests differ from the restored process's at its path."""
    made, path = KINDS[kind]

    def build() -> SimpleNamespace:
        return parts(**{k: make() for k, make in made.items()})

    first = build()
    trained(first)
    lines = restored(first, build())
    assert lines and lines[0].startswith(path), lines
    assert lines[0].endswith("this resume cannot be bitwise")


def test_a_module_global_written_at_validation_is_named():
    first = parts(model=hidden.ValidationGlobalNet(widths=[4]))
    first.model.eval()
    first.model(torch.ones(1, 3, 8, 8))  # validation sets hidden_state_user_code.VALIDATED
    recorded = first.audit.state_dict()
    hidden.VALIDATED = 0  # a fresh process imports the module anew
    again = parts(model=hidden.ValidationGlobalNet(widths=[4]))
    again.audit.load_state_dict(recorded)
    assert again.audit.unrestored() == [
        "global `hidden_state_user_code.VALIDATED` (int) is not in any state_dict(): "
        "this resume cannot be bitwise"
    ]


# --- all user state: the user's code, the data, the process (issue 53) ------------------------

PLACES = {
    "a class attribute": (
        "ClassCounterNet", "class attribute `hidden_state_user_code.ClassCounterNet.calls` (int)"
    ),
    "a mutable default argument": (
        "DefaultArgumentNet",
        "function `hidden_state_user_code.DefaultArgumentNet.count` defaults (tuple, 1 items)",
    ),
    "a mutable keyword-only default": (
        "KeywordDefaultNet",
        "function `hidden_state_user_code.KeywordDefaultNet.count` keyword defaults "
        "(dict, 1 items)",
    ),
    "an attribute of a module-level function": (
        "FunctionAttributeNet", "function `hidden_state_user_code.forwards` attribute `calls` (int)"
    ),
    "os.environ": ("EnvironmentNet", f"environment `{hidden.ENV_COUNT}` (str)"),
    "a module-level function's closure": (
        "ClosureCounterNet",
        "function `hidden_state_user_code._tick` closure `calls` (list, 1 items)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("place", list(PLACES))
def test_state_in_the_users_code_or_the_process_is_named_by_its_path(place, monkeypatch):
    """A count no object's attributes hold: the checkpointing process's digests differ, at
    that path, from a fresh process's (the module imported anew, the environment as it
    started) that restored every state_dict."""
    net, path = PLACES[place]
    monkeypatch.setenv(hidden.ENV_COUNT, "0")
    first = parts(model=getattr(hidden, net)(widths=[4]))
    trained(first)
    recorded = first.audit.state_dict()  # the checkpoint
    importlib.reload(hidden)  # a fresh process imports the user's module anew
    monkeypatch.setenv(hidden.ENV_COUNT, "0")
    lines = restored(first, parts(model=getattr(hidden, net)(widths=[4])), recorded)
    assert lines == [f"{path} is not in any state_dict(): this resume cannot be bitwise"]


def test_a_training_splits_read_counter_in_the_main_process_is_named_by_its_path():
    """The data pipeline's datasets are watched: a split counting its reads at 0 workers."""

    def build() -> tuple[LoaderPipeline, ResumeAudit]:
        data = hidden.CountingImages(num_train=16, num_test=8)
        seeds = Seeds(base=0, init=1, data=2, augment=3, train=4, source="config")
        spec = PipelineSpec(batch_size=8, eval_batch_size=8, device=CPU, seeds=seeds)
        pipeline = LoaderPipeline(data.splits(), data, spec, num_workers=0)
        return pipeline, ResumeAudit(Task(nn.MSELoss()), data, nn.Linear(2, 2), CPU,
                                     pipeline=pipeline)  # fmt: skip

    pipeline, first = build()
    seed_globals(0)
    for _ in pipeline.epoch(1):  # two steps of 8 reads
        pass
    recorded = first.state_dict()
    _, again = build()
    seed_globals(0)
    again.load_state_dict(recorded)
    assert again.unrestored() == [
        "data pipeline attribute `train_set.base.reads` (int) is not in its state_dict(): "
        "this resume cannot be bitwise"
    ]
    assert again.compared["data pipeline"] > 0 and again.compared["environment"] > 0
    not_compared = " ".join(again.not_compared)
    assert (
        "the modules outside your code that it uses (" in not_compared and "torch" in not_compared
    )


def test_torch_state_the_state_dicts_restore_is_not_reported():
    """Momentum, the schedule, a callback's complete state_dict, torch's lazily set
    attributes (a stepped optimizer's, a patched step): all restored, nothing named."""

    def build() -> SimpleNamespace:
        counter = callback_user_code.CheckpointCounter()
        return parts(model=nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.LazyLinear(2)),
                     callbacks={"count": counter})  # fmt: skip

    first = build()
    trained(first)
    first.cbs.callbacks["count"].on_checkpoint(None, None)
    again = build()
    again.model(torch.ones(2, 3, 8, 8))  # the lazy layer built, as the replay would
    assert restored(first, again) == []
    assert sum(again.audit.compared.values()) > 0


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
