"""The starter's samplers (src/starter/imbalanced.py, conf/sampler/, experiment=smoke_balanced):
each raises the positive share of what training sees towards balanced, and a class-balanced
run repeats bitwise (``tools.verify``, what ``make verify`` runs), resumes bitwise after a
SIGKILL mid-epoch, and gives the same bits at 0 and 2 loader workers and on 1 and 2
processes (slow tier). In-process guarantees of the seam itself: tests/test_sampler.py."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO, assert_ok, base_env, jsonl, metrics_without_timings, run_json, train
from reprotrain.data.pipeline import EpochOrder
from starter.imbalanced import Oversample, SyntheticImbalanced, class_balanced

BALANCED = [
    "experiment=smoke_balanced",
    "dataset.num_train=640",  # 576 train after the val split: 9 steps of 64 per epoch
    "dataset.num_test=256",
    "trainer.checkpoint_every_steps=3",
    "repro.num_threads=1",
    "logger=none",
]
KILL_AT = "step:4"  # epoch 1, one step after the step-3 checkpoint: a mid-epoch replay


def drawn_share(sampler) -> float:
    """The positive share of one epoch's draw (1.0 = every draw positive)."""
    train_split = SyntheticImbalanced().splits().train
    labels = train_split.samples[1]
    order = EpochOrder(len(labels), 7, sampler(train_split) if sampler else None)(1)
    return labels[order].float().mean().item()


def test_the_starters_samplers_raise_the_positive_share_towards_balanced():
    shuffled, balanced = drawn_share(None), drawn_share(class_balanced)
    oversampled = drawn_share(lambda split: Oversample(split, factor=4))
    assert 0.19 < shuffled < 0.23  # the data's own share, every sample once
    assert 0.46 < balanced < 0.54
    p = shuffled
    assert oversampled == pytest.approx(4 * p / (4 * p + 1 - p), abs=1e-6)  # exact: no draw
    assert len(Oversample(SyntheticImbalanced().splits().train, factor=4)) > 1843


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A class-balanced run and its twin, in fresh processes, by ``tools.verify``."""
    out = tmp_path_factory.mktemp("balanced")
    proc = subprocess.run(
        [sys.executable, "-m", "reprotrain.tools.runs.verify", "--out-dir", str(out), *BALANCED],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    (run,) = sorted(out.glob("*/a"))
    return run, proc


def test_a_class_balanced_run_repeats_bitwise_and_a_sigkill_mid_epoch_resumes_bitwise(
    reference, tmp_path
):
    run, verified = reference
    assert_ok(verified)
    assert "IDENTICAL" in verified.stdout, verified.stdout
    assert run_json(run)["components"]["sampler"].endswith("WeightedRandomSampler")
    killed = tmp_path / "killed"
    proc = train(killed, *BALANCED, fault=KILL_AT, micro=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    resumed = subprocess.run(
        [sys.executable, "-m", "reprotrain.tools.runs.resume", str(killed)],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert_ok(resumed)
    got, ref = run_json(killed), run_json(run)
    assert got["resumes"][0]["global_step"] == 3 and got["resumes"][0]["bitwise_guarantee"]
    assert got["final_weights_sha256"] == ref["final_weights_sha256"]
    assert metrics_without_timings(killed) == metrics_without_timings(run)
    assert jsonl(killed / "fingerprints.jsonl") == jsonl(run / "fingerprints.jsonl")


@pytest.mark.slow
def test_an_oversampled_run_is_the_same_at_0_and_2_loader_workers(tmp_path):
    loader = [*BALANCED, "sampler=oversample", "trainer.pipeline=loader"]
    for workers in (0, 2):
        assert_ok(train(tmp_path / f"w{workers}", *loader, f"trainer.num_workers={workers}",
                        micro=False))  # fmt: skip
    assert run_json(tmp_path / "w0")["components"]["sampler"] == "starter.imbalanced.Oversample"
    assert metrics_without_timings(tmp_path / "w0") == metrics_without_timings(tmp_path / "w2")
    shas = [run_json(tmp_path / f"w{w}")["final_weights_sha256"] for w in (0, 2)]
    assert shas[0] == shas[1]


@pytest.mark.slow
def test_a_class_balanced_run_on_two_processes_has_the_bits_of_one(tmp_path):
    invariant = [*BALANCED, "trainer.microbatch_size=16", "trainer.world_size_invariant=true"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert_ok(train(one, *invariant, micro=False))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "reprotrain.train", *invariant, f"hydra.run.dir={two}"]  # fmt: skip
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in base_env().items() if k not in drop}
    assert_ok(subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900))
    assert run_json(two)["world_size"] == 2
    assert metrics_without_timings(one) == metrics_without_timings(two)
    assert run_json(one)["final_weights_sha256"] == run_json(two)["final_weights_sha256"]


def test_class_balanced_draws_only_from_the_generator_it_is_handed():
    split = SyntheticImbalanced().splits().train
    sampler = class_balanced(split)
    a = EpochOrder(len(split), 3, sampler)(2)
    b = EpochOrder(len(split), 3, class_balanced(split))(2)
    torch.manual_seed(123)  # the global RNG plays no part
    assert torch.equal(a, b) and torch.equal(a, EpochOrder(len(split), 3, sampler)(2))


def test_exact_training_auroc_refuses_a_sampled_epoch_in_one_line(tmp_path):
    """docs/bring-your-own.md: task=binary's AUROC over the training split needs every sample
    once per epoch; an epoch drawn with repeats (class_balanced) is refused, never scored."""
    binary = ["experiment=smoke_binary", "sampler=class_balanced", *BALANCED[1:]]
    proc = train(tmp_path / "run", *binary, micro=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = [s for s in proc.stderr.splitlines() if s.startswith("error:")]
    assert "distinct sample indices were written" in line
    assert run_json(tmp_path / "run")["status"] == "failed"
