"""The one comparability rule: each field it lists changes the verdict, the fields it leaves
out (how many GPUs are visible, which one, memory) do not. Environments come from
``environment.capture`` on a fake CUDA host (``torch.cuda`` monkeypatched)."""

from __future__ import annotations

import copy

import pytest
import torch

from fake_cuda import A100, H100, gpu_env
from reprotrain.repro import comparability, environment
from reprotrain.repro.comparability import differences, notes

pytestmark = pytest.mark.host_facts  # tests/host_facts.py: also run as on other hosts


@pytest.fixture
def h100(monkeypatch) -> dict:
    return gpu_env(monkeypatch, index=0, n=8, model=H100)


def changed(env: dict, path: str, value) -> dict:
    out = copy.deepcopy(env)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[key]
    node[last] = value
    return out


def another(current, *candidates):
    """The first candidate that differs from the host's value: "another" is never a constant
    (on an AVX2 host, "AVX2" is no change)."""
    return next(c for c in candidates if c != current)


def test_an_environment_matches_itself(h100):
    assert differences(h100, h100) == [] and notes(h100, h100) == []
    cpu = environment.capture(torch.device("cpu"))
    assert differences(cpu, cpu) == []


def test_another_gpu_model_changes_the_verdict(monkeypatch, h100):
    a100 = gpu_env(monkeypatch, model=A100)
    got = differences(h100, a100)
    assert f"gpu model: {H100['name']} -> {A100['name']}" in got
    assert f"gpu SM count: {H100['sms']} -> {A100['sms']}" in got


# (label, field, candidates for "another value": the first that differs from h100's is used)
RULE_FIELDS = [
    ("gpu SM count", "gpu.sm_count", (114, 132)),  # e.g. an H100 PCIe, or a MIG slice
    ("driver", "gpu.driver_version", ("575.57.08", "580.82.07")),
    ("driver CUDA version", "gpu.driver_cuda_version", ("12.9", "13.0")),
    ("CUDA", "cuda", ("12.8", "13.0")),
    ("cuDNN", "cudnn", (91002, 91300)),
    ("torch", "torch", ("2.13.0+cu128", "2.14.1")),
    ("python", "python", ("3.12.3", "3.13.1")),
    ("numpy", "numpy", ("1.26.4", "2.4.6")),
    ("machine", "machine", ("aarch64", "x86_64")),
    ("world size", "world_size", (2, 3)),
    ("cpu capability", "cpu.capability", ("AVX2", "AVX512", "DEFAULT")),
    ("thread count", "num_threads", (7, 8)),
    ("BLAS library", "gpu.blas_library", ("Cublaslt", "Cublas")),
    ("cuBLAS workspace bytes", "gpu.cublas_workspace_bytes", (16 * 8 * 1024, 4096 * 8 * 1024)),
    ("cuBLASLt workspace bytes", "gpu.cublaslt_workspace_bytes", (1 << 20, 1 << 21)),
    ("fp16 reduced-precision reduction", "matmul.fp16_reduced_precision_reduction", (False, True)),
    ("bf16 reduced-precision reduction", "matmul.bf16_reduced_precision_reduction", (False, True)),
    *((f"${v}", f"gpu_env.{v}", ("1", "0")) for v in environment.GPU_ENV_VARS),
]


def value_at(env: dict, path: str):
    node = env
    for key in path.split("."):
        node = node[key]
    return node


@pytest.mark.parametrize("label,path,candidates", RULE_FIELDS, ids=[f[0] for f in RULE_FIELDS])
def test_each_field_of_the_rule_changes_the_verdict(h100, label, path, candidates):
    value = another(value_at(h100, path), *candidates)
    got = differences(h100, changed(h100, path, value))
    assert len(got) == 1 and got[0].startswith(f"{label}: ") and got[0].endswith(f"-> {value}")


def test_the_cublas_variables_named_in_the_issue_are_all_compared():
    compared = {label.lstrip("$") for label, _ in comparability.CUDA_RULE}
    assert {
        "CUBLAS_WORKSPACE_CONFIG",
        "CUBLASLT_WORKSPACE_SIZE",
        "TORCH_BLAS_PREFER_CUBLASLT",
        "NVIDIA_TF32_OVERRIDE",
        "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    } <= compared


def test_the_device_type_changes_the_verdict(h100):
    cpu = environment.capture(torch.device("cpu"))
    assert differences(h100, cpu) == ["device type: cuda -> cpu"]  # one line, not a storm


def test_the_visible_gpu_count_alone_does_not(monkeypatch, h100):
    """An 8-GPU host vs CUDA_VISIBLE_DEVICES=0 (and another of its GPUs, less memory free)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    one = gpu_env(monkeypatch, index=0, n=1, model=H100, free=1_000_000_000)
    assert differences(h100, one) == []
    assert "visible gpus: 8 -> 1" in notes(h100, one)
    other = gpu_env(monkeypatch, index=5, n=8, model=H100)
    assert differences(h100, other) == []
    assert any(line.startswith("gpu uuid:") for line in notes(h100, other))


def test_gpu_only_fields_do_not_matter_on_cpu_runs(monkeypatch):
    cpu = environment.capture(torch.device("cpu"))
    for path, value in (("cudnn", 1), ("cuda", "12.8"), ("gpu_env.NVIDIA_TF32_OVERRIDE", "1")):
        assert differences(cpu, changed(cpu, path, value)) == [], path


# ------------------------------------------------------------------ missing fields


def test_a_record_without_a_field_cannot_promise_bits_it_did_not_record(h100):
    """A field a record lacks is "not recorded": a difference, never shown equal."""
    old = {"torch": h100["torch"], "device": {"type": "cuda"}, "world_size": 1}
    got = differences(old, h100)
    assert "gpu SM count: not recorded -> 132" in got and "driver: not recorded -> 580.82.07" in got
    assert not any(line.startswith(("torch", "device type", "world size")) for line in got)


@pytest.mark.parametrize(
    "name, value",
    [("ONEDNN_DEFAULT_FPMATH_MODE", "BF16"), ("MKL_DYNAMIC", "FALSE"), ("KMP_AFFINITY", "compact"),
     ("GOMP_SPINCOUNT", "0"), ("OPENBLAS_CORETYPE", "Zen"), ("TORCH_ALLOW_TF32", "1"),
     ("PYTORCH_NO_CUDA_MEMORY_CACHING", "1"), ("CUDNN_LOGINFO_DBG", "1"), ("NCCL_ALGO", "Ring"),
     ("ATEN_NUM_THREADS", "3")],
)  # fmt: skip
def test_a_variable_of_the_kernel_families_changes_the_verdict_and_is_named(
    monkeypatch, name, value
):
    """Recorded by family (ONEDNN_*, DNNL_*, MKL_*, OMP_*, KMP_*, GOMP_*, OPENBLAS_*, ATEN_*,
    TORCH_*, PYTORCH_*, CUBLAS_*, CUDNN_*, CUDA_*, NCCL_*), not from a fixed list."""
    monkeypatch.delenv(name, raising=False)
    before = environment.capture(torch.device("cpu"))
    monkeypatch.setenv(name, f"{before['bits_env'].get(name)}-{value}")  # never the host's own
    after = environment.capture(torch.device("cpu"))
    assert differences(before, after) == [f"${name}: none -> {after['bits_env'][name]}"]
    assert differences(after, before) == [f"${name}: {after['bits_env'][name]} -> none"]


@pytest.mark.parametrize(
    "name", ["OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TORCH_HOME",
             "CUDA_PATH", "TORCH_EXTENSIONS_DIR", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
             "OMP_WAIT_POLICY"],
)  # fmt: skip
def test_thread_pool_sizes_visible_gpus_and_paths_are_notes_not_reasons(monkeypatch, name):
    monkeypatch.delenv(name, raising=False)
    before = environment.capture(torch.device("cpu"))
    monkeypatch.setenv(name, "7")
    after = environment.capture(torch.device("cpu"))
    assert differences(before, after) == []
    assert f"${name}: none -> 7" in notes(before, after)


def test_a_record_without_the_variable_families_cannot_promise_bits():
    now = environment.capture(torch.device("cpu"))
    older = {k: v for k, v in now.items() if k != "bits_env"}
    assert differences(older, now) == ["variables steering the kernels: not recorded"]
    assert differences(older, older) == []  # two records of that age compare as they did


def test_a_family_member_named_like_a_credential_is_recorded_by_digest_only(monkeypatch):
    monkeypatch.setenv("TORCH_HUB_TOKEN", "hunter2-secret-value")
    recorded = environment.capture(torch.device("cpu"))["bits_env"]["TORCH_HUB_TOKEN"]
    assert recorded.startswith("sha256:") and "hunter2" not in recorded
