"""Determinism levels: the flags each level applies, and what a nondeterministic op does."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

import reprotrain.train as trainer
from reprotrain import CONF_DIR
from reprotrain.config import register_configs
from reprotrain.errors import ReprotrainError
from reprotrain.repro import determinism
from reprotrain.run.record import RUN_JSON
from reprotrain.selfcheck.net import TinyConvNet

register_configs()


@pytest.fixture(autouse=True)
def restore_torch_globals():
    threads = torch.get_num_threads()
    yield
    torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = True
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, False
    torch.set_num_threads(threads)


def nondeterministic_op() -> None:
    """put_ without accumulate alerts on the CPU too (most alerts are CUDA-only)."""
    torch.zeros(4).put_(torch.tensor([0, 1]), torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("level", ["strict", "warn", "fast"])
def test_each_level_applies_and_reports_its_flags(level):
    flags = determinism.apply(level, num_threads=1)
    strict_like = level != "fast"
    assert flags["deterministic_algorithms"] is strict_like
    assert flags["deterministic_warn_only"] is (level == "warn")
    assert flags["cudnn_deterministic"] is strict_like
    assert flags["cudnn_benchmark"] is not strict_like
    # TF32 is trainer.precision's, not the level's (tests/test_precision.py): off at 32-true.
    assert set(flags["fp32_precision"].values()) == {"ieee"}  # no TF32 on any backend
    assert flags["precision"] == "32-true"
    assert flags["fill_uninitialized_memory"] is strict_like
    assert flags["num_threads"] == torch.get_num_threads() == 1
    assert flags["cublas_workspace_config"] == ":4096:8"


def test_strict_raises_warn_records_fast_ignores():
    determinism.apply("strict", 1)
    with pytest.raises(RuntimeError, match="deterministic"):
        nondeterministic_op()
    determinism.apply("warn", 1)
    sink: list[str] = []
    with determinism.nondeterminism_alerts(sink):
        nondeterministic_op()
        nondeterministic_op()
    assert len(sink) == 1 and sink[0].startswith("put_")
    determinism.apply("fast", 1)
    sink.clear()
    with determinism.nondeterminism_alerts(sink):
        nondeterministic_op()
    assert sink == []


class WithNondeterministicOp(TinyConvNet):
    """A user's model (brought by ``_target_``) with one op that has no deterministic kernel."""

    def forward(self, x):
        nondeterministic_op()
        return super().forward(x)


def run_in_process(tmp_path, monkeypatch, level):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "experiment=selfcheck",
                f"repro={level}",
                f"model._target_={__name__}.WithNondeterministicOp",
                "dataset.num_train=128",
                "dataset.num_test=64",
                "trainer.batch_size=64",
                "trainer.epochs=1",
            ],
        )
    from reprotrain.distributed import Dist

    return trainer.train(cfg, tmp_path, Dist())


def test_trainer_records_nondeterministic_ops_at_warn(tmp_path, monkeypatch):
    run_in_process(tmp_path, monkeypatch, "warn")
    record = json.loads((tmp_path / RUN_JSON).read_text())
    assert record["status"] == "completed"
    assert any(op.startswith("put_") for op in record["nondeterministic_ops"])


def test_trainer_refuses_nondeterministic_ops_at_strict(tmp_path, monkeypatch):
    with pytest.raises(ReprotrainError, match="repro=warn"):
        run_in_process(tmp_path, monkeypatch, "strict")


def test_the_selfcheck_net_uses_only_modules_with_deterministic_cuda_kernels():
    """No GPU in CI, so guard statically: torch documents which ops raise under
    use_deterministic_algorithms on CUDA (AdaptiveAvgPool2d's backward, max-unpooling,
    interpolation backward, ...); the framework's own net sticks to modules that do not.
    (tests/starter checks the user's reference models the same way.)"""
    from reprotrain.selfcheck.net import WIDE

    allowed = (
        TinyConvNet,
        nn.Sequential,
        nn.Conv2d,
        nn.BatchNorm2d,
        nn.ReLU,
        nn.Dropout,
        nn.Linear,
    )
    for kwargs in ({}, WIDE, {"dropout": 0.5}):
        for name, module in TinyConvNet(**kwargs).named_modules():
            assert isinstance(module, allowed), f"{name}: {type(module).__name__}"
