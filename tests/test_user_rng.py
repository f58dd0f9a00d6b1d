"""Every global RNG user code can reach is seeded from the counters, and restored after.

User code draws from python ``random``, numpy's ``np.random`` and torch's global generator
(tests/numpy_user_code.py: a transform adding ``np.random.normal`` noise, mixup with
``np.random.beta``). Each draw must be a pure function of (sample, epoch) in the data path
and of (global step, global micro-batch) in the step: the same bits at any worker count,
any world size (invariant mode) and across a SIGKILL + resume.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from conftest import REPO, TINY, assert_ok, base_env, jsonl, run_json, train
from reprotrain.data import pipeline
from reprotrain.data.base import InMemoryImages, InMemoryTensors
from reprotrain.data.pipeline import SeededCollate, SeededSamples, keyed_items
from reprotrain.repro.rng import Scoped
from reprotrain.step.runner import StepRunner, StepSettings, TrainerState, evaluate
from reprotrain.tasks import Classification
from reprotrain.tasks.base import StepContext

USER = ["experiment=selfcheck", *TINY]
NOISY = ["dataset._target_=numpy_user_code.NoisyImages", "trainer.pipeline=loader"]
MIXUP = ["task._target_=numpy_user_code.NumpyMixup"]
IMAGES = (torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.zeros(2, dtype=torch.long))


def user_env(**extra: str) -> dict[str, str]:
    return base_env(PYTHONPATH=str(REPO / "tests"), **extra)


def global_states() -> tuple:
    return (random.getstate(), np.random.get_state()[1].tobytes(), torch.get_rng_state())


def _draw_all() -> tuple:
    return (random.random(), float(np.random.normal()), float(torch.rand(())))


# --- in process: the scopes ----------------------------------------------------------------


def test_scoped_seeds_python_numpy_and_torch_and_puts_them_back():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    before = global_states()
    with Scoped(42):
        first = _draw_all()
    assert global_states()[0] == before[0] and global_states()[1] == before[1]
    assert torch.equal(global_states()[2], before[2])
    _draw_all()  # consume the outer state: the scope must not care
    with Scoped(42):
        assert _draw_all() == first
    with Scoped(43):
        assert _draw_all() != first


def _numpy_state() -> tuple:
    _, key, pos, has_gauss, cached = np.random.get_state()
    return key.tobytes(), pos, has_gauss, cached


@pytest.mark.parametrize("outer_normals", [0, 1, 2], ids=["fresh", "cached-gaussian", "even"])
@pytest.mark.parametrize(
    "block",
    [lambda: None, lambda: np.random.normal(), lambda: np.random.normal(size=2),
     lambda: np.random.rand(5), lambda: np.random.set_state(np.random.get_state())],
    ids=["nothing", "one-normal", "two-normals", "uniform", "set-state"],
)  # fmt: skip
def test_numpy_comes_back_whole_with_its_cached_gaussian(outer_normals, block):
    """numpy's global state is saved by its words, not get_state (Scoped runs per
    micro-batch): its position and the legacy cached Gaussian come back exactly too, and
    the draws after the block are the ones that would have come without it."""
    np.random.seed(7)
    np.random.normal(size=outer_normals)  # one leaves a Gaussian cached in the RandomState
    before = _numpy_state()
    expected = np.random.normal(size=3)
    np.random.set_state(("MT19937", np.frombuffer(before[0], np.uint32), *before[1:]))
    with Scoped(42):
        block()
    assert _numpy_state() == before
    assert np.array_equal(np.random.normal(size=3), expected)


class _NoisyTensors(InMemoryTensors):
    def batch_transform(self, batch, key):
        x, y = batch
        return x + float(np.random.normal()), y


def test_a_datasets_own_batch_transform_runs_seeded_the_frameworks_own_unguarded(monkeypatch):
    """The RNG guard around a batch transform is for a dataset's own ``batch_transform``; the
    framework's (``InMemoryTensors``, ``InMemoryImages``: counter-based draws only) skip it."""
    on_device = pipeline.DevicePipeline._on_device
    where = SimpleNamespace(augment_seed=5, device=torch.device("cpu"), channels_last=False)
    where.dataset, batch, key = _NoisyTensors(), (torch.zeros(2), torch.zeros(2)), (5, 1, 0)
    np.random.seed(1)
    first = on_device(where, batch, key)[0]
    np.random.seed(2)  # whatever ran before: the draw depends on the key alone
    assert torch.equal(on_device(where, batch, key)[0], first)
    guarded = []
    monkeypatch.setattr(pipeline, "Scoped", lambda *a: guarded.append(a) or nullcontext())
    images = InMemoryImages(mean=[0.5] * 3, std=[0.25] * 3)
    for where.dataset, own in ((InMemoryTensors(), batch), (images, IMAGES)):
        on_device(where, own, key)
    assert guarded == []
    where.dataset = _NoisyTensors()
    on_device(where, (torch.zeros(2), torch.zeros(2)), key)
    assert len(guarded) == 1  # the dataset's own transform is guarded


class _Numpy:
    def __call__(self, sample, train):
        return sample + float(np.random.normal()) + random.random()


class _WithRng:
    def __call__(self, sample, train, rng):
        return sample + float(rng.normal())


@pytest.mark.parametrize("transform", [_Numpy(), _WithRng()], ids=["np.random", "rng"])
def test_a_samples_numpy_draws_depend_on_its_key_alone(transform):
    samples = SeededSamples([0.0] * 8, transform, augment_seed=5, train=True)
    first = samples[(1, 3)]
    np.random.seed(99), random.seed(99)  # whatever ran before in this worker
    np.random.normal(size=17)
    before = global_states()
    assert samples[(1, 3)] == first
    assert samples[(1, 4)] != first and samples[(2, 3)] != first
    assert global_states()[1] == before[1]  # nothing leaks out of the sample


def test_a_collate_that_draws_depends_on_the_batch_alone():
    collate = SeededCollate(lambda xs: sum(xs) + float(np.random.normal()), augment_seed=5)
    data = [float(i) for i in range(8)]
    first = collate(keyed_items(data_by_key(data), [(1, 2), (1, 5)]))
    np.random.normal(size=3)
    assert collate(keyed_items(data_by_key(data), [(1, 2), (1, 5)])) == first
    assert collate(keyed_items(data_by_key(data), [(2, 2), (2, 5)])) != first


class data_by_key:
    def __init__(self, data):
        self.data = data

    def __getitem__(self, key):
        return self.data[key[1]]


class _GlobalDraws(Classification):
    """Adds a global numpy, python and torch draw to the loss (so they reach the bits)."""

    def training_step(self, model, batch, ctx):
        out = super().training_step(model, batch, ctx)
        noise = float(np.random.beta(0.4, 0.4)) + random.random() + float(torch.rand(()))
        return out._replace(loss=out.loss * noise)

    def evaluation_step(self, model, batch, ctx):
        return {"loss": torch.tensor(float(np.random.normal())), "correct": torch.tensor(0)}


def _stepper(microbatch_size=None) -> StepRunner:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = TrainerState(model, opt, sched, scaler, torch.device("cpu"))
    return StepRunner(state, _GlobalDraws(nn.CrossEntropyLoss()),
                      settings=StepSettings(microbatch_size=microbatch_size),
                      train_seed=7)  # fmt: skip


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


@pytest.mark.parametrize("microbatch_size", [None, 4])
def test_a_steps_global_draws_depend_on_the_step_alone_and_do_not_leak(microbatch_size):
    a, b = _stepper(microbatch_size), _stepper(microbatch_size)
    np.random.seed(1), random.seed(1)
    loss_a = a.step(_batch(), global_step=3)[0]
    np.random.normal(size=11), random.random(), torch.rand(5)  # other code drew in between
    before = global_states()
    loss_b = b.step(_batch(), global_step=3)[0]
    assert torch.equal(loss_a, loss_b)
    pairs = zip(a.state.model.parameters(), b.state.model.parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)
    after = global_states()
    assert after[0] == before[0] and after[1] == before[1] and torch.equal(after[2], before[2])
    assert not torch.equal(b.step(_batch(), global_step=4)[0], loss_b)  # keyed by the step


def test_evaluation_batches_draw_from_their_own_counters():
    s = _stepper()
    batches = [_batch(), _batch()]
    kw = dict(prefix="val", device=torch.device("cpu"), train_seed=7, global_step=2)
    first = evaluate(s.task, s.state.model, iter(batches), **kw)
    np.random.normal(size=5)
    assert evaluate(s.task, s.state.model, iter(batches), **kw) == first


def test_the_step_context_hands_a_seeded_numpy_generator():
    ctx = StepContext(torch.device("cpu"), global_step=3, microbatch=1, train_seed=7)
    again = StepContext(torch.device("cpu"), global_step=3, microbatch=1, train_seed=7)
    other = StepContext(torch.device("cpu"), global_step=3, microbatch=2, train_seed=7)
    assert isinstance(ctx.numpy_generator, np.random.Generator)
    assert ctx.numpy_generator is ctx.numpy_generator  # one stream per micro-batch
    draw = ctx.numpy_generator.beta(0.4, 0.4)
    assert draw == again.numpy_generator.beta(0.4, 0.4)
    assert draw != other.numpy_generator.beta(0.4, 0.4)


# --- the trainer: workers, kills, world sizes ---------------------------------------------


def final_bits(run_dir) -> tuple:
    record = run_json(run_dir)
    return record["final_weights_sha256"], [
        f["step_losses"] for f in jsonl(run_dir / "fingerprints.jsonl")
    ]


@pytest.mark.slow  # five runs, two with loader workers: ~70 s on 2 busy cores
def test_numpy_noise_in_a_transform_is_the_same_at_0_and_2_workers_and_across_sigkill(tmp_path):
    ckpt = "trainer.checkpoint_every_steps=1"
    assert_ok(train(tmp_path / "w0", *USER, *NOISY, ckpt, "trainer.num_workers=0",
                    micro=False, env=user_env()))  # fmt: skip
    killed = train(tmp_path / "w2", *USER, *NOISY, ckpt, "trainer.num_workers=2", micro=False,
                   env=user_env(), fault="step:2")  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = subprocess.run(
        [sys.executable, "-m", "reprotrain.tools.runs.resume", str(tmp_path / "w2")],
        cwd=REPO, env=user_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert_ok(resumed)
    assert final_bits(tmp_path / "w0") == final_bits(tmp_path / "w2")
    (entry,) = run_json(tmp_path / "w2")["resumes"]
    assert entry["global_step"] == 1 and entry["bitwise_guarantee"] is True  # and it was
    # The noise is real: without it the weights differ.
    assert_ok(train(tmp_path / "clean", *USER, *NOISY, "+dataset.pixel_noise=0", micro=False,
                    env=user_env()))  # fmt: skip
    assert final_bits(tmp_path / "clean")[0] != final_bits(tmp_path / "w0")[0]


INVARIANT = ["trainer.microbatch_size=16", "trainer.world_size_invariant=true",
             "trainer.checkpoint_every_steps=1", "repro.num_threads=1"]  # fmt: skip


@pytest.mark.slow  # the default tier keeps the cheaper sibling test of this claim
def test_numpy_mixup_in_invariant_mode_resumes_bitwise_after_sigkill(tmp_path):
    assert_ok(train(tmp_path / "ref", *USER, *MIXUP, *INVARIANT, micro=False, env=user_env()))
    killed = train(tmp_path / "run", *USER, *MIXUP, *INVARIANT, micro=False,
                   env=user_env(), fault="step:2")  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert_ok(train(tmp_path / "run", *USER, *MIXUP, *INVARIANT, "resume=auto", micro=False,
                    env=user_env()))  # fmt: skip
    assert final_bits(tmp_path / "ref") == final_bits(tmp_path / "run")
    (entry,) = run_json(tmp_path / "run")["resumes"]
    assert entry["bitwise_guarantee"] is True and entry["unrestored"] == []  # and it was


def _torchrun(nproc: int, run_dir, *overrides: str) -> subprocess.CompletedProcess:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in user_env().items() if k not in drop}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "reprotrain.train", *overrides,
           f"hydra.run.dir={run_dir}"]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["NumpyMixup", "GeneratorMixup"])
def test_numpy_mixup_gives_the_same_bits_on_1_and_2_processes_in_invariant_mode(tmp_path, task):
    overrides = [*USER, f"task._target_=numpy_user_code.{task}", *INVARIANT]
    assert_ok(train(tmp_path / "w1", *overrides, micro=False, env=user_env()))
    assert_ok(_torchrun(2, tmp_path / "w2", *overrides))
    assert run_json(tmp_path / "w2")["world_size"] == 2
    assert final_bits(tmp_path / "w1") == final_bits(tmp_path / "w2")
