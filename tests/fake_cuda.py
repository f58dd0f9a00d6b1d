"""A fake CUDA host for tests on machines without a GPU: ``torch.cuda`` and nvidia-smi are
monkeypatched so the environment record can be exercised as it would be on a real GPU."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from reprotrain.repro import environment, machine

H100 = dict(name="NVIDIA H100 80GB HBM3", major=9, minor=0, sms=132, memory=85_028_896_768)
A100 = dict(name="NVIDIA A100-SXM4-80GB", major=8, minor=0, sms=108, memory=85_899_345_920)
DRIVER = "580.82.07"


def uuid_of(index: int) -> str:
    return f"GPU-{index:08x}-1111-2222-3333-444455556666"


def fake_gpu_host(
    monkeypatch,
    n: int = 8,
    model: dict = H100,
    driver: str | None = DRIVER,
    mig: str = "Disabled",
    free: int = 80_000_000_000,
) -> None:
    """``n`` identical GPUs of ``model``; nvidia-smi reports ``driver`` (None: not on PATH)."""

    def props(device):
        index = torch.device(device).index if not isinstance(device, int) else device
        return SimpleNamespace(
            name=model["name"],
            major=model["major"],
            minor=model["minor"],
            multi_processor_count=model["sms"],
            total_memory=model["memory"],
            uuid=uuid_of(index),
        )

    def smi(*args):
        if driver is None:
            return None
        return "".join(f"{uuid_of(i)}, {driver}, {mig}\n" for i in range(n))

    cuda = torch.cuda
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: n)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "get_device_properties", props)
    monkeypatch.setattr(cuda, "get_device_name", lambda d=None: model["name"])
    monkeypatch.setattr(cuda, "mem_get_info", lambda d=None: (free, model["memory"]))
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda d=None: 6 * 2**30)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda d=None: 5 * 2**30)
    monkeypatch.setattr(torch.backends.cuda, "cublas_workspace_size", lambda: 4096 * 1024 * 8)
    monkeypatch.setattr(torch.backends.cuda, "cublaslt_workspace_size", lambda: 4096 * 1024 * 8)
    monkeypatch.setattr(
        torch.backends.cuda, "preferred_blas_library", lambda: torch._C._BlasBackend.Cublas
    )
    monkeypatch.setattr(machine, "nvidia_smi", smi)


def gpu_env(monkeypatch, index: int = 0, **host) -> dict:
    """environment.capture() of a run on cuda:<index> of a fake host."""
    with monkeypatch.context() as m:
        fake_gpu_host(m, **host)
        return environment.capture(torch.device("cuda", index))
