"""A sampler is a seam (conf/sampler/, src/reprotrain/data/sampler.py): it draws each
epoch's global order from the generator the framework hands it, seeded by (data seed,
epoch), so twins, a mid-epoch resume, ``num_workers`` and the world size keep their bits;
a sampler given any other way is refused in one line before a run directory exists.

The user's code here is tests/sampler_user_code.py; the starter's samplers trained end to
end (twins, SIGKILL and resume): tests/starter/test_sampler_examples.py.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import RandomSampler, WeightedRandomSampler

import sampler_user_code as user
from conftest import MICRO, REPO, TINY, assert_ok, base_env, run_json, train
from reprotrain import preflight
from reprotrain.batches import MicroBatches
from reprotrain.data.pipeline import EpochOrder, PipelineSpec, build_pipeline, epoch_order
from reprotrain.errors import ReprotrainError
from reprotrain.repro.seeding import Seeds

CPU = torch.device("cpu")
SEEDS = Seeds(base=0, init=1, data=2, augment=3, train=4, source="config")


def pipeline(data, sampler, *, kind="auto", workers=0, rank=0, world=1, batch=32, micro=0):
    splits = data.splits()
    made = sampler(splits.train) if sampler is not None else None
    layout = {"rank": rank, "world_size": world, "microbatch_collate": micro}
    spec = PipelineSpec(batch, 16, CPU, SEEDS, sampler=made, **layout)
    return build_pipeline(kind, splits, data, workers, spec)


def epoch(p, e: int = 1, start: int = 0) -> list[tuple[int, list[torch.Tensor]]]:
    """Each step's tensors (a step's micro-batches, collated alone, concatenated)."""
    out = []
    for step, batch in p.epoch(e, start):
        parts = batch.parts if isinstance(batch, MicroBatches) else [batch]
        out.append((step, [torch.cat(t) for t in zip(*parts, strict=True)]))
    return out


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        sa == sb and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))
        for (sa, ta), (sb, tb) in zip(a, b, strict=True)
    )


def test_a_random_sampler_handed_the_frameworks_generator_draws_the_frameworks_own_order():
    """The generator a sampler is handed is the one the default shuffle draws from."""
    sampler = RandomSampler(range(100))
    order = EpochOrder(100, data_seed=9, sampler=sampler)
    for e in (1, 2, 3):
        assert torch.equal(order(e), epoch_order(100, 9, e))
    assert sampler.generator is None  # nothing of the framework's is left on the sampler


def test_a_class_weighted_sampler_raises_the_minority_share_from_0_117_towards_balanced():
    shares = {}
    for name, sampler in (("shuffle", None), ("balanced", user.class_balanced)):
        labels = torch.cat([t[1] for _, t in epoch(pipeline(user.Skewed(), sampler))])
        shares[name] = labels.float().mean().item()
    assert abs(shares["shuffle"] - user.MINORITY) < 0.01
    assert 0.45 < shares["balanced"] < 0.55, shares


def test_twins_draw_the_same_order_and_another_data_seed_or_epoch_another():
    def order(data_seed, e):
        return EpochOrder(1000, data_seed, user.class_balanced(user.Skewed().splits().train))(e)

    assert torch.equal(order(2, 1), order(2, 1))  # two fresh samplers: the same draw
    assert not torch.equal(order(2, 1), order(2, 2)) and not torch.equal(order(2, 1), order(3, 1))


@pytest.mark.parametrize("kind", ["device", "loader"])
def test_a_sampled_epoch_resumed_at_step_k_is_the_tail_of_the_whole_epoch(kind):
    whole = epoch(pipeline(user.Skewed(), user.class_balanced, kind=kind), e=2)
    resumed = epoch(pipeline(user.Skewed(), user.class_balanced, kind=kind), e=2, start=11)
    assert len(whole) == 31 and same(resumed, whole[11:])


def test_a_sampled_epoch_is_the_same_with_0_and_2_workers_and_a_repeat_draws_its_own_noise():
    steps = {w: epoch(pipeline(user.Noisy(), user.Repeat, workers=w)) for w in (0, 2)}
    assert same(steps[0], steps[2])
    index = torch.cat([t[0] for _, t in steps[0]])
    noise = torch.cat([t[2] for _, t in steps[0]])
    assert sorted(index.tolist()) == sorted(list(range(96)) * 2)  # each sample twice
    first, again = (noise[index == 5]).tolist()
    assert first != again  # keyed (epoch, 5) and (epoch, 5, 1): transformed apart


@pytest.mark.parametrize(
    "data, kind, micro",
    [(user.Skewed, "device", 0), (user.Skewed, "loader", 0), (user.Noisy, "loader", 0),
     (user.Noisy, "loader", 8)],
)  # fmt: skip
def test_two_ranks_take_their_parts_of_the_same_sampled_global_batches(data, kind, micro):
    """A sampler draws the epoch's global order; each rank takes its part of each global
    batch, so ranks 0 and 1 of 2 together see one process's batches (micro-batches too)."""
    sampler = user.class_balanced if data is user.Skewed else user.Repeat
    one = epoch(pipeline(data(), sampler, kind=kind, micro=micro))
    ranks = [
        epoch(pipeline(data(), sampler, kind=kind, rank=r, world=2, micro=micro)) for r in (0, 1)
    ]
    joined = [(s, [torch.cat(pair) for pair in zip(a, b, strict=True)])
              for (s, a), (_, b) in zip(*ranks, strict=True)]  # fmt: skip
    assert same(joined, one)


# -- refusals: one line, exit 2, and (where the config or the class shows it) no run dir ---


def preflight_line(*overrides: str) -> str:
    """What ``python -m reprotrain.train`` prints before Hydra starts, run in this process."""
    err, saved = io.StringIO(), sys.argv[:]
    sys.argv = ["reprotrain.train", *MICRO, *TINY, *overrides]
    preflight._checked = False
    try:
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
            preflight.cli_check()
    finally:
        sys.argv, preflight._checked = saved, False
    assert stop.value.code == 2 and len(err.getvalue().splitlines()) == 1, err.getvalue()
    return err.getvalue()


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["+dataset.sampler=x"], "the dataset's YAML has a `sampler` key; bring it as its own"),
        (["+dataset.batch_sampler=x"], "`batch_sampler` key"),
        (["dataset._target_=sampler_user_code.ImagesWithSamplerAttribute"],
         "has a `sampler` attribute, which the framework never uses"),
        (["+sampler._target_=torch.utils.data.SequentialSampler"],
         "SequentialSampler has no `generator` to seed; a sampler is a class"),
        (["+sampler._target_=torch.utils.data.DistributedSampler", "+sampler._partial_=true"],
         "DistributedSampler has no `generator`"),
        (["+sampler._target_=sampler_user_code.unannotated", "+sampler._partial_=true"],
         "a function annotated to return one"),
        (["+sampler._target_=torch.utils.data.RandomSampler", "+sampler._partial_=true",
          "+sampler.generator=null"], "sampler.generator is set; leave it out"),
        (["+sampler._target_=torch.utils.data.RandomSampler", "+sampler._partial_=true",
          "+sampler.replace=true"], "sampler: unknown key 'replace'"),
        (["+sampler._target_=sampler_user_code.Nowhere"], "sampler._target_="),
    ],
)  # fmt: skip
def test_a_sampler_given_any_other_way_is_one_line_before_the_run(overrides, says):
    assert says in preflight_line(*overrides)


def train_on(run: Path, dataset: str) -> subprocess.CompletedProcess:
    """A micro run in ``run`` on ``tests/sampler_user_code.<dataset>``."""
    target = f"dataset._target_=sampler_user_code.{dataset}"
    return subprocess.run(
        [sys.executable, "-m", "reprotrain.train", *MICRO, *TINY, target, f"hydra.run.dir={run}"],
        cwd=REPO, env=base_env(PYTHONPATH=str(REPO / "tests")), capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip


def test_a_sampler_attribute_on_the_dataset_is_exit_2_and_no_run_dir(tmp_path):
    """The issue's case, as typed: without the refusal it trained as if it had no sampler."""
    run = tmp_path / "run"
    proc = train_on(run, "ImagesWithSamplerAttribute")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        "error: dataset sampler_user_code.ImagesWithSamplerAttribute has a `sampler` attribute, "
        "which the framework never uses (it draws each epoch's order itself); bring it as its "
        "own group: sampler=<name>, conf/sampler/<name>.yaml (docs/bring-your-own.md)"
    ]
    assert not run.exists()


@pytest.mark.parametrize("dataset", ["ImagesWithSamplerInInit", "ImagesWithSamplerFromLabels"])
def test_a_sampler_set_on_the_dataset_instance_stops_the_run_in_one_line_recorded_failed(
    tmp_path, dataset
):
    """Only building the dataset (or loading its data) shows it: refused then, in one line,
    before a step, the run recorded as failed."""
    run = tmp_path / "run"
    proc = train_on(run, dataset)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = [s for s in proc.stderr.splitlines() if s.startswith("error:")]
    assert line.startswith(f"error: dataset sampler_user_code.{dataset} has a `sampler` attr")
    assert run_json(run)["status"] == "failed" and not (run / "checkpoints").exists()


@pytest.mark.parametrize(
    "sampler, says",
    [
        (user.Counting, "drew two orders for epoch 1 from the same generator"),
        (user.Pairs, "yields [0, 0], not indices (a batch sampler is not one"),
        (lambda split: WeightedRandomSampler([1.0] * 2000, 10), "drew an index outside the"),
        (lambda split: iter(range(10)), "has no __len__, generator"),
        (lambda split: RandomSampler(split, generator=torch.Generator()), "its own generator"),
    ],
)
def test_a_built_sampler_that_breaks_the_contract_is_one_line(sampler, says):
    with pytest.raises(ReprotrainError) as e:
        pipeline(user.Skewed(), sampler)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_random_sampler_trains_the_bits_of_no_sampler_and_is_recorded(tmp_path: Path):
    """End to end: the generator a sampler gets is the default shuffle's, (data seed, epoch)."""
    random = ["+sampler._target_=torch.utils.data.RandomSampler", "+sampler._partial_=true"]
    assert_ok(train(tmp_path / "plain", *TINY))
    assert_ok(train(tmp_path / "sampled", *TINY, *random))
    plain, sampled = run_json(tmp_path / "plain"), run_json(tmp_path / "sampled")
    assert sampled["components"]["sampler"] == "torch.utils.data.sampler.RandomSampler"
    assert plain["components"]["sampler"] is None
    assert sampled["final_weights_sha256"] == plain["final_weights_sha256"]
