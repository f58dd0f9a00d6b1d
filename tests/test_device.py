"""Device resolution: a named reason when CUDA is unusable, ``auto`` never silent, and the
recorded device reused on resume/reproduce (``torch.cuda`` monkeypatched: no GPU here)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from reprotrain.errors import ReprotrainError
from reprotrain.repro import device as dev


@pytest.fixture
def no_cuda(monkeypatch, tmp_path):
    """A CUDA build of torch on a host without a driver (the default state here)."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(dev, "_NVIDIA_DRIVER", tmp_path / "no-driver")


def gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def one_line_error(spec: str, **kw) -> str:
    with pytest.raises(ReprotrainError) as e:
        dev.resolve(spec, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_cuda_on_a_cpu_build_of_torch_names_the_build(monkeypatch, no_cuda):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "CPU-only build" in one_line_error("cuda")


def test_cuda_with_an_empty_cuda_visible_devices_names_the_variable(monkeypatch, no_cuda):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "CUDA_VISIBLE_DEVICES=''" in one_line_error("cuda")


def test_cuda_without_a_driver_says_how_to_start_the_container(no_cuda):
    msg = one_line_error("cuda:0")
    assert "no NVIDIA driver" in msg and "--gpus" in msg


def test_cuda_with_a_driver_too_old_repeats_torchs_reason(monkeypatch, no_cuda):
    def too_old() -> bool:
        warnings.warn(
            "CUDA initialization: The NVIDIA driver on your system is too old", stacklevel=2
        )
        return False

    monkeypatch.setattr(torch.cuda, "is_available", too_old)
    assert "driver on your system is too old" in one_line_error("cuda")


def test_auto_falls_back_to_cpu_with_a_warning_that_names_why(no_cuda, caplog):
    with caplog.at_level(logging.WARNING, logger="reprotrain"):
        assert dev.resolve("auto") == torch.device("cpu")
    assert "auto resolved to cpu" in caplog.text and "no NVIDIA driver" in caplog.text


def test_auto_and_cuda_resolve_to_an_indexed_gpu(monkeypatch):
    gpus(monkeypatch, 4)
    assert dev.resolve("auto") == torch.device("cuda", 0)
    assert dev.resolve("cuda") == torch.device("cuda", 0)
    assert dev.resolve("cuda", local_rank=2) == torch.device("cuda", 2)  # DDP rank 2
    assert dev.resolve("cuda:3") == torch.device("cuda", 3)
    assert "only 4 GPU(s)" in one_line_error("cuda:4")


def test_an_unknown_device_lists_the_choices():
    assert dev.CHOICES in one_line_error("gpu")
    assert dev.CHOICES in one_line_error("cpu:1")


def test_mps_is_only_used_when_asked_and_carries_no_bitwise_promise(monkeypatch, caplog):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert "MPS is not available" in one_line_error("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    with caplog.at_level(logging.WARNING, logger="reprotrain"):
        assert dev.resolve("mps") == torch.device("mps")
    assert "no bitwise promise" in caplog.text
    assert dev.bitwise_caveat(torch.device("mps")) == dev.MPS_CAVEAT
    assert dev.bitwise_caveat(torch.device("cpu")) is None


def test_on_a_mac_auto_trains_on_the_cpu_and_names_mps(monkeypatch, caplog):
    """macOS arm64: torch has no CUDA; auto keeps the bitwise CPU and says how to use MPS."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    with caplog.at_level(logging.WARNING, logger="reprotrain"):
        assert dev.resolve("auto") == torch.device("cpu")
    assert "CPU-only build" in caplog.text and "trainer.device=mps" in caplog.text
    assert dev.MPS_CAVEAT in caplog.text
    caplog.clear()
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="reprotrain"):
        assert dev.resolve("auto") == torch.device("cpu")
    assert "mps" not in caplog.text


# ---------------------------------------------------------------- resume and reproduce


def test_a_cpu_run_resumes_on_the_cpu_on_a_gpu_host(monkeypatch):
    gpus(monkeypatch, 1)
    assert dev.resolve_for_resume("cpu", "auto", allow_change=False) == torch.device("cpu")


def test_a_cuda_run_resumed_where_cuda_is_gone_is_refused_in_one_line(no_cuda):
    with pytest.raises(ReprotrainError) as e:
        dev.resolve_for_resume("cuda:0", "auto", allow_change=False)
    msg = str(e.value)
    assert "\n" not in msg and "recorded on cuda:0" in msg and dev.ALLOW_CHANGE_OVERRIDE in msg


def test_a_forced_device_change_returns_the_new_device_and_reports_it(no_cuda):
    device = dev.resolve_for_resume("cuda:0", "auto", allow_change=True)
    assert device == torch.device("cpu")


def test_an_explicit_other_device_type_is_refused_unless_allowed(monkeypatch):
    gpus(monkeypatch, 1)
    with pytest.raises(ReprotrainError, match="recorded on cpu"):
        dev.resolve_for_resume("cpu", "cuda", allow_change=False)
    assert dev.resolve_for_resume("cpu", "cuda", allow_change=True) == torch.device("cuda", 0)


def test_the_gpu_ordinal_is_not_identity(monkeypatch):
    """Recorded on cuda:3 of an 8-GPU host, resumed where one GPU is visible."""
    gpus(monkeypatch, 1)
    assert dev.resolve_for_resume("cuda:3", "auto", allow_change=False) == torch.device("cuda", 0)
    gpus(monkeypatch, 8)
    assert dev.resolve_for_resume("cuda:3", "auto", allow_change=False) == torch.device("cuda", 3)
    assert dev.resolve_for_resume("cuda:3", "auto", False, local_rank=1) == torch.device("cuda", 1)


def test_records_without_a_resolved_device_resolve_as_new(monkeypatch):
    gpus(monkeypatch, 1)
    assert dev.resolve_for_resume(None, "auto", allow_change=False) == torch.device("cuda", 0)


def test_reproduce_replays_on_the_recorded_device_type(monkeypatch, no_cuda):
    assert dev.replay_spec("cpu") == ("cpu", None)
    spec, reason = dev.replay_spec("cuda:0")
    assert spec == "cpu" and "recorded on cuda:0" in reason and "no NVIDIA driver" in reason
    gpus(monkeypatch, 2)
    assert dev.replay_spec("cpu") == ("cpu", None)  # a CPU archive stays on the CPU
    assert dev.replay_spec("cuda:1") == ("cuda", None)
    assert dev.replay_spec(None) == ("auto", None)


def test_the_recorded_device_is_read_from_run_json():
    new = {"environment": {"device": {"type": "cuda", "resolved": "cuda:1"}}}
    assert dev.recorded_device(new) == "cuda:1"
    assert dev.recorded_device({}) is None
