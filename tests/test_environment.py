"""Environment and code identity as recorded in run.json."""

import logging

import pytest
import torch

from fake_cuda import DRIVER, H100, fake_gpu_host, gpu_env, uuid_of
from reprotrain.repro import determinism, environment, machine

pytestmark = pytest.mark.host_facts  # tests/host_facts.py: also run as on other hosts


def test_only_allowlisted_variables_are_recorded(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_marker")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    env = environment.capture(torch.device("cpu"))["env"]
    assert env.get("CUDA_VISIBLE_DEVICES") == "0" and "HF_TOKEN" not in env
    assert "hf_secret_marker" not in repr(environment.capture(torch.device("cpu")))


def test_cpu_identity_includes_the_simd_capability():
    device = environment.capture(torch.device("cpu"))["device"]
    assert device["capability"] == torch.backends.cpu.get_cpu_capability()


def test_on_a_cpu_host_every_gpu_field_is_recorded_as_absent():
    env = environment.capture(torch.device("cpu"))
    assert env["gpu"] == dict.fromkeys(machine.GPU_FIELDS)  # present, all None
    assert set(env["gpu_env"]) == set(environment.GPU_ENV_VARS)
    assert set(environment.CUBLAS_ENV_VARS) <= set(env["gpu_env"])
    assert env["cpu"]["capability"] == torch.backends.cpu.get_cpu_capability()
    assert env["world_size"] == 1 and env["device"]["resolved"] == "cpu"
    assert environment.peak_memory(torch.device("cpu")) == {
        "peak_reserved_bytes": None,
        "peak_allocated_bytes": None,
    }


def test_a_gpu_run_records_the_training_gpu_and_the_cpu(monkeypatch):
    env = gpu_env(monkeypatch, index=3)
    gpu = env["gpu"]
    assert env["device"]["type"] == "cuda" and env["device"]["resolved"] == "cuda:3"
    assert gpu["index"] == 3 and gpu["uuid"] == uuid_of(3)  # the training GPU, not cuda:0
    assert gpu["name"] == H100["name"] and gpu["sm_count"] == H100["sms"]
    assert gpu["compute_capability"] == "9.0" and gpu["total_memory_bytes"] == H100["memory"]
    assert gpu["driver_version"] == DRIVER and gpu["mig_mode"] == "Disabled"
    assert gpu["visible_devices"] == 8
    assert gpu["memory_free_at_start_bytes"] == 80_000_000_000
    assert gpu["memory_total_at_start_bytes"] == H100["memory"]
    assert gpu["cublas_workspace_bytes"] == 4096 * 1024 * 8 and gpu["blas_library"] == "Cublas"
    # data order and augmentation run on the CPU: its capability is kept on GPU runs
    assert env["cpu"]["capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(env["gpu"]) == set(machine.GPU_FIELDS)


def test_reduced_precision_reduction_flags_are_read_back(monkeypatch):
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_fp16_reduced_precision_reduction
    try:
        matmul.allow_fp16_reduced_precision_reduction = False
        flags = environment.capture(torch.device("cpu"))["matmul"]
        assert flags["fp16_reduced_precision_reduction"] is False
        matmul.allow_fp16_reduced_precision_reduction = True
        flags = environment.capture(torch.device("cpu"))["matmul"]
        assert flags["fp16_reduced_precision_reduction"] is True
        assert flags["bf16_reduced_precision_reduction"] is bool(
            matmul.allow_bf16_reduced_precision_reduction
        )
    finally:
        matmul.allow_fp16_reduced_precision_reduction = before


def test_driver_cuda_version_comes_from_torch_when_it_exposes_it(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 13000, raising=False)
    assert gpu_env(monkeypatch)["gpu"]["driver_cuda_version"] == "13.0"
    monkeypatch.delattr(torch._C, "_cuda_getDriverVersion")
    assert machine.driver_cuda_version() is None


def test_without_nvidia_smi_the_driver_is_absent_and_mig_comes_from_the_env(monkeypatch):
    assert gpu_env(monkeypatch, driver=None)["gpu"]["driver_version"] is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-0d6d5f4c-2b6e-5a2d-9b8c-2f4f1e0a7b11")
    gpu = gpu_env(monkeypatch, driver=None)["gpu"]
    assert gpu["mig_mode"] == "Enabled"


def test_peak_memory_is_read_from_the_training_gpu(monkeypatch):
    fake_gpu_host(monkeypatch)
    assert environment.peak_memory(torch.device("cuda", 0)) == {
        "peak_reserved_bytes": 6 * 2**30,
        "peak_allocated_bytes": 5 * 2**30,
    }


def test_cublas_variables_are_recorded_as_set(monkeypatch):
    monkeypatch.setenv("TORCH_BLAS_PREFER_CUBLASLT", "1")
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    env = environment.capture(torch.device("cpu"))["gpu_env"]
    assert env["TORCH_BLAS_PREFER_CUBLASLT"] == "1" and env["NVIDIA_TF32_OVERRIDE"] is None


def test_a_users_own_cublas_workspace_is_kept_recorded_and_warned(monkeypatch, caplog):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with caplog.at_level(logging.WARNING, logger="reprotrain"):
        assert determinism.cublas_workspace() == ":4096:8"
    assert caplog.text == ""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with caplog.at_level(logging.WARNING, logger="reprotrain"):
        assert determinism.cublas_workspace() == ":16:8"
    assert ":16:8 replaces the project's :4096:8" in caplog.text
    assert environment.capture(torch.device("cpu"))["gpu_env"]["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_the_record_fits_run_json_and_a_weights_only_checkpoint(monkeypatch):
    """Checkpoints carry the environment for the resume check: plain types only."""
    import io
    import json

    for env in (environment.capture(torch.device("cpu")), gpu_env(monkeypatch)):
        assert json.loads(json.dumps(env)) == env
        buf = io.BytesIO()
        torch.save({"env": env}, buf)
        buf.seek(0)
        assert torch.load(buf, weights_only=True)["env"] == env


def test_no_git_inside_the_image_falls_back_to_the_built_commit(tmp_path, monkeypatch):
    from reprotrain.repro import gitinfo

    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.delenv("REPROTRAIN_GIT_COMMIT", raising=False)
    assert gitinfo.git_info(tmp_path)[0]["commit"] is None
    monkeypatch.setenv("REPROTRAIN_GIT_COMMIT", "0123456789ab-dirty")
    info, diff = gitinfo.git_info(tmp_path)
    assert info["short"].startswith("01234567") and info["dirty"] is True and diff == ""
