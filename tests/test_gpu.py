"""CUDA checks (``pytest -m gpu``; ``scripts/gpu_check.sh`` runs them on a GPU host).

Every test here is marked ``gpu`` and skipped, with the reason CUDA is unusable, where there
is no GPU: they are collected everywhere and run where it matters. Training runs go through
``conftest.train`` (fresh processes) on the micro config with ``trainer.device=cuda``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import REPO, assert_ok, base_env, jsonl, run_json, train
from reprotrain.errors import ReprotrainError
from reprotrain.repro import determinism
from reprotrain.repro.checkpoint import list_step_checkpoints, load
from reprotrain.repro.device import cuda_unavailable_reason
from reprotrain.repro.precision import PRECISIONS

WHY_NOT = cuda_unavailable_reason()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(WHY_NOT is not None, reason=f"CUDA is not usable here: {WHY_NOT}"),
]
CUDA = "trainer.device=cuda"
CKPT_EVERY = "trainer.checkpoint_every_steps=3"


def same_bits(a, b) -> None:
    ra, rb = run_json(a), run_json(b)
    assert ra["status"] == rb["status"] == "completed"
    assert ra["final_weights_sha256"] == rb["final_weights_sha256"]
    assert jsonl(a / "fingerprints.jsonl") == jsonl(b / "fingerprints.jsonl")


@pytest.fixture(scope="module")
def cuda_reference(tmp_path_factory):
    """One strict micro run on cuda:0, checkpoints every 3 steps (8 steps per epoch)."""
    run_dir = tmp_path_factory.mktemp("cuda-ref") / "run"
    assert_ok(train(run_dir, CUDA, CKPT_EVERY))
    return run_dir


def test_strict_twins_are_bitwise_equal_on_cuda(tmp_path, cuda_reference):
    twin = tmp_path / "twin"
    assert_ok(train(twin, CUDA, CKPT_EVERY))
    same_bits(cuda_reference, twin)
    env = run_json(twin)["environment"]
    assert env["device"]["type"] == "cuda" and env["gpu"]["sm_count"] > 0
    assert env["cpu"]["capability"]  # data order and augmentation still run on the CPU


def test_kill_and_resume_on_cuda_is_bitwise_equal(tmp_path, cuda_reference):
    run_dir = tmp_path / "run"
    proc = train(run_dir, CUDA, CKPT_EVERY, fault="step:5")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    # The checkpoint holds the training GPU's generator only, as rank 0's entry.
    rng = load(list_step_checkpoints(run_dir / "checkpoints")[-1])["rng"]
    assert [r["cuda"]["device_index"] for r in rng["ranks"]] == [0]
    resumed = subprocess.run(
        [sys.executable, "-m", "reprotrain.tools.runs.resume", str(run_dir)],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert_ok(resumed)
    same_bits(cuda_reference, run_dir)
    entry = run_json(run_dir)["resumes"][0]
    assert entry["bitwise_guarantee"] is True, resume_reasons(entry)


def resume_reasons(entry: dict) -> str:
    """What a resume entry names as the reasons it is not bitwise: the assertion's message."""
    return (
        f"mismatch={entry.get('mismatch')} unrestored={entry.get('unrestored')} "
        f"replay={entry.get('replay')} verified={entry.get('verified')!r}"
    )


@pytest.mark.parametrize("precision", PRECISIONS)
def test_twins_are_bitwise_equal_on_cuda_at_every_precision(tmp_path, precision):
    """repro=strict promises the bits at the precision chosen: TF32 and autocast are
    deterministic run to run on one GPU. The flags are read back and recorded."""
    chosen = (CUDA, f"trainer.precision={precision}")
    a, b = tmp_path / "a", tmp_path / "b"
    assert_ok(train(a, *chosen))
    assert_ok(train(b, *chosen))
    same_bits(a, b)
    flags = run_json(a)["repro"]
    assert flags["precision"] == precision and flags["deterministic_algorithms"] is True
    tf32 = "tf32" if precision == "tf32" else "ieee"
    assert flags["fp32_precision"]["cuda.matmul"] == flags["fp32_precision"]["cudnn"] == tf32


def test_tf32_changes_the_bits_on_cuda(tmp_path, cuda_reference):
    """On a GPU with TF32 units (compute capability 8.0+) tf32 is another computation than
    32-true: its run differs from the strict 32-true reference (so the two are compared as
    two precisions, never as twins)."""
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("this GPU has no TF32 (compute capability below 8.0): tf32 is 32-true here")
    run_dir = tmp_path / "tf32"
    assert_ok(train(run_dir, CUDA, CKPT_EVERY, "trainer.precision=tf32"))
    assert (
        run_json(run_dir)["final_weights_sha256"]
        != run_json(cuda_reference)["final_weights_sha256"]
    )


@pytest.fixture
def deterministic():
    """Deterministic algorithms on for one test, the previous setting restored after."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_label_smoothing_cross_entropy_runs_under_deterministic_algorithms(deterministic):
    torch.use_deterministic_algorithms(True)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)

    def grads() -> torch.Tensor:
        g = torch.Generator(device="cuda").manual_seed(0)
        logits = torch.randn(512, 10, device="cuda", generator=g, requires_grad=True)
        target = torch.randint(0, 10, (512,), device="cuda", generator=g)
        loss_fn(logits, target).backward()
        return logits.grad

    first, second = grads(), grads()  # would raise here if the kernel had no deterministic path
    assert torch.equal(first, second)


def adaptive_pool_backward() -> None:
    # Output 3x3 from 7x7: a real adaptive pool (a 1x1 output would be a plain mean).
    x = torch.randn(4, 8, 7, 7, device="cuda", requires_grad=True)
    torch.nn.AdaptiveAvgPool2d(3)(x).sum().backward()
    torch.cuda.synchronize()


def test_adaptive_avg_pool_backward_alert_is_captured_at_warn(deterministic):
    torch.use_deterministic_algorithms(True, warn_only=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adaptive_pool_backward()
    alerts = [str(w.message) for w in caught if determinism.is_nondeterminism_alert(str(w.message))]
    assert any("adaptive_avg_pool2d_backward_cuda" in a for a in alerts), alerts
    # The trainer's handler records it once at warn, and turns it into one line at strict.
    sink: list[str] = []
    with determinism.nondeterminism_alerts(sink):
        adaptive_pool_backward()
        adaptive_pool_backward()
    assert len(sink) == 1 and "adaptive_avg_pool2d_backward_cuda" in sink[0]
    torch.use_deterministic_algorithms(True)
    strict = pytest.raises(ReprotrainError, match="adaptive_avg_pool2d_backward_cuda")
    with strict, determinism.nondeterminism_alerts([]):
        adaptive_pool_backward()
