"""The CPU's identity for bits: recorded on CPU and GPU runs, compared by the one rule.

Two AVX-512 CPUs of two vendors trained one config to different bits (issue 24): a record
made on one CPU model and checked on another gets "bits not promised", never DIVERGED; a
portable pair ignores the CPU model but not the architecture, threads or software.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import MICRO, REPO, assert_ok, base_env
from fake_cuda import H100, gpu_env
from reprotrain.repro import comparability, cpu_identity, environment
from reprotrain.repro.comparability import differences, notes
from reprotrain.tools.reproduce import rerun

HOST_FACTS = pytest.mark.host_facts  # tests/host_facts.py: also run as on other hosts

XEON_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
stepping\t: 8
flags\t\t: fpu sse2 smep smx avx avx2 fma f16c avx512f avx512bw avx512_bf16 avx512_fp16 \
amx_bf16 amx_tile amx_int8 avx_vnni

processor\t: 1
vendor_id\t: GenuineIntel
"""


@HOST_FACTS
def test_cpuinfo_gives_vendor_family_model_and_the_flags_kernels_dispatch_on():
    """Only dispatch flags: x86's smep/smx are not arm64's SME (a regex once took smep)."""
    got = cpu_identity.cpuinfo_fields(XEON_CPUINFO)
    assert got["vendor"] == "GenuineIntel" and got["model_name"].startswith("Intel(R) Xeon")
    assert (got["family"], got["model"], got["stepping"]) == ("6", "143", "8")
    assert got["isa_flags"] == sorted(
        ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16",
         "amx_bf16", "amx_tile", "amx_int8", "avx_vnni"]
    )  # fmt: skip


def on_a_xeon(env: dict) -> dict:
    """``env`` as a run on an Intel Xeon with AMX would record it: same torch capability."""
    out = copy.deepcopy(env)
    out["cpu"].update(
        {k: v for k, v in cpu_identity.cpuinfo_fields(XEON_CPUINFO).items()},
        name="Intel(R) Xeon(R) Platinum 8480+",
        onednn_isa="Intel AVX-512 with float16, Intel DL Boost and bfloat16 support and "
        "Intel AMX with bfloat16 and 8-bit integer support",
    )
    return out


@pytest.fixture
def cpu_env() -> dict:
    return environment.capture(torch.device("cpu"))


@HOST_FACTS
def test_a_run_records_the_cpu_identity(cpu_env):
    cpu = cpu_env["cpu"]
    keys = ("vendor", "family", "model", "model_name", "isa_flags", "capability", "onednn_isa",
            "mkl_version", "mkl_cbwr_branch", "onednn_version", "portable")  # fmt: skip
    for key in keys:
        assert key in cpu, key
    assert set(cpu["dispatch_env"]) == set(cpu_identity.DISPATCH_ENV_VARS)
    assert cpu["capability"] == torch.backends.cpu.get_cpu_capability()


@HOST_FACTS
def test_another_cpu_model_with_the_same_capability_promises_no_bits(cpu_env):
    xeon = on_a_xeon(cpu_env)
    assert xeon["cpu"]["capability"] == cpu_env["cpu"]["capability"]
    got = differences(cpu_env, xeon)
    assert got[0] == (
        f"CPU: {comparability.cpu_model(cpu_env)} -> "
        "GenuineIntel Intel(R) Xeon(R) Platinum 8480+ (family 6, model 143)"
    )
    assert any(line.startswith("cpu ISA extensions: ") and "+amx_tile" in line for line in got)


@HOST_FACTS
def test_a_gpu_run_compares_the_cpu_identity_too(monkeypatch):
    """The data path (order, augmentation) runs on the CPU of a GPU run."""
    h100 = gpu_env(monkeypatch, model=H100)
    assert h100["cpu"]["vendor"] == cpu_identity.cpuinfo_fields()["vendor"]
    assert any(line.startswith("CPU: ") for line in differences(h100, on_a_xeon(h100)))


@pytest.mark.parametrize(
    "label, path, value",
    [
        ("oneDNN ISA", ("onednn_isa",), "Intel AVX2"),
        ("oneDNN enabled", ("mkldnn_enabled",), "off"),
        ("MKL CNR branch", ("mkl_cbwr_branch",), "AUTO,STRICT"),
        ("MKL", ("mkl_version",), "Intel(R) oneAPI Math Kernel Library Version 2025.0"),
        ("oneDNN", ("onednn_version",), "v3.99.0"),
        *((f"${n}", ("dispatch_env", n), "x") for n in cpu_identity.DISPATCH_ENV_VARS),
    ],
)
@HOST_FACTS
def test_each_dispatch_field_changes_the_verdict(cpu_env, label, path, value):
    other = copy.deepcopy(cpu_env)
    node = other["cpu"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert [d for d in differences(cpu_env, other) if d.startswith(f"{label}: ")], label


def portable(env: dict) -> dict:
    out = copy.deepcopy(env)
    out["cpu"].update(capability="AVX2", onednn_isa="Intel AVX2", mkl_cbwr_branch="COMPATIBLE",
                      portable=True)  # fmt: skip
    out["cpu"]["dispatch_env"].update(cpu_identity.PORTABLE_ENV)
    return out


@HOST_FACTS
def test_two_portable_runs_promise_bits_across_cpu_models_but_not_across_threads(cpu_env):
    here, xeon = portable(cpu_env), portable(on_a_xeon(cpu_env))
    assert differences(here, xeon) == []
    assert any(line.startswith("CPU: ") for line in notes(here, xeon))  # shown, not a reason
    fewer = {**xeon, "num_threads": here["num_threads"] + 1}
    assert differences(here, fewer) == [
        f"thread count: {here['num_threads']} -> {here['num_threads'] + 1}"
    ]
    other = "aarch64" if here["machine"] != "aarch64" else "x86_64"
    elsewhere = {**xeon, "machine": other}
    assert differences(here, elsewhere) == [f"machine: {here['machine']} -> {other}"]
    native = on_a_xeon(cpu_env)  # a strict run on the Xeon: its CPU model counts again
    got = differences(here, native)
    assert "cpu dispatch: portable -> native" in got and any(g.startswith("CPU: ") for g in got)


@HOST_FACTS
def test_reproduce_sees_an_edited_cpu_identity_as_bits_not_promised(cpu_env):
    record = {"environment": cpu_env, "lock_sha256": "x"}
    blocking, _ = rerun.environment_differences(record, {**record})
    assert blocking == []
    blocking, _ = rerun.environment_differences(
        {"environment": on_a_xeon(cpu_env), "lock_sha256": "x"}, record
    )
    assert blocking and blocking[0].startswith("CPU: GenuineIntel Intel(R) Xeon(R)")


@HOST_FACTS
def test_cpu_key_is_what_the_rule_compares(cpu_env):
    key = comparability.cpu_key(cpu_env)
    assert key["thread count"] == str(cpu_env["num_threads"]) and "CPU" in key
    assert "CPU" not in comparability.cpu_key(portable(cpu_env))  # portable: not the model


# ----------------------------------------------------------------- end to end (slow tier)


def xeon_record(path: Path) -> None:
    """Rewrite a run.json as if its run had been made on an Intel Xeon with AMX."""
    record = json.loads(path.read_text())
    record["environment"] = on_a_xeon(record["environment"])
    path.write_text(json.dumps(record, indent=2))


def run_tool(name: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"reprotrain.tools.{name}", *args], cwd=cwd,
                          env=base_env(), capture_output=True, text=True, timeout=600)  # fmt: skip


def archive_edited(src: Path, tmp_path: Path) -> Path:
    """Archive ``src``, then unpack it, move every run.json to a Xeon, repack (manifest
    regenerated; replayed with --trust)."""
    from test_archive import repack, unpack

    assert_ok(run_tool("archive.archive", str(src), "--out-dir", str(tmp_path / "archives")))
    (archive,) = (tmp_path / "archives").glob("*.tar.gz")
    top = unpack(archive, tmp_path / "unpacked")
    edited = sorted(top.rglob("run.json"))
    assert edited
    for path in edited:
        xeon_record(path)
    return repack(top, tmp_path / "edited.tar.gz")


@pytest.mark.slow
def test_a_run_archive_made_on_another_cpu_model_is_not_comparable_not_diverged(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "reprotrain.train", *MICRO, f"hydra.run.dir={run}"]
    assert_ok(subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True))
    archive = archive_edited(run, tmp_path)
    proc = run_tool("reproduce.reproduce", str(archive), "--trust", "--epochs", "1", "--runs-dir",
                    str(tmp_path / "rerun"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdict = proc.stdout.strip().splitlines()[-1]
    assert verdict.startswith("NOT COMPARABLE") and "CPU: GenuineIntel Intel(R) Xeon(R)" in verdict


@pytest.mark.slow
def test_a_sweep_archive_made_on_another_cpu_model_goes_to_the_statistical_verdict(tmp_path):
    tiny = [*MICRO, "trainer.epochs=1", "trainer.limit_train_steps=2", "seed.base=0,1"]
    cmd = [sys.executable, "-m", "reprotrain.train", "--multirun", *tiny,
           f"hydra.sweep.dir={tmp_path / 's'}"]  # fmt: skip
    assert_ok(subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True))
    archive = archive_edited(tmp_path / "s", tmp_path)
    proc = run_tool("reproduce.reproduce", str(archive), "--trust", "--mode", "auto", "--metric",
                    "train_loss", "--runs-dir", str(tmp_path / "rerun"))  # fmt: skip
    report = json.loads(next((tmp_path / "rerun").glob("*/reproduction.json")).read_text())
    assert report["mode"] == "statistical", proc.stdout + proc.stderr
    assert any("CPU: GenuineIntel Intel(R) Xeon(R)" in r for r in report["bits_not_promised"])
    assert "CONSISTENT" in proc.stdout and "DIVERGED" not in proc.stdout


GRAVITON_CPUINFO = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid sve sve2 bf16 i8mm
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x0
CPU part\t: 0xd4f
CPU revision\t: 1
"""


def test_an_arm64_cpu_is_known_by_implementer_part_and_features():
    got = cpu_identity.cpuinfo_fields(GRAVITON_CPUINFO)
    assert (got["vendor"], got["family"], got["model"]) == ("0x41", "8", "0xd4f")
    assert {"asimd", "sve", "sve2", "bf16", "i8mm"} <= set(got["isa_flags"])


def test_on_macos_the_brand_string_names_the_cpu(monkeypatch):
    import subprocess as sp

    answers = {"machdep.cpu.brand_string": "Apple M2 Pro", "hw.model": "Mac14,9"}

    def fake_run(cmd, **kw):
        return sp.CompletedProcess(cmd, 0, stdout=answers.get(cmd[-1], "") + "\n", stderr="")

    monkeypatch.setattr("platform.system", lambda: "Darwin")
    monkeypatch.setattr("platform.machine", lambda: "arm64")
    monkeypatch.setattr(sp, "run", fake_run)
    got = cpu_identity.cpuinfo_fields("")
    assert (got["vendor"], got["model_name"], got["model"]) == ("Apple", "Apple M2 Pro", "Mac14,9")
