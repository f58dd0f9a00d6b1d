"""World-size invariance for batches whose shape depends on their samples (issue 34.3).

A collate that pads to the longest sequence it is given, plus token dropout whose mask has
the padded shape (drawn in the collate from its ``ctx.generator``, and in the task from the
step's ``ctx.generator``): under ``trainer.world_size_invariant=true`` each micro-batch is
collated alone, so its padding and every draw depend on the micro-batch alone and 1, 2 and 4
processes give the same bits. Before, each rank collated its share of the global batch: the
padded length, and so every mask, changed with the world size (W=1 and W=2 gave different
final weights on this job).

User code: tests/shapes_user_code.py (``Sequences``, ``PadAndDrop``, ``TokenNet``,
``TokenDropout``).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import faults
from conftest import REPO, assert_ok, base_env, jsonl, metrics_without_timings, run_json
from reprotrain.batches import MicroBatches, batch_size, narrow
from reprotrain.data.pipeline import LoaderPipeline, PipelineSpec
from reprotrain.distributed import Dist
from reprotrain.errors import ReprotrainError
from reprotrain.reduction import Exact, Local
from reprotrain.repro.seeding import Seeds
from reprotrain.step.runner import StepRunner, StepSettings, TrainerState
from reprotrain.tasks import Classification
from shapes_user_code import PAD, UNKNOWN, PadAndDrop, Sequences, TokenDropout, TokenNet
from test_reduction import ThreadReducer

SEEDS = Seeds(base=0, init=1, data=2, augment=3, train=4, source="config")
CPU = torch.device("cpu")

# --- in process: what the pipeline serves ---------------------------------------------------


def pipeline(rank: int, world: int, micro: int, workers: int = 0) -> LoaderPipeline:
    data = Sequences(num_train=96, num_test=16, collate=PadAndDrop(drop=0.3))
    spec = PipelineSpec(32, 16, CPU, SEEDS, rank=rank, world_size=world, microbatch_collate=micro)
    return LoaderPipeline(data.splits(), data, spec, num_workers=workers)


def micro_batches_by_step(world: int, workers: int = 0, start: int = 0) -> list[list]:
    """Each step's micro-batches over every rank, in rank order (= micro-batch order)."""
    ranks = [list(pipeline(r, world, 8, workers).epoch(1, start)) for r in range(world)]
    steps = []
    for per_rank in zip(*ranks, strict=True):
        assert len({step for step, _ in per_rank}) == 1
        parts = [part for _, batch in per_rank for part in batch]
        assert all(isinstance(batch, MicroBatches) for _, batch in per_rank)
        steps.append(parts)
    return steps


def assert_same(a: list[list], b: list[list]) -> None:
    assert len(a) == len(b)
    for step_a, step_b in zip(a, b, strict=True):
        assert len(step_a) == len(step_b) == 4  # k = 32 / 8
        for (ta, ya), (tb, yb) in zip(step_a, step_b, strict=True):
            assert ta.shape == tb.shape and torch.equal(ta, tb) and torch.equal(ya, yb)


def test_each_micro_batch_is_collated_alone_the_same_on_1_2_and_4_ranks_and_after_a_resume():
    one = micro_batches_by_step(1)
    assert_same(one, micro_batches_by_step(2))
    assert_same(one, micro_batches_by_step(4, workers=2))  # keys travel to workers intact
    assert_same(one[1:], micro_batches_by_step(2, start=1))  # a resume at step 1
    # Not vacuous: each micro-batch has its own padded length, and the collate drew.
    lengths = {tokens.shape[1] for step in one for tokens, _ in step}
    assert len(lengths) > 1
    assert all((tokens == UNKNOWN).any() for step in one for tokens, _ in step)
    # Its padding is the micro-batch's own: no column of padding alone.
    assert all((tokens[:, -1] != PAD).any() for step in one for tokens, _ in step)


def test_outside_invariance_a_rank_still_collates_its_share_at_once():
    shares = [list(pipeline(r, 2, 0).epoch(1)) for r in range(2)]
    whole = [tokens for _, (tokens, _) in pipeline(0, 1, 0).epoch(1)]
    for (_, (t0, _)), (_, (t1, _)), t in zip(*shares, whole, strict=True):
        assert batch_size((t0,)) == 16 and not isinstance(t0, MicroBatches)
        # Each share is padded to its own longest sequence: the shapes the mode fixes.
        assert max(t0.shape[1], t1.shape[1]) == t.shape[1]
    assert any(t0.shape != t1.shape for (_, (t0, _)), (_, (t1, _)) in zip(*shares, strict=True))


def test_a_collate_is_handed_its_micro_batchs_key():
    seen = []

    def collate(samples, ctx):
        seen.append((ctx.epoch, ctx.step, ctx.microbatch, ctx.training, ctx.seed))
        return PadAndDrop()(samples)

    data = Sequences(num_train=96, num_test=16, collate=collate)
    for rank in range(2):
        spec = PipelineSpec(32, 16, CPU, SEEDS, rank=rank, world_size=2, microbatch_collate=8)
        p = LoaderPipeline(data.splits(), data, spec)
        next(p.epoch(2, start_step=1))
    assert [s[:4] for s in seen] == [(2, 1, j, True) for j in range(4)]
    assert len({s[4] for s in seen}) == 4  # one seed per micro-batch
    list(p.eval_batches("test"))
    assert seen[-1][:4] == (None, 0, None, False)


# --- in process: the step runs micro-batches collated alone --------------------------------


def runner(seed: int = 0) -> StepRunner:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    state = TrainerState(model, opt, sched, torch.amp.GradScaler("cpu", enabled=False), CPU)
    reduction = Exact()
    reduction.prepare(model)
    return StepRunner(state, Classification(), reduction=reduction,
                      settings=StepSettings(microbatch_size=4))  # fmt: skip


def test_micro_batches_collated_alone_train_bit_for_bit_as_views_of_one_batch():
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g))
    views, parts = runner(), runner()
    for step in range(3):
        loss_a, _, _ = views.step(batch, step)
        pieces = MicroBatches(
            [tuple(t.clone() for t in narrow(batch, i, 4)) for i in range(0, 16, 4)]
        )
        loss_b, _, _ = parts.step(pieces, step)
        assert torch.equal(loss_a, loss_b)
    weights = zip(views.model.state_dict().values(), parts.model.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in weights)
    uneven = MicroBatches([narrow(batch, 0, 4), narrow(batch, 4, 8)])
    with pytest.raises(ReprotrainError, match="different sample counts"):
        parts.step(uneven, 3)


# --- in process: two ranks (threads, exact sums between them) train as one process --------


def train_in_process(world: int, microbatch_collate: int, steps: int = 6) -> list:
    """The sequence job's first ``steps`` steps on ``world`` ranks (threads sharing exact
    sums, as test_reduction.py does): rank 0's final weights and step losses."""
    data = Sequences(num_train=96, num_test=16, collate=PadAndDrop(drop=0.3))
    shared = ThreadReducer(world)
    out: dict[int, list] = {}

    models = {}
    for r in range(world):  # before the threads: they would share the global generator
        torch.manual_seed(0)
        models[r] = TokenNet(num_classes=4, hidden=16)

    def rank(r: int) -> None:
        model = models[r]
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        state = TrainerState(model, opt, sched, torch.amp.GradScaler("cpu", enabled=False), CPU)
        reduction = Exact(Dist(rank=r, world_size=world))
        reduction.reduce = shared.for_rank(r)
        reduction.prepare(model)
        settings = StepSettings(microbatch_size=8)
        step_runner = StepRunner(
            state, TokenDropout(drop=0.3), reduction=reduction, settings=settings, train_seed=4
        )
        losses = []
        for s, (_, batch) in enumerate(step_batches[r]):
            losses.append(step_runner.step(batch, s)[0].clone())
        out[r] = [*model.state_dict().values(), *losses]

    step_batches = {}
    for r in range(world):  # drawn before the threads: the pipeline seeds the global RNGs
        layout = dict(rank=r, world_size=world, microbatch_collate=microbatch_collate)
        p = LoaderPipeline(data.splits(), data, PipelineSpec(32, 16, CPU, SEEDS, **layout))
        step_batches[r] = [*p.epoch(1), *p.epoch(2)][:steps]
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == world, "a rank failed"
    return out[0]


def same(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_per_batch_padding_and_token_dropout_give_one_processes_bits_on_two_ranks():
    """Slow siblings (torchrun, gloo): ..._on_one_and_two_processes, ..._on_four_processes
    and the 2-process run resumed on 1 and on 4."""
    assert Exact().microbatch_collate(8) == 8 and Local().microbatch_collate(8) == 0
    one = train_in_process(1, microbatch_collate=8)
    assert same(one, train_in_process(2, microbatch_collate=8))
    # Each rank collating its share at once (the path before, and still outside the mode):
    # the padded lengths, so the token dropout masks, change with the world size.
    assert not same(train_in_process(1, 0), train_in_process(2, 0))


# --- end to end: torchrun, gloo ---------------------------------------------------------------

JOB = [
    "experiment=selfcheck",
    "dataset._target_=shapes_user_code.Sequences",
    *[f"~dataset.{key}" for key in ("noise", "mean", "std", "augment")],
    "dataset.num_train=128",
    "dataset.num_test=64",
    "dataset.val_fraction=0.0",
    "+dataset.collate={_target_:shapes_user_code.PadAndDrop,drop:0.2}",
    "model._target_=shapes_user_code.TokenNet",
    *[f"~model.{key}" for key in ("widths", "convs_per_stage", "dropout")],
    "model.num_classes=4",
    "task._target_=shapes_user_code.TokenDropout",
    "optimizer=adamw",
    "optimizer.lr=0.01",
    "scheduler=constant",
    "trainer.monitor=train_loss",
    "trainer.monitor_mode=min",
    "trainer.batch_size=32",
    "trainer.microbatch_size=8",  # k = 4
    "trainer.world_size_invariant=true",
    "trainer.epochs=2",
    "trainer.checkpoint_every_steps=2",
    "trainer.eval_batch_size=64",
    "repro.num_threads=1",
    "logger=none",
]


def env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    user = base_env(PYTHONPATH=str(REPO / "tests"))
    return {k: v for k, v in user.items() if k not in drop}


def launch(nproc: int, run_dir: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    trainer = ["-m", "reprotrain.train", *JOB, f"hydra.run.dir={run_dir}"]
    if fault:  # tests/faults.py runs the trainer (every rank) with the fault registered
        trainer = faults.command(fault, *trainer[1:])[1:]
    if nproc > 1:
        trainer = ["-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", *trainer]  # fmt: skip
    return subprocess.run([sys.executable, *trainer], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=900)  # fmt: skip


def assert_same_bits(a: Path, b: Path) -> None:
    ra, rb = run_json(a), run_json(b)
    assert ra["final_weights_sha256"] == rb["final_weights_sha256"]
    assert jsonl(a / "fingerprints.jsonl") == jsonl(b / "fingerprints.jsonl")  # every step loss
    assert metrics_without_timings(a) == metrics_without_timings(b)
    assert ra["final_metrics"] == rb["final_metrics"]


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("shapes") / "w1"
    assert_ok(launch(1, run))
    return run


@pytest.mark.slow
def test_per_batch_padding_and_token_dropout_give_the_same_bits_on_one_and_two_processes(
    one, tmp_path
):
    """Fast sibling: test_per_batch_padding_and_token_dropout_give_one_processes_bits_on_
    two_ranks (in process). This one failed before the fix: different final weights."""
    assert_ok(launch(2, tmp_path / "w2"))
    assert run_json(tmp_path / "w2")["world_size"] == 2
    assert_same_bits(one, tmp_path / "w2")


@pytest.mark.slow
def test_per_batch_padding_and_token_dropout_give_the_same_bits_on_four_processes(one, tmp_path):
    """Fast sibling: test_per_batch_padding_and_token_dropout_give_one_processes_bits_on_
    two_ranks (in process)."""
    assert_ok(launch(4, tmp_path / "w4"))
    assert_same_bits(one, tmp_path / "w4")


@pytest.mark.slow
@pytest.mark.parametrize("resume_on", [1, 4])
def test_a_two_process_run_with_per_batch_padding_resumes_on_another_world_size_bitwise(
    one, tmp_path, resume_on
):
    """Fast sibling: test_each_micro_batch_is_collated_alone_the_same_on_1_2_and_4_ranks_and_
    after_a_resume (the pipeline from a mid-epoch step on 2 ranks)."""
    run = tmp_path / "killed"
    killed = launch(2, run, fault="step:7")  # mid-epoch 2 (4 steps an epoch), after step 6's
    assert killed.returncode != 0 and run_json(run)["status"] == "running"
    cmd = [sys.executable, "-m", "reprotrain.tools.runs.resume", str(run), "--nproc",
           str(resume_on)]  # fmt: skip
    assert_ok(subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True,
                             timeout=900))  # fmt: skip
    (entry,) = run_json(run)["resumes"]
    assert entry["global_step"] == 6 and entry["bitwise_guarantee"] is True
    assert_same_bits(one, run)
